"""Regenerating the assistant turns of a chat dataset with the verifier itself (`peagle datagen`).

A drafter learns to predict the verifier; trained on text the verifier wrote itself it sees the
contexts it meets when it serves (speculators and SpecForge recommend this). Every conversation
keeps its system and user turns; its assistant turns are replaced by the verifier's answers:

- turns="first": the conversation up to its first user turn, then the verifier's answer. Later
  turns are dropped (they answer the original assistant, not the new one). The cheap default.
- turns="all": turn by turn, each answer generated with the regenerated history before it. A
  conversation stops early (keeping the turns done) when its next prompt plus max_new_tokens would
  exceed max_length tokens.

Loops: a small verifier decoding greedily often repeats a phrase or line until max_new_tokens
(peagle_ext.data.loops). loops="keep" writes such answers as generated; loops="cut" cuts the loop
off (`loops.cut_loop`: the repeated unit once) before the answer is written and before a later turn
is generated on it, so that the data keeps the verifier's words without the easy repeated tail.

Output: one JSON object a line, {"index": i, "messages": [...]} with i the conversation's index
in the loaded dataset, plus "truncated": [turn numbers that hit max_new_tokens] when any did and
"loops_cut": [turn numbers whose loop was cut off] when any was. A
conversation whose first prompt is already too long is written as {"index": i, "messages": [],
"skipped": reason}: data loaders skip a conversation with no exchange, and a resumed run knows it
was handled.

Engines: "static" (peagle_ext.serving.batch_generation: a preallocated KV cache written in place,
stopped rows dropped from the batch) for the model families StaticVerifier runs, "hf"
(transformers' generate() with left padding) for any causal LM; "auto" takes the first that runs
the model. Both give the verifier's greedy continuations; in float64 the answers are identical.

Batches: conversations sorted by prompt length, cut into groups of at most batch_size, every group
generated together (padded). With batch_tokens a group also holds at most that many
tokens of KV cache: size x (its longest first prompt + max_new_tokens), or size x max_length with
turns="all" (a later turn's prompt grows up to it). Generation of a small verifier is bound by the
host's per-step launches more than by the GPU, so a step of four times the rows costs far less than
four times as much: large groups of short prompts are cheap throughput, and the token bound keeps
the groups of long prompts inside memory. The groups depend only on the data and the settings, so a
resumed run (which redoes every group that is not completely written, and writes only the lines
missing) produces the same file as an uninterrupted one, also when sampling (each group draws
from a generator seeded by (seed, group)).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .loops import cut_loop, ends_in_loop
from .records import DataError

TURN_MODES = ("first", "all")
LOOP_MODES = ("keep", "cut")
ENGINES = ("auto", "static", "hf")


@dataclass
class DatagenStats:
    conversations: int = 0  # in the dataset
    already_done: int = 0  # found in the output file at the start
    written: int = 0  # lines written by this run
    skipped: int = 0  # prompts too long for max_length
    turns: int = 0  # answers generated
    truncated_turns: int = 0  # answers that hit max_new_tokens
    looping_turns: int = 0  # answers that end in a repetition loop (data.loops.ends_in_loop)
    cut_turns: int = 0  # of them, cut off (loops="cut")
    new_tokens: int = 0
    engine: str = ""  # the engine that ran: "static" or "hf"
    step_mode: str = ""  # the static engine's decode steps: "graphs", "eager" (serving/batch_generation.py)
    failed_captures: int = 0  # graphs mode: captures that failed (their group went on eagerly)
    seconds: float = 0.0
    stopped_by_budget: bool = False
    remaining: int = 0
    skip_reasons: list[str] = field(default_factory=list, repr=False)


def read_done_indices(path: Path) -> set[int]:
    """Indices of the complete lines of an existing output file. A torn last line (a run killed
    while writing) is cut off the file, so appending continues on a line boundary."""
    done: set[int] = set()
    if not path.exists():
        return done
    raw = path.read_bytes()
    end = raw.rfind(b"\n") + 1
    if end < len(raw):
        with open(path, "r+b") as f:
            f.truncate(end)
    for lineno, line in enumerate(raw[:end].splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            i = rec["index"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise DataError(
                f"{path}:{lineno}: not a line of `peagle datagen` (no JSON object with an 'index'): "
                "pass a new --output, or the file an earlier datagen run wrote"
            ) from None
        if isinstance(i, bool) or not isinstance(i, int):
            raise DataError(f"{path}:{lineno}: 'index' must be an int, got {i!r}")
        done.add(i)
    return done


def _render_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _split_turns(messages: list[dict]) -> tuple[list[dict], list[str]]:
    """(system messages, the user turns that got an answer), from normalized messages."""
    system = [m for m in messages[:1] if m["role"] == "system"]
    users: list[str] = []
    prev = None
    for m in messages:
        if m["role"] == "user":
            if prev == "user":  # two user turns in a row make one prompt
                users[-1] = users[-1] + "\n\n" + m["content"]
            else:
                users.append(m["content"])
        prev = m["role"]
    return system, users


def pick_engine(model, engine: str):
    """A BatchGenerator for `model` (engine "static", or "auto" where it runs the model), else
    None: transformers' generate() (engine "hf")."""
    from ..serving.batch_generation import BatchGenerator
    from ..serving.static_verifier import static_verifier_support

    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    why = None if engine == "hf" else static_verifier_support(model)
    if engine == "static" and why is not None:
        raise ValueError(f"engine 'static' does not run this verifier ({why}): use engine 'hf' or 'auto'")
    return BatchGenerator(model) if engine != "hf" and why is None else None


@torch.no_grad()
def _generate(model, tokenizer, prompts, *, max_new_tokens, temperature, top_p, eos, pad, seed, engine):
    """Batched generation; [(new token ids without the stop token, hit the limit)]. engine: a
    BatchGenerator, or None for transformers' generate() with left padding."""
    dev = next(model.parameters()).device
    if engine is not None:
        gen = None
        if temperature > 0:
            gen = torch.Generator(device=dev).manual_seed(seed)
        return engine.generate(
            prompts, max_new_tokens=max_new_tokens, eos=eos, temperature=temperature, top_p=top_p, generator=gen
        )
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    am = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = torch.tensor(p)
        am[b, width - len(p) :] = 1
    kw = dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    if temperature > 0:
        kw = dict(do_sample=True, temperature=float(temperature), top_p=float(top_p), top_k=0)
        torch.manual_seed(seed)
        if dev.type == "cuda":
            torch.cuda.manual_seed_all(seed)
    out = model.generate(
        input_ids=ids.to(dev),
        attention_mask=am.to(dev),
        max_new_tokens=max_new_tokens,
        eos_token_id=sorted(eos),
        pad_token_id=pad,
        **kw,
    )
    res = []
    for row in out[:, width:].tolist():
        stop = next((i for i, t in enumerate(row) if t in eos), None)
        res.append((row if stop is None else row[:stop], stop is None))
    return res


def regenerate(
    model,
    tokenizer,
    conversations: list[list[dict]],
    output,
    *,
    max_new_tokens: int = 512,
    max_length: int = 2048,
    temperature: float = 0.0,
    top_p: float = 1.0,
    batch_size: int = 16,
    batch_tokens: int | None = None,
    turns: str = "first",
    loops: str = "keep",
    engine: str = "auto",
    seed: int = 0,
    eos_token_ids=None,
    time_budget_s: float | None = None,
    progress: bool = True,
) -> DatagenStats:
    """Write the conversations with regenerated assistant turns to `output` (module docstring),
    appending to what an earlier run wrote there. time_budget_s: start no new group after that
    many seconds (the rest is left for a resumed run). batch_tokens: the KV-cache tokens a group
    may hold (module docstring; None = batch_size alone decides). engine: "auto", "static" or
    "hf"; loops: "keep" or "cut" (module docstring)."""
    for name, v, lo in (("max_new_tokens", max_new_tokens, 1), ("batch_size", batch_size, 1), ("seed", seed, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= max_new_tokens:
        raise ValueError(f"max_length must be an int > max_new_tokens ({max_new_tokens}), got {max_length!r}")
    bad_bound = isinstance(batch_tokens, bool) or not isinstance(batch_tokens, int) or batch_tokens < 1
    if batch_tokens is not None and bad_bound:
        raise ValueError(f"batch_tokens must be None or an int >= 1, got {batch_tokens!r}")
    if not isinstance(temperature, (int, float)) or temperature < 0 or temperature != temperature:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if turns not in TURN_MODES:
        raise ValueError(f"turns must be one of {TURN_MODES}, got {turns!r}")
    if loops not in LOOP_MODES:
        raise ValueError(f"loops must be one of {LOOP_MODES}, got {loops!r}")
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("the verifier's tokenizer has no chat template: prompts are rendered with it")
    runner = pick_engine(model, engine)
    limit = None if runner is None else runner.sv.max_positions
    if limit and max_length - 1 > limit:  # a group's cache holds up to max_length - 1 positions
        raise ValueError(
            f"max_length {max_length}: a prompt and its answer run through up to max_length - 1 positions, "
            f"the verifier has {limit} (max_position_embeddings)"
        )
    eos = {int(x) for x in (eos_token_ids or [])} or {int(tokenizer.eos_token_id)}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = read_done_indices(out)
    st = DatagenStats(conversations=len(conversations), already_done=len(done & set(range(len(conversations)))))
    st.engine = "hf" if runner is None else "static"
    st.step_mode = "" if runner is None else runner.mode

    parts = [_split_turns(c) for c in conversations]
    first_len = [len(_render_ids(tokenizer, s + [{"role": "user", "content": u[0]}])) for s, u in parts]
    order = sorted(range(len(conversations)), key=lambda i: (first_len[i], i))
    per_row = (lambda i: max_length) if turns == "all" else (lambda i: min(first_len[i] + max_new_tokens, max_length))
    groups = make_groups(order, per_row, batch_size, batch_tokens)
    todo = [(gi, grp) for gi, grp in enumerate(groups) if any(i not in done for i in grp)]
    st.remaining = sum(1 for _, grp in todo for i in grp if i not in done)
    from tqdm import tqdm

    bar = tqdm(total=st.remaining, desc="datagen", unit="conv", disable=not progress, dynamic_ncols=True)
    t0 = time.perf_counter()
    with open(out, "a", encoding="utf-8") as f:
        for gi, grp in todo:
            if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
                st.stopped_by_budget = True
                break
            lines = _regenerate_group(
                model,
                tokenizer,
                [(i, *parts[i]) for i in grp],
                st,
                max_new_tokens=max_new_tokens,
                max_length=max_length,
                temperature=temperature,
                top_p=top_p,
                eos=eos,
                pad=pad,
                seed=seed * 1_000_003 + gi,
                engine=runner,
                all_turns=turns == "all",
                cut_loops=loops == "cut",
            )
            new = [json.dumps(rec, ensure_ascii=False) + "\n" for rec in lines if rec["index"] not in done]
            f.write("".join(new))
            f.flush()
            os.fsync(f.fileno())
            st.written += len(new)
            st.remaining -= len(new)
            bar.update(len(new))
    bar.close()
    st.seconds = time.perf_counter() - t0
    st.failed_captures = 0 if runner is None else runner.failed_captures
    return st


def make_groups(order: list[int], row_tokens, batch_size: int, batch_tokens: int | None) -> list[list[int]]:
    """Consecutive runs of `order` of at most batch_size indices whose size x the largest
    row_tokens(i) among them is at most batch_tokens (a row over the bound alone makes a group of
    one). `order` ascends in row_tokens, so the last index added is the group's largest."""
    groups: list[list[int]] = []
    cur: list[int] = []
    widest = 0
    for i in order:
        w = max(widest, row_tokens(i))
        if cur and (len(cur) == batch_size or (batch_tokens is not None and (len(cur) + 1) * w > batch_tokens)):
            groups.append(cur)
            cur, w = [], row_tokens(i)
        cur.append(i)
        widest = w
    if cur:
        groups.append(cur)
    return groups


def _regenerate_group(
    model, tokenizer, items, st: DatagenStats, *, max_length, all_turns, cut_loops, **gen
) -> list[dict]:
    """The output records of one group [(index, system, user turns)], turn by turn."""
    max_new = gen["max_new_tokens"]
    recs = {}
    live = []  # (index, messages so far, remaining user turns)
    for i, system, users in items:
        prompt = system + [{"role": "user", "content": users[0]}]
        if len(_render_ids(tokenizer, prompt)) + max_new > max_length:
            recs[i] = {"index": i, "messages": [], "skipped": f"first prompt + max_new_tokens > {max_length} tokens"}
            st.skipped += 1
            continue
        recs[i] = {"index": i, "messages": prompt}
        live.append((i, users[1:] if all_turns else []))
    turn = 0
    while live:
        prompts = [_render_ids(tokenizer, recs[i]["messages"]) for i, _ in live]
        answers = _generate(model, tokenizer, prompts, **gen)
        nxt = []
        for (i, rest), (toks, hit_limit) in zip(live, answers):
            text = tokenizer.decode(toks, skip_special_tokens=True)
            st.turns += 1
            st.new_tokens += len(toks)
            if ends_in_loop(text):
                st.looping_turns += 1
                if cut_loops:
                    text = cut_loop(text)
                    st.cut_turns += 1
                    recs[i].setdefault("loops_cut", []).append(turn)
            recs[i]["messages"] = recs[i]["messages"] + [{"role": "assistant", "content": text}]
            if hit_limit:
                st.truncated_turns += 1
                recs[i].setdefault("truncated", []).append(turn)
            if rest:
                cand = recs[i]["messages"] + [{"role": "user", "content": rest[0]}]
                if len(_render_ids(tokenizer, cand)) + max_new <= max_length:
                    recs[i]["messages"] = cand
                    nxt.append((i, rest[1:]))
        live = nxt
        turn += 1
    return [recs[i] for i, _, _ in items]
