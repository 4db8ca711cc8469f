"""Benchmark: `peagle datagen`'s generation engines, new tokens per second at batch sizes.

Engines (peagle_ext.data.datagen): "static" (peagle_ext.serving.batch_generation: one preallocated
KV cache per layer written in place, stopped rows leave the batch; its decode steps replayed as
CUDA graphs on a GPU, its attention "auto": FlashAttention's varlen forward where it runs),
"static-sdpa" (the same with SDPA under the position mask), "static-eager" (eager steps) against
"hf", transformers' generate() with left padding and its dynamic cache, the anchor, in the same run.

Model: the SmolLM2-135M shape (Llama, hidden 576, 30 layers, 9 heads / 3 K/V heads, MLP 1536,
vocab 49152) with random weights, bf16 on CUDA (fp32 on the CPU): the step cost depends on the
shape, not the weights. Prompts: random tokens, lengths uniform in [64, 256] (ShareGPT's first
prompts are mostly in that range), sorted by length as datagen groups them; every row generates
--new-tokens tokens (no stop token is ever drawn: eos is a token id outside the vocabulary),
so both engines do the same work.

Measured per (engine, batch): wall time of one generate call after a warm-up call, new tokens/s,
and the peak memory allocated on CUDA. Printed as a table with the static/hf ratio. --profile adds,
per (engine, batch), one more generate call under torch.profiler: device time per new token by
kernel class (peagle_ext.train.profiling's classes; on the CPU, ops' own time) and, on CUDA, the
time the device waits for the host, by host op: where a datagen step's time goes.

Run: python bench/bench_datagen.py  (writes $OUT/bench_datagen.json or ./bench_out/; QUICK=1 for
smaller batches), or pytest bench/bench_datagen.py --benchmark-only (pytest-benchmark; the CPU
case is tiny).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import pytest
import torch

from peagle_ext.data.datagen import _generate, pick_engine
from peagle_ext.testing import smollm2_model as make_model
from peagle_ext.train.profiling import describe_by_class

ENGINES = ("static", "static-sdpa", "static-eager", "hf")


def make_prompts(n, vocab, lo=64, hi=256, seed=0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    return sorted(prompts, key=len)


def runner(model, engine):
    from peagle_ext.serving.batch_generation import BatchGenerator

    if engine == "static-eager":
        return BatchGenerator(model, mode="eager")
    if engine == "static-sdpa":
        return BatchGenerator(model, attention="sdpa")
    return pick_engine(model, engine)


def generate(model, engine, prompts, new_tokens):
    """One datagen generate call; eos is outside the vocabulary, so every row runs to the limit."""
    eos = {model.config.vocab_size}
    return _generate(
        model,
        None,
        prompts,
        max_new_tokens=new_tokens,
        temperature=0.0,
        top_p=1.0,
        eos=eos,
        pad=0,
        seed=0,
        engine=runner(model, engine),
    )


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(model, engine, batch, new_tokens, prompt_range=(64, 256)):
    dev = next(model.parameters()).device
    prompts = make_prompts(batch, model.config.vocab_size, *prompt_range)
    generate(model, engine, prompts[:8], 4)  # warm-up: kernels, allocator
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    _sync(dev)
    t0 = time.perf_counter()
    res = generate(model, engine, prompts, new_tokens)
    _sync(dev)
    dt = time.perf_counter() - t0
    n = sum(len(toks) for toks, _ in res)
    assert n == batch * new_tokens, (n, batch, new_tokens)
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None
    return {
        "engine": engine,
        "batch": batch,
        "new_tokens": new_tokens,
        "prompt_tokens": list(prompt_range),
        "seconds": dt,
        "tok_s": n / dt,
        "peak_gb": peak,
    }


def profile_generate(model, engine, batch, new_tokens, prompt_range=(64, 256)) -> dict:
    """One generate call under torch.profiler (module docstring): ms per new token of each row."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from peagle_ext.train.profiling import idle_by_host, time_by_class

    dev = next(model.parameters()).device
    prompts = make_prompts(batch, model.config.vocab_size, *prompt_range)
    generate(model, engine, prompts[:8], 4)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        with record_function("peagle.generate"):
            generate(model, engine, prompts, new_tokens)
        _sync(dev)
    out = {"engine": engine, "batch": batch, "time_by_class": time_by_class(prof, dev.type, new_tokens, top=10)}
    if dev.type == "cuda":
        out["device_idle"] = idle_by_host(prof.events(), new_tokens, top=8)
    return out


def describe_profile(p: dict) -> str:
    label = f"{p['engine']} batch {p['batch']}"
    return describe_by_class(label, "new token", p["time_by_class"], p.get("device_idle"))


# ---- pytest-benchmark ------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["static", "hf"])
def test_bench_datagen_cpu(benchmark, engine):
    model = make_model(torch.device("cpu"), torch.float32, num_hidden_layers=2, vocab_size=4096)
    prompts = make_prompts(8, model.config.vocab_size, lo=8, hi=32)
    benchmark.group = "datagen generate cpu 2 layers, 8 rows x 16 tokens"
    benchmark.pedantic(lambda: generate(model, engine, prompts, 16), rounds=3, warmup_rounds=1)


@pytest.mark.parametrize("engine", ["static", "static-sdpa", "static-eager", "hf"])
def test_bench_datagen_cuda(benchmark, engine):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = make_model(torch.device("cuda"), torch.bfloat16)
    prompts = make_prompts(512, model.config.vocab_size)

    def fn():
        generate(model, engine, prompts, 64)
        torch.cuda.synchronize()

    benchmark.group = "datagen generate SmolLM2 shape, 512 rows x 64 tokens"
    benchmark.pedantic(fn, rounds=2, warmup_rounds=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    quick = os.environ.get("QUICK", "0") == "1"
    cuda = torch.cuda.is_available()
    default_batches = "16" if not cuda else ("256,1024" if quick else "256,1024,2048")
    ap.add_argument("--batches", default=default_batches, help="comma-separated batch sizes")
    ap.add_argument("--new-tokens", type=int, default=128 if cuda else 16)
    ap.add_argument("--engines", default="static,static-sdpa,static-eager,hf" if cuda else "static,hf")
    ap.add_argument(
        "--prompt-tokens",
        default="64,256",
        help="MIN,MAX prompt length (uniform); later turns of a conversation: e.g. 1024,1792",
    )
    ap.add_argument("--profile", action="store_true", help="profile one more generate call of each case")
    args = ap.parse_args()
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        ap.error(f"--batches must be comma-separated ints, got {args.batches!r}")
    try:
        lo, hi = (int(x) for x in args.prompt_tokens.split(","))
    except ValueError:
        ap.error(f"--prompt-tokens must be MIN,MAX, got {args.prompt_tokens!r}")
    if not 1 <= lo <= hi:
        ap.error(f"--prompt-tokens needs 1 <= MIN <= MAX, got {args.prompt_tokens!r}")
    engines = args.engines.split(",")
    if not batches or min(batches) < 1 or args.new_tokens < 1 or not set(engines) <= set(ENGINES):
        ap.error(f"--batches and --new-tokens must be >= 1, --engines a subset of {','.join(ENGINES)}")
    out_dir = Path(os.environ.get("OUT") or "bench_out")
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda" if cuda else "cpu")
    model = make_model(dev, torch.bfloat16 if cuda else torch.float32)
    rows = []
    for b in batches:
        for e in engines:
            r = measure(model, e, b, args.new_tokens, (lo, hi))
            rows.append(r)
            peak = "" if r["peak_gb"] is None else f"  peak {r['peak_gb']:.1f} GB"
            print(f"{e:>12} batch {b:>5}: {r['tok_s']:>9.0f} new tok/s ({r['seconds']:.2f} s){peak}", flush=True)
    by = {(r["engine"], r["batch"]): r["tok_s"] for r in rows}
    print("\n| batch | " + " | ".join(f"{e} tok/s" for e in engines) + " | vs hf |")
    print("|---:|" + "---:|" * (len(engines) + 1))
    for b in batches:
        rates = [by[(e, b)] for e in engines]
        vs = " / ".join(f"{by[(e, b)] / by[('hf', b)]:.2f}x" for e in engines if e != "hf") if "hf" in engines else ""
        print(f"| {b} | " + " | ".join(f"{r:.0f}" for r in rates) + f" | {vs} |")
    profiles = []
    if args.profile:
        for b in batches:
            for e in engines:
                profiles.append(profile_generate(model, e, b, args.new_tokens, (lo, hi)))
                print(describe_profile(profiles[-1]), flush=True)
    info = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}
    name = "bench_datagen.json" if (lo, hi) == (64, 256) else f"bench_datagen_prompts{lo}-{hi}.json"
    (out_dir / name).write_text(json.dumps({"info": info, "rows": rows, "profiles": profiles}, indent=1))


if __name__ == "__main__":
    main()
