"""Long-run stability: train the tiny config (random llama verifier, hidden 64, from
peagle_ext.testing) for many steps and record the process RSS and CUDA memory at
intervals; fail if memory keeps growing after warm-up.

  python tools/long_run.py                       # 2000 steps on the CPU -> $OUT or ./bench_out
  python tools/long_run.py --steps 2000 --device cuda
  python tools/long_run.py --steps 200           # quick (what tests/train/test_long_run.py runs)

Writes long_run_<device>.json (every sample, the summary, the verdict) and long_run_<device>.png.
Samples are taken each time the trainer logs a training step (--log-every), with checkpoints
and validation every --checkpoint-every steps, so their allocations are part of the picture.

Verdict: after warm-up (the first --warmup-frac of the steps: hidden-state caching, allocator
and autograd caches settle), growth = median of the last 20% of samples minus median of the
first 20% of the post-warm-up samples, for RSS and for CUDA allocated/reserved memory; the run
fails when a growth exceeds its threshold (default 24 MiB RSS, 8 MiB CUDA). The least-squares
slope (MiB per 1000 steps) is reported too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

MiB = 2**20


def rss_bytes() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read the RSS (no psutil, no /proc/self/status)")


def _slope_per_1000(xs, ys) -> float:
    if len(xs) < 2:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return 1000.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def growth(samples: list[dict], key: str, warmup_step: int) -> dict:
    post = [s for s in samples if s["step"] > warmup_step and s.get(key) is not None]
    if len(post) < 5:
        return {"growth_mib": 0.0, "slope_mib_per_1000_steps": 0.0, "samples": len(post)}
    k = max(1, len(post) // 5)
    first = statistics.median(s[key] for s in post[:k])
    last = statistics.median(s[key] for s in post[-k:])
    return {
        "growth_mib": (last - first) / MiB,
        "slope_mib_per_1000_steps": _slope_per_1000([s["step"] for s in post], [s[key] / MiB for s in post]),
        "start_mib": first / MiB,
        "end_mib": last / MiB,
        "max_mib": max(s[key] for s in post) / MiB,
        "samples": len(post),
    }


def run(
    steps: int = 2000,
    *,
    device: str = "cpu",
    out_dir=None,
    log_every: int = 10,
    checkpoint_every: int = 250,
    warmup_frac: float = 0.25,
    max_rss_growth_mib: float = 24.0,
    max_cuda_growth_mib: float = 8.0,
    workdir=None,
    plot: bool = True,
    quiet: bool = False,
) -> dict:
    """Train `steps` steps of the tiny config, sampling memory; returns the report (see module doc)."""
    import torch

    import peagle_ext.train as T
    from peagle_ext.testing import make_chat_jsonl, make_tiny_verifier

    out_dir = Path(out_dir or os.environ.get("OUT") or "bench_out")
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.TemporaryDirectory(prefix="peagle_long_run_") if workdir is None else None
    work = Path(workdir or tmp.name)
    cuda = device.startswith("cuda")
    # the CUDA attention kernels take head dim 64 or 128: hidden 128 x 2 heads there (hidden 64,
    # head dim 32, on the CPU as before)
    verifier = make_tiny_verifier(work / "verifier", hidden=128 if cuda else 64)
    data = make_chat_jsonl(work / "chat.jsonl", n=60, turns=2, words=(4, 16))
    samples: list[dict] = []
    t_start = time.time()

    def sample(step: int):
        s = {"step": step, "t": time.time() - t_start, "rss": rss_bytes()}
        if cuda:
            s.update(
                cuda_allocated=torch.cuda.memory_allocated(),
                cuda_reserved=torch.cuda.memory_reserved(),
                cuda_max_allocated=torch.cuda.max_memory_allocated(),
            )
        samples.append(s)
        if not quiet and len(samples) % 20 == 1:
            extra = f", cuda alloc {s['cuda_allocated'] / MiB:.1f} MiB" if cuda else ""
            print(f"step {step:5d}: rss {s['rss'] / MiB:.1f} MiB{extra}", flush=True)

    real_write = T.RunLog.write

    def write(self, rec):  # sample right when the trainer logs a training step
        real_write(self, rec)
        if rec.get("split") == "train":
            sample(int(rec["step"]))

    settings = T.TrainSettings(
        verifier=str(verifier),
        data=str(data),
        output=str(work / "run"),
        seq_len=64,
        num_depths=3,
        num_layers=1,
        max_steps=steps,
        draft_vocab_size=None,
        dtype="float32" if not cuda else "auto",
        device=device,
        checkpoint_every=checkpoint_every,
        val_every=checkpoint_every,
        val_fraction=0.1,
        warmup_steps=10,
        log_every=log_every,
        progress=False,
        num_conversations=None,
        keep_checkpoints=2,
    )
    T.RunLog.write = write
    try:
        sample(0)
        result = T.train(settings)
    finally:
        T.RunLog.write = real_write
        if tmp is not None:
            tmp.cleanup()
    wall = time.time() - t_start
    warmup_step = int(steps * warmup_frac)
    report = {
        "device": device,
        "steps": steps,
        "wall_s": wall,
        "steps_per_s": steps / wall,
        "warmup_step": warmup_step,
        "skipped_steps": result.skipped_steps,
        "final_train_loss": result.train.get("loss"),
        "thresholds_mib": {"rss": max_rss_growth_mib, "cuda": max_cuda_growth_mib},
        "rss": growth(samples, "rss", warmup_step),
        "samples": samples,
    }
    failures = []
    if report["rss"]["growth_mib"] > max_rss_growth_mib:
        failures.append(f"RSS grew {report['rss']['growth_mib']:.1f} MiB after warm-up (> {max_rss_growth_mib})")
    if cuda:
        for key in ("cuda_allocated", "cuda_reserved"):
            report[key] = growth(samples, key, warmup_step)
            if report[key]["growth_mib"] > max_cuda_growth_mib:
                failures.append(
                    f"{key} grew {report[key]['growth_mib']:.1f} MiB after warm-up (> {max_cuda_growth_mib})"
                )
    report["ok"] = not failures
    report["failures"] = failures
    tag = "cuda" if cuda else "cpu"
    (out_dir / f"long_run_{tag}.json").write_text(json.dumps(report, indent=1))
    if plot:
        report["plot"] = str(_plot(samples, warmup_step, out_dir / f"long_run_{tag}.png", cuda))
    return report


def _plot(samples, warmup_step, path: Path, cuda: bool) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if cuda else 1, figsize=(12 if cuda else 7, 4), squeeze=False)
    steps = [s["step"] for s in samples]
    ax = axes[0][0]
    ax.plot(steps, [s["rss"] / MiB for s in samples], lw=1)
    ax.axvline(warmup_step, color="gray", ls="--", lw=0.8, label="end of warm-up")
    ax.set_xlabel("step")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title("process RSS")
    ax.grid(alpha=0.3)
    ax.legend()
    if cuda:
        ax = axes[0][1]
        for key in ("cuda_allocated", "cuda_reserved"):
            ax.plot(steps, [s[key] / MiB for s in samples], lw=1, label=key)
        ax.axvline(warmup_step, color="gray", ls="--", lw=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("MiB")
        ax.set_title("CUDA memory")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="output dir (default $OUT or ./bench_out)")
    p.add_argument("--log-every", type=int, default=10, help="sample memory every N steps")
    p.add_argument("--checkpoint-every", type=int, default=250)
    p.add_argument("--warmup-frac", type=float, default=0.25)
    p.add_argument("--max-rss-growth-mib", type=float, default=24.0)
    p.add_argument("--max-cuda-growth-mib", type=float, default=8.0)
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    r = run(
        a.steps,
        device=a.device,
        out_dir=a.out,
        log_every=a.log_every,
        checkpoint_every=a.checkpoint_every,
        warmup_frac=a.warmup_frac,
        max_rss_growth_mib=a.max_rss_growth_mib,
        max_cuda_growth_mib=a.max_cuda_growth_mib,
    )
    print(
        f"\nlong run: {r['steps']} steps on {r['device']} in {r['wall_s']:.0f}s ({r['steps_per_s']:.1f} steps/s), "
        f"final train loss {r['final_train_loss']:.4f}, skipped steps {r['skipped_steps']}"
    )
    for key in ("rss", "cuda_allocated", "cuda_reserved"):
        if key in r:
            g = r[key]
            print(
                f"  {key:15s} after step {r['warmup_step']}: {g.get('start_mib', 0):8.1f} -> {g.get('end_mib', 0):8.1f} MiB "
                f"(growth {g['growth_mib']:+.2f} MiB, slope {g['slope_mib_per_1000_steps']:+.2f} MiB/1000 steps, "
                f"max {g.get('max_mib', 0):.1f})"
            )
    print("  verdict:", "OK (no growth beyond the thresholds)" if r["ok"] else "FAIL: " + "; ".join(r["failures"]))
    print(f"  wrote {r.get('plot')} and its .json")
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
