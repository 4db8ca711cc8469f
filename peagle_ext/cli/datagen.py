"""`peagle datagen`: regenerate the assistant turns of a dataset with the verifier (resumable)."""

from __future__ import annotations

from pathlib import Path

import torch

HELP = "regenerate the assistant turns of a chat dataset with the verifier itself (JSONL out, resumable)"


def _opt_int(v: str):
    return None if v.lower() in ("none", "null", "all", "") else int(v)


def _opt_float(v: str):
    return None if v.lower() in ("none", "null", "") else float(v)


def add_arguments(p) -> None:
    p.add_argument("--verifier", default="smollm2", help="local HF causal-LM directory or 'smollm2' (default)")
    p.add_argument("--data", required=True, help="'sharegpt' or a JSONL of {\"messages\": [...]} lines")
    p.add_argument("--output", required=True, help="JSONL to write; an existing one is resumed (appended to)")
    p.add_argument("--num-conversations", type=_opt_int, default=None, help="first N conversations (default all)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="longest answer per turn (default 512)")
    p.add_argument(
        "--max-length",
        type=int,
        default=2048,
        help="prompt + answer tokens at most (default 2048, the training seq-len): longer turns are not generated",
    )
    p.add_argument(
        "--turns",
        choices=["first", "all"],
        default="first",
        help="regenerate the first assistant turn only (default; later turns dropped) or all, turn by turn",
    )
    p.add_argument(
        "--loops",
        choices=["keep", "cut"],
        default="keep",
        help="answers that end in a repetition loop: keep them as generated (default) or cut the loop off "
        "(the repeated phrase or line once) before a later turn is generated on them",
    )
    p.add_argument(
        "--engine",
        choices=["auto", "static", "hf"],
        default="auto",
        help="static: batched decoding over a preallocated KV cache (Llama/Qwen/Mistral families); hf: "
        "transformers' generate(); auto (default): static where it runs the verifier, else hf",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling when --temperature > 0 (default 1)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--batch-size", type=int, default=16, help="conversations generated together (default 16)")
    p.add_argument(
        "--batch-tokens",
        type=_opt_int,
        default=None,
        help="KV-cache tokens a batch holds at most: rows x (longest prompt + --max-new-tokens); lets "
        "--batch-size be large for short prompts and keeps long ones inside memory (default: no bound)",
    )
    p.add_argument("--device", default="cpu", help="cpu | cuda (default cpu)")
    p.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="auto = bf16 on cuda, fp32 on cpu"
    )
    p.add_argument(
        "--time-budget",
        type=_opt_float,
        default=None,
        help="seconds: start no new batch after this (resume later with the same command)",
    )
    p.add_argument("--no-progress", dest="progress", action="store_false", default=True)


def run(args) -> int:
    from ..data import load_conversations, load_verifier
    from ..data.datagen import regenerate
    from ..eval import eos_ids

    out = Path(args.output)
    if out.is_dir():
        raise ValueError(f"--output {out} is a directory, expected a JSONL file path")
    if args.num_conversations is not None and args.num_conversations < 1:
        raise ValueError(f"--num-conversations must be >= 1, got {args.num_conversations}")
    for flag, v in (("--batch-size", args.batch_size), ("--batch-tokens", args.batch_tokens)):
        if v is not None and v < 1:  # before the verifier loads
            raise ValueError(f"{flag} must be >= 1, got {v}")
    if args.time_budget is not None and not args.time_budget > 0:
        raise ValueError(f"--time-budget must be > 0 seconds, got {args.time_budget}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device available")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(args.dtype) or (
        torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    convs = load_conversations(args.data, limit=args.num_conversations)  # bad --data fails before the verifier loads
    model, tok = load_verifier(args.verifier, device=device, dtype=dtype)
    st = regenerate(
        model,
        tok,
        convs,
        out,
        max_new_tokens=args.max_new_tokens,
        max_length=args.max_length,
        temperature=args.temperature,
        top_p=args.top_p,
        batch_size=args.batch_size,
        batch_tokens=args.batch_tokens,
        turns=args.turns,
        loops=args.loops,
        engine=args.engine,
        seed=args.seed,
        eos_token_ids=eos_ids(model, tok),
        time_budget_s=args.time_budget,
        progress=args.progress,
    )
    rate = st.new_tokens / st.seconds if st.seconds > 0 else 0.0
    print(
        f"datagen: {st.written} conversations written this run ({st.already_done} were already in {out}), "
        f"{st.turns} answers, {st.new_tokens} new tokens in {st.seconds:.0f} s ({rate:.0f} tok/s, engine "
        f"{st.engine}{', ' + st.step_mode + ' steps' if st.step_mode else ''})"
    )
    if st.failed_captures:
        print(f"  {st.failed_captures} CUDA graph capture(s) failed: those groups ran their steps eagerly (slower)")
    if st.truncated_turns:
        print(f"  {st.truncated_turns} answers hit --max-new-tokens {args.max_new_tokens} (cut there)")
    if st.looping_turns:
        what = "cut to the repeated unit once (--loops cut)" if st.cut_turns else "kept (--loops cut cuts them off)"
        print(
            f"  {st.looping_turns} answers end in a repetition loop (a phrase or line repeated to the end; "
            f"easy to draft, so they inflate validation accuracy): {what}"
        )
    if st.skipped:
        print(f"  {st.skipped} conversations skipped: first prompt + --max-new-tokens > --max-length {args.max_length}")
    if st.remaining:
        print(f"  {st.remaining} conversations left (time budget): run the same command again to continue")
    else:
        print(f"  complete: {out} holds all {st.conversations} conversations")
    return 0
