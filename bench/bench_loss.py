"""Fused linear-KL loss (peagle_ext.loss.fused_linear_kl) vs eager PyTorch and speculators.

pytest-benchmark:  PYTHONPATH=. python -m pytest bench/bench_loss.py --benchmark-only
table + JSON:      PYTHONPATH=. python bench/bench_loss.py [--sizes 8192,32768,131072] [--reps 3]
                   [--configs full,draft32k]
                   (writes $OUT/bench_loss.json, or ./bench_out/bench_loss.json; QUICK=1 in the
                   environment: T = 8K only, fewer repetitions)

Work per step (forward + backward, Tw rows of weight > 0 among T, hidden H, draft vocab Vd):
four GEMMs of 2*Tw*H*Vd FLOPs each (draft logits, target logits, grad_hidden, grad_head), i.e.
8*Tw*H*Vd (rows of weight 0 are not computed). "fused_indexed" is the training step's shape:
the T draft rows read their targets through target_index from N = T / 2.8 positions (P-EAGLE's
depths at one position share its target row), so its target GEMM covers the Mw distinct
weighted positions only: (6*Tw + 2*Mw)*H*Vd. The GEMM floor is that count at the bf16 cuBLAS
rate measured in the same run on a [T, H] x [H, Vd] product; the target is <= 1.3x the floor.
Everything else (the row kernels: per logit ~10 B; the fp32 head-gradient accumulation) is
bandwidth-bound overhead on top.

Memory: "extra peak" is max_memory_allocated during one forward+backward minus what was
allocated before (the inputs), so it includes the returned gradients. Target: <= inputs +
grads + 2 chunks, and under 4 GiB at T = 32K; eager needs several [T, Vd] fp32 tensors.

Baselines:
  eager        full [T, Vd] logits, log_softmax / softmax in fp32, kl_div, autograd (speculators'
               eager kl_div_loss); skipped where its estimated peak would not fit (said so).
  speculators  full logits, then speculators' fused Triton KL (speculators.losses.fused), when
               the speculators package (and Triton) imports; else reported as skipped.
Configurations: V = 151,936 (Qwen) with the full vocab as draft vocab ("full"), and a 32K draft
vocab mapped through d2t into it ("draft32k").
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import peagle_ext
from peagle_ext.loss import chunk_plan, fused_linear_kl

H = 4096
V_TARGET = 151_936
CONFIGS = {"full": (V_TARGET, V_TARGET), "draft32k": (32_000, V_TARGET)}
SIZES = [8192, 32768, 131072]
NUM_DEPTHS = 8
GIB = 2**30


def has_cuda():
    return torch.cuda.is_available() and peagle_ext.has_cuda_kernels()


def make_case(t, h, vd, v, device, dtype=torch.bfloat16, seed=0):
    """Normed-looking hidden states (unit scale), heads at init scale (std 0.02): logits ~ N(0, 1.3^2)."""
    g = torch.Generator(device=device).manual_seed(seed)
    xd = torch.randn(t, h, device=device, dtype=dtype, generator=g).requires_grad_()
    w_d = (torch.randn(vd, h, device=device, dtype=dtype, generator=g) * 0.02).requires_grad_()
    xt = torch.randn(t, h, device=device, dtype=dtype, generator=g)
    w_t = torch.randn(v, h, device=device, dtype=dtype, generator=g) * 0.02
    weight = (torch.rand(t, device=device, generator=g) < 0.8).float()
    depth = torch.randint(0, NUM_DEPTHS, (t,), device=device, generator=g, dtype=torch.int32)
    d2t = None
    if vd < v:
        ids = torch.randperm(v, device=device, generator=g)[:vd].sort().values
        d2t = ids - torch.arange(vd, device=device)
    # the training step's shape: T draft rows over N = T / 2.8 target positions
    index = torch.randint(0, max(1, int(t / 2.8)), (t,), device=device, generator=g)
    return dict(xd=xd, w_d=w_d, xt=xt, w_t=w_t, weight=weight, depth=depth, d2t=d2t, index=index)


def input_bytes(c):
    return sum(x.numel() * x.element_size() for k, x in c.items() if x is not None and k != "index")


def fused_step(c, chunk_size="auto", grad=True, indexed=False):
    xt, index = c["xt"], None
    if indexed:
        index = c["index"]
        xt = xt[: int(index.max()) + 1]
    with torch.set_grad_enabled(grad):
        loss, m = fused_linear_kl(
            c["xd"],
            c["w_d"],
            xt,
            c["w_t"],
            c["weight"],
            c["depth"],
            num_depths=NUM_DEPTHS,
            d2t=c["d2t"],
            target_index=index,
            chunk_size=chunk_size,
            validate=False,
        )
    if grad:
        loss.backward()
    return loss


def _target_logits(c):
    with torch.no_grad():
        w_t = c["w_t"]
        if c["d2t"] is not None:
            w_t = w_t[torch.arange(c["w_d"].shape[0], device=w_t.device) + c["d2t"]]
        return c["xt"] @ w_t.T


def _finish(per, logits, targets, c):
    w = c["weight"]
    loss = (per * w).sum() / w.sum()
    with torch.no_grad():  # the same metrics the fused op returns
        agree = (logits.argmax(-1) == targets.argmax(-1)) & (w > 0)
        torch.zeros(NUM_DEPTHS, dtype=torch.int64, device=w.device).index_add_(0, c["depth"].long(), agree.long())
    loss.backward()
    return loss


def eager_step(c):
    logits = c["xd"] @ c["w_d"].T
    targets = _target_logits(c)
    logq = F.log_softmax(logits, dim=-1, dtype=torch.float32)
    p = F.softmax(targets, dim=-1, dtype=torch.float32)
    per = F.kl_div(logq, p, reduction="none").sum(-1)
    return _finish(per, logits, targets, c)


def speculators_kernel():
    """speculators' fused Triton KL, or the reason it is unavailable."""
    try:
        from speculators.losses.fused import fused_kl_div_loss
    except Exception as e:  # noqa: BLE001 - any import failure means "not available here"
        return None, f"speculators not importable ({type(e).__name__}: {e})"
    return fused_kl_div_loss, "available"


def speculators_step(c, kl):
    logits = c["xd"] @ c["w_d"].T
    targets = _target_logits(c)
    per = kl(logits.unsqueeze(0), targets.unsqueeze(0))[0]
    return _finish(per, logits, targets, c)


def eager_peak_estimate(t, vd):
    """Bytes eager needs beyond the inputs: bf16 logits x2, fp32 log_softmax / softmax / kl_div
    terms and their gradients (about 26 B per logit), plus the gradients."""
    return t * vd * 26


def speculators_peak_estimate(t, vd):
    # bf16 logits and targets, the kernel's bf16 logit gradient, fp32 metrics temporaries
    return t * vd * 12


def _clear(c):
    c["xd"].grad = None
    c["w_d"].grad = None


def time_cuda(fn, c, reps, warmup=1):
    for _ in range(warmup):
        _clear(c)
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        _clear(c)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def extra_peak(fn, c):
    _clear(c)
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def gemm_rate(m, h, n, reps=5):
    """bf16 cuBLAS FLOP/s of [m, h] x [h, n] (n-by-h weight, as the logit GEMM uses it)."""
    a = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        torch.mm(a, b.T, out=out)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mm(a, b.T, out=out)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b, out
    torch.cuda.empty_cache()
    return 2 * m * h * n / statistics.median(times)


def kernel_share(c):
    """Device time of one fused step by kernel family (cuBLAS GEMMs, our row kernel, the rest)."""
    from torch.profiler import ProfilerActivity, profile

    _clear(c)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fused_step(c)
        torch.cuda.synchronize()
    shares = {"row_kernel": 0.0, "gemm": 0.0, "other": 0.0}  # row kernels: draft rows + target stats
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        if us is None:
            us = getattr(e, "cuda_time_total", 0.0)
        name = e.key.lower()
        if "draft_rows" in name or "target_stats" in name:
            shares["row_kernel"] += us
        elif any(s in name for s in ("gemm", "cutlass", "sm90", "xmma", "cublas", "nvjet")):
            shares["gemm"] += us
        elif name.startswith("aten::") or name.startswith("peagle::") or "cudaLaunch" in e.key:
            continue  # host-side ranges, not kernels
        else:
            shares["other"] += us
    total = sum(shares.values()) or 1.0
    return {k: round(v / total, 4) for k, v in shares.items()} | {"device_ms": round(total / 1e3, 3)}


def run_table(sizes, configs, reps):
    dev = torch.cuda.get_device_name()
    kl, spec_status = speculators_kernel()
    rows, notes = [], []
    for cfg in configs:
        vd, v = CONFIGS[cfg]
        for t in sizes:
            c = make_case(t, H, vd, v, "cuda")
            inputs = input_bytes(c)
            grads = c["xd"].numel() * 2 + c["w_d"].numel() * 2
            plan = chunk_plan(t, vd, torch.bfloat16)
            mem_target = inputs + grads + plan.logit_bytes
            free = torch.cuda.mem_get_info()[0]
            m = t if t * vd * 2 <= 0.25 * free else 32768
            rate = gemm_rate(m, H, vd)
            chunk_rate = gemm_rate(plan.rows_per_chunk, H, vd)
            tw = int((c["weight"] > 0).sum())
            mw = int(c["index"][c["weight"] > 0].unique().numel())
            floor = 8 * tw * H * vd / rate
            floor_indexed = (6 * tw + 2 * mw) * H * vd / rate
            base = dict(
                T=t,
                config=cfg,
                H=H,
                Vd=vd,
                V=v,
                gemm_tflops=round(rate / 1e12, 1),
                chunk_gemm_tflops=round(chunk_rate / 1e12, 1),
                gemm_rows=m,
                weighted_rows=tw,
                distinct_targets=mw,
                floor_ms=round(floor * 1e3, 2),
                rows_per_chunk=plan.rows_per_chunk,
                num_chunks=plan.num_chunks,
                inputs_gib=round(inputs / GIB, 3),
                mem_target_gib=round(mem_target / GIB, 3),
            )

            def record(method, fn, est=None, floor_s=floor, **extra):
                if est is not None and est > 0.85 * torch.cuda.mem_get_info()[0]:
                    rows.append(dict(base, method=method, skipped=f"would OOM (needs ~{est / GIB:.0f} GiB)"))
                    return
                try:
                    ms = time_cuda(fn, c, reps)
                    peak = extra_peak(fn, c)
                except torch.cuda.OutOfMemoryError as e:
                    rows.append(dict(base, method=method, skipped=f"OOM ({str(e).splitlines()[0][:80]})"))
                    _clear(c)
                    gc.collect()
                    torch.cuda.empty_cache()
                    return
                r = dict(
                    base,
                    method=method,
                    time_ms=round(ms * 1e3, 2),
                    ratio_to_floor=round(ms / floor_s, 3),
                    extra_peak_gib=round(peak / GIB, 3),
                    **extra,
                )
                if method in ("fused", "fused_indexed"):
                    r["time_ok"] = ms <= 1.3 * floor_s
                    r["mem_ok"] = peak <= mem_target and (t != 32768 or peak < 4 * GIB)
                rows.append(r)
                _clear(c)
                gc.collect()
                torch.cuda.empty_cache()

            record("fused", lambda: fused_step(c))
            record("fused_indexed", lambda: fused_step(c, indexed=True), floor_s=floor_indexed)
            record("fused_fwd_nograd", lambda: fused_step(c, grad=False), floor_s=floor / 2)
            record("eager", lambda: eager_step(c), est=eager_peak_estimate(t, vd))
            if kl is not None:
                record("speculators", lambda: speculators_step(c, kl), est=speculators_peak_estimate(t, vd))
            else:
                rows.append(dict(base, method="speculators", skipped=spec_status))
            if t == sizes[0]:
                try:
                    rows.append(dict(base, method="fused_kernel_share", **kernel_share(c)))
                except Exception as e:  # noqa: BLE001 - the profiler is a diagnostic only
                    notes.append(f"kernel_share failed: {e}")
            c = None  # free the case before the next size
            gc.collect()
            torch.cuda.empty_cache()
    return dict(
        device=dev,
        torch=torch.__version__,
        build=peagle_ext.build_info(),
        speculators=spec_status,
        rows=rows,
        notes=notes,
    )


def print_table(res):
    print(f"# fused linear-KL loss on {res['device']} (torch {res['torch']}); speculators: {res['speculators']}")
    hdr = (
        f"{'T':>7} {'cfg':>9} {'method':>17} {'time ms':>9} {'floor ms':>9} {'x floor':>8} "
        f"{'extra GiB':>9} {'target GiB':>10}  note"
    )
    print(hdr)
    for r in res["rows"]:
        if r["method"] == "fused_kernel_share":
            print(
                f"{r['T']:>7} {r['config']:>9} {'kernel share':>17}  row kernel {r['row_kernel']:.1%}, "
                f"GEMMs {r['gemm']:.1%}, other {r['other']:.1%} of {r['device_ms']} ms device time"
            )
            continue
        if "skipped" in r:
            print(
                f"{r['T']:>7} {r['config']:>9} {r['method']:>17} {'-':>9} {r['floor_ms']:>9} {'-':>8} {'-':>9} "
                f"{r['mem_target_gib']:>10}  skipped: {r['skipped']}"
            )
            continue
        note = ""
        if r["method"] == "fused_indexed":
            note = f"{r['distinct_targets']} distinct target rows for {r['weighted_rows']} weighted rows"
        if r["method"] == "fused":
            note = (
                f"time {'OK' if r['time_ok'] else 'OVER'} (<=1.3x), mem {'OK' if r['mem_ok'] else 'OVER'}; "
                f"{r['num_chunks']} chunks of {r['rows_per_chunk']} rows; cuBLAS {r['gemm_tflops']} TF/s "
                f"(chunk shape {r['chunk_gemm_tflops']})"
            )
        elif r["method"] == "fused_fwd_nograd":
            note = "forward only; floor = 2 GEMMs"
        floor_ms = round(r["time_ms"] / r["ratio_to_floor"], 2)
        print(
            f"{r['T']:>7} {r['config']:>9} {r['method']:>17} {r['time_ms']:>9} {floor_ms:>9} "
            f"{r['ratio_to_floor']:>8} {r['extra_peak_gib']:>9} {r['mem_target_gib']:>10}  {note}"
        )
    for n in res["notes"]:
        print("note:", n)


# ---- pytest-benchmark ------------------------------------------------------------------------
def test_bench_fused_loss_cpu(benchmark):
    c = make_case(512, 64, 4096, 4096, "cpu", dtype=torch.float32)
    benchmark.group = "fused_linear_kl cpu T=512 H=64 V=4096"
    benchmark.pedantic(lambda: (_clear(c), fused_step(c, chunk_size=128)), rounds=3, warmup_rounds=1)


def test_bench_fused_loss_cpu_main_job(benchmark):
    """The main job's loss on one thread: ~1.3K draft rows of 512 positions, SmolLM2's hidden
    576, the 8K draft vocab of its 49K (d2t), bf16 (CPU autocast), forward + backward."""
    c = make_case(1300, 576, 8192, 49152, "cpu", dtype=torch.bfloat16)
    benchmark.group = "fused_linear_kl cpu main job T=1300 H=576 Vd=8192"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        benchmark.pedantic(lambda: (_clear(c), fused_step(c, indexed=True)), rounds=3, warmup_rounds=1)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("impl", ["fused", "eager"])
@pytest.mark.parametrize("cfg", ["draft32k", "full"])
def test_bench_loss_cuda(benchmark, cfg, impl):
    if not has_cuda():
        pytest.skip("needs a CUDA GPU and the CUDA build of peagle_ext")
    vd, v = CONFIGS[cfg]
    c = make_case(8192, H, vd, v, "cuda")
    step = {"fused": lambda: fused_step(c), "eager": lambda: eager_step(c)}[impl]

    def fn():
        _clear(c)
        step()
        torch.cuda.synchronize()

    benchmark.group = f"loss T=8192 H={H} {cfg}"
    benchmark.pedantic(fn, rounds=3, warmup_rounds=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    quick = os.environ.get("QUICK", "0") == "1"
    ap.add_argument("--sizes", default=",".join(map(str, [8192] if quick else SIZES)))
    ap.add_argument("--configs", default="draft32k,full")
    ap.add_argument("--reps", type=int, default=2 if quick else 3)
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT") or "bench_out")
    out_dir.mkdir(parents=True, exist_ok=True)
    if not has_cuda():
        print(
            "bench_loss: no CUDA GPU / CUDA build of peagle_ext: nothing to measure (the CPU path is covered "
            "by the pytest-benchmark test)"
        )
        (out_dir / "bench_loss.json").write_text(json.dumps({"skipped": "no CUDA"}, indent=1))
        return
    sizes = [int(s) for s in args.sizes.split(",") if s]
    configs = [s for s in args.configs.split(",") if s]
    res = run_table(sizes, configs, args.reps)
    print_table(res)
    path = out_dir / "bench_loss.json"
    path.write_text(json.dumps(res, indent=1, default=str))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
