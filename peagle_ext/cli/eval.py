"""`peagle eval`: speculative-decoding evaluation of a drafter (acceptance, tokens/s, losslessness)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from ..data import load_verifier
from ..eval import (
    DTYPES,
    eos_ids,
    evaluate,
    fmt,
    load_drafter,
    make_verifier,
    parse_k_sweep,
    plot_k_sweep,
    render_prompts,
    resolve_draft_dir,
)
from ..serving import Verifier

HELP = "speculative-decoding evaluation of a drafter (acceptance, tokens/s, losslessness)"


def add_arguments(p) -> None:
    p.add_argument("--verifier", default="smollm2", help="local HF causal-LM directory or 'smollm2' (default)")
    p.add_argument("--draft", required=True, help="P-EAGLE checkpoint directory (or a training output dir: its final/)")
    p.add_argument("--bench", default="mtbench", help="mtbench | humaneval | PATH.jsonl (default mtbench)")
    p.add_argument("--num-prompts", type=int, default=10, help="first N prompts of the bench (default 10)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="default 128")
    p.add_argument("--num-spec-tokens", type=int, default=None, help="K (default: the drafter's num_depths)")
    p.add_argument("--k-sweep", default=None, help="also run these K, e.g. 1..8 or 1,2,4; writes a PNG")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--plot", default=None, help="K-sweep PNG (default: next to --json, else ./eval_k_sweep.png)")
    p.add_argument("--device", default="cpu", help="cpu | cuda (default cpu)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="verifier and drafter dtype; auto = bfloat16 on cuda, float32 on cpu",
    )
    p.add_argument(
        "--verifier-impl",
        default="auto",
        choices=["auto", "static", "hf"],
        help="static: the verifier's modules over a preallocated KV cache (Llama/Qwen families), hf: "
        "transformers with a DynamicCache; auto = static where supported",
    )
    p.add_argument(
        "--attention",
        default="auto",
        choices=["auto", "sdpa", "flash", "peagle"],
        help="the attention over the KV caches: sdpa (the position mask over the whole cache), flash "
        "(through FlashAttention-2 over each query's filled positions: the static verifier's round tokens, "
        "its greedy steps and prefills staying on sdpa, and every drafter row; CUDA, bf16/fp16), peagle (the "
        "same through this project's decode-attention op; CPU and CUDA); auto = on CUDA peagle, else flash, "
        "where it runs and agrees with sdpa on a probe, else sdpa (a round's device time 1.12-1.17 greedy "
        "steps with peagle, 1.21-1.23 with flash, 1.18-1.46 with sdpa on an H100, bench/RESULTS.md)",
    )
    p.add_argument(
        "--cuda-graphs",
        default="auto",
        choices=["auto", "on", "off"],
        help="replay the fixed-shape rounds as CUDA graphs (auto = on cuda with the static verifier)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        default=False,
        help="also time the parts of a round (draft forward, batch step, verifier forward, crop, bookkeeping)",
    )
    p.add_argument("--profile-prompts", type=int, default=3, help="prompts of the --profile pass (default 3)")
    p.add_argument("--ignore-eos", action="store_true", default=False, help="always generate max-new-tokens tokens")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", default=True)
    p.add_argument("--quiet", action="store_true", default=False, help="no per-prompt lines")


def _check_pos_int(name, v):
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")


def check_report_path(path: str) -> None:
    """--json must name a file this process can create or replace, in a directory that exists or
    can be created: found out now rather than after the evaluation."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"--json {path} is a directory; give a file name")
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"--json {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ValueError(f"--json {path} is not writable")


def run(args) -> int:
    _check_pos_int("--num-prompts", args.num_prompts)
    _check_pos_int("--max-new-tokens", args.max_new_tokens)
    _check_pos_int("--num-spec-tokens", args.num_spec_tokens)
    ks = parse_k_sweep(args.k_sweep) if args.k_sweep else None
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise ValueError(f"--device must be cpu or cuda[:N], got {args.device!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda[:N], got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device available")
    if args.json:  # before the whole evaluation runs, not after it
        check_report_path(args.json)
    dtype = DTYPES.get(args.dtype) or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    draft_dir = resolve_draft_dir(args.draft)  # fail fast, before loading the verifier
    model, tok = load_verifier(args.verifier, device=device, dtype=dtype, require_chat_template=False)
    drafter = load_drafter(draft_dir, Verifier(model), dtype=dtype, attention="sdpa")
    verifier = make_verifier(model, drafter.aux_layer_ids, args.verifier_impl, attention=args.attention)
    try:  # after the verifier's choice, whose errors name the verifier
        drafter.set_attention(args.attention)
    except ValueError as e:
        raise ValueError(f"--attention: {e}") from None
    _check_pos_int("--profile-prompts", args.profile_prompts)
    k = args.num_spec_tokens or drafter.num_depths
    if k > drafter.num_depths:
        raise ValueError(
            f"--num-spec-tokens {k} is larger than the drafter's num_depths {drafter.num_depths} "
            f"({draft_dir} was trained to draft at most that many tokens in parallel)"
        )
    if ks and max(ks) > drafter.num_depths:
        raise ValueError(f"--k-sweep goes up to K={max(ks)}, the drafter's num_depths is {drafter.num_depths}")
    prompts = render_prompts(tok, args.bench, args.num_prompts)
    eos = None if args.ignore_eos else eos_ids(model, tok)
    log = None if args.quiet else (lambda s: print(s, flush=True))
    t0 = time.perf_counter()
    report = evaluate(
        verifier,
        drafter,
        prompts,
        num_spec_tokens=k,
        max_new_tokens=args.max_new_tokens,
        k_sweep=ks,
        eos_token_id=eos,
        warmup=args.warmup,
        log=log,
        cuda_graphs={"auto": None, "on": True, "off": False}[args.cuda_graphs],
        profile_prompts=args.profile_prompts if args.profile else 0,
    )
    meta = {
        "verifier": str(args.verifier),
        "draft": str(draft_dir),
        "bench": args.bench,
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "drafter_num_depths": drafter.num_depths,
        "stop_at_eos": eos is not None,
        "wall_s": time.perf_counter() - t0,
    }
    report = {**meta, **report}
    if ks:
        plot = args.plot or (str(Path(args.json).with_suffix("")) + "_k_sweep.png" if args.json else "eval_k_sweep.png")
        report["plot"] = str(
            plot_k_sweep(
                report["k_sweep"],
                plot,
                f"{Path(str(args.verifier)).name} + P-EAGLE on {Path(str(report['bench'])).stem} "
                f"({len(prompts)} prompts)",
            )
        )
    _print_summary(report)
    if args.json:
        p = Path(args.json)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(report, indent=1) + "\n")
        print(f"report: {p}")
    if report.get("plot"):
        print(f"plot: {report['plot']}")
    return 0


def _print_summary(r: dict):
    k = r["num_spec_tokens"]
    print()
    print(
        f"P-EAGLE speculative decoding, K={k}, {r['num_prompts']} {r['bench']} prompts, "
        f"max {r['max_new_tokens']} new tokens ({r['device']}, {r['dtype']})"
    )
    print(f"  acceptance length {fmt(r['acceptance_length'], 3)} tokens/round over {r['rounds']} rounds")
    print("  per-position acceptance P(k | <k accepted): " + " ".join(fmt(a, 2) for a in r["per_position_acceptance"]))
    print(
        "  per-position acceptance (unconditional):   "
        + " ".join(fmt(a, 2) for a in r["per_position_acceptance_unconditional"])
    )
    print(
        f"  tokens/s {fmt(r['tokens_per_s'])} vs plain greedy {fmt(r['baseline_tokens_per_s'])} "
        f"(speed-up x{fmt(r['speedup'], 2)})"
    )
    print(f"  lossless (== verifier greedy): {r['num_lossless']}/{r['num_prompts']} prompts")
    if r["num_lossless"] < r["num_prompts"] and r["dtype"] != "float32":
        # a verify forward of K + 1 tokens rounds unlike the baseline's one-token forward
        print(
            f"    in {r['dtype']} a near-tied argmax can flip between the two forwards; "
            "tools/mismatch_gaps.py --eval REPORT.json rescores each difference in float32"
        )
    att = f", attention {r['verifier_attention']}" if r.get("verifier_attention") else ""
    datt = f", drafter attention {r['drafter_attention']}" if r.get("drafter_attention") else ""
    print(f"  verifier: {r['verifier_impl']}{att}{datt}, CUDA graphs {'on' if r['cuda_graphs'] else 'off'}")
    if r.get("k_sweep"):
        print("  K  accept_len  tok/s   speed-up  lossless")
        for s in r["k_sweep"]:
            print(
                f"  {s['num_spec_tokens']:<2} {fmt(s['acceptance_length'], 3):>10}  {fmt(s['tokens_per_s']):>6}  "
                f"{fmt(s['speedup'], 2):>8}  {s['num_lossless']}/{r['num_prompts']}"
            )
    if r.get("profile"):
        print_profile(r["profile"], r["device"])


def print_profile(p: dict, device: str):
    parts = p["parts_ms_per_round"]
    print(
        f"  round profile, K={p['num_spec_tokens']}, {p['prompts']} prompts, {p['rounds']} rounds, acceptance "
        f"{fmt(p['acceptance_length'], 2)} (device synchronised around every part), ms per round:"
    )
    print(
        "    "
        + "  ".join(f"{n} {v:.3f}" for n, v in parts.items())
        + f"  (prefill {p['prefill_ms_per_prompt']:.1f} ms a prompt)"
    )
    print(
        f"    = {p['round_ms']:.3f} ms a round part by part, of which {p['overhead_ms']:.3f} ms beyond the verifier "
        f"forward ({100 * p['overhead_ms'] / max(p['round_ms'], 1e-12):.0f}%)"
    )
    line = f"    plain greedy {p['greedy_step_ms']:.3f} ms/token"
    if "engine_round_ms" in p:
        kind = "CUDA graph" if p.get("engine_cuda_graph") else "fixed shapes, eager"
        line += f"; engine round ({kind}) {p['engine_round_ms']:.3f} ms"
    if "greedy_engine_step_ms" in p:
        line += f"; engine greedy step {p['greedy_engine_step_ms']:.3f} ms/token"
    print(line)
    kern = p.get("kernels")
    if kern:
        print(
            f"    device time: engine round {kern['round_us']:.0f} us ("
            + ", ".join(f"{c} {t:.0f}" for c, t in kern["round_us_by_class"].items())
            + f"), greedy step {kern['greedy_step_us']:.0f} us ("
            + ", ".join(f"{c} {t:.0f}" for c, t in kern["greedy_step_us_by_class"].items())
            + f"); host wall per replay: round {kern['round_wall_us']:.0f} us, greedy step"
            + f" {kern['greedy_step_wall_us']:.0f} us"
            + (
                f"; device ops: round {kern['round_device_ops']:.0f}, greedy step {kern['greedy_step_device_ops']:.0f}"
                if "round_device_ops" in kern
                else ""
            )
        )
    step = p.get("greedy_engine_step_ms", p["greedy_step_ms"])
    rnd = p.get("engine_round_ms", p["round_ms"])
    print(
        f"    a round costs {rnd / max(step, 1e-12):.2f} greedy steps: speculative decoding is faster than greedy "
        f"when the acceptance length exceeds that ({device})"
    )
