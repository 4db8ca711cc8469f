"""Drafters for speculative decoding: the interface the decoding loop needs, and PEagleDrafter,
which runs a PEagleDraftModel over vLLM-style parallel-drafting batches with a one-slot-per-position
KV cache (see serving/decode.py for the cache's invariant)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model import PEagleDraftModel
from ..model.layers import apply_rope
from ..ops.parallel_draft import DraftBatch
from . import cache_attention


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
    fc, decoder layers, norm, lm_head, d2t).

    attention over the cache (the choice is self.attention): "sdpa", SDPA under the causal-by-
    position mask over every slot; "flash", each row its own FlashAttention sequence over the slots
    0..its position (serving/cache_attention.py): it reads only those, where SDPA under a mask
    walks every slot of the cache whatever the position; "peagle", the same sequences through
    ops.decode_attention; "auto" (the default), the verifier's rule: on CUDA peagle, else flash,
    where it runs and agrees with sdpa on a probe, else sdpa."""

    def __init__(self, model, *, device=None, dtype: torch.dtype | None = None, attention: str = "auto"):
        if not isinstance(model, PEagleDraftModel):
            raise TypeError(f"model must be a PEagleDraftModel, got {type(model).__name__}")
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
        self._scale = a.head_dim**-0.5  # SDPA's default, which the sdpa path uses
        self.set_attention(attention)
        self._num_layers = n
        self._k_cache: list[torch.Tensor] = []
        self._v_cache: list[torch.Tensor] = []
        with torch.no_grad():
            self._mask_hidden = self.combine_hidden(self.model.mask_hidden.reshape(1, -1))[0].contiguous()
        self._draft_ids = model.draft_token_ids.to(device)

    def set_attention(self, attention: str):
        """Choose the attention over the cache ("auto", "sdpa", "flash" or "peagle"; the class
        docstring); ValueError where the one asked for cannot run. Before any engine is built on
        this drafter (a captured graph keeps the kernels it recorded)."""
        a = self.model.layers[0].self_attn
        self.attention = cache_attention.choose_impl(
            attention, self.device, self.dtype, a.num_heads, a.num_kv_heads, a.head_dim, what="drafter"
        )

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
        """Make room for positions 0..capacity-1 (plus one scratch slot, see forward_static).
        The cache only grows, so buffers a CUDA graph captured stay valid."""
        cap = int(capacity)
        if not self._k_cache or self._k_cache[0].shape[0] < cap + 1:
            shape = (cap + 1, *self._kv_shape)
            # normal tensors even when reset() runs under inference_mode (as teacher-forced rounds
            # and decoding do): an engine built later writes them in place outside that mode, and
            # in-place writes to inference tensors are refused there
            with torch.inference_mode(False):
                layers = range(self._num_layers)
                self._k_cache = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in layers]
                self._v_cache = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in layers]
                # key positions of the cache slots; the scratch slot (the last) is never attended
                self._key_pos = torch.arange(cap + 1, device=self.device)
                self._key_pos[cap] = torch.iinfo(torch.int64).max
                # RoPE of every position a round can reach (a round's rows run up to K past the
                # verified length), looked up per row: a round's cos/sin in one clamp and two
                # gathers instead of nine kernels, with the same values
                reach = torch.arange(cap + self.num_depths + 1, device=self.device)
                self._cos_table, self._sin_table = self._rope_of(reach)
        self.capacity = cap

    @property
    def kv_cache_ptr(self) -> int:
        """Address of the KV cache storage (changes when reset() reallocates it)."""
        return self._k_cache[0].data_ptr() if self._k_cache else 0

    def _rope(self, pos: torch.Tensor):
        """cos, sin [T, 1, D] of positions `pos` [T], from the tables reset() made; a position past
        them (only a rejected row's, whose output nobody reads) takes the last entry."""
        pos = pos.clamp(max=self._cos_table.shape[0] - 1)
        return self._cos_table[pos], self._sin_table[pos]

    def _rope_of(self, pos: torch.Tensor):
        freqs = pos.to(torch.float32)[:, None] * self._inv_freq[None, :]
        emb = torch.cat([freqs, freqs], -1)
        return (
            (emb.cos() * self._rope_scale)[:, None, :].to(self.dtype),
            (emb.sin() * self._rope_scale)[:, None, :].to(self.dtype),
        )

    def forward_rows(
        self, batch: DraftBatch, num_rows: int, context_len: int, out_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Final hidden states (before the final norm) of the batch's rows `out_rows` (default
        all num_rows rows), after writing every row's K/V into the cache."""
        r = slice(0, num_rows)
        return self._forward(
            batch.input_ids[r],
            batch.positions[r],
            batch.slot_mapping[r],
            batch.hidden[r],
            batch.is_masked[r],
            self._key_pos[:context_len],
            out_rows,
        )

    def forward_static(self, batch: DraftBatch, out_rows: torch.Tensor) -> torch.Tensor:
        """forward_rows over ALL rows of the batch in fixed shapes, with no host sync (what a
        CUDA graph captures): rejected rows (slot -1) write their K/V to the scratch slot, which
        no row attends, and every row attends the whole cache under the position mask."""
        scratch = self._k_cache[0].shape[0] - 1
        slots = torch.where(batch.slot_mapping < 0, scratch, batch.slot_mapping)
        return self._forward(
            batch.input_ids, batch.positions, slots, batch.hidden, batch.is_masked, self._key_pos, out_rows
        )

    def _forward(self, ids, pos, slots, hid, is_masked, key_pos, out_rows):
        m = self.model
        ids = ids.to(self.device, torch.long)
        pos = pos.to(self.device)
        slots = slots.to(self.device)
        hid = hid.to(self.device, self.dtype)
        ctx = key_pos.shape[0]
        cos, sin = self._rope(pos)
        varlen = self.attention in cache_attention.VARLEN_IMPLS
        x = None
        last = len(m.layers) - 1
        for li, layer in enumerate(m.layers):
            attn = layer.self_attn
            if layer.first:
                emb = m.embed_tokens(ids)
                mask_embed = getattr(m, "mask_embed", None)
                if mask_embed is not None:  # trained with train_embeddings="mask": the MASK row lives apart
                    emb = torch.where(is_masked.to(self.device)[:, None], mask_embed.to(emb.dtype), emb)
                a_in, res = layer.pre_attention(emb, hid)
            else:
                a_in, res = layer.pre_attention(x)
            k, v = attn.kv(a_in)
            k = apply_rope(k, cos, sin)
            self._k_cache[li].index_copy_(0, slots, k.to(self.dtype))
            self._v_cache[li].index_copy_(0, slots, v.to(self.dtype))
            q_rows = out_rows if (li == last and out_rows is not None) else None
            q_in, q_cos, q_sin, q_pos = a_in, cos, sin, pos
            if q_rows is not None:  # the last layer only needs the rows that are read out
                q_in, q_cos, q_sin, q_pos, res = a_in[q_rows], cos[q_rows], sin[q_rows], pos[q_rows], res[q_rows]
            q = apply_rope(attn.q(q_in), q_cos, q_sin)
            if varlen:
                if li == 0 or q_rows is not None:  # every layer shares them, but the last's query rows
                    lengths = self._varlen_lengths(q_pos)
                o = self._attend_varlen(q.to(self.dtype), li, lengths)
            else:
                allowed = key_pos[None, :] <= q_pos[:, None]  # causal by position over the cache
                o = F.scaled_dot_product_attention(
                    q.transpose(0, 1)[None],
                    self._k_cache[li][:ctx].transpose(0, 1)[None],
                    self._v_cache[li][:ctx].transpose(0, 1)[None],
                    attn_mask=allowed,
                    enable_gqa=attn.num_heads != attn.num_kv_heads,
                )[0].transpose(0, 1)
            x = layer.post_attention(o, res)
        return x

    def _varlen_lengths(self, pos: torch.Tensor):
        """The varlen arguments of one sequence per row over the cache: row i reads slots
        0..pos[i] (slot = position). A rejected row's position may lie past the cache: its count is
        clamped to the positions the cache holds, never reaching the scratch slot (its output is
        not read)."""
        cu_q, cu_k, used = cache_attention.flash_lengths(pos)
        return cu_q, cu_k, used.clamp(1, self._k_cache[0].shape[0] - 1)

    def _attend_varlen(self, q, li: int, lengths):
        """q [rows, heads, D] over layer li's cache [slots, kv heads, D] (already the varlen key
        layout) through self.attention ("flash" or "peagle") -> [rows, heads, D]."""
        kc, vc = self._k_cache[li], self._v_cache[li]
        return cache_attention.attend_varlen(self.attention, q, kc, vc, lengths, kc.shape[0], self._scale)

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

    def propose_static(self, batch: DraftBatch, num_spec_tokens: int) -> torch.Tensor:
        """propose() in fixed shapes (forward_static): long[K] verifier token ids."""
        rows = batch.token_indices_to_sample[:num_spec_tokens].to(self.device, torch.long)
        h = self.forward_static(batch, rows)
        return self._draft_ids[self.model.lm_head(self.model.norm(h)).argmax(-1)]
