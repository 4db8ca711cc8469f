"""Speculative-decoding evaluation of a P-EAGLE drafter (docs/design.md section 7); the
`peagle eval` command line is peagle_ext/cli/eval.py.

For every prompt: the verifier's own greedy decoding (the baseline, timed) and greedy
speculative decoding with the drafter (peagle_ext.serving, timed the same way), compared token
for token (`lossless`). Reports acceptance length (tokens per verifier round = accepted drafts +
1), per-position acceptance, tokens/s of both and, with a K sweep, the same per K plus a PNG of
acceptance length (and speed-up) vs K.

Decoding runs on a StaticVerifier (the verifier's modules over a preallocated KV cache) when the
verifier is of the Llama family, with every round after the first, and every baseline step after
the prefill, on the fixed-shape engines of peagle_ext.serving.graphs: CUDA graphs on a GPU, the
same computation eagerly on a CPU. Other verifiers run through transformers with a DynamicCache.

Prompts: peagle_ext.data.load_eval_prompts (MT-Bench first turns, HumanEval problems as a user
message "Complete the following Python function" + the code, or a JSONL), every one rendered
with the verifier tokenizer's chat template (add_generation_prompt=True); a tokenizer without a
template gets the user text as is.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from .data import load_eval_prompts
from .model import PEagleDraftModel
from .serving import (
    PROFILE_PARTS,
    GreedyResult,
    PEagleDrafter,
    SpecResult,
    Verifier,
    acceptance_stats,
    first_mismatch,
    greedy_generate,
    speculative_generate,
)
from .serving.cache_attention import VARLEN_IMPLS
from .serving.graphs import GreedyEngine, RoundEngine
from .serving.static_verifier import StaticVerifier, static_verifier_support

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_draft_dir(path) -> Path:
    """A section-5 checkpoint dir, or a training output dir (its final/)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"--draft {path}: no such directory")
    if not p.is_dir():
        raise NotADirectoryError(f"--draft {path}: not a directory (pass a P-EAGLE checkpoint directory)")
    if (p / "config.json").is_file():
        return p
    if (p / "final" / "config.json").is_file():
        return p / "final"
    raise FileNotFoundError(f"--draft {path}: not a P-EAGLE checkpoint (no config.json, nor final/config.json)")


def load_drafter(
    path, verifier: Verifier, *, dtype: torch.dtype | None = None, attention: str = "auto"
) -> PEagleDrafter:
    """Load the drafter at `path` and check it fits `verifier` (hidden size, layers, vocab).
    attention: its attention over its KV cache (PEagleDrafter)."""
    d = resolve_draft_dir(path)
    model = PEagleDraftModel.from_pretrained(d)
    cfg = model.config
    if cfg.hidden_size != verifier.hidden_size:
        raise ValueError(
            f"drafter {d} has hidden_size {cfg.hidden_size}, the verifier {verifier.hidden_size}: "
            "it was trained for another verifier"
        )
    ids = cfg.eagle_aux_hidden_state_layer_ids or []
    if not ids or max(ids) > verifier.num_layers:
        raise ValueError(f"drafter {d} reads verifier aux layers {ids}, the verifier has {verifier.num_layers} layers")
    top = int(model.draft_token_ids.max())
    if top >= verifier.vocab_size:
        raise ValueError(f"drafter {d} drafts token id {top}, the verifier's vocab has {verifier.vocab_size} ids")
    return PEagleDrafter(model, device=verifier.device, dtype=dtype or verifier.dtype, attention=attention)


def make_verifier(model, aux_layer_ids, impl: str = "auto", *, attention: str = "auto"):
    """The decoding verifier: impl "static" (StaticVerifier), "hf" (transformers with a
    DynamicCache) or "auto" (static when the model supports it); attention: StaticVerifier's
    (serving/cache_attention.py)."""
    if impl not in ("auto", "static", "hf"):
        raise ValueError(f"verifier implementation must be auto, static or hf, got {impl!r}")
    why = static_verifier_support(model)
    if impl == "static" and why is not None:
        raise ValueError(f"--verifier-impl static: {why}")
    if impl == "hf" or why is not None:
        if attention in VARLEN_IMPLS:  # the static verifier's kernels
            raise ValueError(f"--attention {attention} needs the static verifier ({why or '--verifier-impl hf'})")
        return Verifier(model, aux_layer_ids)
    try:
        return StaticVerifier(model, aux_layer_ids, attention=attention)
    except ValueError as e:
        raise ValueError(f"--attention: {e}") from None


def render_prompts(tokenizer, bench: str, num_prompts: int | None) -> list[tuple[str, list[int]]]:
    """[(prompt id, token ids)] of the bench's first `num_prompts` prompts (module docstring)."""
    msgs_list = load_eval_prompts(bench, limit=num_prompts)
    label = bench.lower() if bench.lower() in ("mtbench", "humaneval") else Path(bench).stem
    out = []
    for i, msgs in enumerate(msgs_list):
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer("\n\n".join(m["content"] for m in msgs if m["role"] == "user"))["input_ids"]
        if not ids:
            raise ValueError(f"{label} prompt {i} renders to no tokens")
        out.append((f"{label}-{i}", list(ids)))
    return out


def eos_ids(model, tokenizer) -> list[int]:
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None:
        ids = getattr(model.config, "eos_token_id", None)
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return [int(ids)] if isinstance(ids, int) else [int(x) for x in ids]


def parse_k_sweep(text: str) -> list[int]:
    """'1..8' or '1,2,4,8' -> sorted unique ints >= 1."""
    s = str(text).strip()
    try:
        if ".." in s:
            lo, hi = s.split("..", 1)
            ks = list(range(int(lo), int(hi) + 1))
        else:
            ks = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--k-sweep must look like 1..8 or 1,2,4, got {text!r}") from None
    if not ks or min(ks) < 1:
        raise ValueError(f"--k-sweep needs K values >= 1, got {text!r}")
    return sorted(set(ks))


# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------
def _rate(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 else None


def summarize_k(
    k: int, prompt_ids: list[str], spec: list[SpecResult], base: list[GreedyResult], prompt_tokens=None
) -> dict:
    """The report of one K over all prompts. A prompt whose output differs from the baseline's
    gets "mismatch": the first differing position, both tokens there and the common prefix
    (prompt + generated tokens before it, when prompt_tokens are given), which
    tools/mismatch_gaps.py rescores in fp32 to tell a rounding-flipped near-tie from a bug."""
    accepted = [a for r in spec for a in r.accepted]
    st = acceptance_stats(accepted, k)
    tok = sum(len(r.tokens) for r in spec)
    sec = sum(r.wall_s for r in spec)
    btok = sum(len(b.tokens) for b in base)
    bsec = sum(b.wall_s for b in base)
    tps, btps = _rate(tok, sec), _rate(btok, bsec)
    prompts = []
    for i, (pid, r, b) in enumerate(zip(prompt_ids, spec, base)):
        mm = first_mismatch(r.tokens, b.tokens)
        detail = None
        if mm is not None:
            detail = {
                "position": mm,
                "token": r.tokens[mm] if mm < len(r.tokens) else None,
                "baseline_token": b.tokens[mm] if mm < len(b.tokens) else None,
            }
            if prompt_tokens is not None:
                detail["prefix"] = list(prompt_tokens[i]) + list(b.tokens[:mm])
        prompts.append(
            {
                "id": pid,
                "prompt_tokens": r.prompt_tokens,
                "tokens_generated": len(r.tokens),
                "rounds": r.rounds,
                "acceptance_length": r.acceptance_length if r.rounds else None,
                "lossless": mm is None,
                "first_mismatch": mm,
                "mismatch": detail,
                "wall_s": r.wall_s,
                "baseline_wall_s": b.wall_s,
                "accepted_per_round": list(r.accepted),
            }
        )
    return {
        "num_spec_tokens": k,
        "acceptance_length": st["acceptance_length"],
        "per_position_acceptance": st["per_position_acceptance"],
        "per_position_acceptance_unconditional": st["per_position_acceptance_unconditional"],
        "rounds": st["rounds"],
        "tokens_generated": tok,
        "tokens_per_s": tps,
        "baseline_tokens_per_s": btps,
        "speedup": tps / btps if tps and btps else None,
        "lossless": all(p["lossless"] for p in prompts),
        "num_lossless": sum(p["lossless"] for p in prompts),
        "prompts": prompts,
    }


def evaluate(
    verifier: Verifier,
    drafter,
    prompts: list[tuple[str, list[int]]],
    *,
    num_spec_tokens: int,
    max_new_tokens: int,
    k_sweep: list[int] | None = None,
    eos_token_id=None,
    warmup: bool = True,
    log=None,
    cuda_graphs: bool | None = None,
    profile_prompts: int = 0,
) -> dict:
    """Baseline + speculative decoding of every prompt; the JSON report (without run metadata).

    The main K runs interleaved with the baseline prompt by prompt (so machine-load drift hits
    both alike); the other K of the sweep run afterwards against the same baseline. With a
    StaticVerifier the rounds run on engines (module docstring); cuda_graphs: replay them as CUDA
    graphs (default: when the verifier is on a GPU). profile_prompts > 0: afterwards, time the
    parts of a round on that many prompts (report["profile"], see profile_rounds)."""
    if not prompts:
        raise ValueError("no prompts to evaluate")
    ks = sorted(set(k_sweep or [])) if k_sweep else []
    for k in [num_spec_tokens, *ks]:
        if k > drafter.num_depths:
            raise ValueError(f"num_spec_tokens {k} is larger than the drafter's num_depths {drafter.num_depths}")
    say = log or (lambda s: None)
    ids = [p for p, _ in prompts]
    engines, greedy_engine = build_engines(
        verifier, drafter, [num_spec_tokens, *ks], max(len(t) for _, t in prompts) + max_new_tokens, cuda_graphs
    )
    eng = engines.get
    eos = eos_token_id
    if warmup:  # first-call costs (allocator, kernels, lazy init) outside the timed runs
        w = min(8, max_new_tokens)
        greedy_generate(verifier, prompts[0][1], w, eos_token_id=eos_token_id, engine=greedy_engine)
        speculative_generate(
            verifier, drafter, prompts[0][1], num_spec_tokens, w, eos_token_id=eos_token_id, engine=eng(num_spec_tokens)
        )
    base, main = [], []
    for i, (pid, toks) in enumerate(prompts):
        b = greedy_generate(verifier, toks, max_new_tokens, eos_token_id=eos_token_id, engine=greedy_engine)
        s = speculative_generate(
            verifier, drafter, toks, num_spec_tokens, max_new_tokens, eos_token_id=eos, engine=eng(num_spec_tokens)
        )
        base.append(b)
        main.append(s)
        say(
            f"[{i + 1}/{len(prompts)}] {pid}: {len(s.tokens)} tokens, {s.rounds} rounds, acceptance "
            f"{s.acceptance_length:.2f}, {'lossless' if s.tokens == b.tokens else 'MISMATCH'}, "
            f"{fmt(_rate(len(s.tokens), s.wall_s))} vs {fmt(_rate(len(b.tokens), b.wall_s))} tok/s"
        )
    toks = [t for _, t in prompts]
    report = summarize_k(num_spec_tokens, ids, main, base, toks)
    if ks:
        sweep = []
        for k in ks:
            if k == num_spec_tokens:
                r = report
            else:
                spec = [
                    speculative_generate(verifier, drafter, t, k, max_new_tokens, eos_token_id=eos, engine=eng(k))
                    for _, t in prompts
                ]
                r = summarize_k(k, ids, spec, base, toks)
            say(
                f"K={k}: acceptance length {r['acceptance_length']:.3f}, {fmt(r['tokens_per_s'])} tok/s "
                f"(x{fmt(r['speedup'], 2)}), lossless {r['num_lossless']}/{len(prompts)}"
            )
            sweep.append({key: v for key, v in r.items() if key != "prompts"})
        report["k_sweep"] = sweep
    report["verifier_impl"] = type(verifier).__name__
    report["verifier_attention"] = getattr(verifier, "attention", None)
    report["drafter_attention"] = getattr(drafter, "attention", None)
    report["cuda_graphs"] = any(e.graph is not None for e in engines.values())
    eager_buckets = sorted({b for e in [*engines.values(), greedy_engine] if e for b in e.eager_prefill_buckets})
    if eager_buckets:  # prefill buckets whose capture failed (a warning said so): eager, slower
        report["eager_prefill_buckets"] = eager_buckets
    if profile_prompts:
        report["profile"] = profile_rounds(
            verifier,
            drafter,
            [t for _, t in prompts[:profile_prompts]],
            num_spec_tokens,
            max_new_tokens,
            eos_token_id=eos_token_id,
            engine=eng(num_spec_tokens),
            greedy_engine=greedy_engine,
        )
    return report


def build_engines(verifier, drafter, ks, longest: int, cuda_graphs: bool | None):
    """({K: RoundEngine}, GreedyEngine) for a StaticVerifier and a PEagleDrafter, all on one
    capacity (longest prompt + new tokens + the largest K); ({}, None) otherwise."""
    if not isinstance(verifier, StaticVerifier) or not isinstance(drafter, PEagleDrafter):
        return {}, None
    graphs = verifier.device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
    cap = -(-(longest + max(ks)) // 64) * 64
    drafter.reset(cap)  # before any capture: engines keep pointers into the drafter's cache
    engines = {k: RoundEngine(verifier, drafter, k, cap, cuda_graph=graphs) for k in sorted(set(ks))}
    return engines, GreedyEngine(verifier, cap, cuda_graph=graphs)


def profile_rounds(
    verifier, drafter, prompt_ids, k, max_new_tokens, *, eos_token_id=None, engine=None, greedy_engine=None
):
    """Milliseconds per round of each part of a speculative round (the general loop, device
    synchronised around every part: PROFILE_PARTS; the prefill apart, per prompt), per engine
    round, and per baseline token with and without its engine (prefill included), over
    `prompt_ids`; plus the acceptance length of these runs."""
    parts = dict.fromkeys(PROFILE_PARTS, 0.0)
    rounds = 0
    accepted = []
    for p in prompt_ids:
        r = speculative_generate(verifier, drafter, p, k, max_new_tokens, eos_token_id=eos_token_id, profile=True)
        for name in PROFILE_PARTS:
            parts[name] += r.profile[name]
        rounds += r.rounds
        accepted += r.accepted
    out = {
        "num_spec_tokens": k,
        "prompts": len(prompt_ids),
        "rounds": rounds,
        "acceptance_length": acceptance_stats(accepted, k)["acceptance_length"],
        "prefill_ms_per_prompt": 1e3 * parts["prefill"] / max(len(prompt_ids), 1),
        "parts_ms_per_round": {
            n: 1e3 * v / max(rounds, 1) for n, v in parts.items() if n not in ("engine_round", "prefill")
        },
    }
    out["round_ms"] = sum(out["parts_ms_per_round"].values())
    out["overhead_ms"] = out["round_ms"] - out["parts_ms_per_round"]["verify"]

    def per_step(fn):
        tok = sec = 0.0
        for p in prompt_ids:
            r = fn(p)
            sec += r.wall_s
            tok += len(r.tokens)
        return sec, tok

    sec, tok = per_step(lambda p: greedy_generate(verifier, p, max_new_tokens, eos_token_id=eos_token_id))
    out["greedy_step_ms"] = 1e3 * sec / max(tok, 1)
    if engine is not None:
        e_sec = e_rounds = 0.0
        for p in prompt_ids:
            r = speculative_generate(
                verifier, drafter, p, k, max_new_tokens, eos_token_id=eos_token_id, engine=engine, profile=True
            )
            e_sec += r.profile["engine_round"]
            e_rounds += r.profile["engine_rounds"]
        out["engine_round_ms"] = 1e3 * e_sec / max(e_rounds, 1)
        out["engine_cuda_graph"] = engine.graph is not None
    if greedy_engine is not None:
        sec, tok = per_step(
            lambda p: greedy_generate(verifier, p, max_new_tokens, eos_token_id=eos_token_id, engine=greedy_engine)
        )
        out["greedy_engine_step_ms"] = 1e3 * sec / max(tok, 1)
    # the kernel breakdown replays from the middle of these decodes: an attention that reads only
    # the filled positions costs what it costs there
    out["replay_position"] = sum(len(p) for p in prompt_ids) // max(len(prompt_ids), 1) + max_new_tokens // 2
    if engine is not None and greedy_engine is not None and verifier.device.type == "cuda":
        try:
            out["kernels"] = kernel_breakdown(engine, greedy_engine, start=out["replay_position"])
        except RuntimeError as e:  # the profiler (CUPTI) over graph replays: not worth the report
            out["kernels_error"] = f"{type(e).__name__}: {e}"
    return out


# kernel classes of a decoding step, by a name fragment (lower case; the first class that matches)
KERNEL_CLASSES = (
    ("attention", ("flash", "fmha", "attention", "efficient", "sdpa", "cudnn")),  # before gemm: fmha_cutlass*
    ("gemm", ("gemm", "gemv", "cutlass", "nvjet", "xmma", "splitk", "cublas")),
    ("parallel draft", ("parallel_draft",)),
    ("reduce", ("reduce", "norm", "argmax", "cumprod", "scan", "softmax")),
    ("copy / index", ("copy", "cat", "index", "gather", "scatter", "fill", "where", "memcpy", "memset")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)


# profiler rows that are runtime calls or transfers, not kernels of the step
_NOT_KERNELS = ("cudaGraph", "cudaStream", "cudaDevice", "Memcpy DtoH", "Activity Buffer")


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, frags in KERNEL_CLASSES:
        if any(f in low for f in frags):
            return cls
    return "other"


def kernel_breakdown(
    engine: RoundEngine, greedy_engine: GreedyEngine, replays: int = 8, top: int = 12, start: int = 0
) -> dict:
    """Device time of one engine round and of one engine greedy step, by kernel class (KERNEL_CLASSES)
    and by kernel name (the `top` names that the round spends most on beyond the greedy step), from
    torch.profiler over `replays` steps of each from position `start` (clamped to leave room for
    them; made-up tokens: the kernels and their
    shapes are those of decoding; no output is read), and the host wall time per replay of each
    (begin() included, a few small copies). Only on a CUDA device. Each engine is left at a state
    that the next decode's begin() replaces."""
    from torch.profiler import ProfilerActivity, profile

    k = engine.k
    # every replay moves a round at most K + 1 positions on; stay inside both capacities
    cap = min(engine.capacity, greedy_engine.capacity)
    start = max(0, min(int(start), cap - (replays + 4) * (k + 1)))
    r_round = max(1, min(replays, (engine.capacity - start) // (k + 1) - 3))
    r_greedy = max(1, min(replays, greedy_engine.capacity - start - 2))
    dev = engine.verifier.device
    zeros = torch.zeros(k + 1, dtype=torch.long, device=dev)

    def by_name(run, n):
        torch.cuda.synchronize(dev)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(n)
            torch.cuda.synchronize(dev)
        times, calls = {}, {}
        for e in prof.key_averages():
            t = getattr(e, "self_device_time_total", None)
            if t is None:
                t = getattr(e, "self_cuda_time_total", 0.0)
            if t > 0 and not e.key.startswith(_NOT_KERNELS):
                times[e.key] = times.get(e.key, 0.0) + t / n  # us per replay
                calls[e.key] = calls.get(e.key, 0.0) + e.count / n
        return times, calls

    def rounds(n):
        engine.begin(zeros, start, torch.zeros_like(engine.aux), zeros[:1], 0)
        for _ in range(n):
            engine.step()

    def steps(n):
        greedy_engine.begin(0, start)
        for _ in range(n):
            greedy_engine.step()

    def wall_us(run, n):
        """Host wall time per replay, the device synchronised before and after: against the device
        time it shows what the host adds (graph launch, the round's device -> host read)."""
        run(1)  # the warm state of a replay
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        run(n)
        torch.cuda.synchronize(dev)
        return 1e6 * (time.perf_counter() - t) / n

    (rnd, rnd_calls), (stp, stp_calls) = by_name(rounds, r_round), by_name(steps, r_greedy)
    round_wall, greedy_wall = wall_us(rounds, r_round), wall_us(steps, r_greedy)

    def classes(times):
        out = {}
        for name, t in times.items():
            c = kernel_class(name)
            out[c] = out.get(c, 0.0) + t
        return {c: round(t, 2) for c, t in sorted(out.items(), key=lambda x: -x[1])}

    diff = {n: rnd.get(n, 0.0) - stp.get(n, 0.0) for n in set(rnd) | set(stp)}
    heavy = [n for n, t in sorted(diff.items(), key=lambda x: -x[1])[:top] if t > 0]
    return {
        "replays": {"round": r_round, "greedy_step": r_greedy},
        "start_position": start,
        "round_us": round(sum(rnd.values()), 2),
        "greedy_step_us": round(sum(stp.values()), 2),
        "round_wall_us": round(round_wall, 2),
        "greedy_step_wall_us": round(greedy_wall, 2),
        "round_kernels": len(rnd),
        "round_us_by_class": classes(rnd),
        "greedy_step_us_by_class": classes(stp),
        "round_minus_greedy_top_us": {n[:120]: round(diff[n], 2) for n in heavy},
        # device ops (kernels, copies, memsets) per replay of those names, [round, greedy step]: more
        # of them or slower ones
        "round_minus_greedy_top_calls": {
            n[:120]: [round(rnd_calls.get(n, 0.0), 2), round(stp_calls.get(n, 0.0), 2)] for n in heavy
        },
        "round_device_ops": round(sum(rnd_calls.values()), 1),
        "greedy_step_device_ops": round(sum(stp_calls.values()), 1),
    }


def fmt(x, nd=1):
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{nd}f}"


def plot_k_sweep(sweep: list[dict], path, title: str = "") -> Path:
    """PNG of acceptance length vs K (left axis) and speed-up vs plain greedy (right axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [r["num_spec_tokens"] for r in sweep]
    al = [r["acceptance_length"] for r in sweep]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ks, al, "o-", color="tab:blue", label="acceptance length (tokens / round)")
    ax.plot(ks, [k + 1 for k in ks], ":", color="gray", label="upper bound K+1")
    ax.set_xlabel("K (tokens drafted in parallel)")
    ax.set_ylabel("acceptance length")
    ax.set_xticks(ks)
    ax.grid(alpha=0.3)
    sp = [r.get("speedup") for r in sweep]
    lines = ax.get_legend_handles_labels()
    if all(s is not None for s in sp):
        ax2 = ax.twinx()
        ax2.plot(ks, sp, "s--", color="tab:orange", label="speed-up vs greedy (tokens/s)")
        ax2.axhline(1.0, color="tab:orange", lw=0.8, alpha=0.5, label="speed-up 1 (as fast as greedy)")
        ax2.set_ylabel("speed-up")
        l2 = ax2.get_legend_handles_labels()
        lines = (lines[0] + l2[0], lines[1] + l2[1])
    ax.set_title(title or "P-EAGLE acceptance vs K")
    # below the axes: inside them it covers points wherever the curves happen to lie
    fig.legend(*lines, fontsize=8, loc="lower center", ncol=2, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p
