"""Benchmark: the verifier's attention in a decoding step, by implementation, alone and in a round.

StaticVerifier attends q_len = K + 1 query tokens (a speculative round's verify forward) or 1 (a
greedy step) to its fixed-capacity KV cache (serving/cache_attention.py): "sdpa" is
F.scaled_dot_product_attention over the whole capacity under the position mask (the backend torch
picks, or one forced: cudnn, efficient, flash, math); "flash-varlen" is FlashAttention-2's varlen
forward over the filled positions only; "peagle" is ops.decode_attention over the same sequences.
SmolLM2-135M's shape (9 query heads, 3 KV heads, head dim 64, bf16, GQA), each
call replayed from a CUDA graph as decoding does.

1. One call: q_len 1, 4, 9 x capacity 512, 1024, 2048, the first `filled` = capacity / 2
   positions visible; us per call (median of 5 x 200 graph replays) and the max abs difference
   from the math backend; an implementation that refuses the inputs is reported as such.
2. The whole round: a random SmolLM2-shaped verifier (30 layers) and a random 1-layer drafter,
   RoundEngine (K=3) and GreedyEngine on CUDA graphs at capacity 512, 1024 and 2048, replayed
   from positions 136 (MT-Bench's short contexts), 512 and 1536, with attention "sdpa", "flash"
   and "peagle" (the verifier's and the drafter's alike): device and wall time per round and per
   greedy step
   (peagle_ext.eval.kernel_breakdown) and the round's cost in greedy steps, which bounds the
   speed-up at a given acceptance length.

Run: python bench/bench_verify_attention.py (prints tables, writes $OUT/bench_verify_attention.json
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

from peagle_ext.serving.cache_attention import attend_cache_varlen, flash_lengths

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
    "flash-varlen": "flash-varlen",  # not SDPA: serving/cache_attention.attend_cache_varlen
    "peagle": "peagle",  # not SDPA: ops.decode_attention over the same sequences
}


def inputs(q_len: int, capacity: int, device="cuda", seed=0):
    """q [1, heads, T, D], k/v [1, kv heads, C, D], the mask [T, C] and the varlen lengths of
    queries at positions filled - T .. filled - 1 (the verifier computes the mask and the lengths
    once per forward, outside the per-layer attention timed here)."""
    g = torch.Generator(device=device).manual_seed(seed)
    # the layout StaticVerifier passes: q projected as [T, heads, D] and viewed as [heads, T, D]
    # (backends choose by strides too); the cache is [kv heads, capacity, D], contiguous
    q = torch.randn(1, q_len, HEADS, HEAD_DIM, device=device, generator=g).to(torch.bfloat16).transpose(1, 2)
    k = torch.randn(1, KV_HEADS, capacity, HEAD_DIM, device=device, generator=g).to(torch.bfloat16)
    v = torch.randn(1, KV_HEADS, capacity, HEAD_DIM, device=device, generator=g).to(torch.bfloat16)
    filled = capacity // 2
    pos = torch.arange(filled - q_len, filled, device=device)
    allowed = torch.arange(capacity, device=device)[None, :] <= pos[:, None]
    return q, k, v, allowed, flash_lengths(pos)


def attend(case, backend):
    q, k, v, allowed, lengths = case
    if backend in ("flash-varlen", "peagle"):
        impl = "flash" if backend == "flash-varlen" else "peagle"
        return attend_cache_varlen(q[0], k[0], v[0], lengths, HEAD_DIM**-0.5, impl)[None]

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
    case = inputs(q_len, capacity)
    ref = attend(case, SDPBackend.MATH).float()
    backend = BACKENDS[backend_name]
    try:
        out = attend(case, backend)
        us = time_graph(lambda: attend(case, backend))
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
    case = inputs(q_len, 1024)
    try:
        attend(case, BACKENDS[backend])
    except RuntimeError as e:
        pytest.skip(f"{backend} refuses these inputs: {str(e).splitlines()[0][:120]}")
    benchmark(lambda: (attend(case, BACKENDS[backend]), torch.cuda.synchronize()))


def smollm2_engines(attention: str, k: int, capacity: int, seed: int = 0):
    """RoundEngine (K = k) and GreedyEngine on CUDA graphs over a random SmolLM2-135M-shaped bf16
    verifier whose StaticVerifier attends with `attention`, and a random 1-layer drafter."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from peagle_ext.model import PEagleDraftModel
    from peagle_ext.serving import PEagleDrafter
    from peagle_ext.serving.graphs import GreedyEngine, RoundEngine
    from peagle_ext.serving.static_verifier import StaticVerifier

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        vocab_size=49152,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    vm = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval().requires_grad_(False)
    dm = PEagleDraftModel.from_verifier(vm.config, num_depths=k, mask_token_id=cfg.vocab_size)
    st = StaticVerifier(vm, dm.config.eagle_aux_hidden_state_layer_ids, attention=attention)
    dr = PEagleDrafter(dm, device="cuda", dtype=torch.bfloat16, attention=attention)
    dr.reset(capacity)
    return RoundEngine(st, dr, k, capacity, cuda_graph=True), GreedyEngine(st, capacity, cuda_graph=True)


def measure_rounds(attention: str, k: int = 3, capacity: int = 1024, start: int = 512) -> dict:
    from peagle_ext.eval import kernel_breakdown

    eng, ge = smollm2_engines(attention, k, capacity)
    assert eng.verifier.attention == eng.drafter.attention == attention
    kb = kernel_breakdown(eng, ge, replays=16, start=start)
    return {
        "attention": attention,
        "k": k,
        "capacity": capacity,
        "start_position": kb["start_position"],
        "round_us": kb["round_us"],
        "greedy_step_us": kb["greedy_step_us"],
        "round_wall_us": kb["round_wall_us"],
        "greedy_step_wall_us": kb["greedy_step_wall_us"],
        "round_in_greedy_steps_wall": round(kb["round_wall_us"] / kb["greedy_step_wall_us"], 3),
        "round_in_greedy_steps_device": round(kb["round_us"] / kb["greedy_step_us"], 3),
        "attention_us": [kb["round_us_by_class"].get("attention"), kb["greedy_step_us_by_class"].get("attention")],
        "round_us_by_class": kb["round_us_by_class"],
        "greedy_step_us_by_class": kb["greedy_step_us_by_class"],
    }


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
    engines = []
    for attention in ("sdpa", "flash", "peagle"):
        for capacity, start in ((512, 136), (1024, 512), (2048, 1536)):
            try:
                engines.append(measure_rounds(attention, capacity=capacity, start=start))
            except (RuntimeError, ValueError) as e:
                engines.append({"attention": attention, "capacity": capacity, "error": str(e).splitlines()[0][:200]})
    print("\nK=3 round and greedy step on CUDA graphs, random SmolLM2-shaped verifier (us per replay)")
    print(
        "| attention | capacity | from position | round wall | greedy wall | round in greedy steps | device: round | greedy | attention: round | greedy |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for e in engines:
        if "error" in e:
            print(f"| {e['attention']} | {e['capacity']} | failed: {e['error']} |")
            continue
        a_r, a_g = e["attention_us"]
        print(
            f"| {e['attention']} | {e['capacity']} | {e['start_position']} | {e['round_wall_us']:.0f} | "
            f"{e['greedy_step_wall_us']:.0f} | {e['round_in_greedy_steps_wall']:.3f} | {e['round_us']:.0f} | "
            f"{e['greedy_step_us']:.0f} | {a_r} | {a_g} |"
        )
    out = Path(os.environ.get("OUT") or "bench_out")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench_verify_attention.json"
    path.write_text(
        json.dumps(
            {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows, "engines": engines},
            indent=1,
        )
    )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
