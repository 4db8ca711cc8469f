"""COD sampling restated in plain PyTorch (docs/design.md section 2): speculators' sampling
loop with the documented Philox key draw, so it must equal the op exactly."""

from __future__ import annotations

import math

import numpy
import torch

_M32 = 0xFFFFFFFF


def philox_u32(seed: int, c0: torch.Tensor, c1: int, c2: int, c3: int) -> torch.Tensor:
    """Philox4x32-10 first output word for counters (c0[i], c1, c2, c3), vectorised (int64 math)."""
    seed &= (1 << 64) - 1
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    x0 = c0.to(torch.int64) & _M32
    x1 = torch.full_like(x0, c1 & _M32)
    x2 = torch.full_like(x0, c2 & _M32)
    x3 = torch.full_like(x0, c3 & _M32)

    def mulhilo(a: int, b: torch.Tensor):
        # a * b < 2^64 does not fit int64: split b into 16-bit halves.
        b_lo, b_hi = b & 0xFFFF, b >> 16
        lo_part = a * b_lo
        hi_part = a * b_hi
        total_lo = (lo_part & _M32) + ((hi_part & 0xFFFF) << 16)
        lo = total_lo & _M32
        hi = ((lo_part >> 32) + (hi_part >> 16) + (total_lo >> 32)) & _M32
        return hi, lo

    for _ in range(10):
        hi0, lo0 = mulhilo(0xD2511F53, x0)
        hi1, lo1 = mulhilo(0xCD9E8D57, x2)
        x0, x1, x2, x3 = hi1 ^ x1 ^ k0, lo1, hi0 ^ x3 ^ k1, lo0
        k0 = (k0 + 0x9E3779B9) & _M32
        k1 = (k1 + 0xBB67AE85) & _M32
    return x0


def reference_cod_sample(
    document_ids,
    loss_mask,
    *,
    num_depths=8,
    down_sample_ratio=0.7,
    down_sample_ratio_min=0.2,
    max_anchors=None,
    depth0="all",
    seed=0,
):
    """speculators' generate_cod_sample_indices loop (randperm per depth replaced by the
    documented key draw, so it must equal the op exactly) plus the two fixes of docs/design.md.
    Returns (anchor, depth, depth_offsets) as int64 tensors / list."""
    doc = document_ids.long().cpu()
    lm = loss_mask.bool().cpu()
    n = doc.shape[0]

    def keep_smallest(cand: torch.Tensor, k: int, stream: int, depth: int) -> torch.Tensor:
        if cand.numel() <= k:
            return cand
        r = philox_u32(seed, cand, depth, stream, 0x50454147)
        # key = (r << 32) | p overflows int64, so order by (r, p) lexicographically instead
        order = torch.from_numpy(numpy.lexsort((cand.numpy(), r.numpy())))
        return cand[order[:k]].sort().values

    p = torch.arange(1, max(n, 1))  # N = 0: no seeds (arange(1, 0) would raise)
    seeds = p[lm[1:] & (doc[1:] >= 0) & (doc[1:] == doc[:-1])] if n > 1 else torch.zeros(0, dtype=torch.long)
    if max_anchors is not None:
        seeds = keep_smallest(seeds, max_anchors, 0x41, 0)
    s = seeds.numel()
    anchors = [torch.arange(n) if depth0 == "all" else seeds - 1]
    pool = seeds
    for d in range(1, num_depths):
        ratio = max(down_sample_ratio**d, down_sample_ratio_min)
        size = int(math.floor(max(0, s - d) * ratio))
        if size <= 0:
            break
        sampled = keep_smallest(pool, size, 0x44, d)
        anchors.append(sampled - d)
        nxt = sampled + 1
        ok = nxt < n
        nxt, src = nxt[ok], sampled[ok]
        pool = nxt[lm[nxt] & (doc[nxt] == doc[src])]
    counts = [a.numel() for a in anchors] + [0] * (num_depths - len(anchors))
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    anchor = torch.cat(anchors)
    depth = torch.cat([torch.full((c,), i, dtype=torch.long) for i, c in enumerate(counts)])
    return anchor, depth, offsets
