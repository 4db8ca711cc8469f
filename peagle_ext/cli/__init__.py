"""The `peagle` command (also `python -m peagle_ext.cli`): one module per subcommand, each with
HELP, add_arguments(parser) and run(args) -> exit code."""

from __future__ import annotations

import argparse
import sys

from . import datagen as datagen_cmd
from . import eval as eval_cmd
from . import export as export_cmd
from . import hidden_states as hidden_states_cmd
from . import train as train_cmd

SUBCOMMANDS = {
    "train": train_cmd,
    "hidden-states": hidden_states_cmd,
    "export": export_cmd,
    "eval": eval_cmd,
    "datagen": datagen_cmd,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="peagle", description="Train, export and evaluate P-EAGLE parallel drafters.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, mod in SUBCOMMANDS.items():
        # flags not given stay absent (SUPPRESS), so "--x none" differs from "not given"
        sp = sub.add_parser(name, help=mod.HELP, description=mod.HELP, argument_default=argparse.SUPPRESS)
        mod.add_arguments(sp)
        sp.set_defaults(_run=mod.run)
    return p


def _stacks_on_sigusr1() -> None:
    """`kill -USR1 <pid>` prints every thread's Python stack to stderr and the command goes on:
    where a run that seems stuck is waiting, with no debugger on the machine."""
    import faulthandler
    import signal

    if hasattr(signal, "SIGUSR1"):
        try:
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        except (OSError, ValueError):  # stderr is no file (captured in-process): nowhere to write
            pass


def main(argv: list[str] | None = None) -> int:
    _stacks_on_sigusr1()
    p = build_parser()
    args = p.parse_args(argv)
    if not getattr(args, "_run", None):
        p.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print(
            "\n[peagle] interrupted; the newest complete checkpoint is kept (continue with --resume)", file=sys.stderr
        )
        return 130
    except (ValueError, FileNotFoundError, NotADirectoryError, PermissionError) as e:
        print(f"peagle {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # disk full, read-only file system, quota: name the file, no traceback
        where = f"{e.filename}: " if e.filename else ""
        print(f"peagle {args.command}: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except RecursionError:  # a deeply nested input file that a reader did not catch itself
        print(f"peagle {args.command}: error: an input file is nested too deeply", file=sys.stderr)
        return 2
