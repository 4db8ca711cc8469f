"""COD (conditional drop-token) sampling: which draft tokens a packed sequence trains on.

docs/design.md section 2. `cod_sample` runs the native op (CPU or CUDA, same draw for a seed)
and returns a CodLayout: tokens in depth-major order, anchors sorted within each depth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._checks import check_float, check_int, check_tensor
from .._native import ops

MAX_DEPTHS = 64
_INT_TYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)
_MASK_TYPES = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
)


@dataclass
class CodLayout:
    """The draft-token set of one packed sequence.

    anchor[T], depth[T]: int32; token t sits at position anchor[t] + depth[t].
    depth_offsets: K+1 host ints, tokens of depth d are [depth_offsets[d], depth_offsets[d+1]).
    document_ids: int32[N], the input (-1 = padding). depth0_all: False in cross mode
    (depth 0 only at the anchors of depth 1's candidate pool).
    """

    anchor: torch.Tensor
    depth: torch.Tensor
    depth_offsets: list[int]
    document_ids: torch.Tensor
    depth0_all: bool = True

    @property
    def position_ids(self) -> torch.Tensor:
        return self.anchor + self.depth

    @property
    def num_tokens(self) -> int:
        return int(self.depth_offsets[-1])

    @property
    def num_depths(self) -> int:
        return len(self.depth_offsets) - 1

    @property
    def seq_len(self) -> int:
        return int(self.document_ids.shape[0])

    @property
    def device(self) -> torch.device:
        return self.anchor.device

    def depth_counts(self) -> list[int]:
        o = self.depth_offsets
        return [o[d + 1] - o[d] for d in range(len(o) - 1)]

    def to(self, device) -> CodLayout:
        return CodLayout(
            self.anchor.to(device),
            self.depth.to(device),
            list(self.depth_offsets),
            self.document_ids.to(device),
            self.depth0_all,
        )


def _as_document_ids(document_ids) -> torch.Tensor:
    check_tensor("document_ids", document_ids, dim=1, dtypes=_INT_TYPES)
    # int32 input goes straight to the op, which rejects ids < -1 itself (on CUDA inside the
    # one host sync it already makes); wider ints need one range check before narrowing.
    if document_ids.dtype != torch.int32 and document_ids.numel():
        lo, hi = (int(x) for x in torch.aminmax(document_ids.to(torch.int64)))
        if lo < -1:
            raise ValueError(f"document_ids must be >= -1 (-1 = padding), got min {lo}")
        if hi > 2**31 - 1:
            raise ValueError("document_ids must fit in int32")
    return document_ids.to(torch.int32).contiguous()


def _as_loss_mask(loss_mask, n: int, device) -> torch.Tensor:
    check_tensor("loss_mask", loss_mask, dim=1, dtypes=_MASK_TYPES, shape=(n,))
    if loss_mask.device != device:
        raise ValueError(f"loss_mask must be on the same device as document_ids ({device}), got {loss_mask.device}")
    if loss_mask.dtype != torch.bool:
        bad = (loss_mask != 0) & (loss_mask != 1)
        if bool(bad.any()):
            raise ValueError("loss_mask must hold only 0 and 1")
        loss_mask = loss_mask != 0
    return loss_mask.contiguous()


def cod_sample(
    document_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    num_depths: int = 8,
    down_sample_ratio: float = 0.7,
    down_sample_ratio_min: float = 0.2,
    max_anchors: int | None = None,
    depth0: str = "all",
    seed: int | None = None,
) -> CodLayout:
    """COD-sample the draft tokens of one packed sequence (docs/design.md section 2).

    Seeds are positions p >= 1 with loss_mask[p] == 1 whose predecessor p-1 is in the same
    document; depth d >= 1 keeps floor((S - d) * max(r^d, r_min)) tokens drawn uniformly from
    its candidate pool, and a chain never leaves its document. `seed=None` draws one from
    torch's default generator (so torch.manual_seed makes runs repeatable).
    """
    document_ids = _as_document_ids(document_ids)
    loss_mask = _as_loss_mask(loss_mask, document_ids.shape[0], document_ids.device)
    check_int("num_depths", num_depths, lo=1, hi=MAX_DEPTHS)
    check_float("down_sample_ratio", down_sample_ratio, lo=0.0, hi=1.0, lo_open=True)
    check_float("down_sample_ratio_min", down_sample_ratio_min, lo=0.0, hi=1.0)
    check_int("max_anchors", max_anchors, lo=0, allow_none=True)
    if depth0 not in ("all", "anchors"):
        raise ValueError(f"depth0 must be 'all' or 'anchors', got {depth0!r}")
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    check_int("seed", seed, lo=-(2**63), hi=2**63 - 1)
    anchor, depth, offsets = ops.cod_sample(
        document_ids,
        loss_mask,
        num_depths,
        float(down_sample_ratio),
        float(down_sample_ratio_min),
        -1 if max_anchors is None else max_anchors,
        depth0 == "all",
        seed,
    )
    return CodLayout(anchor, depth, [int(x) for x in offsets.tolist()], document_ids, depth0 == "all")


@torch.library.register_fake("peagle::cod_sample")
def _cod_sample_fake(document_ids, loss_mask, num_depths, r, r_min, max_anchors, depth0_all, seed):
    ctx = torch.library.get_ctx()
    t = ctx.new_dynamic_size()
    anchor = document_ids.new_empty((t,), dtype=torch.int32)
    depth = document_ids.new_empty((t,), dtype=torch.int32)
    offsets = torch.empty((num_depths + 1,), dtype=torch.int64, device="cpu")
    return anchor, depth, offsets
