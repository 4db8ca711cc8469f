"""Sequence partition: forward_backward(..., segments=S) of PEagleDraftModel.

The layout is cut by anchor ranges into S segments that run forward+backward one after another.
The depth-0 stream is computed once; its per-layer K/V enter every segment as detached leaves
whose gradients are accumulated and pushed back through the stream once at the end, so the
summed gradient is exact (a symmetric query's keys are exactly "stream positions <= its anchor"
plus its own chain, i.e. the cross rule).
"""

from __future__ import annotations

import torch

from ..ops.cod import CodLayout
from .rows import weighted_rows


def partitioned_forward_backward(model, example, layout: CodLayout, segments: int, loss_scale) -> dict:
    """forward_backward(segments > 1) of a PEagleDraftModel (module docstring)."""
    o = model.options
    if o.attention == "symmetric" and o.window is not None and o.window < model.num_depths:
        raise ValueError(
            f"sequence partition in symmetric mode needs window >= num_depths "
            f"({model.num_depths}) so a chain's own depth-0 token stays in its window"
        )
    dev = model.fc.weight.device
    layout = layout.to(dev)
    weight_all = model.token_weight(layout, example)
    scale = (
        loss_scale
        if loss_scale is not None
        else (1.0 / float(weight_all.sum()) if float(weight_all.sum()) > 0 else 0.0)
    )
    stream = model.stream_tokens(example, dev)
    symmetric = o.attention == "symmetric"
    # symmetric: the stream's depth-0 rows feed the loss too; only the weighted ones go on
    keep_stream = weighted_rows(model.token_weight(stream.layout, example)) if symmetric else None
    with model.amp():
        tgt = model.target_normed(example, model.compute_dtype(model.fc.weight))
        l0 = model.layer0_rows(example)
        h_stream, kvs = model.run_layers(stream, l0, collect_kv=True, last_full=symmetric, keep=keep_stream)
    # the leaves gather their gradient over every segment: in fp32 even where the stream's K/V are
    # bf16, so the sum of the segments' gradients is not rounded segment by segment
    leaves = [(_fp32_leaf(k), _fp32_leaf(v)) for k, v in kvs]
    total_sum = 0.0
    wsum_all = 0.0
    correct = torch.zeros(model.num_depths, dtype=torch.int64)
    total = torch.zeros(model.num_depths, dtype=torch.int64)
    roots, grads = [], []
    if symmetric:
        # depth 0 = the stream itself; its loss joins the final backward through the stream
        with model.amp():
            s_sum, s_w, c, t = model.loss_terms(h_stream, stream.layout, example, tgt, keep=keep_stream)
        roots.append(s_sum * scale)
        grads.append(None)
        total_sum += float(s_sum.detach())
        wsum_all += float(s_w)
        correct += c.cpu()
        total += t.cpu()
        keep = layout.depth > 0
    else:
        keep = torch.ones_like(layout.depth, dtype=torch.bool)
    for sub in segment_layouts(layout, keep, segments):
        tok = model.pass_tokens(sub)
        rows = weighted_rows(model.token_weight(sub, example))
        with model.amp():
            h, _ = model.run_layers(tok, model.layer0_rows(example), contexts=leaves, keep=rows)
            s_sum, s_w, c, t = model.loss_terms(h, sub, example, tgt, keep=rows)
        (s_sum * scale).backward()
        total_sum += float(s_sum.detach())
        wsum_all += float(s_w)
        correct += c.cpu()
        total += t.cpu()
    for (k, v), (lk, lv) in zip(kvs, leaves):
        for t_, leaf in ((k, lk), (v, lv)):
            if leaf.grad is not None:
                roots.append(t_)
                grads.append(leaf.grad.to(t_.dtype))
    if roots:
        torch.autograd.backward(roots, [g if g is not None else torch.ones_like(r) for r, g in zip(roots, grads)])
    return {
        "weight": wsum_all,
        "correct": correct,
        "total": total,
        "loss_sum": total_sum,
        "num_tokens": layout.num_tokens,
    }


def segment_layouts(layout: CodLayout, keep: torch.Tensor, segments: int):
    """Split the kept layout tokens into <= `segments` sub-layouts of contiguous anchor ranges with
    about equal token counts; a chain (one anchor) never straddles two segments. Each keeps the
    depth-major, anchor-sorted order and is marked depth0_all=False (cross-mode layout)."""
    a = layout.anchor[keep]
    d = layout.depth[keep]
    if a.numel() == 0:
        return []
    # the anchor of rank r in sorted order is the first position whose cumulative anchor count
    # exceeds r: quantile cuts from a histogram, no sort
    cum = torch.bincount(a.long(), minlength=layout.seq_len).cumsum(0)
    ranks = torch.tensor([(s * a.numel()) // segments for s in range(segments)] + [a.numel() - 1], device=a.device)
    at = torch.searchsorted(cum, ranks, right=True).tolist()
    cuts = sorted(set(at[1:-1]))
    bounds = [at[0]] + cuts + [at[-1] + 1]
    subs = []
    k = layout.num_depths
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        sel = (a >= lo) & (a < hi)
        if not bool(sel.any()):
            continue
        sa, sd = a[sel], d[sel]
        counts = torch.bincount(sd.long(), minlength=k)[:k].tolist()
        offs = [0]
        for c in counts:
            offs.append(offs[-1] + int(c))
        subs.append(CodLayout(sa.contiguous(), sd.contiguous(), offs, layout.document_ids, False))
    return subs


def _fp32_leaf(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).requires_grad_()
