"""The draft model's training forward restated in plain PyTorch, token by token (docs/design.md
sections 1, 3, 4 and 7): every layout token builds its own layer-0 input (its token's or the
MASK embedding, its hidden state or `mask_hidden` through fc), attention is SDPA over the dense
COD mask, and the loss holds the full [T, V] draft and target logits. No row is shared between
tokens, no fused op runs: the "no kernels" baseline of the benchmarks and the reference the
fused model's loss, metrics and gradients are tested against."""

from __future__ import annotations

import torch

from ..model import PEagleDraftModel
from ..model.layers import apply_rope, rms_norm
from ..ops.cod import CodLayout
from .attention import reference_cod_attention


def _rope_tables(model, pos: torch.Tensor):
    freqs = pos.to(model.rope_inv_freq.dtype)[:, None] * model.rope_inv_freq[None, :]
    emb = torch.cat([freqs, freqs], -1)
    return (emb.cos() * model.rope_scale)[:, None, :], (emb.sin() * model.rope_scale)[:, None, :]


def _layer0_inputs(model, example, anchor: torch.Tensor, depth: torch.Tensor):
    """(embeds [T, H], fc(hidden) [T, H]) of each token: depth 0 reads token and hidden state at
    its anchor, deeper tokens the MASK embedding and mask_hidden."""
    dev = model.fc.weight.device
    real = (depth == 0)[:, None]
    ids = example.input_ids.to(dev, torch.long)[anchor]
    mask_ids = torch.full_like(ids, model.config.mask_token_id)
    emb = model.embed_tokens(torch.where(real[:, 0], ids, mask_ids))
    if model.mask_embed is not None:
        emb = torch.where(real, emb, model.mask_embed[None].to(emb.dtype))
    mask = model.mask_hidden.reshape(1, -1)
    hid = torch.where(real, example.hidden.to(dev)[anchor].to(mask.dtype), mask)
    if model.input_norm is not None:
        hid = model.input_norm(hid)
    return emb, model.fc(hid)


def _run_layers(model, layout: CodLayout, l0, contexts=None):
    """(final hidden [T, H], per-layer (k, v)) of the layout's tokens."""
    o = model.options
    cos, sin = _rope_tables(model, layout.anchor.long() + layout.depth.long())
    x, kvs = None, []
    for li, layer in enumerate(model.layers):
        a_in, res = layer.pre_attention(*l0) if layer.first else layer.pre_attention(x)
        q = layer.self_attn.q(a_in)
        k, v = layer.self_attn.kv(a_in)
        k = apply_rope(k, cos.to(k.dtype), sin.to(k.dtype))
        q = apply_rope(q, cos.to(q.dtype), sin.to(q.dtype))
        kvs.append((k, v))
        dt = model.compute_dtype(q)
        ctx = None if contexts is None else (contexts[li][0].to(dt), contexts[li][1].to(dt))
        out = reference_cod_attention(
            q.to(dt),
            k.to(dt),
            v.to(dt),
            layout,
            context_k=None if ctx is None else ctx[0],
            context_v=None if ctx is None else ctx[1],
            window=o.window,
            sink=o.sink,
        )
        x = layer.post_attention(out.to(q.dtype), res)
    return x, kvs


def _full_logit_loss(model, h, layout: CodLayout, example):
    """(weighted loss sum, weight sum, correct[K], total[K]) over the full [T, V] logits."""
    pos = layout.anchor.long() + layout.depth.long()
    weight = example.loss_mask.to(pos.device)[pos].float()
    hn = model.norm(h)
    dt = model.compute_dtype(hn)
    acc = torch.promote_types(dt, torch.float32)
    logits = hn.to(dt) @ model.lm_head.weight.to(dt).t()  # [T, Vd]
    with torch.no_grad():
        last = example.last_hidden.to(pos.device)
        tn = rms_norm(last.float(), model.verifier_norm_weight, model.verifier_norm_eps)
        tlogits = tn[pos].to(dt) @ model.verifier_lm_head_weight.to(dt).t()  # [T, Vd]
        tlogp = torch.log_softmax(tlogits.to(acc), -1)
    logp = torch.log_softmax(logits.to(acc), -1)
    if model.options.loss_kind == "kl":
        per = (tlogp.exp() * (tlogp - logp)).sum(-1)
    else:
        per = -logp.gather(1, tlogits.argmax(-1, keepdim=True))[:, 0]
    k = model.num_depths
    with torch.no_grad():
        counted = weight > 0
        ok = (logits.argmax(-1) == tlogits.argmax(-1)) & counted
        d = layout.depth.long()
        correct = torch.bincount(d[ok], minlength=k)[:k].cpu()
        total = torch.bincount(d[counted], minlength=k)[:k].cpu()
    w = weight.to(per.dtype)
    return (per * w).sum(), weight.sum(), correct, total


def reference_forward_sum(model, example, layout: CodLayout | None = None, seed: int | None = None):
    """What PEagleDraftModel.forward_sum returns, computed token by token in plain PyTorch."""
    loss_sum, wsum, correct, total, num_tokens = reference_forward_terms(model, example, layout, seed)
    return loss_sum, {
        "weight": float(wsum),
        "correct": correct,
        "total": total,
        "loss_sum": float(loss_sum.detach()),
        "num_tokens": num_tokens,
    }


def reference_forward_terms(model, example, layout: CodLayout | None = None, seed: int | None = None):
    """What PEagleDraftModel.forward_terms returns (loss sum, weight sum, correct [K], total [K],
    draft tokens), computed token by token in plain PyTorch."""
    n = example.input_ids.shape[0]
    layout = model.sample_layout(example, seed=seed) if layout is None else layout
    model.check_layout(layout, n)
    dev = model.fc.weight.device
    layout = layout.to(dev)
    contexts = None
    if model.options.attention == "cross":
        doc = example.document_ids.to(dev, torch.int32)
        zero = torch.zeros(n, dtype=torch.int32, device=dev)
        stream = CodLayout(torch.arange(n, dtype=torch.int32, device=dev), zero, [0, n], doc, True)
        _, contexts = _run_layers(model, stream, _layer0_inputs(model, example, stream.anchor.long(), zero))
    l0 = _layer0_inputs(model, example, layout.anchor.long(), layout.depth)
    h, _ = _run_layers(model, layout, l0, contexts)
    loss_sum, wsum, correct, total = _full_logit_loss(model, h, layout, example)
    return loss_sum, wsum, correct, total, layout.num_tokens


def plain_model_class():
    """A PEagleDraftModel subclass whose training forward is `reference_forward_sum`: SDPA over
    the dense COD mask (GQA by repeat_interleave) and the full [T, V] logits (log_softmax KL).
    Modules, COD sampling and the optimizer are shared with the fused model."""

    class PlainTorch(PEagleDraftModel):
        # forward_sum, forward and forward_backward all run through forward_terms
        def forward_terms(self, example, layout=None, seed=None):
            return reference_forward_terms(self, example, layout, seed)

        def forward_backward(self, example, layout=None, *, segments: int = 1, **kw):
            if segments != 1:
                raise ValueError("the plain-PyTorch drafter runs one pass (segments=1)")
            return super().forward_backward(example, layout, segments=1, **kw)

    return PlainTorch
