"""COD attention restated in plain PyTorch (docs/design.md section 3): the dense mask of
the attention rules and SDPA over it. Slow and O(T^2) on purpose: the kernels are tested
against it, and nothing on a fast path calls it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops.cod import CodLayout


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """start[p] = first position of the run of equal document ids that contains p."""
    n = document_ids.shape[0]
    idx = torch.arange(n, device=document_ids.device)
    new_run = torch.ones(n, dtype=torch.bool, device=document_ids.device)
    if n > 1:
        new_run[1:] = document_ids[1:] != document_ids[:-1]
    starts = torch.where(new_run, idx, torch.zeros_like(idx))
    return torch.cummax(starts, 0).values


def dense_cod_mask(layout: CodLayout, *, cross: bool = False, window: int | None = None, sink: int = 0) -> torch.Tensor:
    """Boolean mask of which key each layout token attends.

    Symmetric: [T, T] over the layout tokens. Cross: [T, N + T], the first N columns being
    the context positions 0..N-1 and the rest the layout tokens (own chain only).
    """
    doc = layout.document_ids.long()
    a = layout.anchor.long()
    d = layout.depth.long()
    starts = document_starts(doc)
    doc_q = doc[a]
    valid_q = doc_q != -1

    def in_window(key_pos: torch.Tensor) -> torch.Tensor:
        if window is None:
            return torch.ones(a.shape[0], key_pos.shape[0], dtype=torch.bool, device=a.device)
        w = key_pos[None, :] > (a + d - window)[:, None]
        if sink > 0:
            w = w | ((key_pos[None, :] - starts[a][:, None]) < sink)
        return w

    same_chain = (a[:, None] == a[None, :]) & (d[None, :] <= d[:, None]) & valid_q[:, None]
    if not cross:
        same_doc = (doc[a][None, :] == doc_q[:, None]) & valid_q[:, None]
        context = (d[None, :] == 0) & (a[None, :] <= a[:, None]) & in_window(a)
        return same_doc & (context | same_chain)
    n = doc.shape[0]
    c = torch.arange(n, device=a.device)
    ctx = (doc[None, :] == doc_q[:, None]) & valid_q[:, None] & (c[None, :] <= a[:, None]) & in_window(c)
    return torch.cat([ctx, same_chain], dim=1)


def reference_cod_attention(
    q,
    k,
    v,
    layout: CodLayout,
    *,
    context_k=None,
    context_v=None,
    window: int | None = None,
    sink: int = 0,
    scale: float | None = None,
):
    """SDPA with the dense mask. q [T, Hq, D], k/v [T, Hkv, D] (+ context [N, Hkv, D]).
    Rows with no allowed key give 0 (and zero gradient)."""
    cross = context_k is not None
    mask = dense_cod_mask(layout, cross=cross, window=window, sink=sink)
    if cross:
        k = torch.cat([context_k, k], 0)
        v = torch.cat([context_v, v], 0)
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    has_key = mask.any(dim=1)
    safe = mask | ~has_key[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=safe, scale=scale
    ).transpose(0, 1)
    return torch.where(has_key[:, None, None], out, torch.zeros_like(out))
