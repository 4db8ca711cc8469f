"""Chunked fused linear-KL loss: draft vs verifier distributions without [T, V] logits.

docs/design.md section 4. `fused_linear_kl` computes, per token t,
    KL(p_t || q_t),  p_t = softmax(target_hidden[s_t] @ target_head.T)  (restricted to the
                            draft vocab through d2t and renormalised there; s_t =
                            target_index[t], or t without an index)
                     q_t = softmax(draft_hidden[t] @ draft_head.T)
and returns sum_t weight[t] * KL_t / sum_t weight[t] with per-depth argmax-agreement counts.

How: the rows of weight 0 are dropped, the others grouped by target row and cut into chunks.
Per chunk, cuBLAS / CPU-BLAS GEMMs write the target logits of its distinct target rows and the
draft logits of its draft rows into two preallocated buffers of at most [chunk rows, Vd] (the
only vocab-sized memory the op holds); a target kernel computes each target row's softmax
statistics once, a draft row kernel the draft softmax, the loss, both argmaxes and overwrites
the draft logits with the logit gradient, and two more GEMMs fold that chunk's gradient into
grad_hidden[rows] and grad_head. The gradients are thus complete when the forward returns
(Liger-Kernel style); backward only scales them by the incoming gradient. Many draft rows that
share one target row (P-EAGLE's depths at one position) cost one target GEMM row and one
target softmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._checks import check_int, check_tensor
from .._native import ops  # noqa: F401  (loads the native library: registers peagle::fused_linear_kl)

__all__ = ["fused_linear_kl", "chunk_plan", "ChunkPlan", "AUTO_CHUNK_BYTES"]

# "auto" chunks: the rows of one [rows, Vd] logit buffer (one side) fit in this many bytes.
# Two such buffers exist during the op. 512 MiB keeps the head-gradient GEMM (whose inner
# dimension is the chunk's row count) compute bound on an H200 at V = 152K (~1.6K rows)
# while two buffers stay at 1 GiB.
AUTO_CHUNK_BYTES = 512 * 2**20
# auto chunks are a multiple of this many rows (GEMM tile friendly) when they hold more
_ROW_ALIGN = 128

_FLOAT_TYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INT_TYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
_WEIGHT_TYPES = _FLOAT_TYPES + _INT_TYPES + (torch.bool,)
_KINDS = ("kl", "ce")


@dataclass(frozen=True)
class ChunkPlan:
    """How the op splits T tokens: `num_chunks` chunks of at most `rows_per_chunk` rows.

    bytes_per_chunk is one [rows_per_chunk, vocab] logit buffer of one side; the op holds
    exactly two (draft and target) and no other vocab-sized tensor.
    """

    num_tokens: int
    vocab: int
    rows_per_chunk: int
    num_chunks: int
    bytes_per_chunk: int

    @property
    def logit_bytes(self) -> int:
        """Bytes of logits alive at any time (both sides)."""
        return 2 * self.bytes_per_chunk


def chunk_plan(num_tokens: int, vocab: int, dtype: torch.dtype, chunk_size="auto") -> ChunkPlan:
    """The chunking `fused_linear_kl` uses for `num_tokens` rows over a `vocab`-wide draft vocab.

    chunk_size: "auto" or None (rows such that one [rows, vocab] buffer of `dtype` is at most
    AUTO_CHUNK_BYTES, rounded down to a multiple of 128 rows when above it), or an int number
    of rows. Chunk boundaries need not align with anything.
    """
    check_int("num_tokens", num_tokens, lo=0)
    check_int("vocab", vocab, lo=1)
    if dtype not in _FLOAT_TYPES:
        raise TypeError(f"dtype must be one of float16, bfloat16, float32, float64, got {dtype}")
    elem = torch.empty((), dtype=dtype).element_size()
    if chunk_size is None or (isinstance(chunk_size, str) and chunk_size == "auto"):
        rows = max(1, AUTO_CHUNK_BYTES // (vocab * elem))
        if rows > _ROW_ALIGN:
            rows -= rows % _ROW_ALIGN
    elif isinstance(chunk_size, int) and not isinstance(chunk_size, bool):
        check_int("chunk_size", chunk_size, lo=1)
        rows = chunk_size
    else:
        raise TypeError(f"chunk_size must be 'auto', None or a positive int, got {chunk_size!r}")
    rows = max(1, min(rows, num_tokens))
    num_chunks = math.ceil(num_tokens / rows) if num_tokens else 0
    return ChunkPlan(num_tokens, vocab, rows, num_chunks, rows * vocab * elem)


def _check_inputs(
    draft_hidden, draft_head, target_hidden, target_head, weight, depth, num_depths, d2t, target_index, kind, validate
):
    check_tensor("draft_hidden", draft_hidden, dim=2, dtypes=_FLOAT_TYPES)
    dtype, device = draft_hidden.dtype, draft_hidden.device
    t, h = draft_hidden.shape
    check_tensor("draft_head", draft_head, dim=2, dtypes=_FLOAT_TYPES)
    check_tensor("target_hidden", target_hidden, dim=2, dtypes=_FLOAT_TYPES)
    check_tensor("target_head", target_head, dim=2, dtypes=_FLOAT_TYPES)
    for name, x in (("draft_head", draft_head), ("target_hidden", target_hidden), ("target_head", target_head)):
        if x.dtype != dtype:
            raise TypeError(
                f"{name} must have the dtype of draft_hidden ({str(dtype).replace('torch.', '')}), "
                f"got {str(x.dtype).replace('torch.', '')}"
            )
        if x.device != device:
            raise ValueError(f"{name} must be on draft_hidden's device ({device}), got {x.device}")
    if device.type == "cuda" and dtype == torch.float64:
        raise TypeError("draft_hidden: float64 is not supported on CUDA; use float32, float16 or bfloat16")
    if draft_head.shape[1] != h:
        raise ValueError(f"draft_head must have shape (Vd, {h}) (H of draft_hidden), got {tuple(draft_head.shape)}")
    m = target_hidden.shape[0]
    if target_index is None and m != t:
        raise ValueError(
            f"target_hidden must have {t} rows (T of draft_hidden) when no target_index is given, "
            f"got shape {tuple(target_hidden.shape)}"
        )
    if target_index is not None:
        check_tensor("target_index", target_index, dim=1, dtypes=_INT_TYPES, shape=(t,))
        if target_index.device != device:
            raise ValueError(f"target_index must be on draft_hidden's device ({device}), got {target_index.device}")
    ht = target_hidden.shape[1]
    if target_head.shape[1] != ht:
        raise ValueError(f"target_head must have shape (V, {ht}) (H of target_hidden), got {tuple(target_head.shape)}")
    vd, v = draft_head.shape[0], target_head.shape[0]
    if vd < 1:
        raise ValueError("draft_head must have at least one row (the draft vocab is empty)")
    if vd > v:
        raise ValueError(
            f"draft_head has more rows ({vd}) than target_head ({v}): the draft vocab must be a "
            f"subset of the target vocab"
        )
    check_tensor("weight", weight, dim=1, dtypes=_WEIGHT_TYPES, shape=(t,))
    check_tensor("depth", depth, dim=1, dtypes=_INT_TYPES, shape=(t,))
    check_int("num_depths", num_depths, lo=1, hi=2**30)
    for name, x in (("weight", weight), ("depth", depth)):
        if x.device != device:
            raise ValueError(f"{name} must be on draft_hidden's device ({device}), got {x.device}")
    if kind not in _KINDS:
        raise ValueError(f"kind must be 'kl' or 'ce', got {kind!r}")
    if d2t is None:
        if vd != v:
            raise ValueError(
                f"d2t is required when the draft vocab ({vd}) is smaller than the target vocab ({v}): "
                f"draft id i corresponds to target id i + d2t[i]"
            )
    else:
        check_tensor("d2t", d2t, dim=1, dtypes=(torch.int32, torch.int64), shape=(vd,))
        if d2t.device != device:
            raise ValueError(f"d2t must be on draft_hidden's device ({device}), got {d2t.device}")
    if not validate:
        return
    # Value checks, gathered into one host sync; the messages below are built only on failure.
    flags = []
    if t:
        wf = weight if weight.dtype.is_floating_point else None
        flags += [
            (~torch.isfinite(wf)).any() if wf is not None else torch.zeros((), dtype=torch.bool, device=device),
            (weight < 0).any(),
            depth.min().long() < 0,
            depth.max().long() >= num_depths,
        ]
        if target_index is not None:
            flags += [target_index.min().long() < 0, target_index.max().long() >= m]
    if d2t is not None:
        ids = torch.arange(vd, device=device, dtype=torch.int64) + d2t.to(torch.int64)
        sorted_ids = ids.sort().values
        flags += [(ids < 0).any() | (ids >= v).any(), (sorted_ids[1:] == sorted_ids[:-1]).any()]
    if not flags or not any(torch.stack(flags).tolist()):
        return
    if t:
        if wf is not None and not bool(torch.isfinite(wf).all()):
            raise ValueError("weight must be finite (found NaN or inf)")
        if bool((weight < 0).any()):
            raise ValueError(f"weight must be >= 0, got min {float(weight.min())}")
        dmin, dmax = int(depth.min()), int(depth.max())
        if dmin < 0 or dmax >= num_depths:
            raise ValueError(f"depth must lie in [0, num_depths={num_depths}), got values in [{dmin}, {dmax}]")
        if target_index is not None:
            imin, imax = int(target_index.min()), int(target_index.max())
            if imin < 0 or imax >= m:
                raise ValueError(
                    f"target_index must lie in [0, {m}) (the rows of target_hidden), got values in [{imin}, {imax}]"
                )
    if d2t is None:  # pragma: no cover - a flag above was raised by one of the checks just made
        raise AssertionError("inconsistent value checks")
    bad = torch.nonzero((ids < 0) | (ids >= v))
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(
            f"d2t maps draft id {i} to target id {int(ids[i])}, outside [0, {v}) (draft id i -> target id i + d2t[i])"
        )
    raise ValueError("d2t maps two draft ids to the same target id (i + d2t[i] must be distinct)")


class _FusedLinearKL(torch.autograd.Function):
    """Autograd over peagle::fused_linear_kl: the forward op already returns d loss / d draft_hidden
    and d loss / d draft_head; backward scales them by the incoming gradient. Target side: no grad."""

    @staticmethod
    def forward(
        ctx,
        draft_hidden,
        draft_head,
        target_hidden,
        target_head,
        weight,
        depth,
        d2t,
        target_index,
        num_depths,
        chunk_rows,
        kind,
        need_grad_hidden,
        need_grad_head,
    ):
        loss, correct, total, grad_hidden, grad_head = torch.ops.peagle.fused_linear_kl(
            draft_hidden,
            draft_head,
            target_hidden,
            target_head,
            weight,
            depth,
            d2t,
            target_index,
            num_depths,
            chunk_rows,
            kind,
            need_grad_hidden,
            need_grad_head,
        )
        ctx.save_for_backward(grad_hidden, grad_head)
        ctx.need_grads = (need_grad_hidden, need_grad_head)
        ctx.mark_non_differentiable(correct, total)
        return loss, correct, total

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct, _grad_total):
        grad_hidden, grad_head = ctx.saved_tensors
        need_hidden, need_head = ctx.need_grads
        # Out of place: the saved gradients stay valid for a second backward (retain_graph).
        # (a 0-dim grad_loss keeps the gradients' dtype; the product is formed in fp32)
        gh = grad_hidden * grad_loss if need_hidden else None
        gw = grad_head * grad_loss if need_head else None
        return gh, gw, None, None, None, None, None, None, None, None, None, None, None


def fused_linear_kl(
    draft_hidden: torch.Tensor,
    draft_head: torch.Tensor,
    target_hidden: torch.Tensor,
    target_head: torch.Tensor,
    weight: torch.Tensor,
    depth: torch.Tensor,
    *,
    num_depths: int,
    d2t: torch.Tensor | None = None,
    target_index: torch.Tensor | None = None,
    chunk_size="auto",
    kind: str = "kl",
    validate: bool = True,
):
    """Weighted mean KL(target || draft) (or CE to the target argmax) without [T, V] logits.

    draft_hidden [T, H] (already normed), draft_head [Vd, H], target_hidden [M, Ht] (already
    normed), target_head [V, Ht]; all of one dtype (bf16/fp16/fp32; fp64 on CPU) and device.
    target_index [T] int in [0, M): the target row of each draft row (e.g. each draft token's
    position); None means target row t for draft row t (M == T). Each distinct target row of a
    row of weight > 0 is computed once, however many draft rows share it.
    weight [T] (>= 0, e.g. the loss mask at each token's position), depth [T] in [0, num_depths).
    Rows of weight 0 are not computed (no GEMM row, no row kernel) and get a zero gradient.
    d2t [Vd] int: draft id i is target id i + d2t[i] (speculators / vLLM); required when
    Vd < V. The target distribution is the softmax over those Vd target logits.
    kind: "kl" = sum_t w_t KL(p_t || q_t) / sum_t w_t; "ce" = same with -log q_t[argmax p_t].
    The loss is 0 (not NaN) when the weights sum to 0.
    chunk_size: "auto"/None or rows per chunk (see `chunk_plan`).
    validate: check value ranges (weight finite and >= 0, depth range, target_index range, d2t
    range and injectivity); each check is a host sync. Shapes, dtypes and devices are always
    checked, and the native op checks the target index of every row it computes (it syncs
    once anyway, to plan its chunks).

    Returns (loss, {"correct": int64[K], "total": int64[K]}): total[d] counts tokens of depth d
    with weight > 0, correct[d] those among them whose draft argmax equals the target argmax
    (both over the draft vocab; first index on ties). loss is a 0-dim float32 tensor (float64
    for float64 inputs). Gradients flow to draft_hidden and draft_head only.
    """
    _check_inputs(
        draft_hidden,
        draft_head,
        target_hidden,
        target_head,
        weight,
        depth,
        num_depths,
        d2t,
        target_index,
        kind,
        validate,
    )
    dtype = draft_hidden.dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    plan = chunk_plan(draft_hidden.shape[0], draft_head.shape[0], dtype, chunk_size)
    args = (
        draft_hidden.contiguous(),
        draft_head.contiguous(),
        target_hidden.detach().contiguous(),
        target_head.detach().contiguous(),
        weight.detach().to(acc).contiguous(),
        depth.detach().to(torch.int32).contiguous(),
        None if d2t is None else d2t.detach().to(torch.int64).contiguous(),
        None if target_index is None else target_index.detach().to(torch.int64).contiguous(),
        num_depths,
        plan.rows_per_chunk,
        kind,
    )
    grad_on = torch.is_grad_enabled()
    need_hidden = grad_on and draft_hidden.requires_grad
    need_head = grad_on and draft_head.requires_grad
    if need_hidden or need_head:
        loss, correct, total = _FusedLinearKL.apply(*args, need_hidden, need_head)
    else:
        loss, correct, total, _, _ = torch.ops.peagle.fused_linear_kl(*args, False, False)
    return loss, {"correct": correct, "total": total}


@torch.library.register_fake("peagle::fused_linear_kl")
def _fused_linear_kl_fake(
    draft_hidden,
    draft_head,
    target_hidden,
    target_head,
    weight,
    depth,
    d2t,
    target_index,
    num_depths,
    chunk_rows,
    kind,
    compute_grad_hidden,
    compute_grad_head,
):
    acc = torch.float64 if draft_hidden.dtype == torch.float64 else torch.float32
    loss = draft_hidden.new_empty((), dtype=acc)
    correct = draft_hidden.new_empty((num_depths,), dtype=torch.int64)
    total = draft_hidden.new_empty((num_depths,), dtype=torch.int64)
    grad_hidden = torch.empty_like(draft_hidden) if compute_grad_hidden else draft_hidden.new_empty((0,))
    grad_head = torch.empty_like(draft_head) if compute_grad_head else draft_head.new_empty((0,))
    return loss, correct, total, grad_hidden, grad_head
