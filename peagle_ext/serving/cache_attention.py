"""Attention over a KV cache in decoding, in two shapes:
- the verifier's (StaticVerifier): a few query tokens at consecutive positions p, p+1, ...,
  p+T-1 over one layer's cache [kv heads, capacity, head dim], query i seeing the cache
  positions <= p + i (the cache holds every earlier position); the drafter's rows
  (serving/drafter.py) the same way, at any positions;
- batched generation's (serving/batch_generation.py, `peagle datagen`): one query token per row
  over a batch of caches [rows, kv heads, capacity, head dim], row r seeing its first used[r]
  positions.

Two implementations of each, and a third for the verifier's shape; choose_impl picks one per
model (the one heuristics place):
- "sdpa": F.scaled_dot_product_attention over the whole capacity under the position mask. Any
  device and dtype; its shapes do not depend on how much of the cache is filled (CUDA graphs).
  On the H200 cuDNN runs it: ~6 us a layer for one query token inside a greedy step's CUDA graph;
  for several query tokens its kernel walks the whole capacity in one block per head (17 us at
  capacity 512, 39 us at 2048 for a K=3 round's 4 tokens, SmolLM2's 9/3 heads x 64;
  bench/bench_verify_attention.py). Over a batch of rows under a per-row mask cuDNN runs the same
  prefill-tiled kernel per (row, kv head): ~360 us a layer for 256 rows of ~1,900 positions, 58%
  of a datagen step (bench/bench_datagen.py --profile).
- "flash": FlashAttention-2's variable-length forward (torch.ops.aten._flash_attention_forward)
  with one query token per sequence and each sequence's used key count as a device tensor
  (seqused_k): it reads only the filled positions, GQA natively, and with one query per sequence
  FlashAttention folds a K/V head's query heads into one tile and splits the keys across blocks,
  its decode path. Batched generation's rows are such sequences over their own caches; the
  verifier's T query tokens are T sequences over the one cache, all starting at its position 0,
  query i seeing p + i + 1 positions. CUDA, fp16/bf16, head dim <= 256 and a multiple of 8. Its
  grid depends on the capacity only, so a captured graph stays valid as the sequences grow.
- "peagle": this project's decode-attention op (ops/decode_attention.py, csrc/decode_attention)
  over the same sequences as "flash": one memset and one kernel per layer for all of a round's
  query tokens, where FlashAttention's varlen path takes five launches (its GQA decode layout
  copies q in and out, then split-KV and combine kernels). Like FlashAttention's decode path it
  splits each run of keys across blocks, but it reads a KV head's keys once for all of its query
  heads, and the last block of a (token, KV head) combines the splits. The verifier's rounds and
  the drafter's rows; CPU and CUDA (float16/bfloat16, head dim 64 or 128, at most 8 query heads
  per kv head).

What "auto" picks (auto_candidates): for the verifier's rounds and the drafter's rows on CUDA,
peagle where it runs and agrees with sdpa on a probe, else flash on the same terms, else sdpa;
for batched generation's rows and on the CPU, flash or sdpa. A greedy step's one token and a
prefill always take sdpa. Measured on an H100 inside decoding's CUDA graphs (SmolLM2 shape, K=3;
bench/bench_verify_attention.py), a round's attention in us and its device time in greedy steps:

  capacity, from position   peagle        flash         sdpa (cuDNN)
  512, from 136             238 / 1.12    324 / 1.21    328 / 1.18
  1024, from 512            264 / 1.13    339 / 1.23    558 / 1.29
  2048, from 1536           372 / 1.17    373 / 1.23    1,014 / 1.46

A greedy step's attention is ~180-210 us with cuDNN. A round as one causal sequence through
FlashAttention costs 1,185 us at 2048 (H200), since FlashAttention splits the keys only for one
query per sequence. Batched generation's rows: 15,249 new tokens/s with flash against 13,190
with sdpa (batch 256, prompts of 1,024-1,792 tokens; bench/bench_datagen.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

IMPLS = ("auto", "sdpa", "flash", "peagle")
VARLEN_IMPLS = ("flash", "peagle")  # the implementations that attend one sequence per query token


def flash_unsupported(device: torch.device, dtype: torch.dtype, head_dim: int, model: str = "verifier") -> str | None:
    """None when the "flash" implementation can run these inputs, else why not (naming `model`)."""
    if torch.device(device).type != "cuda":
        return f"it needs a CUDA device (the {model} is on {device})"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"it needs float16 or bfloat16 (the {model} is {dtype})"
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


ROUND_TOKENS_MAX = 16  # the verifier's flash attends 2..this many query tokens (a round's K + 1)


def _flash_varlen(q, k, v, cu_q, cu_k, max_k: int, scale: float, seqused_k):
    """aten::_flash_attention_forward with one query per sequence (non-causal, no dropout):
    q [sequences, heads, D] with cu_q = 0, 1, ..., k/v [total_k, kv heads, D]; sequence b's
    query attends the seqused_k[b] rows of k from cu_k[b]. The one call site of the kernel (tests
    stand in for it here with its plain-PyTorch semantics)."""
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, 1, max_k, 0.0, False, False, scale=scale, seqused_k=seqused_k
    )[0]


def _peagle_varlen(q, k, v, key_start, scale: float, used):
    """ops.decode_attention over the same sequences as _flash_varlen: q [sequences, heads, D],
    sequence b's query attends the used[b] rows of k from key_start[b]."""
    from ..ops.decode_attention import decode_attention

    return decode_attention(q, k, v, key_start, used, scale)


def attend_varlen(impl: str, q, k, v, lengths, max_k: int, scale: float):
    """One query per sequence through `impl` ("flash" or "peagle"): q [sequences, heads, D],
    k/v [rows, kv heads, D] views, lengths = (cu_q, cu_k, used) with cu_k[b] the first key row
    of sequence b. The one dispatch between the two kernels."""
    cu_q, cu_k, used = lengths
    if impl == "peagle":
        return _peagle_varlen(q, k, v, cu_k[: q.shape[0]], scale, used)
    return _flash_varlen(q, k, v, cu_q, cu_k, max_k, scale, used)


def flash_lengths(pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The varlen arguments of query tokens at consecutive positions `pos` [T] (device), one
    sequence per token over the verifier's cache: int32 [0, 1, ..., T] for the queries, [T + 1]
    zeros for the keys (every sequence reads the cache from its position 0) and pos + 1 used
    keys each. Computed on the device (no host sync, so a CUDA graph captures it), once per
    forward: every layer shares them."""
    t = pos.shape[0]
    cu_q = torch.arange(t + 1, device=pos.device, dtype=torch.int32)
    cu_k = torch.zeros(t + 1, device=pos.device, dtype=torch.int32)
    return cu_q, cu_k, (pos + 1).to(torch.int32)


def attend_cache_varlen(q, k_cache, v_cache, lengths, scale: float, impl: str = "flash"):
    """q [heads, T, D], k/v_cache [kv heads, C, D], lengths from flash_lengths -> [heads, T, D],
    through `impl` ("flash", or "peagle" over the same sequences). The cache is passed as its
    [C, kv heads, D] view (row stride D, head stride C*D): no copy."""
    k, v = k_cache.transpose(0, 1), v_cache.transpose(0, 1)
    return attend_varlen(impl, q.transpose(0, 1), k, v, lengths, k.shape[0], scale).transpose(0, 1)


def attend_rows_sdpa(q, k_cache, v_cache, allowed, scale: float):
    """q [rows, heads, D] (one query token per row), k/v_cache [rows, kv heads, C, D], allowed
    bool [rows, C] -> [rows, heads, D]. The query heads that share a K/V head enter attention as
    that head's query rows (they sit at one position), so no K/V head is repeated."""
    b, heads, d = q.shape
    kv = k_cache.shape[1]
    out = F.scaled_dot_product_attention(
        q.reshape(b, kv, heads // kv, d), k_cache, v_cache, attn_mask=allowed[:, None, None, :], scale=scale
    )
    return out.reshape(b, heads, d)


def rows_varlen_view(cache: torch.Tensor, rows: int) -> torch.Tensor:
    """The first `rows` rows of a batch cache [rows', kv heads, C, D] (contiguous) in
    FlashAttention's variable-length key layout: a view [(rows - 1) * kv heads * C + C, kv heads,
    D] with row stride D and head stride C * D, in which row r's positions start at offset
    r * kv heads * C (rows_offsets). No copy: the view addresses exactly the cache's elements."""
    if not cache.is_contiguous():
        raise ValueError("the batch cache must be contiguous")
    _, kv, cap, d = cache.shape
    return cache.as_strided(((rows - 1) * kv * cap + cap, kv, d), (d, cap * d, 1), cache.storage_offset())


def rows_offsets(rows: int, kv_heads: int, capacity: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The varlen offsets of one query per row over rows_varlen_view: int32 [rows + 1] for the
    queries (0, 1, ..., rows) and for the keys (r * kv heads * capacity). Shared by every layer."""
    ar = torch.arange(rows + 1, device=device, dtype=torch.int32)
    return ar, ar * (kv_heads * capacity)


def attend_rows_flash(q, k_cache, v_cache, offsets, used, scale: float):
    """q [rows, heads, D] (one query token per row), k/v_cache [rows', kv heads, C, D] with
    rows' >= rows (contiguous), offsets from rows_offsets, used int32 [rows]: row r attends its
    positions 0..used[r]-1 -> [rows, heads, D]."""
    b, cap = q.shape[0], k_cache.shape[2]
    cu_q, cu_k = offsets
    return _flash_varlen(q, rows_varlen_view(k_cache, b), rows_varlen_view(v_cache, b), cu_q, cu_k, cap, scale, used)


def auto_candidates(device, rows: bool = False) -> tuple[str, ...]:
    """What "auto" tries, in this order, before falling back to sdpa: on CUDA the verifier's and
    the drafter's rounds go to peagle first (module docstring: the least device time per round),
    then flash; batched generation's rows and every other device try flash only (peagle has no
    rows shape, and its CPU path is a plain reference loop, not a fast path)."""
    if rows or torch.device(device).type != "cuda":
        return ("flash",)
    return ("peagle", "flash")


def choose_impl(
    requested: str,
    device,
    dtype,
    num_heads: int,
    kv_heads: int,
    head_dim: int,
    *,
    rows: bool = False,
    what: str | None = None,
) -> str:
    """ "sdpa", "flash" or "peagle" for `requested`: the verifier's cache attention (the drafter's
    has the same semantics: its rows' positions need not be consecutive), or with rows=True
    batched generation's (module docstring; no "peagle" there). "auto": the first of
    auto_candidates() that runs and agrees with sdpa on a probe, else sdpa. "flash" or "peagle"
    where it cannot run or its probe disagrees: ValueError saying why. what: the model the
    messages name ("verifier", "drafter"; batched generation's by default with rows=True)."""
    if requested not in IMPLS:
        raise ValueError(f"attention must be one of {', '.join(IMPLS)}, got {requested!r}")
    what = what or ("batched generation" if rows else "verifier")
    if requested == "sdpa":
        return "sdpa"
    if requested == "peagle" and rows:
        raise ValueError(f"attention='peagle' cannot run this {what}: it serves decoding (auto, sdpa or flash)")
    for impl in auto_candidates(device, rows) if requested == "auto" else (requested,):
        why = _unsupported(impl, device, dtype, num_heads, kv_heads, head_dim, rows, what)
        if why is None:
            return impl
        if requested != "auto":
            raise ValueError(f"attention={requested!r} cannot run this {what}: {why}")
    return "sdpa"


def _unsupported(impl, device, dtype, num_heads, kv_heads, head_dim, rows, what) -> str | None:
    """None when `impl` ("flash" or "peagle") can run these inputs and its probe agrees with
    sdpa, else why not."""
    device = torch.device(device)
    if impl == "peagle":
        from ..ops.decode_attention import decode_attention_unsupported

        why = decode_attention_unsupported(device, dtype, num_heads, kv_heads, head_dim)
        return why if why is not None else _probe(device, dtype, num_heads, kv_heads, head_dim, "peagle")
    why = flash_unsupported(device, dtype, head_dim, what)
    if why is None:
        why = (_probe_rows if rows else _probe)(device, dtype, num_heads, kv_heads, head_dim)
    return why


@functools.cache
def _probe(
    device: torch.device, dtype, num_heads: int, kv_heads: int, head_dim: int, impl: str = "flash"
) -> str | None:
    """None when `impl` ("flash" or "peagle") runs on this device and agrees with "sdpa" on a
    small random case (a torch built without FlashAttention, or an unsupported GPU, raises here
    rather than mid-decode)."""
    kernel = "aten::_flash_attention_forward" if impl == "flash" else "peagle::decode_attention"
    g = torch.Generator(device=device).manual_seed(0)
    cap, scale = 512, head_dim**-0.5
    k = torch.randn(kv_heads, cap, head_dim, device=device, generator=g).to(dtype)
    v = torch.randn(kv_heads, cap, head_dim, device=device, generator=g).to(dtype)
    # rounds of K = 1 and K = 8 (the splits past a sequence's used keys exit early)
    for t, start in ((2, 40), (9, 37)):
        q = torch.randn(num_heads, t, head_dim, device=device, generator=g).to(dtype)
        pos = torch.arange(start, start + t, device=device)
        allowed = torch.arange(cap, device=device)[None, :] <= pos[:, None]
        try:
            got = attend_cache_varlen(q, k, v, flash_lengths(pos), scale, impl).float()
        except RuntimeError as e:
            return f"{kernel} failed: {str(e).splitlines()[0][:200]}"
        want = attend_sdpa(q.float(), k.float(), v.float(), allowed, scale)
        err = float((got - want).abs().max())
        if not err < 0.05:
            return f"it disagrees with sdpa on a probe of {t} query tokens (max abs difference {err:.3g})"
        if device.type == "cuda":
            run = functools.partial(_attend_varlen_at, q, k, v, pos, scale, impl)
            why = _replays_in_a_graph(run, functools.partial(pos.add_, 100), device)
            if why is not None:
                return why
    return None


def _attend_varlen_at(q, k_cache, v_cache, pos, scale: float, impl: str = "flash"):
    """attend_cache_varlen with its lengths computed from `pos` on every call (as a captured forward does)."""
    return attend_cache_varlen(q, k_cache, v_cache, flash_lengths(pos), scale, impl)


def _replays_in_a_graph(fn, advance, device) -> str | None:
    """None when fn(), captured in a CUDA graph, replays what it computes eagerly after advance()
    moved its lengths on in place (decoding's graphs rely on the lengths being read at replay)."""
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        advance()
        graph.replay()
        want = fn()
        torch.cuda.synchronize(device)
    except RuntimeError as e:
        return f"it failed in a CUDA graph: {str(e).splitlines()[0][:200]}"
    if not torch.equal(out, want):
        return "its CUDA-graph replay differs from its eager result"
    return None


@functools.cache
def _probe_rows(device: torch.device, dtype, num_heads: int, kv_heads: int, head_dim: int) -> str | None:
    """None when attend_rows_flash runs on this device, agrees with attend_rows_sdpa on a small
    random batch (rows of one position, of the whole capacity and between) over a cache with more
    rows than the batch, and, on CUDA, replays from a graph what it computes eagerly after the
    lengths moved on."""
    g = torch.Generator(device=device).manual_seed(0)
    rows, cap, scale = 5, 256, head_dim**-0.5
    k = torch.randn(rows + 2, kv_heads, cap, head_dim, device=device, generator=g).to(dtype)
    v = torch.randn(rows + 2, kv_heads, cap, head_dim, device=device, generator=g).to(dtype)
    q = torch.randn(rows, num_heads, head_dim, device=device, generator=g).to(dtype)
    used = torch.tensor([1, 40, 129, 200, cap], device=device, dtype=torch.int32)
    offsets = rows_offsets(rows, kv_heads, cap, device)
    try:
        got = attend_rows_flash(q, k, v, offsets, used, scale).float()
    except RuntimeError as e:
        return f"aten::_flash_attention_forward failed: {str(e).splitlines()[0][:200]}"
    allowed = torch.arange(cap, device=device)[None, :] < used[:, None]
    want = attend_rows_sdpa(q.float(), k[:rows].float(), v[:rows].float(), allowed, scale)
    err = float((got - want).abs().max())
    if not err < 0.05:
        return f"it disagrees with sdpa on a probe of {rows} rows (max abs difference {err:.3g})"
    if device.type != "cuda":
        return None
    return _replays_in_a_graph(
        lambda: attend_rows_flash(q, k, v, offsets, used, scale),
        lambda: used.copy_(torch.tensor([7, 1, cap, 130, 64], device=device, dtype=torch.int32)),
        device,
    )
