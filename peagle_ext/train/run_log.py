"""What a training run tells its user: DIR/log.jsonl, one-line events on stderr, progress bars."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


class RunLog:
    """DIR/log.jsonl (one JSON object a line) + echo of events to stderr."""

    def __init__(self, path: Path, echo=True):
        self.path = path
        self.echo = echo
        self._f = open(path, "a", buffering=1)

    def write(self, rec: dict):
        self._f.write(json.dumps(rec) + "\n")

    def event(self, name: str, msg: str, **kw):
        self.write({"event": name, "message": msg, **kw})
        if self.echo:
            print(f"[peagle] {msg}", file=sys.stderr, flush=True)

    def close(self):
        self._f.close()

    @staticmethod
    def truncate_after(path: Path, step: int):
        """Drop the step records a killed run wrote after the checkpoint we resume from."""
        if not path.exists():
            return
        keep = []
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "step" in rec and rec["step"] > step:
                continue
            keep.append(line)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(x + "\n" for x in keep))
        os.replace(tmp, path)


def say(msg: str):
    print(f"[peagle] {msg}", file=sys.stderr, flush=True)


class NullLog:
    """RunLog stand-in of ranks other than 0 (rank 0 alone writes log.jsonl and talks)."""

    def write(self, rec):
        pass

    def event(self, name, msg, **kw):
        pass

    def close(self):
        pass


def progress_bar(it, **kw):
    from tqdm import tqdm

    # redrawn every second on a terminal; into a log file only every 30 s
    interval = 1.0 if sys.stderr.isatty() else 30.0
    return tqdm(it, dynamic_ncols=True, file=sys.stderr, mininterval=interval, **kw)
