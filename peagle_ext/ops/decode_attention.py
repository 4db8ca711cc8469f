"""Decode attention over a KV cache (csrc/decode_attention): a few query tokens, each attending
its own run of key rows, in one op (on CUDA one kernel, after a memset where the runs are split
across blocks). Decoding's verify rounds and drafter rows
use it through serving/cache_attention.py (attention "peagle"); it is inference only (no
autograd).

`decode_attention(q, k, v, key_start, key_count, scale)`: q [T, Hq, D], k/v [S, Hkv, D] (the
last dim contiguous; any other strides, so a cache's [C, kv heads, D] view is passed without a
copy); query t, head h attends key rows key_start[t] .. key_start[t] + key_count[t] - 1 of kv
head h // (Hq // Hkv), softmax(scale * q k) v. A run of no keys gives 0. Returns [T, Hq, D]
contiguous in q's dtype. The CPU op checks the runs against S; the CUDA op (float16/bfloat16,
head dim 64 or 128, Hq / Hkv <= 8) reads them on the device, clamped to S, with no host sync
(so a CUDA graph captures it and reads the runs at every replay).
"""

from __future__ import annotations

import torch

from .._checks import check_tensor
from .._native import has_cuda_kernels, ops

CUDA_HEAD_DIMS = (64, 128)
CUDA_MAX_GROUP = 8  # query heads per kv head in the CUDA kernel


def decode_attention_unsupported(
    device, dtype: torch.dtype, num_heads: int, kv_heads: int, head_dim: int
) -> str | None:
    """None when decode_attention runs these inputs on `device`, else why not."""
    device = torch.device(device)
    if kv_heads <= 0 or num_heads % kv_heads:
        return f"its query heads ({num_heads}) must be a multiple of its kv heads ({kv_heads})"
    if device.type == "cpu":
        return None if dtype.is_floating_point else f"it needs a floating dtype (got {dtype})"
    if device.type != "cuda":
        return f"it runs on the CPU and CUDA (got {device})"
    if not has_cuda_kernels():
        return "this build of peagle_ext has no CUDA kernels"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"on CUDA it needs float16 or bfloat16 (got {dtype})"
    if head_dim not in CUDA_HEAD_DIMS:
        return f"on CUDA it needs a head dim of 64 or 128 (got {head_dim})"
    if num_heads // kv_heads > CUDA_MAX_GROUP:
        return f"on CUDA at most {CUDA_MAX_GROUP} query heads may share a kv head (got {num_heads // kv_heads})"
    return None


def decode_attention(q, k, v, key_start, key_count, scale: float) -> torch.Tensor:
    """See the module docstring. key_start, key_count: int32 [T] on q's device."""
    check_tensor("q", q, dim=3)
    check_tensor("k", k, dim=3)
    check_tensor("v", v, dim=3, shape=tuple(k.shape))
    t = q.shape[0]
    check_tensor("key_start", key_start, dtypes=(torch.int32,), shape=(t,))
    check_tensor("key_count", key_count, dtypes=(torch.int32,), shape=(t,))
    return ops.decode_attention(q, k, v, key_start, key_count, float(scale))


@torch.library.register_fake("peagle::decode_attention")
def _decode_attention_fake(q, k, v, key_start, key_count, scale):
    return q.new_empty(q.shape)
