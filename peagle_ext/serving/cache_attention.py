"""The verifier's attention in decoding: a few query tokens at consecutive positions
p, p+1, ..., p+T-1 over one layer's KV cache [kv heads, capacity, head dim], query i seeing the
cache positions <= p + i (StaticVerifier; the cache holds every earlier position).

Two implementations of that one computation; StaticVerifier picks one per model (choose_impl):
- "sdpa": F.scaled_dot_product_attention over the whole capacity under the position mask. Any
  device and dtype; its shapes do not depend on how much of the cache is filled (CUDA graphs).
  On the H200 cuDNN runs it: ~10 us for one query token at any capacity, but its kernel for
  several query tokens walks the whole capacity in one block per head (17 us at capacity 512,
  39 us at 2048 for the 4 tokens of a K=3 round, SmolLM2's 9/3 heads x 64;
  bench/bench_verify_attention.py), so a round's 30 attention calls cost twice a greedy step's.
- "flash": FlashAttention-2's variable-length forward (torch.ops.aten._flash_attention_forward)
  with the filled length as a device tensor: it reads only the filled positions, GQA natively,
  causal aligned to the last key, which is the position mask for consecutive positions. CUDA,
  fp16/bf16, head dim <= 256 and a multiple of 8. Its grid depends on the capacity only, so a
  captured graph stays valid as the sequence grows.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

IMPLS = ("auto", "sdpa", "flash")


def flash_unsupported(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """None when the "flash" implementation can run these inputs, else why not."""
    if torch.device(device).type != "cuda":
        return f"it needs a CUDA device (the verifier is on {device})"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"it needs float16 or bfloat16 (the verifier is {dtype})"
    if head_dim > 256 or head_dim % 8:
        return f"it needs a head dim <= 256 and a multiple of 8 (got {head_dim})"
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return "this torch has no aten::_flash_attention_forward"
    return None


def attend_sdpa(q, k_cache, v_cache, allowed, scale: float):
    """q [heads, T, D], k/v_cache [kv heads, C, D], allowed bool [T, C] -> [heads, T, D]."""
    return F.scaled_dot_product_attention(
        q[None],
        k_cache[None],
        v_cache[None],
        attn_mask=allowed,
        scale=scale,
        enable_gqa=q.shape[0] != k_cache.shape[0],
    )[0]


def flash_lengths(pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The varlen offsets of one sequence of queries at consecutive positions `pos` [T] (device):
    int32 [0, T] for the queries and [0, pos[-1] + 1] for the keys, computed on the device (no
    host sync, so a CUDA graph captures it). Once per forward: every layer shares them."""
    t = pos.shape[0]
    cu_q = torch.arange(2, device=pos.device, dtype=torch.int32) * t
    cu_k = torch.arange(2, device=pos.device, dtype=torch.int32) * (pos[-1:] + 1).to(torch.int32)
    return cu_q, cu_k


def attend_flash(q, k_cache, v_cache, lengths, scale: float):
    """q [heads, T, D], k/v_cache [kv heads, C, D], lengths from flash_lengths -> [heads, T, D].
    The cache is passed as its [C, kv heads, D] view (row stride D, head stride C*D): no copy."""
    cu_q, cu_k = lengths
    t, cap = q.shape[1], k_cache.shape[1]
    out = torch.ops.aten._flash_attention_forward(
        q.transpose(0, 1),
        k_cache.transpose(0, 1),
        v_cache.transpose(0, 1),
        cu_q,
        cu_k,
        t,
        cap,
        0.0,
        True,
        False,
        scale=scale,
    )[0]
    return out.transpose(0, 1)


def choose_impl(requested: str, device, dtype, num_heads: int, kv_heads: int, head_dim: int) -> str:
    """ "sdpa" or "flash" for `requested` ("auto": flash where it runs and agrees with sdpa on a
    probe, else sdpa; "flash" where it cannot run: ValueError saying why)."""
    if requested not in IMPLS:
        raise ValueError(f"attention must be one of {', '.join(IMPLS)}, got {requested!r}")
    if requested == "sdpa":
        return "sdpa"
    why = flash_unsupported(device, dtype, head_dim)
    if why is None:
        why = _probe(torch.device(device), dtype, num_heads, kv_heads, head_dim)
    if why is None:
        return "flash"
    if requested == "flash":
        raise ValueError(f"attention='flash' cannot run this verifier: {why}")
    return "sdpa"


@functools.cache
def _probe(device: torch.device, dtype, num_heads: int, kv_heads: int, head_dim: int) -> str | None:
    """None when "flash" runs on this device and agrees with "sdpa" on a small random case (a
    torch built without FlashAttention, or an unsupported GPU, raises here rather than mid-decode)."""
    g = torch.Generator(device=device).manual_seed(0)
    cap, scale = 512, head_dim**-0.5
    k = torch.randn(kv_heads, cap, head_dim, device=device, generator=g).to(dtype)
    v = torch.randn(kv_heads, cap, head_dim, device=device, generator=g).to(dtype)
    # a greedy step (with GQA FlashAttention folds the query groups into rows and splits the keys;
    # the splits past the filled length exit early) and a round
    for t, start in ((1, 40), (4, 37)):
        q = torch.randn(num_heads, t, head_dim, device=device, generator=g).to(dtype)
        pos = torch.arange(start, start + t, device=device)
        allowed = torch.arange(cap, device=device)[None, :] <= pos[:, None]
        try:
            got = attend_flash(q, k, v, flash_lengths(pos), scale).float()
        except RuntimeError as e:
            return f"aten::_flash_attention_forward failed: {str(e).splitlines()[0][:200]}"
        want = attend_sdpa(q.float(), k.float(), v.float(), allowed, scale)
        err = float((got - want).abs().max())
        if not err < 0.05:
            return f"it disagrees with sdpa on a probe of {t} query tokens (max abs difference {err:.3g})"
        if device.type == "cuda":
            why = _replays_in_a_graph(q, k, v, pos, scale)
            if why is not None:
                return why
    return None


def _replays_in_a_graph(q, k, v, pos, scale: float) -> str | None:
    """None when attend_flash, captured in a CUDA graph, replays what it computes eagerly after
    the positions moved on (decoding's graphs rely on the length being read at replay)."""
    dev = q.device
    try:
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            attend_flash(q, k, v, flash_lengths(pos), scale)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = attend_flash(q, k, v, flash_lengths(pos), scale)
        pos.add_(100)
        graph.replay()
        want = attend_flash(q, k, v, flash_lengths(pos), scale)
        torch.cuda.synchronize(dev)
    except RuntimeError as e:
        return f"it failed in a CUDA graph: {str(e).splitlines()[0][:200]}"
    if not torch.equal(out, want):
        return "its CUDA-graph replay differs from its eager result"
    return None
