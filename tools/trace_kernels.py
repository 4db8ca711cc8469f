"""Which host ops launched a profiled step's kernels: device time grouped by kernel class and by
the op stack around each launch, from a torch.profiler chrome trace.

    python tools/trace_kernels.py TRACE.json[.gz] [--top 40] [--cls copy,elementwise] [--depth 2]

The class is peagle_ext.train.profiling.kernel_class (the classes of bench_train_step's tables).
Each kernel, copy or memset is matched to its launch (runtime or driver API) by the trace's
correlation id, and the launch to the host ops (cpu_op and record_function events) enclosing it on the same thread; a
row names the innermost `--depth` of them, outermost first. Times are ms summed over the trace
(bench_train_step traces hold one step).
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from peagle_ext.train.profiling import KERNEL_CLASSES, kernel_class  # noqa: E402

_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _fail(msg: str):
    print(f"trace_kernels: {msg}", file=sys.stderr)
    raise SystemExit(2)


def load_events(path: Path) -> list[dict]:
    if not path.is_file():
        _fail(f"{path}: no such file")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as f:
            data = json.load(f)
    except (OSError, ValueError, EOFError) as e:
        _fail(f"{path}: not a chrome trace ({e})")
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        _fail(f"{path}: no traceEvents list")
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]


class HostStacks:
    """The host ops (cpu_op and record_function events) of each thread as a forest: ops on one thread
    nest, so each op's parent is the innermost op open at its start."""

    def __init__(self, events):
        by_tid = defaultdict(list)
        for e in events:
            if e.get("cat") in ("cpu_op", "user_annotation") and not e["name"].startswith("ProfilerStep"):
                start = float(e["ts"])
                by_tid[e.get("tid")].append((start, -(start + float(e.get("dur", 0))), e["name"]))
        self.threads = {}
        for tid, ops in by_tid.items():
            ops.sort()  # by start, the outer of two ops that start together first
            starts = [s for s, _, _ in ops]
            ends = [-ne for _, ne, _ in ops]
            parent, open_ops = [], []
            for i, start in enumerate(starts):
                while open_ops and ends[open_ops[-1]] < start:
                    open_ops.pop()
                parent.append(open_ops[-1] if open_ops else -1)
                open_ops.append(i)
            self.threads[tid] = (starts, ends, [n for _, _, n in ops], parent)

    def enclosing(self, tid, ts: float) -> list[str]:
        """Names of the ops open at ts on thread tid, outermost first."""
        if tid not in self.threads:
            return []
        starts, ends, names, parent = self.threads[tid]
        i = bisect.bisect_right(starts, ts) - 1  # the last op to start by ts; those open at ts are it or its ancestors
        while i >= 0 and ends[i] < ts:
            i = parent[i]
        out = []
        while i >= 0:
            out.append(names[i])
            i = parent[i]
        return out[::-1]


def attribute(events, depth: int):
    """{(class, stack): [ms, count]} and {class: ms} over the device events."""
    launches = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):  # cuBLAS and Triton launch through the driver API
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launches[corr] = e
    stacks = HostStacks(events)
    rows = defaultdict(lambda: [0.0, 0])
    by_class = defaultdict(float)
    for e in events:
        if e.get("cat") not in _DEVICE_CATS:
            continue
        ms = float(e.get("dur", 0)) / 1e3
        cls = kernel_class(e["name"], "cuda")
        by_class[cls] += ms
        launch = launches.get((e.get("args") or {}).get("correlation"))
        stack = stacks.enclosing(launch.get("tid"), float(launch["ts"])) if launch else []
        key = (cls, " > ".join(stack[-depth:]) if stack else "(no host op)", e["name"][:70])
        rows[key][0] += ms
        rows[key][1] += 1
    return rows, by_class


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--top", type=int, default=40, help="rows to print (default 40)")
    ap.add_argument("--cls", default="", help="comma-separated kernel classes to keep (default all)")
    ap.add_argument("--depth", type=int, default=2, help="host ops named per row, innermost (default 2)")
    a = ap.parse_args(argv)
    if a.top < 1 or a.depth < 1:
        ap.error("--top and --depth must be >= 1")
    keep = {c for c in a.cls.split(",") if c}
    if keep - set(KERNEL_CLASSES):
        ap.error(f"--cls: unknown class {sorted(keep - set(KERNEL_CLASSES))} (classes: {', '.join(KERNEL_CLASSES)})")
    events = load_events(a.trace)
    try:
        rows, by_class = attribute(events, a.depth)
    except (KeyError, TypeError, ValueError) as e:  # an event without its name, ts or dur, or not a number
        _fail(f"{a.trace}: malformed trace event ({type(e).__name__}: {e})")
    print("class ms: " + ", ".join(f"{c} {ms:.2f}" for c, ms in sorted(by_class.items(), key=lambda kv: -kv[1])))
    print(f"{'ms':>8} {'n':>5}  class        host ops > kernel")
    shown = sorted(((k, v) for k, v in rows.items() if not keep or k[0] in keep), key=lambda kv: -kv[1][0])
    for (cls, stack, kernel), (ms, n) in shown[: a.top]:
        print(f"{ms:8.3f} {n:5d}  {cls:<12} {stack} > {kernel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
