"""Benchmark: greedy speculative decoding with a P-EAGLE drafter vs plain greedy decoding.

For each bench (MT-Bench first turns, HumanEval) and each K of the sweep: acceptance length
(tokens per verifier round), per-position acceptance, tokens/s of speculative and of plain greedy
decoding (same verifier, same prompts, same KV-cache loop, timed the same way), losslessness
(output == the verifier's own greedy output, per prompt), and a PNG of acceptance length and
speed-up vs K. Then a profiled pass (peagle_ext.eval.profile_rounds, device synchronised around
each part) splits a round into its parts and compares the speed-up with its bound:

    t_step  = plain greedy time per token             (the baseline's step, on its engine)
    t_round = speculative time per round              (the engine's round: draft + verify + bookkeeping)
    bound   = acceptance_length * t_step / t_verify   (speed-up if everything but the verifier were free)
    achieved = acceptance_length * t_step / t_round   (~ tokens/s ratio)

Drafter: --draft DIR, else $PEAGLE_DRAFT, else an UNTRAINED random drafter (acceptance ~1: then
the run measures the per-round overhead and losslessness only; the report says so).

Run: python bench/bench_eval.py [--draft DIR] [--verifier smollm2] [--device cuda]
       [--benches mtbench,humaneval] [--num-prompts 10] [--max-new-tokens 128] [--k-sweep 1..8]
     writes $OUT/bench_eval.json (or ./bench_out/) and $OUT/bench_eval_<bench>_k_sweep.png;
     QUICK=1: 4 prompts, 64 new tokens, K in 1,2,4,8.
     pytest bench/bench_eval.py --benchmark-only: pytest-benchmark of one speculative decode vs
     greedy on the tiny random verifier (CPU, or CUDA when present).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from peagle_ext.serving import PEagleDrafter, Verifier, greedy_generate, speculative_generate

ROOT = Path(__file__).resolve().parents[1]


def _out_dir() -> Path:
    d = Path(os.environ.get("OUT") or ROOT / "bench_out")
    d.mkdir(parents=True, exist_ok=True)
    return d


def _random_drafter(model, num_depths=8):
    from peagle_ext.model import PEagleDraftModel

    torch.manual_seed(0)
    dm = PEagleDraftModel.from_verifier(model.config, num_depths=num_depths, mask_token_id=int(model.config.vocab_size))
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    dm.attach_verifier(
        norm_weight=base.norm.weight.detach().float().cpu(),
        lm_head_weight=model.get_output_embeddings().weight.detach().float().cpu(),
        embed_weight=model.get_input_embeddings().weight.detach().float().cpu(),
    )
    return dm


def _profile(verifier, drafter, prompts, k, max_new, eos, engines, greedy_engine):
    """profile_rounds over `prompts` plus the bound / achieved speed-ups (module docstring)."""
    from peagle_ext.eval import profile_rounds

    p = profile_rounds(
        verifier,
        drafter,
        [t for _, t in prompts],
        k,
        max_new,
        eos_token_id=eos,
        engine=engines.get(k),
        greedy_engine=greedy_engine,
    )
    t_step = p.get("greedy_engine_step_ms", p["greedy_step_ms"])
    t_round = p.get("engine_round_ms", p["round_ms"])
    t_verify = p["parts_ms_per_round"]["verify"]
    al = p["acceptance_length"] or 1.0
    return {
        **p,
        "t_step_ms": t_step,
        "t_round_ms": t_round,
        "t_verify_ms": t_verify,
        "t_draft_ms": p["overhead_ms"],
        "verify_cost_in_steps": t_verify / t_step,
        "draft_cost_in_steps": p["overhead_ms"] / t_step,
        "speedup_bound_free_draft": al * t_step / t_verify,
        "speedup_achieved": al * t_step / t_round,
    }


def main(argv=None) -> int:
    from peagle_ext.data import load_verifier
    from peagle_ext.eval import (
        build_engines,
        eos_ids,
        evaluate,
        load_drafter,
        make_verifier,
        parse_k_sweep,
        plot_k_sweep,
        render_prompts,
    )

    quick = os.environ.get("QUICK", "0") not in ("", "0")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--verifier", default="smollm2")
    ap.add_argument("--draft", default=os.environ.get("PEAGLE_DRAFT"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--benches", default="mtbench,humaneval")
    ap.add_argument("--num-prompts", type=int, default=4 if quick else 10)
    ap.add_argument("--max-new-tokens", type=int, default=64 if quick else 128)
    ap.add_argument("--k-sweep", default="1,2,4,8" if quick else "1..8")
    ap.add_argument("--num-spec-tokens", type=int, default=None, help="main K (default: the largest of the sweep)")
    ap.add_argument("--verifier-impl", default="auto", choices=["auto", "static", "hf"])
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(args.dtype) or (
        torch.bfloat16 if dev.type == "cuda" else torch.float32
    )
    model, tok = load_verifier(args.verifier, device=dev, dtype=dtype, require_chat_template=False)
    if args.draft:
        drafter = load_drafter(args.draft, Verifier(model), dtype=dtype)
        draft_name = str(args.draft)
    else:
        drafter = PEagleDrafter(_random_drafter(model), device=dev, dtype=dtype)
        draft_name = "UNTRAINED random drafter (no --draft / PEAGLE_DRAFT): acceptance ~1, overhead only"
    verifier = make_verifier(model, drafter.aux_layer_ids, args.verifier_impl)
    ks = [k for k in parse_k_sweep(args.k_sweep) if k <= drafter.num_depths]
    k_main = args.num_spec_tokens or max(ks)
    eos = eos_ids(model, tok)
    print(f"verifier {args.verifier} ({dev}, {str(dtype).replace('torch.', '')}), drafter: {draft_name}")
    out = _out_dir()
    report = {
        "verifier": args.verifier,
        "draft": draft_name,
        "device": str(dev),
        "dtype": str(dtype),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "num_prompts": args.num_prompts,
        "max_new_tokens": args.max_new_tokens,
        "benches": {},
    }
    rows = []
    for bench in [b for b in args.benches.split(",") if b]:
        t0 = time.perf_counter()
        prompts = render_prompts(tok, bench, args.num_prompts)
        r = evaluate(
            verifier,
            drafter,
            prompts,
            num_spec_tokens=k_main,
            max_new_tokens=args.max_new_tokens,
            k_sweep=ks,
            eos_token_id=eos,
        )
        r["plot"] = str(
            plot_k_sweep(
                r["k_sweep"],
                out / f"bench_eval_{bench}_k_sweep.png",
                f"{args.verifier} + P-EAGLE, {bench} ({len(prompts)} prompts, {dev})",
            )
        )
        engines, greedy_engine = build_engines(
            verifier, drafter, sorted({1, k_main}), max(len(t) for _, t in prompts) + args.max_new_tokens, None
        )
        r["profile"] = [
            _profile(verifier, drafter, prompts[:3], k, args.max_new_tokens, eos, engines, greedy_engine)
            for k in sorted({1, k_main})
        ]
        r["wall_s"] = time.perf_counter() - t0
        report["benches"][bench] = r
        for s in r["k_sweep"]:
            rows.append((bench, s))
        (out / "bench_eval.json").write_text(json.dumps(report, indent=1) + "\n")  # partial results survive a timeout
        print(f"{bench}: {len(prompts)} prompts in {r['wall_s']:.0f}s")
    print()
    print(
        f"{'bench':<10} {'K':>2} {'accept_len':>10} {'tok/s':>8} {'greedy tok/s':>12} {'speed-up':>8} {'lossless':>8}"
    )
    for bench, s in rows:
        print(
            f"{bench:<10} {s['num_spec_tokens']:>2} {s['acceptance_length']:>10.3f} {s['tokens_per_s']:>8.1f} "
            f"{s['baseline_tokens_per_s']:>12.1f} {s['speedup']:>8.2f} {s['num_lossless']:>4}/{args.num_prompts}"
        )
    print()
    print("round breakdown (3 prompts, device synchronised; t_draft = everything but the verifier forward): ms")
    print(
        f"{'bench':<10} {'K':>2} {'accept_len':>10} {'t_step':>7} {'t_verify':>8} {'t_draft':>7} "
        f"{'verify/step':>11} {'draft/step':>10} {'bound':>6} {'achieved':>8}"
    )
    for bench, r in report["benches"].items():
        for p in r["profile"]:
            print(
                f"{bench:<10} {p['num_spec_tokens']:>2} {p['acceptance_length']:>10.3f} {p['t_step_ms']:>7.2f} "
                f"{p['t_verify_ms']:>8.2f} {p['t_draft_ms']:>7.2f} {p['verify_cost_in_steps']:>11.2f} "
                f"{p['draft_cost_in_steps']:>10.2f} {p['speedup_bound_free_draft']:>6.2f} {p['speedup_achieved']:>8.2f}"
            )
    print(f"\nreport: {out / 'bench_eval.json'}")
    return 0


# ---------------------------------------------------------------------------------------------
# pytest-benchmark: the tiny random verifier (fast anywhere)
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_setup():
    from transformers import AutoModelForCausalLM

    from peagle_ext.testing import make_tiny_verifier

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    d = make_tiny_verifier(Path(tempfile.mkdtemp()) / "v")
    vm = AutoModelForCausalLM.from_pretrained(d).to(dev).eval().requires_grad_(False)
    dm = _random_drafter(vm, num_depths=4)
    return Verifier(vm, dm.config.eagle_aux_hidden_state_layer_ids), PEagleDrafter(dm, device=dev)


def test_bench_greedy_32_tokens(benchmark, tiny_setup):
    v, _ = tiny_setup
    p = torch.arange(5, 17)
    r = benchmark(lambda: greedy_generate(v, p, 32))
    assert len(r.tokens) == 32


def test_bench_speculative_32_tokens_k4(benchmark, tiny_setup):
    v, dr = tiny_setup
    p = torch.arange(5, 17)
    base = greedy_generate(v, p, 32).tokens
    r = benchmark(lambda: speculative_generate(v, dr, p, 4, 32))
    assert r.tokens == base


if __name__ == "__main__":
    sys.exit(main())
