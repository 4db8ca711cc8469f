"""A transformers causal LM of the Llama family run on one sequence with a preallocated KV cache:
the verifier forward that speculative decoding needs in fixed shapes, so that CUDA graphs can
capture it (peagle_ext.serving.graphs).

It runs the model's own modules (embeddings, q/k/v/o projections, q/k norms of Qwen3, MLPs,
norms, lm_head) in the order transformers' Llama/Qwen decoder layers run them, with its own
attention over a [kv heads, capacity, head dim] cache per layer. A position's K/V is written when
a token at that position is run; tokens are never removed: a later forward at the same positions
overwrites them, and every query attends only the cache positions <= its own, so entries past
the sequence (rejected drafts) are never read. Cropping is therefore free.

Two forms of the same computation: forward() (the Verifier interface: any number of tokens,
attention over the filled positions only) and forward_static() (a fixed number of tokens at
positions given as a device tensor, no host sync: what a CUDA graph captures). Both run tokens at
consecutive positions and attend through serving/cache_attention.py: SDPA under the position
mask (forward_static's over the whole capacity), or, for a round's few tokens, FlashAttention over
each token's filled positions where it is asked for and runs.
"""

from __future__ import annotations

import contextlib

import torch

from ..data import check_aux_layer_ids, decoder_parts
from .cache_attention import (
    ROUND_TOKENS_MAX,
    VARLEN_IMPLS,
    attend_cache_varlen,
    attend_sdpa,
    choose_impl,
    flash_lengths,
)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
ROPE_EXPAND_MAX = 4096  # positions up to which StaticVerifier.rope expands its tables per head


def static_verifier_support(model) -> str | None:
    """None when StaticVerifier runs `model`, else why not."""
    cfg = getattr(model.config, "text_config", None) or model.config
    mt = getattr(cfg, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        return f"model_type {mt!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", mt == "mistral"):
        return "sliding-window attention"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) in ("dynamic", "longrope"):
        return f"rope type {rope.get('rope_type')!r} (its frequencies depend on the sequence length)"
    try:
        _, layers, _ = decoder_parts(model)
    except TypeError as e:
        return str(e)
    a = getattr(layers[0], "self_attn", None)
    if a is None or not all(hasattr(a, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "decoder layers without self_attn.{q,k,v,o}_proj"
    return None


class StaticKV:
    """Per-layer K and V [kv heads, capacity, head dim] and the filled length (for forward())."""

    def __init__(self, num_layers, kv_heads, capacity, head_dim, *, device, dtype):
        shape = (kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.capacity = capacity
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length


class StaticVerifier:
    """The Verifier interface (serving/verifier.py) over a StaticKV cache (module docstring)."""

    def __init__(self, model, aux_layer_ids=None, *, capacity: int | None = None, attention: str = "auto"):
        """attention: "auto", "sdpa", "flash" or "peagle" (serving/cache_attention.py: flash or
        peagle attends a round's 2..ROUND_TOKENS_MAX tokens, sdpa everything else; auto: on CUDA
        peagle, else flash, where it runs and agrees with sdpa on a probe, else sdpa); the choice
        is self.attention."""
        why = static_verifier_support(model)
        if why is not None:
            raise ValueError(f"StaticVerifier does not run this model: {why}")
        self.model = model
        self._base, self._layers, self._norm = decoder_parts(model)
        self.num_layers = len(self._layers)
        self.aux_layer_ids = None if aux_layer_ids is None else check_aux_layer_ids(aux_layer_ids, self.num_layers)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        cfg = getattr(model.config, "text_config", None) or model.config
        self.hidden_size = int(cfg.hidden_size)
        self.vocab_size = int(cfg.vocab_size)
        self.max_positions = getattr(cfg, "max_position_embeddings", None)
        a = self._layers[0].self_attn
        self.num_heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or self.hidden_size // self.num_heads)
        self.scale = float(getattr(a, "scaling", self.head_dim**-0.5))
        rot = getattr(self._base, "rotary_emb", None)
        if rot is not None and hasattr(rot, "inv_freq"):
            self._inv_freq = rot.inv_freq.detach().float().to(self.device)
            self._rope_scale = float(getattr(rot, "attention_scaling", 1.0))
        else:
            from ..model.layers import rope_inv_freq

            inv, self._rope_scale = rope_inv_freq(cfg, self.head_dim)
            self._inv_freq = inv.to(self.device)
        self.attention = choose_impl(attention, self.device, self.dtype, self.num_heads, self.kv_heads, self.head_dim)
        self.default_capacity = capacity
        self._capturing = False
        self._embed = model.get_input_embeddings()
        self._head = model.get_output_embeddings()

    # -- the Verifier interface -------------------------------------------------------------------
    def new_cache(self, capacity: int | None = None) -> StaticKV:
        cap = capacity or self.default_capacity or self.max_positions
        if not cap:
            raise ValueError("StaticVerifier.new_cache needs a capacity (the config has no max_position_embeddings)")
        return StaticKV(self.num_layers, self.kv_heads, int(cap), self.head_dim, device=self.device, dtype=self.dtype)

    @staticmethod
    def crop(cache: StaticKV, length: int):
        """Keep the first `length` positions: later ones are overwritten before anything reads them."""
        cache.length = min(cache.length, int(length))

    @contextlib.contextmanager
    def capturing(self):
        if self.aux_layer_ids is None:
            raise ValueError("this StaticVerifier was built without aux_layer_ids")
        self._capturing = True
        try:
            yield self
        finally:
            self._capturing = False

    def forward(self, ids: torch.Tensor, cache: StaticKV, start: int, *, last_only: bool = False):
        """(logits [T or 1, V], aux [T, n_aux*H] or None) of tokens `ids` [T] at positions
        start..start+T-1; attention over positions < start + T."""
        t = ids.shape[0]
        if start + t > cache.capacity:
            raise ValueError(f"the KV cache holds {cache.capacity} positions, the forward needs {start + t}")
        pos = torch.arange(start, start + t, device=self.device)
        rows = slice(t - 1, t) if last_only else None
        logits, aux = self._run(ids.to(self.device), pos, cache, start + t, rows, self._capturing)
        cache.length = start + t
        return logits, aux

    # -- the fixed-shape form (CUDA graphs) -------------------------------------------------------
    def forward_static(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        cache: StaticKV,
        *,
        with_aux: bool = True,
        logit_rows: torch.Tensor | None = None,
    ):
        """forward() of tokens `ids` [T] at the consecutive positions `pos` [T] (a device tensor,
        pos[0] + arange(T)): no shape or control flow depends on their values.
        logit_rows: int64 [R] device tensor, the rows whose logits are computed (default all)."""
        return self._run(ids, pos, cache, None, logit_rows, with_aux)

    def rope(self, pos):
        """RoPE's tables for positions `pos` [..., T], in the projections' layout [..., T, heads,
        D]: (cos_q, sin_q, cos_k, sin_k), with sin's first half negated (qkv swaps x's halves
        instead of building rotate_half's [-x2, x1]). Built once per forward. For a decoding step
        or round (at most ROPE_EXPAND_MAX positions) each table is expanded over its heads and
        contiguous, so every layer's RoPE runs on contiguous operands of one shape, which on CUDA
        takes torch's vectorised kernels (a broadcast or transposed operand takes the strided
        ones); a longer prefill's tables stay [..., T, 1, D] and broadcast (the same values, and
        no copy the size of q per table)."""
        freqs = pos.to(torch.float32)[..., None] * self._inv_freq
        cos = (torch.cat([freqs, freqs], -1).cos() * self._rope_scale).to(self.dtype).unsqueeze(-2)
        sin = (torch.cat([-freqs.sin(), freqs.sin()], -1) * self._rope_scale).to(self.dtype).unsqueeze(-2)
        if pos.numel() > ROPE_EXPAND_MAX:
            return cos, sin, cos, sin
        tables = []
        for heads in (self.num_heads, self.kv_heads):
            shape = (*cos.shape[:-2], heads, self.head_dim)
            tables += [cos.expand(shape).contiguous(), sin.expand(shape).contiguous()]
        return tuple(tables)

    def qkv(self, layer, x, rope):
        """q [..., heads, T, D] and k, v [..., kv heads, T, D] (transposed views) of hidden states
        x [..., T, H] in decoder layer `layer`: its input norm, projections, Qwen3's q/k norms and
        RoPE with the tables of rope(), all in the projections' [..., T, heads, D] layout."""
        cos_q, sin_q, cos_k, sin_k = rope
        a = layer.self_attn
        lead = x.shape[:-1]
        h = layer.input_layernorm(x)
        q = a.q_proj(h).view(*lead, self.num_heads, self.head_dim)
        k = a.k_proj(h).view(*lead, self.kv_heads, self.head_dim)
        v = a.v_proj(h).view(*lead, self.kv_heads, self.head_dim)
        if getattr(a, "q_norm", None) is not None:
            q = a.q_norm(q)
        if getattr(a, "k_norm", None) is not None:
            k = a.k_norm(k)
        q = q * cos_q + _swap_halves(q) * sin_q
        k = k * cos_k + _swap_halves(k) * sin_k
        return q.transpose(-2, -3), k.transpose(-2, -3), v.transpose(-2, -3)

    def layer_out(self, layer, x, o):
        """The rest of decoder layer `layer` after attention: x [..., T, H] plus the output
        projection of o [..., heads, T, D], then plus the MLP of that."""
        lead = x.shape[:-1]
        x = x + layer.self_attn.o_proj(o.transpose(-2, -3).reshape(*lead, self.num_heads * self.head_dim))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def _run(self, ids, pos, cache: StaticKV, ctx: int | None, out_rows, with_aux: bool):
        """out_rows: the rows whose logits are computed: None (all), a slice or an index tensor."""
        x = self._embed(ids.long())
        rope = self.rope(pos)
        # flash or peagle for a round's tokens; a greedy step's one token and a prefill take sdpa
        # (serving/cache_attention.py says why)
        varlen = self.attention in VARLEN_IMPLS and 2 <= ids.shape[0] <= ROUND_TOKENS_MAX
        if varlen:  # reads positions <= pos[i] only, whatever the capacity
            lengths = flash_lengths(pos)
        else:
            key_pos = torch.arange(cache.capacity if ctx is None else ctx, device=self.device)
            allowed = key_pos[None, :] <= pos[:, None]
        aux_ids = self.aux_layer_ids if with_aux else None
        captured = {}
        L = self.num_layers
        for li, layer in enumerate(self._layers):
            if aux_ids is not None and li in aux_ids:
                captured[li] = x
            q, k, v = self.qkv(layer, x, rope)
            kc, vc = cache.k[li], cache.v[li]
            kc.index_copy_(1, pos, k.to(kc.dtype))
            vc.index_copy_(1, pos, v.to(vc.dtype))
            if varlen:
                o = attend_cache_varlen(q, kc, vc, lengths, self.scale, self.attention)
            else:
                if ctx is not None:
                    kc, vc = kc[:, :ctx], vc[:, :ctx]
                o = attend_sdpa(q, kc, vc, allowed, self.scale)
            x = self.layer_out(layer, x, o)
        if aux_ids is not None and L in aux_ids:
            captured[L] = x
        if isinstance(out_rows, torch.Tensor):
            x = x.index_select(0, out_rows)
        elif out_rows is not None:
            x = x[out_rows]
        h = self._norm(x)
        logits = self._head(h)
        aux = torch.cat([captured[i] for i in aux_ids], dim=-1) if aux_ids is not None else None
        return logits, aux


def _swap_halves(x):
    """[x2, x1] of x = [x1, x2] along the last dim, in one kernel: with rope()'s sin, whose first
    half is negated, x * cos + _swap_halves(x) * sin is RoPE's x * cos + rotate_half(x) * sin to
    the bit ((-a) * b and -(a * b) round alike)."""
    d = x.shape[-1] // 2
    return x.unflatten(-1, (2, d)).flip(-2).flatten(-2)
