"""Where the COD attention's time goes, per kernel (issue 3), on the GPU.

    python bench/profile_attention.py [--n 8192] [--cap 1024|none] [--out DIR]
        torch.profiler over 5 fwd+bwd steps: per-kernel CUDA time (ms per step), the share of
        the step, and each kernel's matmul FLOPs per second where they are known (count below).
    ncu --clock-control none -k regex:cod_attn --launch-skip 6 --launch-count 6 \\
        --section SpeedOfLight ... python bench/profile_attention.py --ncu
        one warm-up step, then one step for Nsight Compute to replay.

Run once with PEAGLE_ATTN_BWD unset and once with PEAGLE_ATTN_BWD=atomic to compare the two
backward structures. Shapes as bench_attention.py: 32 q / 8 kv heads, D=128, K=8, r=0.7, bf16.

FLOPs per kernel (P = allowed (query, key) pairs per head summed over heads, x 2 per MAC):
  fwd:  S = Q K^T, O += P V                         -> 2 matmuls = 4 D P
  dq (default): S, dP = dO V^T, dQ += dS K          -> 3 matmuls = 6 D P
  dkv (default): S^T, dP^T, dV += P^T dO, dK += dS^T Q -> 4 = 8 D P ; atomic: + dQ -> 10 D P
(range pairs only for the tensor-core kernels; the chain pairs, <= K per query, are CUDA-core.)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import D, HQ, allowed_pairs, inputs, make_layout  # noqa: E402
from peagle_ext.attention import cod_attention, cod_attention_metadata  # noqa: E402

# matmuls per allowed pair of each kernel (the wgmma kernels of the default on sm_90 included)
MATMULS = {"cod_attn_fwd": 2, "cod_attn_dq_kernel": 3, "cod_attn_dq_wgmma_kernel": 3, "cod_attn_dkv_kernel": 4,
           "cod_attn_dkv_wgmma_kernel": 4}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--cap", default="1024", help="max_anchors, or none")
    ap.add_argument("--ncu", action="store_true", help="warm-up + one step, no profiler (run under ncu)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    args = ap.parse_args()
    cap = None if args.cap == "none" else int(args.cap)
    lay = make_layout(args.n, cap)
    t = lay.num_tokens
    q, k, v, go = inputs(t)
    qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))

    def step():
        out = cod_attention(qg, kg, vg, lay)
        torch.autograd.grad(out, [qg, kg, vg], go)

    step()
    torch.cuda.synchronize()
    if args.ncu:
        step()
        torch.cuda.synchronize()
        return
    steps = 5
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    pairs = allowed_pairs(cod_attention_metadata(lay)) * HQ
    atomic = os.environ.get("PEAGLE_ATTN_BWD") == "atomic"
    rows, total = [], 0.0
    for e in prof.key_averages():
        dev_us = getattr(e, "device_time_total", None)
        if dev_us is None:
            dev_us = e.cuda_time_total
        if dev_us <= 0:
            continue
        ms = dev_us / 1e3 / steps
        total += ms
        rows.append({"kernel": e.key[:110], "ms_per_step": ms, "calls_per_step": e.count / steps})
    for r in rows:
        r["share"] = r["ms_per_step"] / total
        mm = next((m for key, m in MATMULS.items() if key in r["kernel"]), None)
        if mm is not None:
            if atomic and "dkv" in r["kernel"]:
                mm = 5
            r["tflops"] = mm * 2 * D * pairs / (r["ms_per_step"] * 1e-3) / 1e12
    rows.sort(key=lambda r: -r["ms_per_step"])
    variant = os.environ.get("PEAGLE_ATTN_BWD") or "auto"
    name = f"profile_attention_n{args.n}_cap{args.cap}_{variant}"
    print(f"{name}: T={t}, pairs/head={pairs // HQ}, {total:.2f} ms per fwd+bwd step (sum of kernels)")
    for r in rows:
        tf = f"{r['tflops']:7.1f} TF/s" if "tflops" in r else " " * 12
        print(f"  {r['ms_per_step']:8.3f} ms  {100 * r['share']:5.1f}%  {tf}  x{r['calls_per_step']:.0f}  {r['kernel']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"n": args.n, "cap": cap, "T": t, "pairs_per_head": pairs // HQ,
                                                  "atomic": atomic, "total_ms": total, "kernels": rows}, indent=1))


if __name__ == "__main__":
    main()
