"""Benchmark: the verifier's attention in a decoding step, by SDPA backend.

StaticVerifier attends q_len = K + 1 query tokens (a speculative round's verify forward) or 1 (a
greedy step) to its whole fixed-capacity KV cache under a boolean mask (F.scaled_dot_product_attention,
backend chosen by torch). `peagle eval --profile` on the H200 found a round's 30 attention calls
at ~14 us each on cuDNN's flash prefill kernel, about twice a greedy step's. This times one call
per backend, replayed from a CUDA graph as decoding does, SmolLM2-135M's shape (9 query heads, 3
KV heads, head dim 64, bf16, GQA), to pick the backend for short queries on evidence.

Cases: q_len 1, 4, 9 x capacity 512, 1024, 2048, the first `filled` = capacity / 2 positions
visible. Backends: default (torch's choice), cudnn, efficient, flash, math; one that refuses the
inputs is reported as such. Each result: us per call (median of 5 x 200 graph replays) and the
max abs difference from the math backend.

Run: python bench/bench_verify_attention.py (prints a table, writes $OUT/bench_verify_attention.json
or ./bench_out/...), or pytest bench/bench_verify_attention.py --benchmark-only (skips without a GPU).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HAS_CUDA = torch.cuda.is_available()
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
Q_LENS = (1, 4, 9)
CAPACITIES = (512, 1024, 2048)
BACKENDS = {
    "default": None,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "math": SDPBackend.MATH,
}


def inputs(q_len: int, capacity: int, device="cuda", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    # the layout StaticVerifier passes: q projected as [T, heads, D] and viewed as [heads, T, D]
    # (backends choose by strides too); the cache is [kv heads, capacity, D], contiguous
    q = torch.randn(1, q_len, HEADS, HEAD_DIM, device=device, generator=g).to(torch.bfloat16).transpose(1, 2)
    k = torch.randn(1, KV_HEADS, capacity, HEAD_DIM, device=device, generator=g).to(torch.bfloat16)
    v = torch.randn(1, KV_HEADS, capacity, HEAD_DIM, device=device, generator=g).to(torch.bfloat16)
    filled = capacity // 2
    pos = torch.arange(filled - q_len, filled, device=device)
    allowed = torch.arange(capacity, device=device)[None, :] <= pos[:, None]
    return q, k, v, allowed


def attend(q, k, v, allowed, backend):
    def run():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=HEAD_DIM**-0.5, enable_gqa=True)

    if backend is None:
        return run()
    with sdpa_kernel([backend]):
        return run()


def time_graph(fn, replays=200, reps=5) -> float:
    """us per call of fn replayed from a CUDA graph (median of reps)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(replays):
            fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / replays)
    return statistics.median(times)


def measure(q_len: int, capacity: int, backend_name: str) -> dict:
    q, k, v, allowed = inputs(q_len, capacity)
    ref = attend(q, k, v, allowed, SDPBackend.MATH).float()
    backend = BACKENDS[backend_name]
    try:
        out = attend(q, k, v, allowed, backend)
        us = time_graph(lambda: attend(q, k, v, allowed, backend))
    except RuntimeError as e:
        return {"q_len": q_len, "capacity": capacity, "backend": backend_name, "refused": str(e).splitlines()[0][:200]}
    return {
        "q_len": q_len,
        "capacity": capacity,
        "backend": backend_name,
        "us": round(us, 2),
        "max_abs_diff_vs_math": float((out.float() - ref).abs().max()),
    }


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("q_len", Q_LENS)
def test_verify_attention(benchmark, q_len, backend):
    q, k, v, allowed = inputs(q_len, 1024)
    try:
        attend(q, k, v, allowed, BACKENDS[backend])
    except RuntimeError as e:
        pytest.skip(f"{backend} refuses these inputs: {str(e).splitlines()[0][:120]}")
    benchmark(lambda: (attend(q, k, v, allowed, BACKENDS[backend]), torch.cuda.synchronize()))


def main() -> int:
    if not HAS_CUDA:
        print("bench_verify_attention: needs a CUDA device", file=sys.stderr)
        return 2
    rows = [measure(q, c, b) for q in Q_LENS for c in CAPACITIES for b in BACKENDS]
    print(f"us per attention call, CUDA graph ({torch.cuda.get_device_name()}, torch {torch.__version__})")
    print("| q_len | capacity | " + " | ".join(BACKENDS) + " |")
    print("|---:|---:|" + "---:|" * len(BACKENDS))
    for q in Q_LENS:
        for c in CAPACITIES:
            cells = []
            for b in BACKENDS:
                r = next(x for x in rows if (x["q_len"], x["capacity"], x["backend"]) == (q, c, b))
                cells.append(f"{r['us']:.1f}" if "us" in r else "refused")
            print(f"| {q} | {c} | " + " | ".join(cells) + " |")
    bad = [r for r in rows if r.get("max_abs_diff_vs_math", 0.0) > 2e-2]
    for r in bad:
        print(f"differs from math: {r}")
    out = Path(os.environ.get("OUT") or "bench_out")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench_verify_attention.json"
    path.write_text(
        json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, indent=1)
    )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
