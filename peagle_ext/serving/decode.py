"""Greedy speculative decoding with a P-EAGLE drafter and a transformers verifier.

One request, greedy, exact: the output is token for token the verifier's own greedy decoding
(up to floating-point differences between scoring K+1 tokens in one forward and one at a time,
which only matter at near-ties of the verifier's top-2 logits; fp32 tests are exact).

    prefill:   verifier(prompt) -> greedy token b (the first "bonus"), aux hidden states of every
               prompt token (layers eagle_aux_hidden_state_layer_ids, layer-input convention as in
               training: peagle_ext.data.verifier_hidden_states).
    per round: batch = prepare_parallel_draft_inputs(the verifier's last inputs, their positions,
                   b, num_rejected, fc(aux), fc(mask_hidden), ...)    # exactly vLLM's step
               drafts d_1..d_K = ONE draft forward over the batch's rows
               verifier([b, d_1..d_K]) with its KV cache -> greedy g_0..g_K
               a = longest prefix with d_{i+1} == g_i; emit d_1..d_a, g_a; crop the verifier
               cache to the accepted tokens; b = g_a.

Draft rows (docs/design.md section 1, vLLM parallel drafting): a depth-0 row at position p carries token
p+1 and the verifier's hidden state of p; the bonus row sits at the last accepted position m;
MASK rows at m+1..m+K-1 carry the MASK token and mask_hidden; the bonus row's logits give draft 1,
MASK row k's give draft k+1.

Draft KV cache: like vLLM's paged cache for one request, one slot per position (identity block
table, so slot_mapping from the op = position). Every non-rejected row of a round, MASK rows
included, writes its K/V at its slot, then each row attends the slots at positions <= its own.
The MASK rows of a round sit at positions past the last accepted token; the next round rewrites
those positions (depth-0 rows for the newly accepted tokens, then the new MASK rows) before any
row can see them, so stale MASK entries are never read and the cache needs no explicit rollback.
What each row sees is exactly the P-EAGLE symmetric rule with the round's anchor = last accepted
position (depth-0: earlier depth-0 rows; MASK row d: the context up to the anchor and MASK rows
1..d of its round), with full attention (no window: vLLM serves without one).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..ops.parallel_draft import prepare_parallel_draft_inputs
from .drafter import Drafter
from .verifier import Verifier

BLOCK_SIZE = 16  # draft KV cache "pages"; any value works, the block table is the identity


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class GreedyResult:
    tokens: list[int]
    prompt_tokens: int
    wall_s: float


@dataclass
class SpecResult:
    tokens: list[int]
    prompt_tokens: int
    wall_s: float
    num_spec_tokens: int
    accepted: list[int] = field(default_factory=list)  # accepted drafts per round (0..K)
    # with profile=True: time outside the verifier (acceptance bookkeeping, fc of the new hidden
    # states, the batch op, the draft forward) and in verifier forwards (prefill included) of the
    # rounds run part by part, and `profile`: seconds per part (PROFILE_PARTS)
    draft_s: float | None = None
    verify_s: float | None = None
    profile: dict | None = None

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def acceptance_length(self) -> float:
        """Tokens per round: accepted drafts + the verifier's bonus token."""
        return (sum(self.accepted) + len(self.accepted)) / len(self.accepted) if self.accepted else float("nan")


def _as_prompt(prompt_ids, device) -> torch.Tensor:
    t = torch.as_tensor(prompt_ids, dtype=torch.long).flatten().to(device)
    if t.numel() == 0:
        raise ValueError("prompt_ids is empty: a prompt needs at least one token")
    return t


def _check_budget(verifier: Verifier, n: int, max_new_tokens: int, extra: int = 0):
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    need = n + max_new_tokens + extra
    if verifier.max_positions is not None and need > verifier.max_positions:
        raise ValueError(
            f"prompt ({n} tokens) + max_new_tokens ({max_new_tokens})"
            + (f" + {extra} draft positions" if extra else "")
            + f" = {need} exceeds the verifier's max_position_embeddings {verifier.max_positions}"
        )


def _finish(tokens: list[int], max_new_tokens: int, eos: frozenset) -> tuple[list[int], bool]:
    """Cut at the first EOS (kept) and at max_new_tokens; (tokens, done)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: min(i + 1, max_new_tokens)], True
    if len(tokens) >= max_new_tokens:
        return tokens[:max_new_tokens], True
    return tokens, False


def _eos_set(eos_token_id) -> frozenset:
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset([eos_token_id])
    return frozenset(int(x) for x in eos_token_id)


@torch.inference_mode()
def greedy_generate(
    verifier: Verifier, prompt_ids, max_new_tokens: int, *, eos_token_id=None, engine=None
) -> GreedyResult:
    """Plain greedy decoding with the KV cache, one token per forward (the baseline). engine: a
    GreedyEngine (serving/graphs.py) of this verifier: the steps after the prefill run on its
    static buffers (as a CUDA graph when it holds one), and the prefill on the prompt padded to a
    bucket when it has padded_prefill (its default with graphs)."""
    prompt = _as_prompt(prompt_ids, verifier.device)
    n = prompt.shape[0]
    _check_budget(verifier, n, max_new_tokens)
    if engine is not None and n + max_new_tokens > engine.capacity:
        raise ValueError(
            f"prompt + max_new_tokens = {n + max_new_tokens} exceeds the engine's capacity {engine.capacity}"
        )
    eos = _eos_set(eos_token_id)
    _sync(verifier.device)
    t0 = time.perf_counter()
    cache = engine.cache if engine is not None else verifier.new_cache(n + max_new_tokens)
    if engine is not None and engine.padded_prefill:
        tok = engine.prefill(prompt)
    else:
        logits, _ = verifier.forward(prompt, cache, 0, last_only=True)
        tok = int(logits[-1].argmax())
        if engine is not None:
            engine.begin(tok, n)
    out = [tok]
    while len(out) < max_new_tokens and tok not in eos:
        if engine is not None:
            tok = engine.step()
        else:
            logits, _ = verifier.forward(
                torch.tensor([tok], device=verifier.device), cache, n + len(out) - 1, last_only=True
            )
            tok = int(logits[-1].argmax())
        out.append(tok)
    _sync(verifier.device)
    return GreedyResult(out, n, time.perf_counter() - t0)


# the parts of a round that profile=True times (device synchronised around each)
PROFILE_PARTS = ("prefill", "verify", "hidden", "batch", "draft", "accept", "crop", "engine_round")


def _check_spec_args(verifier, drafter, k):
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"num_spec_tokens must be an int >= 1, got {k!r}")
    if k > drafter.num_depths:
        raise ValueError(
            f"num_spec_tokens {k} is larger than the drafter's num_depths {drafter.num_depths} "
            "(it was trained to draft at most that many tokens in parallel)"
        )
    if verifier.aux_layer_ids is None or list(verifier.aux_layer_ids) != list(drafter.aux_layer_ids):
        raise ValueError(
            f"the verifier must capture the drafter's aux layers {drafter.aux_layer_ids}, got {verifier.aux_layer_ids}"
        )


@torch.inference_mode()
def speculative_generate(
    verifier: Verifier,
    drafter: Drafter,
    prompt_ids,
    num_spec_tokens: int,
    max_new_tokens: int,
    *,
    eos_token_id=None,
    profile: bool = False,
    engine=None,
) -> SpecResult:
    """Greedy speculative decoding (module docstring); the tokens equal greedy_generate's.

    profile=True also times the parts of every round (PROFILE_PARTS; synchronising the device
    around them, which costs a little on CUDA). engine: a RoundEngine (serving/graphs.py) for
    this verifier, drafter and K: every round after the first in one engine step (one CUDA graph
    replay when the engine holds a graph); the prefill and the first round too, as one step on the
    prompt padded to a bucket, when the engine has padded_prefill (its default with graphs) and
    profile is off, else part by part."""
    k = num_spec_tokens
    _check_spec_args(verifier, drafter, k)
    if engine is not None and (engine.k != k or engine.verifier is not verifier or engine.drafter is not drafter):
        raise ValueError("the engine was built for another verifier, drafter or num_spec_tokens")
    dev = verifier.device
    prompt = _as_prompt(prompt_ids, dev)
    n = prompt.shape[0]
    _check_budget(verifier, n, max_new_tokens, extra=k)
    eos = _eos_set(eos_token_id)
    # draft positions reach (last accepted) + K - 1 < n + max_new_tokens + K
    capacity = -(-(n + max_new_tokens + k) // BLOCK_SIZE) * BLOCK_SIZE
    if engine is not None:
        if capacity > engine.capacity:
            raise ValueError(
                f"prompt + max_new_tokens + K = {n + max_new_tokens + k} exceeds the engine's "
                f"capacity {engine.capacity}"
            )
        capacity = engine.capacity
    block_table = torch.arange(capacity // BLOCK_SIZE, dtype=torch.int32, device=dev)[None]
    qsl = torch.tensor([0, 0], dtype=torch.int32, device=dev)
    mask_hidden = drafter.mask_hidden.to(dev)

    _sync(dev)
    t0 = time.perf_counter()
    drafter.reset(capacity)
    if engine is not None:
        engine.check()
    cache = engine.cache if engine is not None else verifier.new_cache(capacity)
    accepted: list[int] = []
    clock = dict.fromkeys(PROFILE_PARTS, 0.0)
    mark = [t0]

    def take(host, out):
        """An engine's packed round [a, verified ids, greedy ids]: record a, append the tokens."""
        a = host[0]
        accepted.append(a)
        return _finish(out + host[2 : a + 2] + [host[k + 2 + a]], max_new_tokens, eos)

    def tick(part):
        if profile:
            _sync(dev)
            now = time.perf_counter()
            clock[part] += now - mark[0]
            mark[0] = now

    if engine is not None and engine.padded_prefill and not profile:
        # the prefill and the first round as one engine step, then the engine's rounds
        host = engine.first_round(prompt)
        out, done = _finish([host[1]], max_new_tokens, eos)
        if not done:
            out, done = take(host, out)
        while not done:
            out, done = take(engine.step(), out)
        _sync(dev)
        return SpecResult(out, n, time.perf_counter() - t0, k, accepted, None, None, None)
    with verifier.capturing():
        tick("accept")
        logits, aux = verifier.forward(prompt, cache, 0, last_only=True)
        tick("prefill")
        bonus = logits[-1].argmax().reshape(1)
        out = [int(bonus)]
        tgt_ids, tgt_pos = prompt, torch.arange(n, device=dev)
        tgt_hidden = drafter.combine_hidden(aux)
        tick("hidden")
        n_rej = 0
        seq_len = n  # tokens in the verifier cache = position of `bonus`
        out, done = _finish(out, max_new_tokens, eos)
        while not done and (engine is None or not accepted):
            t_in = tgt_ids.shape[0]
            qsl[1] = t_in
            batch = prepare_parallel_draft_inputs(
                tgt_ids.to(torch.int32),
                tgt_pos,
                bonus.to(torch.int32),
                qsl,
                torch.tensor([n_rej], dtype=torch.int32, device=dev),
                tgt_hidden.to(mask_hidden.dtype).contiguous(),
                mask_hidden,
                block_table,
                num_spec_tokens=k,
                mask_token_id=drafter.mask_token_id,
                block_size=BLOCK_SIZE,
                max_model_len=capacity,
            )
            tick("batch")
            num_rows = t_in + k - 1 - n_rej
            drafts = drafter.propose(batch, k, num_rows, seq_len - 1 + k).to(dev)
            tick("draft")
            if engine is not None and not profile:
                # the verify half on the engine (its graph): the same computation, and the
                # engine holds the next round's inputs afterwards
                out, done = take(engine.first_verify(drafts, bonus, seq_len), out)
                break
            verify_ids = torch.cat([bonus, drafts])
            logits, aux = verifier.forward(verify_ids, cache, seq_len)
            tick("verify")
            greedy = logits.argmax(-1)
            n_match = torch.cumprod((drafts == greedy[:k]).int(), 0).sum()
            # one device->host copy per round: accepted count, the verified inputs and the greedy tokens
            host = torch.cat([n_match.reshape(1).to(greedy.dtype), verify_ids, greedy]).tolist()
            a = host[0]
            accepted.append(a)
            new = host[2 : a + 2] + [host[k + 2 + a]]
            bonus = greedy[a].reshape(1)
            out, done = _finish(out + new, max_new_tokens, eos)
            tick("accept")
            verifier.crop(cache, seq_len + 1 + a)
            tick("crop")
            tgt_ids, tgt_pos = verify_ids, torch.arange(seq_len, seq_len + k + 1, device=dev)
            tgt_hidden = drafter.combine_hidden(aux)
            tick("hidden")
            n_rej = k - a
            if engine is not None and not done:
                engine.begin(verify_ids, seq_len, aux, bonus, n_rej)
            seq_len += 1 + a
        while not done:  # engine rounds
            out, done = take(engine.step(), out)
            tick("engine_round")
    _sync(dev)
    prof = None
    if profile:
        prof = dict(clock)
        prof["rounds_by_part"] = min(len(accepted), 1) if engine is not None else len(accepted)
        prof["engine_rounds"] = len(accepted) - prof["rounds_by_part"]
    return SpecResult(
        out,
        n,
        time.perf_counter() - t0,
        k,
        accepted,
        sum(v for p, v in clock.items() if p not in ("prefill", "verify", "engine_round")) if profile else None,
        clock["verify"] + clock["prefill"] if profile else None,
        prof,
    )


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------
def acceptance_stats(accepted_per_round, num_spec_tokens: int) -> dict:
    """Acceptance over rounds: acceptance_length (mean accepted + 1), per-position rates
    conditional[k-1] = P(draft k accepted | drafts < k accepted) (None when never reached) and
    unconditional[k-1] = P(draft k accepted), and the raw counts."""
    acc = [int(a) for a in accepted_per_round]
    k = int(num_spec_tokens)
    if any(a < 0 or a > k for a in acc):
        raise ValueError(f"accepted counts must be in [0, {k}]")
    rounds = len(acc)
    reached = [sum(1 for a in acc if a >= j) for j in range(k)]  # drafts < j+1 all accepted
    hit = [sum(1 for a in acc if a >= j + 1) for j in range(k)]  # draft j+1 accepted
    return {
        "rounds": rounds,
        "acceptance_length": (sum(acc) + rounds) / rounds if rounds else None,
        "per_position_acceptance": [h / r if r else None for h, r in zip(hit, reached)],
        "per_position_acceptance_unconditional": [h / rounds if rounds else None for h in hit],
        "per_position_reached": reached,
        "per_position_accepted": hit,
    }


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
