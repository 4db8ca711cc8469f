"""The draft model with its two fused ops restated in plain PyTorch: SDPA over the dense COD
mask and the full [T, V] logits. The "no kernels" baseline of the benchmarks and a reference
for the fused model's loss and gradients."""

from __future__ import annotations

import torch

from ..model import PEagleDraftModel
from .attention import reference_cod_attention


def plain_model_class():
    """A PEagleDraftModel subclass whose attention is SDPA over the dense COD mask
    (reference_cod_attention: [T, T] mask, GQA by repeat_interleave) and
    whose loss holds the full [T, V] draft and target logits (log_softmax KL in fp32).
    Layers, RoPE, COD sampling and the optimizer are shared with the fused model."""

    class PlainTorch(PEagleDraftModel):
        def attend(self, q, k, v, tok, context=None):
            o = self.options
            dt = self.compute_dtype(q)
            ck = None if context is None else context[0].to(dt)
            cv = None if context is None else context[1].to(dt)
            return reference_cod_attention(
                q.to(dt), k.to(dt), v.to(dt), tok.layout, context_k=ck, context_v=cv, window=o.window, sink=o.sink
            )

        def loss_terms(self, h, layout, example, target_normed):
            pos = layout.anchor.long() + layout.depth.long()
            weight = example.loss_mask.to(pos.device)[pos].float()
            hn = self.norm(h)
            dt = self.compute_dtype(hn)
            logits = hn.to(dt) @ self.lm_head.weight.to(dt).t()  # [T, V]
            with torch.no_grad():
                tlogits = target_normed[pos].to(dt) @ self.verifier_lm_head_weight.to(dt).t()  # [T, V]
                tlogp = torch.log_softmax(tlogits.float(), -1)
            logp = torch.log_softmax(logits.float(), -1)
            kl = (tlogp.exp() * (tlogp - logp)).sum(-1)
            k = self.num_depths
            with torch.no_grad():
                ok = (logits.argmax(-1) == tlogits.argmax(-1)) & (weight > 0)
                d = layout.depth.long()
                correct = torch.bincount(d[ok], minlength=k)[:k].cpu()
                total = torch.bincount(d[weight > 0], minlength=k)[:k].cpu()
            return (kl * weight).sum(), weight.sum(), correct, total

    return PlainTorch
