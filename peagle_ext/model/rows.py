"""How a training pass takes rows from shared tensors without a duplicate-index gather.

Layer 0 computes its inputs once per unique row: rows 0..N-1 are the real tokens at their
positions and row N is the MASK token (docs/design.md section 1). A pass's tokens are depth-major
(depth 0 first), so they take those rows as
- depth 0: a slice of rows 0..N-1 (symmetric mode: all N, in order) or a gather of distinct
  anchor rows (cross mode, sequence-partition segments), whose gradient is a scatter;
- depth >= 1: row N broadcast, whose gradient is a sum.
Neither backward accumulates into repeated indices (torch's deterministic index_put backward
sorts them and adds a run of ~15K equal indices one after another), and both are deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class _DistinctRows(torch.autograd.Function):
    """x[index] for distinct indices: the backward writes each gradient row once (index_copy_)."""

    @staticmethod
    def forward(ctx, x, index):
        ctx.shape = x.shape
        ctx.save_for_backward(index)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        out = grad.new_zeros(ctx.shape)
        return out.index_copy_(0, index, grad), None


def gather_distinct_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] along dim 0, for an int64 index without repeats (not checked: the callers build
    it from sorted unique anchors or a mask's nonzero positions)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _DistinctRows.apply(x, index)
    return x.index_select(0, index)


@dataclass(frozen=True)
class LayerZeroRows:
    """Where each token of a pass reads its layer-0 row among the N + 1 unique rows: tokens
    [0, num_real) are depth 0, at rows `real_rows` (None: rows 0..num_real-1, a slice); the
    following num_mask tokens are deeper and all read row N (the MASK)."""

    n: int
    num_real: int
    num_mask: int
    real_rows: torch.Tensor | None = None

    @classmethod
    def of_layout(cls, layout) -> LayerZeroRows:
        n, t = layout.seq_len, layout.num_tokens
        n0 = layout.depth_offsets[1] - layout.depth_offsets[0] if layout.num_depths else t
        if layout.depth0_all:
            if n0 != n:
                raise ValueError(f"a symmetric layout has N={n} depth-0 tokens first, got {n0}")
            return cls(n, n, t - n, None)
        rows = layout.anchor[:n0].long()
        return cls(n, n0, t - n0, rows)

    @property
    def num_tokens(self) -> int:
        return self.num_real + self.num_mask

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """[num_tokens, ...] rows of x [N + 1, ...]."""
        parts = []
        if self.num_real:
            parts.append(x[: self.num_real] if self.real_rows is None else gather_distinct_rows(x, self.real_rows))
        if self.num_mask:
            parts.append(x[self.n : self.n + 1].expand(self.num_mask, *x.shape[1:]))
        if not parts:
            return x[:0]
        return torch.cat(parts, 0) if len(parts) > 1 else parts[0].contiguous()


# The rows after the last attention are counted up to a multiple of this many on CUDA. Their number
# is new every step under COD sampling, and every GEMM of a new shape pays cuBLAS's algorithm
# selection on the host (65-130 us a call against 13 us for a repeated shape, measured on an H100),
# which decides the step time of a small drafter; a few hundred extra rows of weight 0 cost the
# device next to nothing. On CPU no selection is cached, and the extra rows would be pure cost.
WEIGHTED_ROWS_MULTIPLE = {"cuda": 256}


def weighted_rows(weight: torch.Tensor, multiple: int | None = None) -> torch.Tensor | None:
    """Sorted indices of the rows of weight > 0, plus the first rows of weight 0 that take their
    count up to a multiple of `multiple` (default: WEIGHTED_ROWS_MULTIPLE for weight's device, 1
    elsewhere); None when that is every row. A row of weight 0 adds nothing to the loss or to any
    gradient, so the padding changes no result. One host sync."""
    if multiple is None:
        multiple = WEIGHTED_ROWS_MULTIPLE.get(weight.device.type, 1)
    positive = weight > 0
    count = int(positive.sum())
    count = -(-count // multiple) * multiple
    if count >= weight.numel():
        return None
    # a stable sort puts the positive rows first, each group in row order
    order = torch.sort((~positive).to(torch.uint8), stable=True).indices
    return order[:count].sort().values
