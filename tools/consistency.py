"""Train/serve consistency of a trained drafter, measured on held-out conversations of the
training distribution: where decoding's position-k acceptance and the trainer's validation
accuracy at depth k-1 part, and by how much each cause moves them.

For held-out conversations (the first --num-conversations after --skip, truncated to --max-len
tokens), on every scored chain (peagle_ext.serving.teacher_forced):
  val_fp32    the training forward's accuracy, inside the draft vocab (what the trainer reports),
              with fp32 verifier hidden states
  val_amp     the same with the verifier and the drafter in bf16 autocast, as `peagle train`
              runs them on a GPU or a bf16 CPU (only with --amp)
  tf_full     teacher-forced decoding rounds: the draft against the verifier's full-vocab choice
  in_vocab    fraction of scored targets whose verifier choice is in the draft vocab (tf_full can
              reach val only where it is)
and, on the verifier's own greedy continuations of the same conversations' first user turns
(--gen-tokens new tokens), what decoding meets on training-distribution prompts:
  greedy_tf   teacher-forced rounds on that text (unconditional per-position correctness)
  greedy_tf_conditional  the same rounds' conditional per-position acceptance (every anchor)
  greedy_tf_walk  of those rounds, the ones decoding runs (serving.decoding_rounds): the gap to
              greedy_tf_conditional is which anchors decoding meets, the gap to decode is the
              numerics of decoding's cached forwards (none in exact arithmetic)
  decode      speculative decoding of those prompts (conditional per-position acceptance)

The greedy continuations and the speculative decoding run on the decoding verifier of `peagle
eval` (--verifier-impl; "auto": the fixed-shape StaticVerifier where the model supports it, with
its engines, replayed as CUDA graphs on a GPU): the same tokens as the transformers forward, in a
fraction of the time on a GPU.

python tools/consistency.py --draft runs/smollm2/final [--verifier smollm2] [--data sharegpt]
    [--skip 400] [--num-conversations 40] [--device cpu] [--amp] [--verifier-impl auto] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peagle_ext.data import (  # noqa: E402
    PackedSequence,
    decoder_parts,
    eagle_shift,
    load_conversations,
    load_verifier,
    tokenize_conversation,
    verifier_hidden_states,
)
from peagle_ext.eval import build_engines, eos_ids, make_verifier, resolve_draft_dir  # noqa: E402
from peagle_ext.model import PEagleDraftModel  # noqa: E402
from peagle_ext.serving import (  # noqa: E402
    PEagleDrafter,
    Verifier,
    acceptance_stats,
    decoding_rounds,
    greedy_generate,
    scored_chains_layout,
    speculative_generate,
    teacher_forced_rounds,
)


def _ratio(c, t):
    return [a / b if b else None for a, b in zip(c, t)]


def _add(acc, xs):
    return [a + int(b) for a, b in zip(acc, xs)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draft", required=True)
    ap.add_argument("--verifier", default="smollm2")
    ap.add_argument("--data", default="sharegpt")
    ap.add_argument("--skip", type=int, default=400, help="conversations before the held-out ones (default 400)")
    ap.add_argument("--num-conversations", type=int, default=40)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--gen-prompts", type=int, default=12, help="prompts for greedy_tf / decode (default 12)")
    ap.add_argument("--gen-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=None, help="K (default: the drafter's num_depths)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--amp", action="store_true", help="also measure val_amp (bf16 autocast)")
    ap.add_argument(
        "--verifier-impl",
        default="auto",
        choices=["auto", "static", "hf"],
        help="the verifier of the greedy continuations and the decoding (as peagle eval; default auto)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    for name in ("num_conversations", "gen_prompts", "gen_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_len < 2:  # prompts keep the last max_len // 2 tokens
        ap.error(f"--max-len must be >= 2, got {args.max_len}")
    if args.skip < 0:
        ap.error(f"--skip must be >= 0, got {args.skip}")
    torch.set_num_threads(1)
    dev = torch.device(args.device)
    t0 = time.time()
    model, tok = load_verifier(args.verifier, device=dev, dtype=torch.float32)
    dm = PEagleDraftModel.from_pretrained(resolve_draft_dir(args.draft))
    _, _, norm = decoder_parts(model)
    dm.attach_verifier(
        norm_weight=norm.weight.float().cpu(),
        lm_head_weight=model.get_output_embeddings().weight.float().cpu(),
        init_from_verifier=False,
    )
    dm = dm.to(dev).eval().requires_grad_(False)
    k = args.k or dm.num_depths
    aux_ids = dm.config.eagle_aux_hidden_state_layer_ids
    v = Verifier(model, aux_ids)
    dr = PEagleDrafter(dm, device=dev, dtype=torch.float32)
    in_vocab = torch.zeros(int(model.config.vocab_size) + 1, dtype=torch.bool)
    in_vocab[dm.draft_token_ids.cpu()] = True
    convs = load_conversations(args.data, limit=args.skip + args.num_conversations)[args.skip :]
    vb = None
    if args.amp:
        vb, _ = load_verifier(args.verifier, device=dev, dtype=torch.bfloat16)
    z = [0] * k
    val_c, val_t, amp_c, amp_t, tf_c, tf_t = z, z, z, z, z, z
    cover_hit = cover_all = 0
    for ci, conv in enumerate(convs):
        ids, mask = tokenize_conversation(tok, conv, max_len=args.max_len)
        n = ids.numel()
        row = PackedSequence(ids, torch.zeros(n, dtype=torch.int32), mask, 0)
        aux, last = verifier_hidden_states(model, row, aux_ids)
        ex = eagle_shift(row, aux, last)
        lay = scored_chains_layout(ex, dm.num_depths)
        with torch.no_grad():
            _, met = dm(ex, lay)
        val_c, val_t = _add(val_c, met["correct"][:k]), _add(val_t, met["total"][:k])
        if vb is not None:
            aux_b, last_b = verifier_hidden_states(vb, row, aux_ids)
            ex_b = eagle_shift(row, aux_b, last_b)
            with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16):
                _, met_b = dm(ex_b, lay)
            amp_c, amp_t = _add(amp_c, met_b["correct"][:k]), _add(amp_t, met_b["total"][:k])
        r = teacher_forced_rounds(v, dr, ids, k, scored=mask)
        tf_c, tf_t = _add(tf_c, r.correct), _add(tf_t, r.total)
        with torch.no_grad():
            g = model(ids[None].to(dev)).logits[0].argmax(-1).cpu()
        sc = mask[1:].clone()  # the scored targets of depth 0: g[a+1] for rounds with x_{a+1} scored
        cover_hit += int(in_vocab[g[1:][sc]].sum())
        cover_all += int(sc.sum())
        print(f"[{ci + 1}/{len(convs)}] {n} tokens; tf_full d0 so far {tf_c[0] / max(tf_t[0], 1):.3f}", flush=True)
    eos = eos_ids(model, tok)
    g_acc, w_acc, d_acc = [], [], []
    g_c, g_t = z, z
    prompts = []
    for conv in convs[: args.gen_prompts]:
        text = tok.apply_chat_template(conv[:1], tokenize=False, add_generation_prompt=True)
        prompts.append(tok(text, add_special_tokens=False)["input_ids"][-(args.max_len // 2) :])
    dec = make_verifier(model, aux_ids, args.verifier_impl)
    # engines first, at the largest capacity: teacher_forced_rounds' smaller drafter.reset() then
    # keeps the draft cache the engines captured
    engines, greedy_engine = build_engines(dec, dr, [k], max(map(len, prompts), default=1) + args.gen_tokens, None)
    for prompt in prompts:
        gen = greedy_generate(dec, prompt, args.gen_tokens, eos_token_id=eos, engine=greedy_engine).tokens
        full = torch.tensor(prompt + gen)
        r = teacher_forced_rounds(v, dr, full, k, scored=torch.arange(full.numel()) >= len(prompt))
        g_c, g_t = _add(g_c, r.correct), _add(g_t, r.total)
        g_acc += r.accepted
        w_acc += decoding_rounds(r.accepted)
        d_acc += speculative_generate(
            dec, dr, prompt, k, args.gen_tokens, eos_token_id=eos, engine=engines.get(k)
        ).accepted
    rep = {
        "draft": str(args.draft),
        "held_out": f"{args.data} conversations {args.skip}..{args.skip + len(convs) - 1}, <= {args.max_len} tokens",
        "num_spec_tokens": k,
        "gen_tokens": args.gen_tokens,
        "decoding_verifier": type(dec).__name__,
        "cuda_graphs": bool(engines) and engines[k].graph is not None,
        "val_fp32": _ratio(val_c, val_t),
        "val_amp": _ratio(amp_c, amp_t) if vb is not None else None,
        "tf_full": _ratio(tf_c, tf_t),
        "scored": val_t,
        "in_vocab": cover_hit / cover_all if cover_all else None,
        "greedy_tf": _ratio(g_c, g_t),
        "greedy_tf_conditional": acceptance_stats(g_acc, k)["per_position_acceptance"],
        "greedy_tf_walk": acceptance_stats(w_acc, k)["per_position_acceptance"],
        "greedy_tf_walk_acceptance_length": acceptance_stats(w_acc, k)["acceptance_length"],
        "decode": acceptance_stats(d_acc, k)["per_position_acceptance"],
        "decode_acceptance_length": acceptance_stats(d_acc, k)["acceptance_length"],
        "wall_s": time.time() - t0,
    }

    def f(xs):
        return " ".join("  n/a" if x is None else f"{x:.3f}" for x in xs) if xs else "-"

    print(f"\nheld-out: {rep['held_out']}; per position k = 1..{k} (validation depth k-1)")
    for key in ("val_fp32", "val_amp", "tf_full", "greedy_tf", "greedy_tf_conditional", "greedy_tf_walk", "decode"):
        print(f"  {key:<22} {f(rep[key])}")
    print(f"  in_vocab (verifier's choice inside the draft vocab): {rep['in_vocab']:.3f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rep, indent=1) + "\n")
        print(f"report: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
