"""The `peagle` command (also `python -m peagle_ext.cli`): one module per subcommand, each with
HELP, add_arguments(parser) and run(args) -> exit code."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import traceback

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


_STACKS_THREAD: threading.Thread | None = None
_STACKS_WAKEUP: tuple[socket.socket, socket.socket] | None = None  # open while the process lives


def _print_stacks() -> None:
    names = {t.ident: t.name for t in threading.enumerate()}
    out = [f"[peagle] SIGUSR1: the Python stacks of pid {os.getpid()}\n"]
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue  # the thread printing this, waiting for the next signal
        name = names.get(ident, "not started by threading")
        out.append(f"Thread {ident:#018x} ({name}), most recent call last:\n")
        out.extend(traceback.format_stack(frame))
    try:
        sys.stderr.write("".join(out))
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed: nowhere to write, and the command goes on
        pass


def _stacks_on_sigusr1() -> None:
    """`kill -USR1 <pid>` prints every thread's Python stack to stderr and the command goes on:
    where a run that seems stuck is waiting, with no debugger on the machine.

    Whichever thread the signal lands on, Python's C handler writes its number to the wakeup
    socket, and one daemon thread reading that socket prints the stacks holding the GIL, so every
    frame it reads is consistent (faulthandler reads running threads' frames without the GIL and
    can crash the process it is meant to diagnose). A main thread stuck in a call that releases
    the GIL (a CUDA sync, a collective, a sleep) is still reported."""
    global _STACKS_THREAD, _STACKS_WAKEUP
    if _STACKS_THREAD is not None or not hasattr(signal, "SIGUSR1"):
        return
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers are set in the main thread only
    wake_r, wake_w = socket.socketpair()
    wake_w.setblocking(False)
    previous = signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
    if previous != -1:  # an event loop owns the wakeup fd: leave it and SIGUSR1 as they are
        signal.set_wakeup_fd(previous)
        wake_r.close()
        wake_w.close()
        return
    _STACKS_WAKEUP = (wake_r, wake_w)
    signal.signal(signal.SIGUSR1, lambda signum, frame: None)  # the socket does the work

    def serve() -> None:
        while True:
            if signal.SIGUSR1 in wake_r.recv(64):  # other signals' numbers pass through unread
                _print_stacks()

    _STACKS_THREAD = threading.Thread(target=serve, name="peagle-sigusr1-stacks", daemon=True)
    _STACKS_THREAD.start()


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
