"""Benchmark: the trainer's warm-up of its hidden-state cache (peagle_ext.train.hidden.HiddenStates
.warm), verifier tokens per second and where the time goes.

Before its first step, `peagle train` on a GPU runs the verifier over every training row and keeps
the states in host memory: one batched verifier pass per warm_rows_per_pass() rows (their documents
grouped by length into forwards of at most WARM_TOKENS padded tokens), then the EAGLE shift and the
copies to the host. On the SmolLM2 study this takes 79 s of a 6-minute training on an H100.

Model: the SmolLM2-135M shape (peagle_ext.testing.smollm2_config) with random weights, bf16 on
CUDA (fp32 on the CPU): the pass's cost depends on the shape, not the weights. Rows: --rows packed
rows of --seq-len tokens, documents of lengths uniform in --doc-tokens (whole multi-turn
conversations, as the regenerated ShareGPT rows hold).

Measured per --cases entry ROWS:TOKENS (rows a pass, "auto" for the trainer's default by bytes;
padded tokens a forward): the warm-up's wall time after a warm-up on a few rows, tokens per second,
its split into verifier passes and shift + copies to the host (the trainer logs the same split), the
number of verifier forwards and the padding they carried, and on CUDA the peak memory allocated. On
the CPU the trainer warms row by row (the batched passes are for a GPU), so --cases changes nothing
there. --attention compares the SDPA backends of the verifier forwards: no-cudnn (the default,
data.hidden_states.PASS_WITHOUT_CUDNN_ATTENTION) against sdpa (torch's own choice, cuDNN on an H100).
--profile adds one more warm-up under torch.profiler: device time per pass by kernel class
(peagle_ext.train.profiling's classes) and the time the device waits for the host, by host op.

Run: python bench/bench_hidden_states.py  (writes $OUT/bench_hidden_states.json or
./bench_out/), or pytest bench/bench_hidden_states.py --benchmark-only (the CPU case is tiny).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import pytest
import torch

from peagle_ext import data as D
from peagle_ext.data import hidden_states as HS
from peagle_ext.testing import smollm2_model as make_model
from peagle_ext.train.hidden import HiddenStates
from peagle_ext.train.profiling import describe_by_class

AUX = [2, 15, 27]


def make_rows(n_rows: int, seq_len: int, doc_tokens: tuple[int, int], vocab: int, seed: int = 0):
    """About n_rows packed rows of seq_len tokens from random documents (cut to n_rows)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = doc_tokens
    docs, total = [], 0
    while total < n_rows * seq_len:
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        docs.append((torch.randint(3, vocab, (n,), generator=g), torch.ones(n, dtype=torch.bool)))
        total += n
    return D.pack_conversations(docs, seq_len, pad_token_id=0)[:n_rows]


def parse_case(text: str) -> tuple:
    """ "ROWS:TOKENS" -> (rows a pass or None for the trainer's default, padded tokens a forward)."""
    rows, tokens = text.split(":")
    case = (None if rows == "auto" else int(rows), int(tokens))
    if (case[0] is not None and case[0] < 1) or case[1] < 1:
        raise ValueError(text)
    return case


def case_name(case: tuple) -> str:
    return f"{'auto' if case[0] is None else case[0]}:{case[1]}"


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def warm(model, rows, case: tuple, device) -> tuple[HiddenStates, int, int]:
    """A fresh cache warmed over rows with case = (rows a pass or None for the default, padded
    tokens a forward); returns it, the number of verifier forwards and their padded
    tokens."""
    hs = HiddenStates(model, AUX, rows, cache=True, store_dtype=torch.bfloat16, device=device)
    hs.WARM_ROWS, hs.WARM_TOKENS = case
    seen = [0, 0]

    def count(module, args, kwargs):
        x = args[0] if args else kwargs["input_ids"]
        seen[0] += 1
        seen[1] += x.numel()

    handle = model.model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        with torch.no_grad():
            hs.warm("warm", progress=False)
        _sync(device)
    finally:
        handle.remove()
    return hs, seen[0], seen[1]


def measure(model, rows, case: tuple) -> dict:
    dev = next(model.parameters()).device
    warm(model, rows[: min(len(rows), 8)], case, dev)  # kernels, allocator
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    hs, forwards, padded = warm(model, rows, case, dev)
    dt = time.perf_counter() - t0
    assert sorted(hs._mem) == list(range(len(rows)))
    ntok = sum(len(r) for r in rows)
    real = sum(e - s for r in rows for s, e in r.document_spans())
    return {
        "case": case_name(case),
        "rows_per_pass": hs.warm_rows_per_pass(),
        "rows": len(rows),
        "tokens": ntok,
        "seconds": dt,
        "tok_s": ntok / dt,
        "verifier_s": hs.warm_seconds["verifier"],
        "to_host_s": hs.warm_seconds["to_host"],
        "forwards": forwards,
        "padding": padded / max(real, 1) - 1,
        "peak_gb": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None,
    }


def profile_warm(model, rows, case: tuple) -> dict:
    """One warm-up under torch.profiler: ms per pass by kernel class, and device idle by host op."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from peagle_ext.train.profiling import idle_by_host, time_by_class

    dev = next(model.parameters()).device
    probe = HiddenStates(model, AUX, rows, cache=True, store_dtype=torch.bfloat16, device=dev)
    probe.WARM_ROWS = case[0]
    passes = -(-len(rows) // probe.warm_rows_per_pass())
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        with record_function("peagle.warm"):
            warm(model, rows, case, dev)
    out = {"case": case_name(case), "time_by_class": time_by_class(prof, dev.type, passes, top=10)}
    if dev.type == "cuda":
        out["device_idle"] = idle_by_host(prof.events(), passes, top=8)
    return out


def describe_profile(p: dict) -> str:
    return describe_by_class(p["case"], "pass", p["time_by_class"], p.get("device_idle"), digits=1)


# ---- pytest-benchmark ------------------------------------------------------------------------
def test_bench_hidden_states_cpu(benchmark):
    model = make_model(
        torch.device("cpu"),
        torch.float32,
        num_hidden_layers=28,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    )
    rows = make_rows(4, 256, (32, 200), 512)
    benchmark.group = "hidden-state warm-up cpu, 28 narrow layers, 4 rows x 256"
    benchmark.pedantic(lambda: warm(model, rows, (2, 512), torch.device("cpu")), rounds=3, warmup_rounds=1)


def test_bench_hidden_states_cuda(benchmark):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev = torch.device("cuda")
    model = make_model(dev, torch.bfloat16)
    rows = make_rows(64, 2048, (256, 2048), model.config.vocab_size)
    benchmark.group = "hidden-state warm-up SmolLM2 shape, 64 rows x 2048"
    benchmark.pedantic(
        lambda: warm(model, rows, (None, HiddenStates.WARM_TOKENS), dev),
        rounds=2,
        warmup_rounds=1,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    ap.add_argument("--rows", type=int, default=256 if cuda else 8, help="packed rows to warm")
    ap.add_argument("--seq-len", type=int, default=2048 if cuda else 256)
    ap.add_argument("--doc-tokens", default="256,2048" if cuda else "32,200", help="MIN,MAX document length")
    ap.add_argument(
        "--cases",
        default="16:32768,auto:32768",
        help="comma-separated ROWS:TOKENS (rows a pass or auto for the trainer's default, padded tokens a forward)",
    )
    ap.add_argument(
        "--attention",
        default="no-cudnn,sdpa",
        help="comma-separated SDPA choices of the verifier forwards: no-cudnn (flash / memory-efficient) | sdpa (torch's choice)",
    )
    ap.add_argument("--profile", action="store_true", help="profile one more warm-up of each case")
    args = ap.parse_args()
    try:
        cases = [parse_case(c) for c in args.cases.split(",")]
        lo, hi = (int(x) for x in args.doc_tokens.split(","))
        attentions = args.attention.split(",")
        if not attentions or any(a not in ("no-cudnn", "sdpa") for a in attentions):
            raise ValueError(args.attention)
    except ValueError:
        ap.error(
            f"--cases must be ROWS:TOKENS,... (ints >= 1, ROWS may be auto), --doc-tokens MIN,MAX and "
            f"--attention no-cudnn and/or sdpa, got {args.cases!r}, {args.doc_tokens!r} and {args.attention!r}"
        )
    if args.rows < 1 or args.seq_len < 2 or not 1 <= lo <= hi:
        ap.error("--rows must be >= 1, --seq-len >= 2, --doc-tokens 1 <= MIN <= MAX")
    out_dir = Path(os.environ.get("OUT") or "bench_out")
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda" if cuda else "cpu")
    model = make_model(dev, torch.bfloat16 if cuda else torch.float32)
    rows = make_rows(args.rows, args.seq_len, (lo, min(hi, args.seq_len)), model.config.vocab_size)
    results, profiles = [], []
    print(f"{len(rows)} rows of {args.seq_len} tokens, documents of {lo}-{hi} tokens, SmolLM2 shape on {dev}")
    print(
        "| case | attention | rows a pass | forwards | padding | s | tokens/s | verifier passes s | shift + to host s | peak GB |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for case in cases:
        for attention in attentions:
            HS.PASS_WITHOUT_CUDNN_ATTENTION = attention == "no-cudnn"
            r = {**measure(model, rows, case), "attention": attention}
            results.append(r)
            peak = "-" if r["peak_gb"] is None else f"{r['peak_gb']:.1f}"
            print(
                f"| {r['case']} | {attention} | {r['rows_per_pass']} | {r['forwards']} | {r['padding']:.1%} | "
                f"{r['seconds']:.2f} | {r['tok_s']:.0f} | {r['verifier_s']:.2f} | {r['to_host_s']:.2f} | {peak} |",
                flush=True,
            )
    HS.PASS_WITHOUT_CUDNN_ATTENTION = True
    if args.profile:
        for case in cases:
            profiles.append(profile_warm(model, rows, case))
            print(describe_profile(profiles[-1]), flush=True)
    info = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "seq_len": args.seq_len,
        "doc_tokens": [lo, hi],
    }
    out = out_dir / "bench_hidden_states.json"
    out.write_text(json.dumps({"info": info, "results": results, "profiles": profiles}, indent=1))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
