"""COD attention (docs/design.md section 3): every draft token attends one contiguous range of the
depth-0 stream (or of the verifier context, cross mode) plus at most K tokens of its own chain.

`cod_attention` builds the attention metadata from the layout (`cod_attention_metadata`, O(T),
no host sync on CUDA) and runs the native forward; autograd runs the native, deterministic
backward. No T x T mask exists anywhere on this path; `peagle_ext.reference` holds the dense
statement that the tests compare against.

CUDA kernels: one heuristics function (csrc/attention/attention_dispatch.h, `attention_kernel`
below) picks the family. On compute capability 9.0 with sm_90a code in the build it runs the Hopper
kernels (warpgroup MMAs, FlashAttention-3-style pipelining); everywhere else (Ampere, Ada,
Blackwell, Hopper builds without sm_90a) the portable mma.sync kernels. Both are deterministic and
give the same outputs and gradients bit for bit at head dim 128 (at 64 the forwards use other
query tiles and agree to rounding). The one override, for debugging and tests, is the environment
variable PEAGLE_ATTN_KERNEL: unset / "auto" = that choice, "portable" = the mma.sync kernels on
any GPU; any other value is a ValueError.

Memory safety: the CPU ops check every index they use (ValueError). On CUDA the layout's and the
metadata's contents are not checked (a check costs a host sync); the kernels clamp every range and
skip every chain entry outside their inputs, so any values give unspecified results but never an
out-of-bounds access. A layout from cod_sample is always valid; pass validate=True to check a
hand-built one on CUDA too (one host sync). Metadata is bound to its layout (CodAttentionMetadata).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from .._checks import check_int, check_tensor
from .._native import attention_kernel_choice, has_hopper_kernels, ops
from .cod import CodLayout

_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_CUDA_DTYPES = (torch.bfloat16, torch.float16)
_CUDA_HEAD_DIMS = (64, 128)
KERNEL_ENV = "PEAGLE_ATTN_KERNEL"


def attention_kernel(head_dim: int = 128, device=None) -> dict:
    """The COD attention kernels that run for `head_dim` on a CUDA `device` (default: the current
    one) with this build and PEAGLE_ATTN_KERNEL: {"family": "hopper" | "portable" | "unsupported",
    "fwd_block_q", "dq_block_q", "dkv_block_k", "dkv_block_q"}. The CUDA ops ask the same function."""
    check_int("head_dim", head_dim, lo=1)
    if not torch.cuda.is_available():
        raise ValueError("attention_kernel: no CUDA device here")
    major, minor = torch.cuda.get_device_capability(device)
    return attention_kernel_choice(major, minor, head_dim, has_hopper_kernels(), os.environ.get(KERNEL_ENV, ""))


@dataclass
class CodAttentionMetadata:
    """What the kernels need from a layout: ranges int32 [5, T] (window lo/hi, sink lo/hi, valid),
    chains int32 [2, T, K] (own-chain key rows per query, and the reverse map).

    It is bound to the layout it was built from: `layout_tensors` holds that layout's anchor,
    depth and document_ids tensors, and cod_attention accepts it only with a layout made of the
    same tensor objects (metadata of another layout with the same depth_offsets would otherwise
    index keys that do not exist). Edit a layout's tensors in place after building its metadata and
    the metadata describes the old contents (still in bounds: the kernels never index outside
    their inputs)."""

    ranges: torch.Tensor
    chains: torch.Tensor
    depth_offsets: list[int]
    cross: bool
    use_sink: bool
    window: int | None = None
    sink: int = 0
    layout_tensors: tuple = field(default=(), repr=False, compare=False)

    def built_for(self, layout: CodLayout) -> bool:
        """Whether this metadata was built from `layout` (the same anchor, depth and document_ids)."""
        mine = self.layout_tensors
        return len(mine) == 3 and all(a is b for a, b in zip(mine, (layout.anchor, layout.depth, layout.document_ids)))


def cod_attention_metadata(
    layout: CodLayout, *, cross: bool = False, window: int | None = None, sink: int = 0, validate: bool = False
) -> CodAttentionMetadata:
    """Per-token key ranges and chain tables of `layout` (on the layout's device). The CPU op checks
    the layout's contents; validate=True checks them on CUDA too (sorted anchors, depth segments,
    depth-0 rows, contiguous documents; one host sync)."""
    if not isinstance(validate, bool):
        raise TypeError(f"validate must be a bool, got {type(validate).__name__}")
    _check_layout(layout)
    check_int("window", window, lo=1, allow_none=True)
    check_int("sink", sink, lo=0)
    if not cross and layout.depth_offsets[1] != layout.seq_len:
        raise ValueError(
            "layout: symmetric mode (no context_k/context_v) needs depth 0 at every position "
            f"(cod_sample depth0='all'); got {layout.depth_offsets[1]} depth-0 tokens for N={layout.seq_len}"
        )
    if layout.device.type == "cpu":
        _check_contiguous_documents(layout.document_ids)  # the CPU op checks the rest itself
    elif validate:
        _check_layout_contents(layout, cross)
    ranges, chains = ops.cod_attention_metadata(
        layout.anchor,
        layout.depth,
        layout.document_ids,
        list(layout.depth_offsets),
        bool(cross),
        -1 if window is None else int(window),
        int(sink),
    )
    return CodAttentionMetadata(
        ranges,
        chains,
        list(layout.depth_offsets),
        bool(cross),
        window is not None and sink > 0,
        window,
        sink,
        (layout.anchor, layout.depth, layout.document_ids),
    )


def cod_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: CodLayout,
    *,
    context_k: torch.Tensor | None = None,
    context_v: torch.Tensor | None = None,
    window: int | None = None,
    sink: int = 0,
    scale: float | None = None,
    metadata: CodAttentionMetadata | None = None,
    validate: bool = False,
) -> torch.Tensor:
    """COD attention over the layout's tokens. q [T, Hq, D], k/v [T, Hkv, D] (Hq % Hkv == 0);
    cross mode: context_k/context_v [N, Hkv, D]. Returns [T, Hq, D]; rows without keys are 0.

    `metadata` (from cod_attention_metadata with the same layout/cross/window/sink) may be passed
    to reuse it across layers. validate: as in cod_attention_metadata.
    """
    cross = context_k is not None or context_v is not None
    _check_inputs(q, k, v, layout, context_k, context_v, cross)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite float or None, got {scale!r}")
    if metadata is None:
        metadata = cod_attention_metadata(layout, cross=cross, window=window, sink=sink, validate=validate)
    else:
        check_int("window", window, lo=1, allow_none=True)
        check_int("sink", sink, lo=0)
        if not isinstance(metadata, CodAttentionMetadata):
            raise TypeError(f"metadata must be a CodAttentionMetadata, got {type(metadata).__name__}")
        if not metadata.built_for(layout) or metadata.depth_offsets != list(layout.depth_offsets):
            raise ValueError(
                "metadata was built for another layout: pass the CodLayout (the same anchor, depth and "
                "document_ids tensors) it was built from with cod_attention_metadata"
            )
        if (metadata.cross, metadata.window, metadata.sink) != (cross, window, sink):
            raise ValueError(
                f"metadata was built for another mode: cross={metadata.cross} window={metadata.window} "
                f"sink={metadata.sink}, called with cross={cross} window={window} sink={sink}"
            )
    ck = _dense(context_k) if cross else None
    cv = _dense(context_v) if cross else None
    out, _ = ops.cod_attention_fwd(
        _dense(q),
        _dense(k),
        _dense(v),
        ck,
        cv,
        metadata.ranges,
        metadata.chains,
        metadata.depth_offsets,
        float(scale),
        metadata.use_sink,
    )
    return out


def _dense(t: torch.Tensor) -> torch.Tensor:
    """Contiguous, and 16-byte aligned on CUDA (the kernels copy rows with 16-byte cp.async)."""
    t = t.contiguous()
    if t.is_cuda and t.data_ptr() % 16:
        t = t.clone()
    return t


# ---------------------------------------------------------------- validation
def _check_layout(layout):
    if not isinstance(layout, CodLayout):
        raise TypeError(f"layout must be a peagle_ext.cod.CodLayout, got {type(layout).__name__}")
    t = layout.num_tokens
    check_tensor("layout.anchor", layout.anchor, dim=1, dtypes=(torch.int32,), shape=(t,))
    check_tensor("layout.depth", layout.depth, dim=1, dtypes=(torch.int32,), shape=(t,))
    check_tensor("layout.document_ids", layout.document_ids, dim=1, dtypes=(torch.int32,))
    if layout.depth.device != layout.anchor.device or layout.document_ids.device != layout.anchor.device:
        raise ValueError("layout.anchor, layout.depth and layout.document_ids must be on one device")
    o = layout.depth_offsets
    if len(o) < 2 or o[0] != 0 or any(o[i] > o[i + 1] for i in range(len(o) - 1)):
        raise ValueError(f"layout.depth_offsets must be nondecreasing from 0, got {o}")


def _check_layout_contents(layout: CodLayout, cross: bool):
    """Layout invariants the kernels rely on for correct values (host sync: only with validate=True
    on CUDA; the CPU metadata op checks them itself)."""
    a, d, doc = layout.anchor.long(), layout.depth.long(), layout.document_ids.long()
    n = doc.shape[0]
    if a.numel():
        if int(a.min()) < 0 or int(a.max()) >= n:
            raise ValueError("layout.anchor must lie in [0, N)")
        o = layout.depth_offsets
        want = torch.repeat_interleave(
            torch.arange(len(o) - 1, device=a.device),
            torch.tensor([o[i + 1] - o[i] for i in range(len(o) - 1)], device=a.device),
        )
        if not torch.equal(d, want):
            raise ValueError("layout.depth must match layout.depth_offsets (depth-major order)")
        seg_start = torch.zeros_like(a, dtype=torch.bool)
        seg_start[torch.tensor(o[:-1], device=a.device).clamp(max=a.numel() - 1)] = True
        if bool(((a[1:] <= a[:-1]) & ~seg_start[1:]).any()):
            raise ValueError("layout.anchor must be strictly increasing within each depth")
        if not cross and not torch.equal(a[:n], torch.arange(n, device=a.device)):
            raise ValueError("layout: symmetric mode needs depth-0 anchors 0..N-1")
    _check_contiguous_documents(doc)


def _check_contiguous_documents(doc: torch.Tensor):
    real = doc[doc >= 0]
    if real.numel():
        runs = int((real[1:] != real[:-1]).sum()) + 1
        if runs != int(torch.unique(real).numel()):
            raise ValueError("layout.document_ids: each document must be one contiguous run of positions")


def _check_inputs(q, k, v, layout, context_k, context_v, cross):
    _check_layout(layout)
    check_tensor("q", q, dim=3)
    dev = q.device
    dtypes = _CUDA_DTYPES if dev.type == "cuda" else _CPU_DTYPES
    check_tensor("q", q, dtypes=dtypes)
    t, hq, dim = q.shape
    if t != layout.num_tokens:
        raise ValueError(f"q must have T={layout.num_tokens} rows (the layout's tokens), got shape {tuple(q.shape)}")
    check_tensor("k", k, dim=3, dtypes=(q.dtype,), device=dev)
    hkv = k.shape[1]
    check_tensor("k", k, shape=(t, None, dim))
    check_tensor("v", v, dim=3, dtypes=(q.dtype,), device=dev, shape=tuple(k.shape))
    if hkv < 1 or hq % hkv:
        raise ValueError(f"k: q heads ({hq}) must be a multiple of k/v heads ({hkv})")
    if dev.type == "cuda" and dim not in _CUDA_HEAD_DIMS:
        raise ValueError(f"q: head dim {dim} is not supported on CUDA (supported: {_CUDA_HEAD_DIMS})")
    if dim < 1:
        raise ValueError("q: head dim must be >= 1")
    if layout.device != dev:
        raise ValueError(f"layout must be on q's device ({dev}), got {layout.device}")
    if cross:
        if context_k is None or context_v is None:
            raise ValueError("context_k and context_v must be given together")
        n = layout.seq_len
        check_tensor("context_k", context_k, dim=3, dtypes=(q.dtype,), device=dev, shape=(n, hkv, dim))
        check_tensor("context_v", context_v, dim=3, dtypes=(q.dtype,), device=dev, shape=(n, hkv, dim))


# ---------------------------------------------------------------- fake impls + autograd
@torch.library.register_fake("peagle::cod_attention_metadata")
def _metadata_fake(anchor, depth, document_ids, depth_offsets, cross, window, sink):
    t, kk = anchor.shape[0], len(depth_offsets) - 1
    return anchor.new_empty((5, t)), anchor.new_empty((2, t, kk))


@torch.library.register_fake("peagle::cod_attention_fwd")
def _fwd_fake(q, k, v, context_k, context_v, ranges, chains, depth_offsets, scale, use_sink):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=lse_dtype)


@torch.library.register_fake("peagle::cod_attention_bwd")
def _bwd_fake(grad_out, q, k, v, context_k, context_v, out, lse, ranges, chains, depth_offsets, scale, use_sink):
    if context_k is None:
        ck = q.new_empty((0, k.shape[1], k.shape[2]))
        cv = q.new_empty((0, k.shape[1], k.shape[2]))
    else:
        ck, cv = torch.empty_like(context_k), torch.empty_like(context_v)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), ck, cv


def _setup_context(ctx, inputs, output):
    q, k, v, context_k, context_v, ranges, chains, depth_offsets, scale, use_sink = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, context_k, context_v, ranges, chains, out, lse)
    ctx.depth_offsets = depth_offsets
    ctx.scale = scale
    ctx.use_sink = use_sink


def _backward(ctx, grad_out, grad_lse):
    q, k, v, context_k, context_v, ranges, chains, out, lse = ctx.saved_tensors
    dq, dk, dv, dck, dcv = ops.cod_attention_bwd(
        _dense(grad_out),
        q,
        k,
        v,
        context_k,
        context_v,
        out,
        lse,
        ranges,
        chains,
        ctx.depth_offsets,
        ctx.scale,
        ctx.use_sink,
    )
    cross = context_k is not None
    return dq, dk, dv, (dck if cross else None), (dcv if cross else None), None, None, None, None, None


torch.library.register_autograd("peagle::cod_attention_fwd", _backward, setup_context=_setup_context)
