"""Greedy speculative decoding with a P-EAGLE drafter and a transformers verifier (issue 6).

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

Draft rows (DESIGN section 1, vLLM parallel drafting): a depth-0 row at position p carries token
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

import contextlib
import inspect
import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .vllm import DraftBatch, prepare_parallel_draft_inputs

BLOCK_SIZE = 16  # draft KV cache "pages"; any value works, the block table is the identity


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------
# The verifier: HF causal LM with a DynamicCache, optional aux hidden-state capture
# ---------------------------------------------------------------------------------------------
class Verifier:
    """A transformers causal LM run step by step on one sequence with a KV cache.

    aux_layer_ids: layer ids whose INPUT residual stream is captured (id L = the final norm's
    input), the convention of peagle_ext.data.verifier_hidden_states; None = no capture.
    """

    def __init__(self, model, aux_layer_ids=None):
        from ._data_verifier import _decoder_parts, check_aux_layer_ids
        self.model = model
        _, self._layers, self._norm = _decoder_parts(model)
        self.num_layers = len(self._layers)
        self.aux_layer_ids = None if aux_layer_ids is None else check_aux_layer_ids(aux_layer_ids, self.num_layers)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        cfg = model.config
        self.hidden_size = int(cfg.hidden_size)
        self.vocab_size = int(cfg.vocab_size)
        self.max_positions = getattr(cfg, "max_position_embeddings", None)
        params = inspect.signature(model.forward).parameters
        # transformers >= 5.2x renamed past_key_values -> cache
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._captured: dict[int, torch.Tensor] = {}
        self._capturing = False

    def new_cache(self):
        from transformers import DynamicCache
        try:
            return DynamicCache(config=self.model.config)
        except TypeError:
            return DynamicCache()

    @staticmethod
    def crop(cache, length: int):
        """Keep the first `length` tokens of the cache."""
        cur = cache.get_seq_length()
        if length >= cur:
            return
        if "tokens_to_remove" in inspect.signature(cache.crop).parameters:
            cache.crop(length - cur)  # new API: negative = number of tokens removed
        else:
            cache.crop(length)  # legacy API: the new absolute length

    @contextlib.contextmanager
    def capturing(self):
        """Within this block forward() also returns the aux hidden states [T, n_aux*H]."""
        if self.aux_layer_ids is None:
            raise ValueError("this Verifier was built without aux_layer_ids")
        captured = self._captured

        def hook(key):
            def fn(module, args, kwargs):
                captured[key] = args[0] if args else kwargs["hidden_states"]
            return fn

        L = self.num_layers
        handles = [self._layers[k].register_forward_pre_hook(hook(k), with_kwargs=True)
                   for k in sorted(set(self.aux_layer_ids)) if k < L]
        if L in self.aux_layer_ids:
            handles.append(self._norm.register_forward_pre_hook(hook(L), with_kwargs=True))
        self._capturing = True
        try:
            yield self
        finally:
            self._capturing = False
            for h in handles:
                h.remove()
            captured.clear()

    def forward(self, ids: torch.Tensor, cache, start: int, *, last_only: bool = False):
        """(logits [T or 1, V], aux [T, n_aux*H] or None) of tokens `ids` [T] at positions
        start..start+T-1, appending them to `cache` (which must hold exactly `start` tokens)."""
        t = ids.shape[0]
        pos = torch.arange(start, start + t, device=self.device)[None]
        self._captured.clear()
        out = self.model(input_ids=ids[None].to(self.device), position_ids=pos, use_cache=True,
                         logits_to_keep=1 if last_only else 0, **{self._cache_kw: cache})
        aux = None
        if self._capturing:
            aux = torch.cat([self._captured[k][0] for k in self.aux_layer_ids], dim=-1)
        return out.logits[0], aux


# ---------------------------------------------------------------------------------------------
# Drafters
# ---------------------------------------------------------------------------------------------
class Drafter:
    """What speculative_generate needs from a drafter.

    combine_hidden(aux [T, n_aux*H]) -> the per-row hidden fed to prepare_parallel_draft_inputs;
    mask_hidden -> that hidden for MASK rows (same dtype/width); reset(capacity) before each
    request; propose(batch, num_spec_tokens, num_rows, context_len) -> long[K] verifier token ids,
    where the batch's first num_rows rows are not rejected and context_len = 1 + the largest
    position among them.
    """

    mask_token_id: int
    num_depths: int
    aux_layer_ids: list[int]

    def combine_hidden(self, aux: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def mask_hidden(self) -> torch.Tensor:
        raise NotImplementedError

    def reset(self, capacity: int):
        pass

    def propose(self, batch: DraftBatch, num_spec_tokens: int, num_rows: int, context_len: int) -> torch.Tensor:
        raise NotImplementedError


class PEagleDrafter(Drafter):
    """Inference of a PEagleDraftModel over vLLM-style parallel-drafting batches, with a
    one-slot-per-position KV cache (module docstring). Uses the model's own modules (embeddings,
    fc, decoder layers, norm, lm_head, d2t); attention is plain SDPA with the causal-by-position
    mask over the cache."""

    def __init__(self, model, *, device=None, dtype: torch.dtype | None = None):
        from .model import PEagleDraftModel, _rotate
        if not isinstance(model, PEagleDraftModel):
            raise TypeError(f"model must be a PEagleDraftModel, got {type(model).__name__}")
        self._rotate = _rotate
        # RoPE frequencies stay fp32 whatever the model dtype (as in training)
        self._inv_freq = model.rope_inv_freq.detach().float().clone()
        self._rope_scale = float(model.rope_scale)
        device = torch.device(device) if device is not None else model.fc.weight.device
        dtype = dtype or model.fc.weight.dtype
        self.model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self._inv_freq = self._inv_freq.to(device)
        self.device, self.dtype = device, dtype
        cfg = model.config
        self.mask_token_id = int(cfg.mask_token_id)
        self.num_depths = int(cfg.num_depths)
        n = cfg.transformer_layer_config.num_hidden_layers
        self.aux_layer_ids = list(cfg.eagle_aux_hidden_state_layer_ids or [])
        if len(self.aux_layer_ids) != cfg.num_aux:
            raise ValueError("the drafter config has no eagle_aux_hidden_state_layer_ids")
        self.hidden_size = cfg.hidden_size
        a = model.layers[0].self_attn
        self._kv_shape = (a.num_kv_heads, a.head_dim)
        self._num_layers = n
        self._k_cache: list[torch.Tensor] = []
        self._v_cache: list[torch.Tensor] = []
        with torch.no_grad():
            self._mask_hidden = self.combine_hidden(self.model.mask_hidden.reshape(1, -1))[0].contiguous()
        self._draft_ids = model.draft_token_ids.to(device)

    def combine_hidden(self, aux):
        m = self.model
        x = aux.to(device=self.device, dtype=self.dtype)
        if m.input_norm is not None:
            x = m.input_norm(x)
        return m.fc(x)

    @property
    def mask_hidden(self):
        return self._mask_hidden

    def reset(self, capacity: int):
        cap = int(capacity)
        if not self._k_cache or self._k_cache[0].shape[0] < cap:
            shape = (cap, *self._kv_shape)
            self._k_cache = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self._num_layers)]
            self._v_cache = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self._num_layers)]
        self.capacity = cap

    def _rope(self, pos: torch.Tensor):
        freqs = pos.to(torch.float32)[:, None] * self._inv_freq[None, :]
        emb = torch.cat([freqs, freqs], -1)
        return ((emb.cos() * self._rope_scale)[:, None, :].to(self.dtype),
                (emb.sin() * self._rope_scale)[:, None, :].to(self.dtype))

    def forward_rows(self, batch: DraftBatch, num_rows: int, context_len: int,
                     out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states (before the final norm) of the batch's rows `out_rows` (default
        all num_rows rows), after writing every row's K/V into the cache."""
        m = self.model
        ids = batch.input_ids[:num_rows].to(self.device, torch.long)
        pos = batch.positions[:num_rows].to(self.device)
        slots = batch.slot_mapping[:num_rows].to(self.device)
        hid = batch.hidden[:num_rows].to(self.device, self.dtype)
        cos, sin = self._rope(pos)
        key_pos = torch.arange(context_len, device=self.device)
        x = None
        last = len(m.layers) - 1
        for li, layer in enumerate(m.layers):
            attn = layer.self_attn
            if layer.first:
                emb = m.embed_tokens(ids)
                mask_embed = getattr(m, "mask_embed", None)
                if mask_embed is not None:  # trained with train_embeddings="mask": the MASK row lives apart
                    is_mask = batch.is_masked[:num_rows].to(self.device)[:, None]
                    emb = torch.where(is_mask, mask_embed.to(emb.dtype), emb)
                a_in, res = layer.pre_attention(emb, hid)
            else:
                a_in, res = layer.pre_attention(x)
            k, v = attn.kv(a_in)
            k = self._rotate(k, cos, sin)
            self._k_cache[li].index_copy_(0, slots, k.to(self.dtype))
            self._v_cache[li].index_copy_(0, slots, v.to(self.dtype))
            q_rows = out_rows if (li == last and out_rows is not None) else None
            q_in, q_cos, q_sin, q_pos = a_in, cos, sin, pos
            if q_rows is not None:  # the last layer only needs the rows that are read out
                q_in, q_cos, q_sin, q_pos, res = a_in[q_rows], cos[q_rows], sin[q_rows], pos[q_rows], res[q_rows]
            q = self._rotate(attn.q(q_in), q_cos, q_sin)
            allowed = key_pos[None, :] <= q_pos[:, None]  # causal by position over the cache
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], self._k_cache[li][:context_len].transpose(0, 1)[None],
                self._v_cache[li][:context_len].transpose(0, 1)[None], attn_mask=allowed,
                enable_gqa=attn.num_heads != attn.num_kv_heads)
            x = layer.post_attention(o[0].transpose(0, 1), res)
        return x

    def draft_logits(self, batch: DraftBatch, num_spec_tokens: int, num_rows: int, context_len: int) -> torch.Tensor:
        """Draft-vocab logits [K, Vd] of draft tokens 1..K."""
        rows = batch.token_indices_to_sample[:num_spec_tokens].to(self.device, torch.long)
        h = self.forward_rows(batch, num_rows, context_len, out_rows=rows)
        return self.model.lm_head(self.model.norm(h))

    def propose(self, batch, num_spec_tokens, num_rows, context_len):
        if context_len > self.capacity:
            raise ValueError(f"draft KV cache holds {self.capacity} positions, the round needs {context_len}")
        logits = self.draft_logits(batch, num_spec_tokens, num_rows, context_len)
        return self._draft_ids[logits.argmax(-1)]


# ---------------------------------------------------------------------------------------------
# Decoding loops
# ---------------------------------------------------------------------------------------------
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
    # states, the batch op, the draft forward) and in verifier forwards (prefill included)
    draft_s: float | None = None
    verify_s: float | None = None

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
        raise ValueError(f"prompt ({n} tokens) + max_new_tokens ({max_new_tokens})"
                         + (f" + {extra} draft positions" if extra else "")
                         + f" = {need} exceeds the verifier's max_position_embeddings {verifier.max_positions}")


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
def greedy_generate(verifier: Verifier, prompt_ids, max_new_tokens: int, *, eos_token_id=None) -> GreedyResult:
    """Plain greedy decoding with the KV cache, one token per forward (the baseline)."""
    prompt = _as_prompt(prompt_ids, verifier.device)
    n = prompt.shape[0]
    _check_budget(verifier, n, max_new_tokens)
    eos = _eos_set(eos_token_id)
    _sync(verifier.device)
    t0 = time.perf_counter()
    cache = verifier.new_cache()
    logits, _ = verifier.forward(prompt, cache, 0, last_only=True)
    tok = int(logits[-1].argmax())
    out = [tok]
    while len(out) < max_new_tokens and tok not in eos:
        logits, _ = verifier.forward(torch.tensor([tok], device=verifier.device), cache, n + len(out) - 1,
                                     last_only=True)
        tok = int(logits[-1].argmax())
        out.append(tok)
    _sync(verifier.device)
    return GreedyResult(out, n, time.perf_counter() - t0)


@torch.inference_mode()
def speculative_generate(verifier: Verifier, drafter: Drafter, prompt_ids, num_spec_tokens: int,
                         max_new_tokens: int, *, eos_token_id=None, profile: bool = False) -> SpecResult:
    """Greedy speculative decoding (module docstring); the tokens equal greedy_generate's.
    profile=True also times the draft step and the verifier forwards (synchronising the device
    around them, which costs a little on CUDA)."""
    k = num_spec_tokens
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"num_spec_tokens must be an int >= 1, got {k!r}")
    if k > drafter.num_depths:
        raise ValueError(f"num_spec_tokens {k} is larger than the drafter's num_depths {drafter.num_depths} "
                         "(it was trained to draft at most that many tokens in parallel)")
    if verifier.aux_layer_ids is None or list(verifier.aux_layer_ids) != list(drafter.aux_layer_ids):
        raise ValueError(f"the verifier must capture the drafter's aux layers {drafter.aux_layer_ids}, "
                         f"got {verifier.aux_layer_ids}")
    dev = verifier.device
    prompt = _as_prompt(prompt_ids, dev)
    n = prompt.shape[0]
    _check_budget(verifier, n, max_new_tokens, extra=k)
    eos = _eos_set(eos_token_id)
    # draft positions reach (last accepted) + K - 1 < n + max_new_tokens + K
    capacity = -(-(n + max_new_tokens + k) // BLOCK_SIZE) * BLOCK_SIZE
    block_table = torch.arange(capacity // BLOCK_SIZE, dtype=torch.int32, device=dev)[None]
    qsl = torch.tensor([0, 0], dtype=torch.int32, device=dev)
    mask_hidden = drafter.mask_hidden.to(dev)

    _sync(dev)
    t0 = time.perf_counter()
    drafter.reset(capacity)
    cache = verifier.new_cache()
    accepted: list[int] = []
    clock = [0.0, 0.0]  # draft, verify

    def tick(i, since):
        if profile:
            _sync(dev)
            now = time.perf_counter()
            clock[i] += now - since
            return now
        return since

    with verifier.capturing():
        t = tick(1, time.perf_counter())
        logits, aux = verifier.forward(prompt, cache, 0, last_only=True)
        t = tick(1, t)
        bonus = logits[-1].argmax().reshape(1)
        out = [int(bonus)]
        tgt_ids, tgt_pos = prompt, torch.arange(n, device=dev)
        tgt_hidden = drafter.combine_hidden(aux)
        n_rej = 0
        seq_len = n  # tokens in the verifier cache = position of `bonus`
        out, done = _finish(out, max_new_tokens, eos)
        while not done:
            t_in = tgt_ids.shape[0]
            qsl[1] = t_in
            batch = prepare_parallel_draft_inputs(
                tgt_ids.to(torch.int32), tgt_pos, bonus.to(torch.int32), qsl,
                torch.tensor([n_rej], dtype=torch.int32, device=dev), tgt_hidden.to(mask_hidden.dtype).contiguous(),
                mask_hidden, block_table, num_spec_tokens=k, mask_token_id=drafter.mask_token_id,
                block_size=BLOCK_SIZE, max_model_len=capacity)
            num_rows = t_in + k - 1 - n_rej
            drafts = drafter.propose(batch, k, num_rows, seq_len - 1 + k).to(dev)
            t = tick(0, t)
            verify_ids = torch.cat([bonus, drafts])
            logits, aux = verifier.forward(verify_ids, cache, seq_len)
            t = tick(1, t)
            greedy = logits.argmax(-1)
            n_match = torch.cumprod((drafts == greedy[:k]).int(), 0).sum()
            # one device->host copy per round: accepted count, the verified inputs and the greedy tokens
            host = torch.cat([n_match.reshape(1).to(greedy.dtype), verify_ids, greedy]).tolist()
            a = host[0]
            accepted.append(a)
            new = host[2:a + 2] + [host[k + 2 + a]]
            Verifier.crop(cache, seq_len + 1 + a)
            tgt_ids, tgt_pos = verify_ids, torch.arange(seq_len, seq_len + k + 1, device=dev)
            tgt_hidden = drafter.combine_hidden(aux)
            n_rej = k - a
            seq_len += 1 + a
            bonus = greedy[a].reshape(1)
            out, done = _finish(out + new, max_new_tokens, eos)
    _sync(dev)
    return SpecResult(out, n, time.perf_counter() - t0, k, accepted,
                      clock[0] if profile else None, clock[1] if profile else None)


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
    reached = [sum(1 for a in acc if a >= j) for j in range(k)]      # drafts < j+1 all accepted
    hit = [sum(1 for a in acc if a >= j + 1) for j in range(k)]      # draft j+1 accepted
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
