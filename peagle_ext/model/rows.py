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


def weighted_rows(weight: torch.Tensor) -> torch.Tensor | None:
    """Indices of the rows of weight > 0, or None when that is every row (one host sync)."""
    keep = torch.nonzero(weight > 0)[:, 0]
    return None if keep.numel() == weight.numel() else keep
