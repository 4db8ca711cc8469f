"""The training forward of PEagleDraftModel over a COD layout (docs/design.md section 7).

One forward trains every depth of the drafter at once on a COD-sampled token set:

    depth 0 (anchor p):  embed(token p+1) ; fc(verifier aux hidden at p)
    depth d >= 1:        embed(MASK)      ; fc(mask_hidden)            at position anchor + d

Layer 0 reads [embeds ; hidden] (2H) into q/k/v, layers 1.. are plain decoder layers, RoPE sits
at position anchor + depth, and the loss is KL(verifier || draft) through
`peagle_ext.ops.loss.fused_linear_kl` with the verifier's final norm and lm_head held as frozen,
never-saved buffers.

Attention goes through `peagle_ext.ops.attention.cod_attention`:
- "symmetric": one call over every layout token (depth 0 at all N positions first).
- "cross": the depth-0 stream over all N positions is run as its own causal pass and only
  provides context K/V per layer; the layout (depth 0 only at the anchors, then the deeper
  tokens) attends that context plus its own chain.

Rows no later computation reads are not computed:
- layer 0 runs on the N + 1 unique rows (N positions, one MASK row) and the tokens take them as
  a slice plus a broadcast (rows.LayerZeroRows; no duplicate-index gather anywhere);
- after the last layer's attention only the rows of weight > 0 (loss-masked positions) go on
  through o_proj, the MLP, the final norm and the loss: the others are keys and values of the
  attention and nothing else;
- the loss computes the verifier's logits once per distinct loss-masked position
  (fused_linear_kl's target_index), not once per draft token.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..ops.cod import CodLayout
from .layers import DraftLayer, folds_head_norm, norm_rope_to, rms_norm, rope_to
from .partition import partitioned_forward_backward
from .rows import LayerZeroRows, gather_distinct_rows, weighted_rows


@dataclass
class PassTokens:
    """Which tokens one pass computes: layout (the attention op's view), where each token reads
    its layer-0 row (depth 0: its position; deeper: the MASK row N), and RoPE tables."""

    layout: CodLayout
    rows: LayerZeroRows
    cos: torch.Tensor
    sin: torch.Tensor
    meta: object = None  # attention metadata, built on first use


@dataclass
class DeviceMetrics:
    """forward_backward(sync=False)'s metrics, still on the device (forward_terms' results):
    read() brings them to the host as forward_backward's dict, waiting for the device once."""

    terms: tuple

    def read(self) -> dict:
        return TrainingForward.host_metrics(*self.terms)


class TrainingForward:
    """The training forward of PEagleDraftModel (a mixin: its methods use the model's modules,
    options and verifier buffers)."""

    def layer0_rows(self, example):
        """Unique layer-0 inputs: rows 0..N-1 are the real tokens/hidden, row N the MASK."""
        n = example.input_ids.shape[0]
        dev = self.fc.weight.device
        if self.mask_embed is not None:
            emb = torch.cat([self.embed_tokens(example.input_ids.to(dev, torch.long)), self.mask_embed[None]], 0)
        else:
            ids = torch.cat(
                [
                    example.input_ids.to(dev, torch.long),
                    torch.tensor([self.config.mask_token_id], device=dev, dtype=torch.long),
                ]
            )
            emb = self.embed_tokens(ids)
        mask = self.mask_hidden.reshape(1, -1)
        hidden = example.hidden.to(dev)
        if hidden.dim() != 2 or hidden.shape[0] != n:
            raise ValueError(f"example.hidden must have shape [N={n}, n_aux*H], got {tuple(hidden.shape)}")
        if hidden.shape[1] != mask.shape[1]:
            raise ValueError(
                f"verifier/draft hidden size mismatch: example.hidden has {hidden.shape[1]} features, "
                f"the drafter's fc expects {mask.shape[1]} ({self.config.num_aux} aux layers x "
                f"hidden {self.config.hidden_size})"
            )
        amp_dt = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else None
        if self.input_norm is None and amp_dt is not None and hidden.dtype == amp_dt:
            # autocast casts fc's input to amp_dt anyway: concatenating in amp_dt gives the same
            # values without an fp32 copy of the [N, n_aux * H] states (~13 GB at N=128K, 3x4096)
            hid = torch.cat([hidden, mask.to(amp_dt)], 0)
        else:
            hid = torch.cat([hidden.to(mask.dtype), mask], 0)
        if self.input_norm is not None:
            hid = self.input_norm(hid)
        hid = self.fc(hid)
        assert emb.shape[0] == n + 1
        return emb, hid

    def pass_tokens(self, layout: CodLayout, rows: LayerZeroRows | None = None) -> PassTokens:
        rows = LayerZeroRows.of_layout(layout) if rows is None else rows
        pos = layout.anchor.long() + layout.depth.long()
        freqs = pos.to(self.rope_inv_freq.dtype)[:, None] * self.rope_inv_freq[None, :]
        emb = torch.cat([freqs, freqs], -1)
        cos = (emb.cos() * self.rope_scale)[:, None, :]
        sin = (emb.sin() * self.rope_scale)[:, None, :]
        return PassTokens(layout, rows, cos, sin)

    def attend(self, q, k, v, tok: PassTokens, context=None):
        from ..ops.attention import cod_attention, cod_attention_metadata

        o = self.options
        dt, in_dt = self.compute_dtype(q), v.dtype  # v is never roped: the projections' dtype
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
        if context is not None:
            context = (context[0].to(dt), context[1].to(dt))
        if tok.meta is None:  # the key ranges / chain tables serve every layer of the pass
            tok.meta = cod_attention_metadata(tok.layout, cross=context is not None, window=o.window, sink=o.sink)
        out = cod_attention(
            q,
            k,
            v,
            tok.layout,
            context_k=None if context is None else context[0],
            context_v=None if context is None else context[1],
            window=o.window,
            sink=o.sink,
            metadata=tok.meta,
        )
        # fp32 parameters on CUDA without autocast: the kernel ran in bf16, o_proj is fp32
        return out.to(in_dt)

    def compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        """One dtype for the attention and loss ops: the autocast dtype when autocast is on;
        else the activations' (fp32 on CPU; the CUDA attention kernels take bf16/fp16 only)."""
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            return torch.get_autocast_dtype(dev)
        if dev == "cuda" and x.dtype == torch.float32:
            return torch.bfloat16
        return x.dtype

    def qkv(self, layer: DraftLayer, x, tok: PassTokens, *, l0, want_q=True):
        """q/k/v of the pass's tokens at `layer` (after RoPE), and the residual."""
        attn = layer.self_attn
        if layer.first:
            emb, hid = l0
            a_in, res = layer.pre_attention(emb, hid)
        else:
            a_in, res = layer.pre_attention(x)
        # qwen3's q/k head norms: inside the RoPE kernel in a CUDA training step (no fp32 copy of
        # q and k in memory), else here, before layer 0's rows are taken (N + 1 rows, not T)
        fold = folds_head_norm(a_in, attn.k_norm)
        if fold:
            q = attn.q_heads(a_in) if want_q else None
            k, v = attn.kv_heads(a_in)
        else:
            q = attn.q(a_in) if want_q else None
            k, v = attn.kv(a_in)
        if layer.first:
            rows = tok.rows
            q = rows.take(q) if q is not None else None
            k, v, res = rows.take(k), rows.take(v), rows.take(res)
        # in fp32 (float64 stays float64), written in the attention's dtype; one fused kernel
        # each way on the GPU (layers.rope_to, layers.norm_rope_to)
        dt = self.compute_dtype(k)
        if fold:
            k = norm_rope_to(k, attn.k_norm, tok.cos, tok.sin, dt)
            q = norm_rope_to(q, attn.q_norm, tok.cos, tok.sin, dt) if q is not None else None
        else:
            k = rope_to(k, tok.cos, tok.sin, dt)
            q = rope_to(q, tok.cos, tok.sin, dt) if q is not None else None
        return q, k, v, res

    def run_layers(self, tok: PassTokens, l0, contexts=None, *, collect_kv=False, last_full=True, keep=None):
        """Run the layers over one pass's tokens. contexts[l] = (k, v) of the stream at layer l
        (cross mode). collect_kv returns this pass's per-layer (k, v); last_full=False stops at the
        last layer's k/v (the stream in cross mode needs nothing more). keep: the rows whose
        output is read (distinct, ascending; None = all): after the last layer's attention only
        they are computed, and the output has one row per kept row."""
        x = None
        kvs = []
        n_layers = len(self.layers)
        for li, layer in enumerate(self.layers):
            last = li == n_layers - 1
            kv_only = last and not last_full
            ctx = None if contexts is None else contexts[li]
            x, kv = layer(self.layer_pass, x, l0, ctx, tok, kv_only=kv_only, keep=keep if last else None)
            if collect_kv:
                kvs.append(kv)
            if kv_only:
                return None, kvs
        return x, kvs

    def layer_pass(self, layer: DraftLayer, x, l0, ctx, tok: PassTokens, *, kv_only: bool, keep=None):
        """(layer output or None when kv_only, (k, v) of this pass) for one layer; with keep, the
        output of those rows only."""
        q, k, v, res = self.qkv(layer, x, tok, l0=l0, want_q=not kv_only)
        if kv_only:
            return None, (k, v)
        out = self.attend(q, k, v, tok, ctx)
        if keep is not None:
            out, res = gather_distinct_rows(out, keep), gather_distinct_rows(res, keep)
        return layer.post_attention(out, res), (k, v)

    def token_weight(self, layout: CodLayout, example) -> torch.Tensor:
        """[T] float: the loss mask at each token's position."""
        pos = layout.anchor.long() + layout.depth.long()
        return example.loss_mask.to(pos.device)[pos].float()

    def loss_terms(self, h, layout: CodLayout, example, target_normed, keep=None):
        """(weighted loss SUM, weight sum, correct[K], total[K]) over the tokens of `layout`.
        h: final hidden states of every token, or of the rows `keep` (run_layers(keep=...)), which
        must then hold every row of weight > 0. target_normed [N, H]: the verifier's normed last
        hidden state per position (target_normed()); the loss reads it by position."""
        from ..ops.loss import fused_linear_kl

        pos = layout.anchor.long() + layout.depth.long()
        weight = self.token_weight(layout, example)
        depth = layout.depth
        w_rows = weight
        if keep is not None:
            pos, w_rows, depth = pos[keep], weight[keep], depth[keep]
        hn = self.norm(h)
        dt = self.compute_dtype(hn)
        hn = hn.to(dt)
        tgt = target_normed if target_normed.dtype == dt else target_normed.to(dt)
        w = self.lm_head.weight
        head = w.to(dt) if w.requires_grad else self.frozen_copy("lm_head", w, dt)
        vhead = self.frozen_copy("verifier_lm_head", self.verifier_lm_head_weight, dt)
        loss, m = fused_linear_kl(
            hn,
            head,
            tgt,
            vhead,
            w_rows,
            depth,
            num_depths=self.num_depths,
            target_index=pos,
            kind=self.options.loss_kind,
            validate=hn.device.type == "cpu",
        )
        wsum = weight.sum()
        return loss * wsum, wsum, m["correct"], m["total"]

    def frozen_copy(self, name: str, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """w in `dtype` for a tensor no gradient reaches (the verifier head, a frozen lm_head):
        cast once and kept while w is unchanged, instead of once per step. "Unchanged" is w's
        storage and in-place version counter (what autograd itself checks): loading weights or
        re-attaching the verifier writes in place and bumps it."""
        if w.dtype == dtype:
            return w
        cache = self.__dict__.setdefault("_frozen_copies", {})
        key = (w.data_ptr(), w._version, w.device, tuple(w.shape), dtype)
        hit = cache.get(name)
        if hit is not None and hit[0] == key:
            return hit[1]
        cache.pop(name, None)  # the old copy goes before the new one is made
        copy = w.detach().to(dtype)
        cache[name] = (key, copy)
        return copy

    def target_normed(self, example, dtype: torch.dtype | None = None):
        """The verifier's final norm over its last hidden states [N, H] (fp32 statistics), in
        `dtype` (default fp32)."""
        if not self.has_verifier:
            raise RuntimeError("the drafter has no verifier head attached: call attach_verifier(...) first")
        last = example.last_hidden.to(self.verifier_norm_weight.device)
        if last.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"verifier/draft hidden size mismatch: example.last_hidden has {last.shape[-1]} "
                f"features, the drafter's hidden_size is {self.config.hidden_size}"
            )
        with torch.no_grad():
            out = rms_norm(last.float(), self.verifier_norm_weight, self.verifier_norm_eps)
            return out if dtype is None else out.to(dtype)

    def check_layout(self, layout: CodLayout, n: int):
        if layout.num_depths != self.num_depths:
            raise ValueError(f"layout has {layout.num_depths} depths, the drafter {self.num_depths}")
        want_all = self.options.attention == "symmetric"
        if layout.depth0_all != want_all:
            raise ValueError(
                f"{self.options.attention} attention needs a layout sampled with "
                f"depth0={'all' if want_all else 'anchors'}"
            )
        if layout.seq_len != n:
            raise ValueError(f"layout is for N={layout.seq_len}, the example has N={n}")

    def stream_tokens(self, example, dev) -> PassTokens:
        n = example.input_ids.shape[0]
        doc = example.document_ids.to(dev, torch.int32)
        zero = torch.zeros(n, dtype=torch.int32, device=dev)
        lay = CodLayout(torch.arange(n, dtype=torch.int32, device=dev), zero, [0, n], doc, True)
        return self.pass_tokens(lay)

    def layout_rows(self, layout: CodLayout) -> LayerZeroRows:
        """Where each token of `layout` reads its layer-0 row (rows.LayerZeroRows)."""
        return LayerZeroRows.of_layout(layout)

    # -- public forward -------------------------------------------------------------------------
    def forward(self, example, layout: CodLayout | None = None, *, seed: int | None = None):
        """(loss, metrics) for one packed sequence: loss = KL summed over the loss-masked layout
        tokens / their count (0 when there are none); metrics holds per-depth argmax-agreement
        counts "correct"/"total" (int64[K]), "loss_sum", "weight" and "num_tokens"."""
        loss_sum, m = self.forward_sum(example, layout, seed)
        w = m["weight"]
        loss = loss_sum / w if w > 0 else loss_sum * 0.0
        return loss, {**m, "loss": float(loss.detach())}

    def forward_sum(self, example, layout=None, seed=None):
        """(weighted loss SUM over the layout's loss tokens, metrics); forward() divides by the weight."""
        terms = self.forward_terms(example, layout, seed)
        return terms[0], self.host_metrics(*terms)

    def forward_terms(self, example, layout=None, seed=None):
        """forward_sum's results left on the device: (loss_sum, weight sum, correct [K], total [K],
        number of draft tokens). No host sync after the layers are launched."""
        n = example.input_ids.shape[0]
        layout = self.sample_layout(example, seed=seed) if layout is None else layout
        self.check_layout(layout, n)
        dev = self.fc.weight.device
        layout = layout.to(dev)
        tgt = self.target_normed(example, self.compute_dtype(self.fc.weight))
        l0 = self.layer0_rows(example)
        tok = self.pass_tokens(layout)
        keep = weighted_rows(self.token_weight(layout, example))
        if self.options.attention == "symmetric":
            h, _ = self.run_layers(tok, l0, keep=keep)
        else:
            _, kvs = self.run_layers(self.stream_tokens(example, dev), l0, collect_kv=True, last_full=False)
            h, _ = self.run_layers(tok, l0, contexts=kvs, keep=keep)
        loss_sum, wsum, correct, total = self.loss_terms(h, layout, example, tgt, keep=keep)
        return loss_sum, wsum, correct, total, layout.num_tokens

    @staticmethod
    def host_metrics(loss_sum, wsum, correct, total, num_tokens) -> dict:
        """forward_terms' results as forward_sum's metrics (host numbers: one sync)."""
        return {
            "weight": float(wsum),
            "correct": correct.cpu(),
            "total": total.cpu(),
            "loss_sum": float(loss_sum.detach()),
            "num_tokens": num_tokens,
        }

    def forward_backward(
        self,
        example,
        layout: CodLayout | None = None,
        *,
        seed: int | None = None,
        segments: int = 1,
        loss_scale: float | None = None,
        autocast_dtype: torch.dtype | None = None,
        sync: bool = True,
    ) -> dict | DeviceMetrics:
        """Forward + backward of `loss_sum * loss_scale` (default 1 / weight, i.e. the mean),
        accumulating into .grad. segments > 1 = sequence partition: the layout runs in that many
        anchor-range segments with exact gradients (module docstring). autocast_dtype: forward
        passes run under torch.autocast with it (backward outside). Returns the metrics; with
        sync=False and one segment, as DeviceMetrics, so the caller can queue more work (the
        optimizer's) before it waits for the device."""
        self._amp_dtype = autocast_dtype
        if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
            raise ValueError(f"segments must be an int >= 1, got {segments!r}")
        n = example.input_ids.shape[0]
        layout = self.sample_layout(example, seed=seed) if layout is None else layout
        self.check_layout(layout, n)
        if segments == 1:
            with self.amp():
                terms = self.forward_terms(example, layout, None)
            loss_sum, wsum = terms[0], terms[1]
            if loss_scale is None:  # 1 / weight on the device: the backward is queued before any sync
                w = wsum.to(loss_sum.dtype)  # the reciprocal in the loss's precision (float64 on CPU tests)
                scale = torch.where(w > 0, w.reciprocal(), torch.zeros_like(w))
            else:
                scale = loss_scale
            (loss_sum * scale).backward()
            return self.host_metrics(*terms) if sync else DeviceMetrics(terms)
        return partitioned_forward_backward(self, example, layout, segments, loss_scale)

    def amp(self):
        dt = getattr(self, "_amp_dtype", None)
        if dt is None:
            return contextlib.nullcontext()
        return torch.autocast(self.fc.weight.device.type, dtype=dt)
