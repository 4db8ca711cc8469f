"""Where a training run's time goes: torch.profiler over a window of real steps of `peagle train`
(`--profile-steps N` after `--profile-warmup W` steps), with the loop's host phases as named ranges.

A step's kernels say what the device computes; the loop around them (reading cached states,
concatenating and copying them to the device, COD sampling, host syncs for metrics, logging)
says whether the device waits for the host. The summary gives both per step: the wall time, the
host time of each phase, the device time by kernel class and how much of the wall the device
was busy. Files: DIR/profile/summary.json and DIR/profile/trace.json.gz (chrome://tracing or
Perfetto)."""

from __future__ import annotations

import bisect
import json
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType

# the loop's host phases, in step order (record_function names "peagle.<phase>")
PHASES = ("data", "layout", "forward_backward", "optimizer", "bookkeeping")

KERNEL_CLASSES = ("gemm", "index", "copy", "optimizer", "elementwise", "loss", "attention")


def kernel_class(name: str, device_type: str) -> str:
    """The class of one profiled kernel (CUDA) or leaf op (CPU) of a training step, by its name."""
    n = name.lower()
    # torch's own attention kernels too (cuDNN's "..._native_sdpa_...", FlashAttention's
    # "flash_fwd_...", cutlass "fmha_..."): without them they count as elementwise work
    attn = ("cod_attn", "flex", "triton_tem", "attention", "scaled_dot_product", "sdpa", "fmha", "flash")
    if any(s in n for s in attn):
        return "attention"
    if any(s in n for s in ("draft_rows", "target_stats", "loss_forward_kernel", "loss_backward_kernel")):
        return "loss"
    if device_type == "cpu" and "fused_linear_kl" in n:
        return "loss"
    if any(s in n for s in ("adam", "multi_tensor_apply")):
        return "optimizer"
    if any(s in n for s in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitkreduce", "aten::mm", "aten::addmm")):
        return "gemm"
    if any(s in n for s in ("index", "gather", "scatter", "embedding", "sort", "segment", "unique", "nonzero")):
        return "index"
    if any(s in n for s in ("copy", "cat", "memcpy", "memset", "fill", "aten::to", "zero_", "contiguous")):
        return "copy"
    return "elementwise"


def _device_us(e) -> float:
    t = getattr(e, "self_device_time_total", None)
    return float(t if t is not None else getattr(e, "self_cuda_time_total", 0.0))


def _on_device(e) -> bool:
    """A kernel, copy or memset that ran on the device: not a host op that launched one, and not
    the device-side span of a record_function range (first to last kernel launched inside it)."""
    return getattr(e, "device_type", DeviceType.CPU) != DeviceType.CPU and not getattr(e, "is_user_annotation", False)


def _on_host(e) -> bool:
    return getattr(e, "device_type", DeviceType.CPU) == DeviceType.CPU


def time_by_class(prof, device_type: str, steps: int, top: int = 25) -> dict:
    """ms per step by KERNEL_CLASSES of a finished profile: device kernels' self time on CUDA,
    leaf ops' self CPU time on the CPU (record_function ranges and profiler rows left out); and
    the `top` heaviest names as [name, class, ms per step]. On CUDA only device events count: a
    host op's "self device time" is its kernels' time again (with CPU activity recorded)."""
    by = dict.fromkeys(KERNEL_CLASSES, 0.0)
    names = {}
    for e in prof.key_averages():
        if e.key.startswith(("ProfilerStep", "[", "peagle.")):
            continue
        if device_type == "cuda" and not _on_device(e):
            continue
        us = _device_us(e) if device_type == "cuda" else float(e.self_cpu_time_total)
        if us <= 0:
            continue
        cls = kernel_class(e.key, device_type)
        by[cls] += us / 1e3 / steps
        names[e.key[:120]] = (cls, us / 1e3 / steps)
    heavy = sorted(names.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "classes_ms": {k: round(v, 3) for k, v in by.items()},
        "total_ms": round(sum(by.values()), 3),
        "top": [[k, c, round(ms, 3)] for k, (c, ms) in heavy],
    }


def merge_intervals(spans) -> list[tuple[float, float]]:
    """The union of [start, end) spans, as sorted disjoint spans."""
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def gaps(busy, lo: float, hi: float) -> list[tuple[float, float]]:
    """[lo, hi) minus the merged spans `busy`."""
    out, t = [], lo
    for a, b in busy:
        if b <= lo or a >= hi:
            continue
        if a > t:
            out.append((t, min(a, hi)))
        t = max(t, b)
    if t < hi:
        out.append((t, hi))
    return out


def overlap(spans, starts, a: float, b: float) -> float:
    """Length of [a, b) inside the sorted disjoint `spans` (starts: their start points)."""
    i = max(bisect.bisect_right(starts, a) - 1, 0)
    total = 0.0
    while i < len(spans) and spans[i][0] < b:
        total += max(0.0, min(b, spans[i][1]) - max(a, spans[i][0]))
        i += 1
    return total


def intersect(a, b) -> list[tuple[float, float]]:
    """The intersection of two sorted lists of disjoint spans."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def idle_by_host(events, steps: int, top: int = 12) -> dict:
    """Where the device waits for the host, from a profile's events (CPU and CUDA activity): the
    device-idle time inside the loop's phases (the main thread's peagle.* ranges), per phase, and
    per host op by the idle time spent in its own code (its children's subtracted), so a slow
    host op or a gap between ops (the phase's own self time) shows up where it happens. The
    backward runs on autograd's own thread while the main thread waits in it: idle time while
    that thread works is that thread's, not the main thread's. ms per step."""
    phases = [e for e in events if e.name.startswith("peagle.") and _on_host(e)]
    if not phases:
        return {"idle_ms": 0.0, "by_phase": {}, "by_host_op": []}
    main = phases[0].thread
    lo = min(e.time_range.start for e in phases)
    hi = max(e.time_range.end for e in phases)
    busy = merge_intervals((e.time_range.start, e.time_range.end) for e in events if _on_device(e))
    idle = gaps(busy, lo, hi)
    starts = [a for a, _ in idle]
    by_phase: dict[str, float] = {}
    for e in phases:
        k = e.name[len("peagle.") :]
        by_phase[k] = by_phase.get(k, 0.0) + overlap(idle, starts, e.time_range.start, e.time_range.end)
    host = [e for e in events if _on_host(e) and not e.name.startswith("ProfilerStep")]
    grad_threads = {e.thread for e in host if e.thread != main and e.name.startswith("autograd::engine")}
    grad_spans = merge_intervals((e.time_range.start, e.time_range.end) for e in host if e.thread in grad_threads)
    # the main thread owns the idle time no backward thread is working through
    idle_main = intersect(idle, gaps(grad_spans, lo, hi))
    views = {"main": (idle_main, [a for a, _ in idle_main]), "grad": (idle, starts)}
    by_op: dict[str, float] = {}
    for e in host:
        if e.thread != main and e.thread not in grad_threads:
            continue
        spans, st = views["main" if e.thread == main else "grad"]
        own = overlap(spans, st, e.time_range.start, e.time_range.end)
        if own <= 0:
            continue
        for c in getattr(e, "cpu_children", []) or []:
            own -= overlap(spans, st, c.time_range.start, c.time_range.end)
        if own > 0:
            by_op[e.name[:120]] = by_op.get(e.name[:120], 0.0) + own
    n = max(steps, 1)
    heavy = sorted(by_op.items(), key=lambda kv: -kv[1])[:top]
    return {
        "idle_ms": round(sum(b - a for a, b in idle) / 1e3 / n, 3),
        "by_phase": {k: round(v / 1e3 / n, 3) for k, v in by_phase.items()},
        "by_host_op": [[k, round(v / 1e3 / n, 3)] for k, v in heavy],
    }


class StepProfiler:
    """Profiles steps warmup+1 .. warmup+n of this process's run. The loop calls before_step and
    after_step around each step (steps_here counts this process's steps, so a resumed run warms up
    again) and enter(phase) where each of its phases begins: a phase lasts until the next one or
    the step's end. close() at the end writes what a run that ended inside the window has. Off
    (n = 0) it does nothing."""

    def __init__(self, out_dir: Path, n: int, warmup: int, device: torch.device, log=None):
        self.dir = Path(out_dir)
        self.n, self.warmup = int(n), int(warmup)
        self.device = device
        self.log = log
        self._prof = None
        self._t0 = 0.0
        self._first = 0
        self._done = 0
        self._range = None
        self.summary: dict | None = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def enter(self, phase: str) -> None:
        self._end_phase()
        if self._prof is not None:
            self._range = torch.profiler.record_function("peagle." + phase)
            self._range.__enter__()

    def _end_phase(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def before_step(self, steps_here: int, step: int) -> None:
        if self.n <= 0 or self.summary is not None or self._prof is not None or steps_here != self.warmup:
            return
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._sync()
        self._prof = profile(activities=acts)
        self._prof.__enter__()
        self._first, self._done = step + 1, 0
        self._t0 = time.perf_counter()

    def after_step(self) -> None:
        self._end_phase()
        if self._prof is None:
            return
        self._done += 1
        if self._done >= self.n:
            self._finish()

    def close(self) -> None:
        if self._prof is not None:
            self._finish()
        elif self.n > 0 and self.summary is None and self.log is not None:
            self.log.event(
                "profile",
                f"nothing profiled: the run ended before step {self.warmup + 1} of this process (--profile-warmup)",
            )

    def _finish(self) -> None:
        # a diagnostic: whatever goes wrong in it is logged, never ends the training
        try:
            self._summarize()
        except Exception as e:  # noqa: BLE001
            self._prof = None
            self.summary = {"error": f"{type(e).__name__}: {e}"}
            if self.log is not None:
                self.log.event("profile", f"profiling failed ({type(e).__name__}: {e}); training goes on")

    def _summarize(self) -> None:
        self._end_phase()
        self._sync()
        wall = time.perf_counter() - self._t0
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        n = max(self._done, 1)
        host = dict.fromkeys(PHASES, 0.0)
        for e in prof.key_averages():
            if e.key.startswith("peagle.") and e.key[len("peagle.") :] in host:
                host[e.key[len("peagle.") :]] += e.cpu_time_total / 1e3 / n
        kernels = time_by_class(prof, self.device.type, n)
        wall_ms = wall * 1e3 / n
        summary = {
            "steps": [self._first, self._first + self._done - 1],
            "device": str(self.device),
            "wall_ms_per_step": round(wall_ms, 3),
            "host_ms_per_step": {k: round(v, 3) for k, v in host.items()},
            ("device_ms_per_step" if self.device.type == "cuda" else "cpu_op_ms_per_step"): kernels,
        }
        if self.device.type == "cuda":
            idle = idle_by_host(prof.events(), n)
            summary["device_idle_ms_per_step"] = idle
            busy = max(wall_ms - idle["idle_ms"], 0.0)
            summary["device_busy_fraction"] = round(min(busy / wall_ms, 1.0), 4) if wall_ms > 0 else 0.0
        self.dir.mkdir(parents=True, exist_ok=True)
        trace = self.dir / "trace.json.gz"
        try:
            prof.export_chrome_trace(str(trace))
            summary["trace"] = str(trace)
        except Exception as e:  # noqa: BLE001 - the trace is a convenience; the summary is the result
            summary["trace_error"] = f"{type(e).__name__}: {e}"
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        self.summary = summary
        if self.log is not None:
            self.log.event("profile", describe(summary), summary=str(self.dir / "summary.json"))


def describe(summary: dict) -> str:
    """One line: the window, wall per step, host phases, and device time by class (CUDA)."""
    a, b = summary["steps"]
    host = ", ".join(f"{k} {v:.1f}" for k, v in summary["host_ms_per_step"].items())
    text = f"steps {a}-{b}: {summary['wall_ms_per_step']:.1f} ms a step; host ms: {host}"
    dev = summary.get("device_ms_per_step")
    if dev:
        cls = ", ".join(f"{k} {v:.1f}" for k, v in dev["classes_ms"].items() if v >= 0.05)
        busy = 100 * summary["device_busy_fraction"]
        text += f"; device kernels {dev['total_ms']:.1f} ms, busy {busy:.0f}% of the wall: {cls}"
        idle = summary.get("device_idle_ms_per_step")
        if idle and idle["idle_ms"] >= 0.05:
            where = ", ".join(f"{k} {v:.1f}" for k, v in idle["by_phase"].items() if v >= 0.05)
            ops = ", ".join(f"{k} {v:.1f}" for k, v in idle["by_host_op"][:3])
            text += f"; device idle {idle['idle_ms']:.1f} ms in {where} (host: {ops})"
    return text


def describe_by_class(label: str, unit: str, by_class: dict, idle: dict | None = None, digits: int = 2) -> str:
    """One line of a benchmark's profile: `label`, device ms per `unit` by kernel class (a
    time_by_class result) and, where given, the device's idle time and the host ops it waited
    on (an idle_by_host result)."""
    classes = ", ".join(f"{k} {v:.{digits}f}" for k, v in by_class["classes_ms"].items() if v > 0)
    line = f"{label}: ms per {unit}: {classes} (all {by_class['total_ms']:.{digits}f})"
    if idle is not None:
        ops = ", ".join(f"{n} {ms:.{digits}f}" for n, ms in idle["by_host_op"][:6])
        line += f"; device idle {idle['idle_ms']:.{digits}f}, the host then in {ops}"
    return line
