"""COD attention vs the dense-mask SDPA reference (peagle_ext.reference), CPU and CUDA.

CPU: forward and every gradient in float64 against reference_cod_attention (tight), float32 /
bf16 loosely. CUDA (skipped without a GPU): bf16/fp16 kernels against the float64 reference with
relative L2 error <= 1e-2 on out, dq, dk, dv (+ context grads), for symmetric and cross layouts,
windows, sinks, GQA 1/4/8, D 64/128, odd sizes; determinism; CUDA-graph capture; large N spot
checks; metadata equal on both devices; the non-default forward CTA shapes
(PEAGLE_ATTN_FWD_MF / PEAGLE_ATTN_FWD_WARPS) on a subset of those cases and against the default
shape; the opt-in atomic-dQ backward (PEAGLE_ATTN_BWD=atomic) on a subset of the reference
scenarios, tiny / padding / all-padding / K=64 layouts, large-N spot checks, graph capture, its
run-to-run closeness (dq is summed with fp32 atomics: not bitwise reproducible) and its agreement
with the deterministic backward; the Hopper kernels (sm_90a warpgroup MMAs; what "auto", the
default, runs on an sm_90 GPU): the backward forced by PEAGLE_ATTN_BWD=wgmma (32- or 64-query
blocks) and the forward by PEAGLE_ATTN_FWD=wgmma, with and without their pipelined loops
(PEAGLE_ATTN_WGMMA_PIPE), on the same subsets where the GPU is sm_90 (skipped elsewhere, where
they must refuse to run), bitwise equal to the mma.sync kernels ("mma") at D = 128 and across
pipelining levels. The plain tests (no config) run "auto". A failing GPU case names its
configuration.
"""

import math
import os

import pytest
import torch

import peagle_ext
from peagle_ext.attention import cod_attention, cod_attention_metadata
from peagle_ext.cod import CodLayout, cod_sample
from peagle_ext.reference import dense_cod_mask, document_starts, reference_cod_attention
from peagle_ext.testing import random_documents
from tests.helpers import HAS_CUDA, mask_from_metadata, requires_cuda


# ---------------------------------------------------------------- helpers
def make_layout(g, n, *, cross=False, num_depths=8, max_anchors=None, max_doc_len=120, pad_tail=0, r=0.7, device="cpu"):
    doc, lm = random_documents(n, g, max_doc_len=max_doc_len, pad_tail=pad_tail)
    seed = int(torch.randint(0, 2**31, (1,), generator=g))
    lay = cod_sample(
        doc,
        lm,
        num_depths=num_depths,
        down_sample_ratio=r,
        max_anchors=max_anchors,
        depth0="anchors" if cross else "all",
        seed=seed,
    )
    return lay.to(device)


def make_inputs(g, lay, hq, hkv, d, dtype, device, cross, requires_grad=True):
    t, n = lay.num_tokens, lay.seq_len

    def rnd(*shape):
        x = torch.randn(*shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
        return x.requires_grad_(requires_grad)

    q, k, v = rnd(t, hq, d), rnd(t, hkv, d), rnd(t, hkv, d)
    ctx = {}
    if cross:
        ctx = dict(context_k=rnd(n, hkv, d), context_v=rnd(n, hkv, d))
    return q, k, v, ctx


def run_both(g, lay, q, k, v, ctx, *, window=None, sink=0, scale=None, return_go=False):
    """(ours, reference) outputs and gradients; the reference runs in float64 on the same device.
    return_go: also return the float64 grad_out used."""
    ins = [q, k, v] + list(ctx.values())
    out = cod_attention(q, k, v, lay, window=window, sink=sink, scale=scale, **ctx)
    go = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.device)
    grads = torch.autograd.grad(out, ins, go.to(out.dtype)) if out.numel() else [torch.zeros_like(x) for x in ins]
    ref_ins = [x.detach().double().requires_grad_(True) for x in ins]
    rctx = dict(zip(ctx.keys(), ref_ins[3:]))
    ref = reference_cod_attention(*ref_ins[:3], lay, window=window, sink=sink, scale=scale, **rctx)
    rgrads = torch.autograd.grad(ref, ref_ins, go) if ref.numel() else [torch.zeros_like(x) for x in ref_ins]
    names = ["out", "dq", "dk", "dv"] + ["d" + n for n in ctx.keys()]
    if return_go:
        return names, [out] + list(grads), [ref] + list(rgrads), go
    return names, [out] + list(grads), [ref] + list(rgrads)


def flash_backward_reference(q, k, v, ctx, lay, go, out, *, window=None, sink=0, scale=None):
    """float64 gradients of the flash-style backward as the kernels define it: P from the exact
    scores, dS = P * (dO V^T - delta) with delta = rowsum(dO * out) taken from the given `out`
    (the kernel's rounded 16-bit output, as FlashAttention does). With the exact output this is
    autograd's gradient (test_flash_backward_reference_is_autograd_with_exact_out)."""
    cross = bool(ctx)
    q, k, v, go, out = (x.detach().double() for x in (q, k, v, go, out))
    kk, vv = k, v
    if cross:
        kk = torch.cat([ctx["context_k"].detach().double(), k], 0)
        vv = torch.cat([ctx["context_v"].detach().double(), v], 0)
    group = q.shape[1] // k.shape[1]
    kk, vv = kk.repeat_interleave(group, 1), vv.repeat_interleave(group, 1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    mask = dense_cod_mask(lay, cross=cross, window=window, sink=sink).to(q.device)
    s = torch.einsum("thd,jhd->htj", q, kk) * scale
    s = s.masked_fill(~mask[None], float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)  # rows without keys: 0
    dp = torch.einsum("thd,jhd->htj", go, vv)
    delta = (go * out).sum(-1).transpose(0, 1)  # [H, T]
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("htj,jhd->thd", ds, kk) * scale
    dkk = torch.einsum("htj,thd->jhd", ds, q) * scale
    dvv = torch.einsum("htj,thd->jhd", p, go)
    hkv = k.shape[1]
    dkk = dkk.reshape(dkk.shape[0], hkv, group, -1).sum(2)
    dvv = dvv.reshape(dvv.shape[0], hkv, group, -1).sum(2)
    if not cross:
        return [dq, dkk, dvv]
    n = lay.seq_len
    return [dq, dkk[n:], dvv[n:], dkk[:n], dvv[:n]]


def rel_l2(x, ref, floor=0.0):
    """||x - ref|| / max(||ref||, floor * sqrt(numel)): floor > 0 keeps a reference that cancels
    to ~0 (one key per row: the exact dq is 0) from turning rounding noise into a huge ratio."""
    x, ref = x.double(), ref.double()
    den = max(ref.norm().item(), floor * math.sqrt(ref.numel()))
    num = (x - ref).norm().item()
    return num / den if den > 0 else num


def assert_close_all(names, ours, refs, *, tol, what, rel=True, floor=0.0):
    """Checks every tensor and reports all of them at once (one GPU run should say exactly
    which outputs of which configuration are off, and by how much)."""
    report, bad = [], False
    tols = list(tol) if isinstance(tol, (list, tuple)) else [tol] * len(names)
    for name, a, b, tol in zip(names, ours, refs, tols):
        if a.shape != b.shape:
            report.append(f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}")
            bad = True
            continue
        nonfinite = int((~torch.isfinite(a)).sum())
        if rel:
            err = rel_l2(a, b, floor) if nonfinite == 0 else float("inf")
        else:
            err = (a.double() - b.double()).abs().max().item() if nonfinite == 0 else float("inf")
        worst = ""
        if err > tol and nonfinite == 0 and a.numel():
            diff = (a.double() - b.double()).abs().reshape(a.shape[0], -1).amax(1)
            worst = f" worst rows {diff.topk(min(3, diff.numel())).indices.tolist()}"
        report.append(
            f"{name}: err {err:.2e} (tol {tol:.1e}){' NONFINITE=' + str(nonfinite) if nonfinite else ''}{worst}"
        )
        bad |= not (err <= tol)
    assert not bad, f"{what}: " + "; ".join(report)


@pytest.mark.parametrize("cross", [False, True])
def test_flash_backward_reference_is_autograd_with_exact_out(rng, cross):
    """The float64 restatement of the kernels' backward (used by the tiny CUDA cases) is the
    exact gradient when given the exact output: it differs from autograd only through `out`."""
    lay = make_layout(rng, 90, cross=cross, num_depths=4, max_doc_len=40)
    q, k, v, ctx = make_inputs(rng, lay, 4, 2, 16, torch.float64, "cpu", cross)
    names, _, refs, go = run_both(rng, lay, q, k, v, ctx, window=7, sink=1, return_go=True)
    algo = flash_backward_reference(q, k, v, ctx, lay, go, refs[0], window=7, sink=1)
    for name, a, b in zip(names[1:], algo, refs[1:]):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), name


# ---------------------------------------------------------------- metadata
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("window,sink", [(None, 0), (9, 0), (6, 2), (1, 0), (3, 50)])
def test_metadata_is_the_dense_mask_each_pair_once(rng, cross, window, sink):
    lay = make_layout(rng, 160, cross=cross, max_doc_len=50, pad_tail=5)
    meta = cod_attention_metadata(lay, cross=cross, window=window, sink=sink)
    cnt = mask_from_metadata(lay, meta, cross)
    dense = dense_cod_mask(lay, cross=cross, window=window, sink=sink)
    assert cnt.max() <= 1, "a key is visited twice for one query"
    assert torch.equal(cnt.bool(), dense)
    # reverse chain table is the exact inverse of the chain table
    ch, rch = meta.chains[0].long(), meta.chains[1].long()
    pairs = {(i, c) for i in range(ch.shape[0]) for c in ch[i].tolist() if c >= 0}
    rpairs = {(i, c) for c in range(rch.shape[0]) for i in rch[c].tolist() if i >= 0}
    assert pairs == rpairs


def test_metadata_bounds_are_monotone_per_depth(rng):
    lay = make_layout(rng, 400, max_doc_len=80, pad_tail=9)
    meta = cod_attention_metadata(lay, window=13, sink=4)
    o = lay.depth_offsets
    for e in range(len(o) - 1):
        seg = meta.ranges[:4, o[e] : o[e + 1]]
        if seg.shape[1] > 1:
            assert bool((seg[:, 1:] >= seg[:, :-1]).all()), f"depth {e}: bounds not monotone"


# ---------------------------------------------------------------- CPU correctness
CPU_CASES = [
    # (n, cross, window, sink, hq, hkv, d, max_anchors, num_depths, pad_tail)
    (150, False, None, 0, 2, 1, 16, None, 8, 0),
    (150, False, 7, 0, 4, 1, 8, None, 8, 6),
    (150, False, 5, 3, 4, 4, 8, None, 6, 4),
    (150, False, 2, 1, 8, 1, 8, None, 8, 0),  # window <= depth: own depth-0 token via the chain
    (200, False, None, 0, 2, 2, 16, 20, 8, 10),  # max_anchors
    (130, True, None, 0, 4, 1, 16, None, 8, 3),
    (130, True, 6, 2, 2, 1, 8, None, 8, 0),
    (130, True, 1, 0, 8, 1, 8, 15, 5, 7),
    (70, False, 3, 5, 2, 1, 64, None, 8, 2),  # D 64
    (50, True, 4, 2, 2, 1, 128, None, 4, 0),  # D 128, cross
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_cpu_float64_matches_reference(rng, case):
    n, cross, window, sink, hq, hkv, d, max_anchors, k_depths, pad = case
    lay = make_layout(rng, n, cross=cross, max_anchors=max_anchors, num_depths=k_depths, max_doc_len=60, pad_tail=pad)
    q, k, v, ctx = make_inputs(rng, lay, hq, hkv, d, torch.float64, "cpu", cross)
    names, ours, refs = run_both(rng, lay, q, k, v, ctx, window=window, sink=sink)
    assert_close_all(names, ours, refs, tol=1e-10, what=f"cpu f64 {case}", rel=False)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("cross", [False, True])
def test_cpu_low_precision(rng, dtype, tol, cross):
    lay = make_layout(rng, 120, cross=cross, max_doc_len=50, pad_tail=3)
    q, k, v, ctx = make_inputs(rng, lay, 4, 2, 32, dtype, "cpu", cross)
    names, ours, refs = run_both(rng, lay, q, k, v, ctx, window=11, sink=2)
    assert ours[0].dtype == dtype
    assert_close_all(names, ours, refs, tol=tol, what=f"cpu {dtype}")


def test_cpu_custom_scale(rng):
    lay = make_layout(rng, 90, max_doc_len=40)
    q, k, v, ctx = make_inputs(rng, lay, 2, 1, 8, torch.float64, "cpu", False)
    names, ours, refs = run_both(rng, lay, q, k, v, ctx, scale=0.37)
    assert_close_all(names, ours, refs, tol=1e-10, what="scale", rel=False)


@pytest.mark.parametrize("cross", [False, True])
def test_single_token_and_tiny(rng, cross):
    # N = 2 (one seed at most), N < K, and T = 1
    for n in (1, 2, 3, 5):
        doc = torch.zeros(n, dtype=torch.int32)
        lm = torch.ones(n, dtype=torch.bool)
        lay = cod_sample(doc, lm, num_depths=8, depth0="anchors" if cross else "all", seed=3)
        if lay.num_tokens == 0:
            continue
        q, k, v, ctx = make_inputs(rng, lay, 2, 1, 8, torch.float64, "cpu", cross)
        names, ours, refs = run_both(rng, lay, q, k, v, ctx, window=2)
        assert_close_all(names, ours, refs, tol=1e-10, what=f"tiny n={n}", rel=False)
    lay = CodLayout(
        torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), [0, 1], torch.zeros(1, dtype=torch.int32)
    )
    q, k, v, _ = make_inputs(rng, lay, 1, 1, 4, torch.float64, "cpu", False)
    out = cod_attention(q, k, v, lay)
    assert torch.allclose(out, v.detach())  # one key: the output is its value


def test_padding_rows_are_zero_with_zero_grads(rng):
    doc = torch.tensor([0] * 10 + [-1] * 5 + [1] * 8 + [-1] * 4, dtype=torch.int32)
    lm = doc >= 0
    lay = cod_sample(doc, lm, num_depths=4, seed=5)
    q, k, v, _ = make_inputs(rng, lay, 2, 2, 8, torch.float64, "cpu", False)
    out = cod_attention(q, k, v, lay, window=3, sink=1)
    pad = doc[lay.anchor.long()] < 0
    assert pad.any()
    assert torch.equal(out[pad], torch.zeros_like(out[pad]))
    (dq,) = torch.autograd.grad(out.sum(), [q])
    assert torch.equal(dq[pad], torch.zeros_like(dq[pad]))
    assert torch.isfinite(dq).all()


def test_all_padding_and_empty(rng):
    doc = torch.full((6,), -1, dtype=torch.int32)
    lay = cod_sample(doc, torch.zeros(6, dtype=torch.bool), num_depths=3, seed=0)
    q, k, v, _ = make_inputs(rng, lay, 2, 1, 8, torch.float32, "cpu", False)
    out = cod_attention(q, k, v, lay)
    assert torch.equal(out, torch.zeros_like(out))
    grads = torch.autograd.grad(out.sum(), [q, k, v])
    assert all(torch.equal(g_, torch.zeros_like(g_)) for g_ in grads)
    empty = CodLayout(
        torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), [0, 0], torch.zeros(0, dtype=torch.int32)
    )
    q, k, v, _ = make_inputs(rng, empty, 2, 1, 8, torch.float32, "cpu", False)
    assert cod_attention(q, k, v, empty).shape == (0, 2, 8)


def test_opcheck_and_compile(rng):
    ops = torch.ops.peagle
    lay = make_layout(rng, 60, max_doc_len=30)
    meta = cod_attention_metadata(lay, window=5, sink=1)
    q, k, v, _ = make_inputs(rng, lay, 2, 1, 8, torch.float64, "cpu", False)
    args = (q, k, v, None, None, meta.ranges, meta.chains, meta.depth_offsets, 0.3, True)
    torch.library.opcheck(
        ops.cod_attention_fwd, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration")
    )
    torch.library.opcheck(
        ops.cod_attention_metadata,
        (lay.anchor, lay.depth, lay.document_ids, lay.depth_offsets, False, 5, 1),
        test_utils=("test_schema", "test_faketensor"),
    )


def test_torch_compile_fullgraph(rng):
    """With metadata built outside, the op traces as one graph (fake impls + registered autograd)."""
    lay = make_layout(rng, 100, max_doc_len=40)
    meta = cod_attention_metadata(lay, window=9, sink=2)
    q, k, v, _ = make_inputs(rng, lay, 4, 2, 16, torch.float32, "cpu", False)

    def f(q, k, v):
        return (cod_attention(q, k, v, lay, window=9, sink=2, metadata=meta) * 2).sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    a = compiled(q, k, v)
    ga = torch.autograd.grad(a, [q, k, v])
    b = f(q, k, v)
    gb = torch.autograd.grad(b, [q, k, v])
    assert torch.allclose(a, b)
    assert all(torch.allclose(x, y) for x, y in zip(ga, gb))


def test_metadata_argument_mismatch(rng):
    lay = make_layout(rng, 60, max_doc_len=30)
    q, k, v, _ = make_inputs(rng, lay, 2, 1, 8, torch.float32, "cpu", False, requires_grad=False)
    meta = cod_attention_metadata(lay, window=5, sink=2)
    with pytest.raises(ValueError, match="another layout or mode"):
        cod_attention(q, k, v, lay, metadata=meta)  # built with a sink, called without window
    out = cod_attention(q, k, v, lay, window=5, sink=2, metadata=meta)
    assert torch.allclose(out, cod_attention(q, k, v, lay, window=5, sink=2))


# ---------------------------------------------------------------- bad inputs
def test_bad_inputs(rng):
    lay = make_layout(rng, 50, max_doc_len=30)
    q, k, v, _ = make_inputs(rng, lay, 4, 2, 8, torch.float32, "cpu", False, requires_grad=False)
    t = lay.num_tokens
    with pytest.raises(TypeError, match="q must have dtype"):
        cod_attention(q.int(), k, v, lay)
    with pytest.raises(TypeError, match="k must have dtype"):
        cod_attention(q, k.double(), v, lay)
    with pytest.raises(ValueError, match="q must have T="):
        cod_attention(q[:-1], k[:-1], v[:-1], lay)
    with pytest.raises(ValueError, match="q must be 3-D"):
        cod_attention(q[0], k, v, lay)
    with pytest.raises(ValueError, match="v must have shape"):
        cod_attention(q, k, v[:, :1], lay)
    with pytest.raises(ValueError, match="multiple of k/v heads"):
        cod_attention(q[:, :3], k, v, lay)
    with pytest.raises(ValueError, match="k must have shape"):
        cod_attention(q, k[..., :4], v[..., :4], lay)
    with pytest.raises(TypeError, match="layout must be"):
        cod_attention(q, k, v, "layout")
    with pytest.raises(ValueError, match="window must be >= 1"):
        cod_attention(q, k, v, lay, window=0)
    with pytest.raises(ValueError, match="sink must be >= 0"):
        cod_attention(q, k, v, lay, window=4, sink=-1)
    with pytest.raises(TypeError, match="scale"):
        cod_attention(q, k, v, lay, scale=float("nan"))
    with pytest.raises(ValueError, match="context_k and context_v must be given together"):
        cod_attention(q, k, v, lay, context_k=k)
    ck = torch.randn(lay.seq_len + 1, 2, 8)
    with pytest.raises(ValueError, match="context_k must have shape"):
        cod_attention(q, k, v, lay, context_k=ck, context_v=ck)
    cross = make_layout(rng, 50, cross=True, max_doc_len=30)
    qc, kc, vc, _ = make_inputs(rng, cross, 4, 2, 8, torch.float32, "cpu", False, requires_grad=False)
    with pytest.raises(ValueError, match="symmetric mode"):
        cod_attention(qc, kc, vc, cross)  # depth0='anchors' layout without context
    split = CodLayout(
        lay.anchor,
        lay.depth,
        lay.depth_offsets,
        torch.where(torch.arange(lay.seq_len) < 10, 0, lay.document_ids + 100).int().contiguous(),
    )
    split.document_ids[-3:] = 0  # document 0 in two runs
    with pytest.raises(ValueError, match="contiguous run"):
        cod_attention(q, k, v, split)
    unsorted = CodLayout(lay.anchor.flip(0).contiguous(), lay.depth, lay.depth_offsets, lay.document_ids)
    with pytest.raises(ValueError):
        cod_attention(q, k, v, unsorted)
    assert t > 0
    if HAS_CUDA:
        qb, kb, vb = (x.cuda().bfloat16() for x in (q, k, v))
        q64, k64, v64 = (x.repeat(1, 1, 8).cuda().bfloat16() for x in (q, k, v))
        with pytest.raises(ValueError, match="layout must be on q's device"):
            cod_attention(q64, k64, v64, lay)
        with pytest.raises(TypeError, match="q must have dtype"):
            cod_attention(q.cuda(), k.cuda(), v.cuda(), lay.to("cuda"))
        with pytest.raises(ValueError, match="head dim 8 is not supported on CUDA"):
            cod_attention(qb, kb, vb, lay.to("cuda"))
        with pytest.raises(ValueError, match="k must be on"):
            cod_attention(qb, kb.cpu(), vb, lay.to("cuda"))


def test_cpu_moderate_size_is_fast(rng):
    """A CPU-training-sized call (T ~ 3K, D 64, 4 heads) stays well under a few seconds."""
    import time

    lay = make_layout(rng, 1024, max_doc_len=400)
    q, k, v, _ = make_inputs(rng, lay, 4, 2, 64, torch.float32, "cpu", False)
    t0 = time.perf_counter()
    out = cod_attention(q, k, v, lay, window=256)
    out.sum().backward()
    assert time.perf_counter() - t0 < 20.0


# ---------------------------------------------------------------- CUDA
GPU_SCENARIOS = [
    # (name, n, hq, hkv, window, sink, max_anchors, num_depths, max_doc_len, pad_tail)
    ("plain-gqa1", 1100, 4, 4, None, 0, None, 8, 300, 0),
    ("window-gqa4", 1300, 8, 2, 96, 0, None, 8, 500, 17),
    ("window-sink-gqa8", 1200, 8, 1, 80, 8, None, 8, 700, 5),
    ("tiny-window", 900, 4, 1, 3, 0, None, 8, 200, 9),  # window <= depth: chain depth-0 keys
    ("tiny-window-sink", 900, 4, 2, 2, 3, None, 6, 250, 0),
    ("max-anchors", 1500, 8, 2, None, 0, 60, 8, 400, 33),
    ("long-doc", 2100, 4, 1, None, 0, None, 8, 2100, 0),  # many full key blocks
    ("long-doc-window", 2100, 8, 8, 700, 16, None, 8, 2100, 0),
]


def _gpu_case(dtype, d, cross, scen, seed_extra=0):
    name, n, hq, hkv, window, sink, max_anchors, k_depths, max_doc, pad = scen
    import zlib

    g = torch.Generator().manual_seed(zlib.crc32(f"{dtype}-{d}-{cross}-{name}-{seed_extra}".encode()))
    lay = make_layout(
        g,
        n,
        cross=cross,
        num_depths=k_depths,
        max_anchors=max_anchors,
        max_doc_len=max_doc,
        pad_tail=pad,
        device="cuda",
    )
    q, k, v, ctx = make_inputs(g, lay, hq, hkv, d, dtype, "cuda", cross)
    names, ours, refs = run_both(g, lay, q, k, v, ctx, window=window, sink=sink)
    what = f"cuda {dtype} D={d} cross={cross} {name} T={lay.num_tokens} N={n} Hq={hq} Hkv={hkv} w={window} s={sink}"
    assert_close_all(names, ours, refs, tol=1e-2, what=what)


@requires_cuda
@pytest.mark.parametrize("scen", GPU_SCENARIOS, ids=lambda s: s[0])
@pytest.mark.parametrize("cross", [False, True], ids=["sym", "cross"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_matches_reference(dtype, d, cross, scen):
    _gpu_case(dtype, d, cross, scen)


# Forward CTA shapes (env read per call by the CUDA glue, see csrc/attention/cuda/cod_attn_configs.cuh):
# mma = the mma.sync forward's default shape, 16 rows per warp, 8 warps at D = 64 and 4 at D = 128
# (setting a shape env selects the mma.sync forward); mf1w4 / mf1w8 = 4 / 8 warps x 16
# rows; mf2w4 / mf2w8 = 4 / 8 warps x 32 rows (two m16 fragments per warp).
FWD_CONFIGS = {
    "auto": {},  # what runs without the env: the wgmma forward on sm_90, the mma.sync one elsewhere
    "mma": {"PEAGLE_ATTN_FWD": "mma"},  # the mma.sync forward's default shape
    "mf1w4": {"PEAGLE_ATTN_FWD_WARPS": "4"},
    "mf1w8": {"PEAGLE_ATTN_FWD_WARPS": "8"},
    "mf2w4": {"PEAGLE_ATTN_FWD_MF": "2"},
    "mf2w8": {"PEAGLE_ATTN_FWD_MF": "2", "PEAGLE_ATTN_FWD_WARPS": "8"},
    # PEAGLE_ATTN_FWD=wgmma: one warpgroup per 64 query rows on sm_90a warpgroup MMAs
    # (cod_attn_fwd_wgmma.cuh; sm_90 only, elsewhere it must refuse to run)
    # (unpipelined: PEAGLE_ATTN_WGMMA_PIPE=0; unset means 2)
    "fwd_wgmma": {"PEAGLE_ATTN_FWD": "wgmma", "PEAGLE_ATTN_WGMMA_PIPE": "0"},
    # + PEAGLE_ATTN_WGMMA_PIPE (one switch for every wgmma kernel, CodAttnParams::wgmma_pipe): 1 =
    # each block's second MMA left in flight; 2 = the forward's softmax overlapped with P V too, and
    # the dK/dV elementwise with dV / dK += (FlashAttention-3 style; the dQ pass and the 64-query
    # dK/dV pass run level 1). Bitwise equal to level 0.
    "fwd_wgmma_pipe1": {"PEAGLE_ATTN_FWD": "wgmma", "PEAGLE_ATTN_WGMMA_PIPE": "1"},
    "fwd_wgmma_pipe": {"PEAGLE_ATTN_FWD": "wgmma", "PEAGLE_ATTN_WGMMA_PIPE": "2"},
}


def _wgmma_runs_here():
    """The wgmma kernels (PEAGLE_ATTN_FWD / PEAGLE_ATTN_BWD = wgmma, and auto's choice) run on
    compute capability 9.0 with a build that has sm_90a kernels."""
    if not HAS_CUDA or torch.cuda.get_device_capability() != (9, 0):
        return False
    return "90" in peagle_ext.build_info().get("cuda_archs", [])


def profiled_kernel_names(run, contains):
    """Names of the CUDA kernels containing `contains` that one call of run() launches (after a
    warm-up call, under torch.profiler); skips the test where the profiler records no kernels."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if contains in e.name}
    if not names:
        pytest.skip("the profiler recorded no kernels here")
    return names


HAS_WGMMA = HAS_FWD_WGMMA = _wgmma_runs_here()
requires_fwd_wgmma = pytest.mark.skipif(
    not HAS_FWD_WGMMA, reason="PEAGLE_ATTN_FWD=wgmma needs an sm_90 GPU and a build with 90"
)
FWD_WGMMA = pytest.param("fwd_wgmma", marks=requires_fwd_wgmma)
FWD_WGMMA_PIPE = pytest.param("fwd_wgmma_pipe", marks=requires_fwd_wgmma)
FWD_WGMMA_PIPE1 = pytest.param("fwd_wgmma_pipe1", marks=requires_fwd_wgmma)


def set_fwd_config(monkeypatch, name):
    """Also clears PEAGLE_ATTN_WGMMA_PIPE unless `name` sets it: call before set_bwd_variant."""
    for key in ("PEAGLE_ATTN_FWD_MF", "PEAGLE_ATTN_FWD_WARPS", "PEAGLE_ATTN_FWD", "PEAGLE_ATTN_WGMMA_PIPE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in FWD_CONFIGS[name].items():
        monkeypatch.setenv(key, value)


# The non-default forward shapes on the reference scenarios, a subset of the cross product (the
# default shape runs all 64 cases above): mf2w4 (the candidate default) on every scenario and head
# dim, the mode alternating so each scenario runs in both modes; mf2w8 on every scenario; mf1w4
# on half. dtype alternates by scenario.
FWD_VARIANT_CASES = (
    [("mf2w4", d, (i + d // 64) % 2 == 1, i) for d in (64, 128) for i in range(len(GPU_SCENARIOS))]
    + [("mf2w8", 64 if i % 2 else 128, i % 4 >= 2, i) for i in range(len(GPU_SCENARIOS))]
    + [("mf1w4", 64 if i % 4 else 128, i % 4 == 2, i) for i in range(0, len(GPU_SCENARIOS), 2)]
    + [("mf1w8", 128, i % 4 == 3, i) for i in range(1, len(GPU_SCENARIOS), 2)]  # D=128's former default
    # the wgmma forward (sm_90 only) on every scenario and head dim, the mode alternating
    + [("fwd_wgmma", d, (i + d // 64) % 2 == 0, i) for d in (64, 128) for i in range(len(GPU_SCENARIOS))]
    # its pipelined loops: level 2 like fwd_wgmma (the other mode), level 1 on half
    + [("fwd_wgmma_pipe", d, (i + d // 64) % 2 == 1, i) for d in (64, 128) for i in range(len(GPU_SCENARIOS))]
    + [("fwd_wgmma_pipe1", 64 if i % 4 else 128, i % 4 == 0, i) for i in range(0, len(GPU_SCENARIOS), 2)]
)


@requires_cuda
@pytest.mark.parametrize(
    "cfg,d,cross,scen_idx",
    [pytest.param(*c, marks=requires_fwd_wgmma) if c[0].startswith("fwd_wgmma") else c for c in FWD_VARIANT_CASES],
    ids=[f"{c}-D{d}-{'cross' if x else 'sym'}-{GPU_SCENARIOS[i][0]}" for c, d, x, i in FWD_VARIANT_CASES],
)
def test_cuda_fwd_configs_match_reference(monkeypatch, cfg, d, cross, scen_idx):
    """Every forward CTA shape against the float64 reference (grads too: they read the forward's
    out and LSE)."""
    set_fwd_config(monkeypatch, cfg)
    dtype = torch.bfloat16 if scen_idx % 2 == 0 else torch.float16
    _gpu_case(dtype, d, cross, GPU_SCENARIOS[scen_idx], seed_extra=cfg)


@requires_cuda
@pytest.mark.parametrize("cfg", ["mf1w4", "mf2w4", "mf2w8", FWD_WGMMA, FWD_WGMMA_PIPE, FWD_WGMMA_PIPE1])
@pytest.mark.parametrize("cross", [False, True], ids=["sym", "cross"])
def test_cuda_fwd_configs_tiny_and_padding(monkeypatch, cross, cfg):
    """test_cuda_tiny_and_padding's layouts (T = 1, N < K, padding runs) for every forward CTA
    shape: the forward against the float64 reference (the bf16 gradients of T <= 3 are a known
    tolerance issue of the backward, not this test's subject), zero rows without keys."""
    set_fwd_config(monkeypatch, cfg)
    g = torch.Generator().manual_seed(11)
    cases = []
    for n in (1, 2, 3, 5, 9):  # T = 1, N < K
        doc = torch.zeros(n, dtype=torch.int32)
        lay = cod_sample(
            doc, torch.ones(n, dtype=torch.bool), num_depths=8, depth0="anchors" if cross else "all", seed=3
        ).to("cuda")
        if lay.num_tokens:
            cases += [(lay, d, torch.bfloat16, 2, 2, 0) for d in (64, 128)]
    doc = torch.tensor([-1] * 7 + [0] * 40 + [-1] * 5 + [1] * 30 + [-1] * 9, dtype=torch.int32)
    lay = cod_sample(doc, doc >= 0, num_depths=5, depth0="anchors" if cross else "all", seed=2).to("cuda")
    cases += [(lay, d, torch.float16, 1, 6, 2) for d in (64, 128)]
    for lay, d, dtype, hkv, window, sink in cases:
        q, k, v, ctx = make_inputs(g, lay, 4, hkv, d, dtype, "cuda", cross, requires_grad=False)
        with torch.no_grad():
            out = cod_attention(q, k, v, lay, window=window, sink=sink, **ctx)
        ref = reference_cod_attention(
            q.double(),
            k.double(),
            v.double(),
            lay,
            window=window,
            sink=sink,
            **{name: x.double() for name, x in ctx.items()},
        )
        what = f"{cfg} T={lay.num_tokens} D={d} cross={cross}"
        assert torch.isfinite(out).all(), what
        assert rel_l2(out, ref) <= 1e-2, f"{what}: rel err {rel_l2(out, ref):.2e}"
        pad = lay.document_ids[lay.anchor.long()] < 0
        assert torch.equal(out[pad], torch.zeros_like(out[pad])), f"{what}: padding rows not zero"


@requires_cuda
@pytest.mark.parametrize("cfg", ["mma", "mf2w4", "mf2w8", FWD_WGMMA, FWD_WGMMA_PIPE])
def test_cuda_fwd_configs_deep_chains(monkeypatch, cfg):
    """K = 64 depths (the maximum) needs the most chain scratch: mf2w8 at D = 128 would exceed the
    shared memory per block and runs with 4 warps instead. Forward only, against the CPU op in
    float32 on the same bf16-rounded inputs."""
    set_fwd_config(monkeypatch, cfg)
    g = torch.Generator().manual_seed(17)
    lay = make_layout(g, 600, num_depths=64, max_doc_len=300, pad_tail=7)
    assert len(lay.depth_offsets) - 1 == 64
    q, k, v, _ = make_inputs(g, lay, 4, 2, 128, torch.bfloat16, "cpu", False, requires_grad=False)
    with torch.no_grad():
        out = cod_attention(q.cuda(), k.cuda(), v.cuda(), lay.to("cuda"), window=64, sink=2)
        ref = cod_attention(q.float(), k.float(), v.float(), lay, window=64, sink=2)
    assert torch.isfinite(out).all()
    assert rel_l2(out.cpu().float(), ref) <= 1e-2, f"{cfg}: rel err {rel_l2(out.cpu().float(), ref):.2e}"


@requires_cuda
@pytest.mark.parametrize("cfg", ["mf1w4", "mf2w4", "mf2w8", FWD_WGMMA, FWD_WGMMA_PIPE])
def test_cuda_fwd_configs_agree_with_default(monkeypatch, cfg):
    """The forward CTA shapes compute the same function: outputs and LSE agree with the default
    shape to bf16 rounding (the key-block partition differs, so not bitwise)."""
    g = torch.Generator().manual_seed(21)
    lay = make_layout(g, 3000, max_doc_len=1400, pad_tail=13, device="cuda")
    q, k, v, _ = make_inputs(g, lay, 8, 2, 128, torch.bfloat16, "cuda", False, requires_grad=False)
    meta = cod_attention_metadata(lay, window=300, sink=3)

    def forward():
        return torch.ops.peagle.cod_attention_fwd(
            q, k, v, None, None, meta.ranges, meta.chains, meta.depth_offsets, 1 / math.sqrt(128), meta.use_sink
        )

    set_fwd_config(monkeypatch, "mma")
    ref_out, ref_lse = forward()
    set_fwd_config(monkeypatch, cfg)
    out, lse = forward()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), f"{cfg}: rows without keys differ"
    fin = torch.isfinite(ref_lse)  # [Hq, T]
    assert fin.any(), "layout should have rows with keys"
    assert (lse[fin] - ref_lse[fin]).abs().max() <= 1e-3, f"{cfg}: lse differs"
    rows = fin.T  # [T, Hq]
    row_err = (out.float() - ref_out.float()).norm(dim=-1) / ref_out.float().norm(dim=-1).clamp_min(1e-6)
    assert row_err[rows].max() <= 0.05, f"{cfg}: worst row rel err {row_err[rows].max():.3e}"
    assert rel_l2(out.float(), ref_out.float()) <= 1e-2, f"{cfg}: out differs"
    assert torch.equal(out[~rows], torch.zeros_like(out[~rows])), f"{cfg}: rows without keys not zero"


@requires_cuda
def test_cuda_fwd_wgmma_refused_off_sm90(monkeypatch):
    """Where the wgmma forward cannot run (not compute capability 9.0, or a build without sm_90a),
    the forward raises a sentence naming the requirement instead of running anything."""
    if HAS_FWD_WGMMA:
        pytest.skip("this GPU runs PEAGLE_ATTN_FWD=wgmma")
    set_fwd_config(monkeypatch, "fwd_wgmma")
    g = torch.Generator().manual_seed(47)
    lay = make_layout(g, 200, device="cuda")
    q, k, v, _ = make_inputs(g, lay, 4, 2, 64, torch.bfloat16, "cuda", False, requires_grad=False)
    with pytest.raises(RuntimeError, match="PEAGLE_ATTN_FWD=wgmma needs an sm_90 GPU"):
        cod_attention(q, k, v, lay)


@requires_cuda
@pytest.mark.parametrize("cfg", ["auto", "mma", "mf2w4", FWD_WGMMA])
def test_cuda_fwd_wgmma_selects_kernel(monkeypatch, cfg):
    """The env switch really picks the forward (profiler): cod_attn_fwd_wgmma_kernel with
    PEAGLE_ATTN_FWD=wgmma and without the env on sm_90, cod_attn_fwd_kernel otherwise (mma, a CTA
    shape, or auto elsewhere); without this every fwd_wgmma test would also pass if the glue
    ignored the env."""
    set_fwd_config(monkeypatch, cfg)
    g = torch.Generator().manual_seed(53)
    lay = make_layout(g, 400, max_doc_len=200, device="cuda")
    q, k, v, _ = make_inputs(g, lay, 4, 2, 128, torch.bfloat16, "cuda", False, requires_grad=False)
    names = profiled_kernel_names(lambda: cod_attention(q, k, v, lay, window=50, sink=2), "cod_attn_fwd")
    has_wgmma = any("cod_attn_fwd_wgmma_kernel" in n for n in names)
    has_mma = any("cod_attn_fwd_kernel" in n for n in names)
    wgmma = cfg == "fwd_wgmma" or (cfg == "auto" and HAS_FWD_WGMMA)
    assert (has_wgmma, has_mma) == ((True, False) if wgmma else (False, True)), sorted(set(names))


# Backward variants (env PEAGLE_ATTN_BWD, read per call by the CUDA glue; csrc/attention/cuda/
# cod_attn_bwd.cuh launch_bwd): "auto" = what runs without the env (wgmma64 at D = 128 and wgmma at
# D = 64 on sm_90, "mma" elsewhere); "mma" = the deterministic 4-launch mma.sync backward; "atomic" = the
# FlashAttention-2-style one (dQ summed with fp32 atomics in the key-major dK/dV pass); "wgmma" =
# the default with its dQ and dK/dV passes on Hopper warpgroup MMAs (cod_attn_dq_wgmma.cuh,
# cod_attn_bwd_wgmma.cuh; sm_90 only).
BWD_VARIANTS = {
    "auto": None,
    "mma": "mma",
    "atomic": "atomic",
    "wgmma": "wgmma",
    "wgmma64": "wgmma",
    "wgmma_pipe": "wgmma",
    "wgmma64_pipe": "wgmma",
}


requires_wgmma = pytest.mark.skipif(
    not HAS_WGMMA, reason="PEAGLE_ATTN_BWD=wgmma needs an sm_90 GPU and a build with 90"
)
WGMMA = pytest.param("wgmma", marks=requires_wgmma)
WGMMA_PIPE = pytest.param("wgmma_pipe", marks=requires_wgmma)
WGMMA64_PIPE = pytest.param("wgmma64_pipe", marks=requires_wgmma)


def set_bwd_variant(monkeypatch, name):
    """name in BWD_VARIANTS; "wgmma64" = wgmma with 64-query blocks at D = 128 (PEAGLE_ATTN_WGMMA_BMQ);
    "*_pipe" = with PEAGLE_ATTN_WGMMA_PIPE=2 (which the wgmma forward reads too); "wgmma" /
    "wgmma64" = the unpipelined loops (PIPE=0) unless PEAGLE_ATTN_WGMMA_PIPE is set already (by
    set_fwd_config); other names leave it as it is (unset = 2)."""
    monkeypatch.delenv("PEAGLE_ATTN_BWD", raising=False)
    monkeypatch.delenv("PEAGLE_ATTN_WGMMA_BMQ", raising=False)
    if BWD_VARIANTS[name] is not None:
        monkeypatch.setenv("PEAGLE_ATTN_BWD", BWD_VARIANTS[name])
    if name.startswith("wgmma64"):
        monkeypatch.setenv("PEAGLE_ATTN_WGMMA_BMQ", "64")
    if name.endswith("_pipe"):
        monkeypatch.setenv("PEAGLE_ATTN_WGMMA_PIPE", "2")
    elif name in ("wgmma", "wgmma64") and "PEAGLE_ATTN_WGMMA_PIPE" not in os.environ:
        monkeypatch.setenv("PEAGLE_ATTN_WGMMA_PIPE", "0")


def assert_bf16_rounding_close(a, b, what):
    """a, b: two runs of one computation whose fp32 partial sums were added in different orders
    and then rounded to a 16-bit type: every element may differ by one rounding step of the 16-bit
    type (<= 2^-7 relative for bf16, 2^-10 for fp16), plus a little for cancelling sums (fp32
    reordering noise is ~1e-7 of the summands)."""
    ulp = 2.0**-7 if a.dtype == torch.bfloat16 else 2.0**-10
    a64, b64 = a.double(), b.double()
    assert torch.isfinite(a64).all() and torch.isfinite(b64).all(), f"{what}: non-finite values"
    diff = (a64 - b64).abs()
    rms = b64.pow(2).mean().sqrt().item() if b64.numel() else 0.0
    bound = 1.01 * ulp * torch.maximum(a64.abs(), b64.abs()) + 1e-4 * rms
    bad = int((diff > bound).sum())
    assert bad == 0, (
        f"{what}: {bad} elements differ by more than a 16-bit rounding step "
        f"(max |diff| {diff.max().item():.3e}, rms {rms:.3e})"
    )
    assert rel_l2(a, b) <= 2e-3, f"{what}: rel err {rel_l2(a, b):.2e}"


def assert_rows_close(a, b, what, tol=2e-2):
    """Per (row, head) relative error of two [T, H, D] gradients computed with different summation
    orders and partitions of the keys (16-bit dS rounding may differ too): <= tol per row, with
    row norms floored at 0.1x the RMS row norm (rows with one key cancel to ~0). A missing or
    misplaced key block costs a row ~sqrt(64 / keys) of its norm, far above tol."""
    a64, b64 = a.double(), b.double()
    assert torch.isfinite(a64).all(), f"{what}: non-finite values"
    rn = b64.norm(dim=-1)
    floor = 0.1 * rn.pow(2).mean().sqrt().item()
    err = (a64 - b64).norm(dim=-1) / rn.clamp_min(max(floor, 1e-30))
    worst = err.flatten().topk(min(3, err.numel()))
    assert worst.values[0].item() <= tol, (
        f"{what}: worst (row, head) rel err {worst.values[0].item():.3e} at flat index "
        f"{worst.indices.tolist()} (tol {tol})"
    )
    assert rel_l2(a, b) <= 5e-3, f"{what}: rel err {rel_l2(a, b):.2e}"


# The atomic backward on the reference scenarios: every scenario at both head dims, the mode
# alternating so every scenario runs in both modes, dtype alternating by scenario (32 of the
# default's 64 cases would double the GPU time for little: the kernels differ only in the dQ sum).
BWD_VARIANT_CASES = [(d, (i + d // 64) % 2 == 1, i) for d in (64, 128) for i in range(len(GPU_SCENARIOS))]


@requires_cuda
@pytest.mark.parametrize(
    "d,cross,scen_idx",
    BWD_VARIANT_CASES,
    ids=[f"D{d}-{'cross' if x else 'sym'}-{GPU_SCENARIOS[i][0]}" for d, x, i in BWD_VARIANT_CASES],
)
def test_cuda_bwd_atomic_matches_reference(monkeypatch, d, cross, scen_idx):
    """The atomic-dQ backward against the float64 reference (same bound as the default one)."""
    set_bwd_variant(monkeypatch, "atomic")
    dtype = torch.bfloat16 if scen_idx % 2 == 0 else torch.float16
    _gpu_case(dtype, d, cross, GPU_SCENARIOS[scen_idx], seed_extra="bwd-atomic")


@requires_cuda
@requires_wgmma
@pytest.mark.parametrize("variant", ["wgmma", "wgmma_pipe"])
@pytest.mark.parametrize(
    "d,cross,scen_idx",
    BWD_VARIANT_CASES,
    ids=[f"D{d}-{'cross' if x else 'sym'}-{GPU_SCENARIOS[i][0]}" for d, x, i in BWD_VARIANT_CASES],
)
def test_cuda_bwd_wgmma_matches_reference(monkeypatch, d, cross, scen_idx, variant):
    """The wgmma dQ + dK/dV backward (and its pipelined loops) against the float64 reference (same
    bound as the default one)."""
    set_bwd_variant(monkeypatch, variant)
    dtype = torch.bfloat16 if scen_idx % 2 == 0 else torch.float16
    _gpu_case(dtype, d, cross, GPU_SCENARIOS[scen_idx], seed_extra=f"bwd-{variant}")


@requires_cuda
@requires_wgmma
@pytest.mark.parametrize("pipe", [False, True], ids=["plain", "pipelined"])
@pytest.mark.parametrize("scen_idx", range(len(GPU_SCENARIOS)), ids=[s[0] for s in GPU_SCENARIOS])
def test_cuda_fwd_wgmma_bwd_wgmma_matches_reference(monkeypatch, scen_idx, pipe):
    """PEAGLE_ATTN_FWD=wgmma with PEAGLE_ATTN_BWD=wgmma (the Hopper fwd + bwd together; the backward
    reads the wgmma forward's out and LSE) on every scenario, head dims / modes / dtypes alternating;
    pipelined: all of them with PEAGLE_ATTN_WGMMA_PIPE=2."""
    set_fwd_config(monkeypatch, "fwd_wgmma_pipe" if pipe else "fwd_wgmma")
    set_bwd_variant(monkeypatch, "wgmma_pipe" if pipe else "wgmma")
    dtype = torch.bfloat16 if scen_idx % 2 == 0 else torch.float16
    _gpu_case(
        dtype,
        64 if scen_idx % 4 < 2 else 128,
        scen_idx % 2 == 1,
        GPU_SCENARIOS[scen_idx],
        seed_extra=f"fwd-wgmma-bwd-wgmma-{pipe}",
    )


@requires_cuda
@requires_wgmma
@pytest.mark.parametrize("variant", ["wgmma64", "wgmma64_pipe"])
@pytest.mark.parametrize("scen_idx", range(len(GPU_SCENARIOS)), ids=[s[0] for s in GPU_SCENARIOS])
def test_cuda_bwd_wgmma64_matches_reference(monkeypatch, scen_idx, variant):
    """PEAGLE_ATTN_WGMMA_BMQ=64 (64-query blocks, D = 128 only; and pipelined) on every scenario, modes
    and dtypes alternating."""
    set_bwd_variant(monkeypatch, variant)
    dtype = torch.bfloat16 if scen_idx % 2 == 1 else torch.float16
    _gpu_case(dtype, 128, scen_idx % 2 == 0, GPU_SCENARIOS[scen_idx], seed_extra=f"bwd-{variant}")


@requires_cuda
@requires_wgmma
@pytest.mark.parametrize("cross", [False, True], ids=["sym", "cross"])
@pytest.mark.parametrize("d,variant", [(64, "wgmma"), (128, "wgmma"), (128, "wgmma64")])
def test_cuda_bwd_wgmma_agrees_with_default(monkeypatch, d, variant, cross):
    """Same function as the default backward: out bitwise equal (the same forward kernel), dq and dk /
    dv (+ context grads) from the same P / dS elements (the same query tiles and key blocks), with
    tensor-core sums in another order: per (row, head) to 2e-2 and rel. L2 <= 1e-3. A misplaced query
    block, key block or key row costs far more. Window + sink, GQA 4, padding rows (dq of those
    exactly 0), documents up to 1400 tokens."""
    g = torch.Generator().manual_seed(37 + d + int(cross))
    lay = make_layout(g, 3000, cross=cross, max_doc_len=1400, pad_tail=13, device="cuda")
    q, k, v, ctx = make_inputs(g, lay, 8, 2, d, torch.bfloat16, "cuda", cross)
    ins = [q, k, v] + list(ctx.values())
    go = torch.randn(q.shape, generator=g).to("cuda", torch.bfloat16)
    res = {}
    for name in ("mma", variant):
        set_bwd_variant(monkeypatch, name)
        out = cod_attention(q, k, v, lay, window=700, sink=3, **ctx)
        res["wgmma" if name == variant else name] = [out.detach()] + list(torch.autograd.grad(out, ins, go))
    names = ["out", "dq", "dk", "dv"] + ["d" + n for n in ctx]
    what = f"{variant} vs default D={d} cross={cross}"
    assert torch.equal(res["wgmma"][0], res["mma"][0]), f"{what}: forward differs"
    for name, a, b in zip(names[1:], res["wgmma"][1:], res["mma"][1:]):
        assert_rows_close(a, b, f"{what}: {name}")
        assert rel_l2(a, b) <= 1e-3, f"{what}: {name} rel err {rel_l2(a, b):.2e}"
    pad = lay.document_ids[lay.anchor.long()] < 0
    assert cross or pad.any(), "symmetric layout should have padding rows"
    assert torch.equal(res["wgmma"][1][pad], torch.zeros_like(res["wgmma"][1][pad])), f"{what}: padding dq not 0"


# Layouts of the pipelined-vs-unpipelined bitwise comparison: (name, n, cross, num_depths,
# max_doc_len, pad_tail, max_anchors, window, sink). T (= the layout's token count) is not a multiple
# of the 64-row tiles in every case but the tiny one (T < 64: one partial tile and key block).
PIPE_BITWISE_LAYOUTS = [
    ("padding-window-sink", 1500, False, 8, 500, 37, None, 200, 4),
    ("cross-window", 1200, True, 8, 600, 0, None, 150, 0),
    ("k64-chains", 500, False, 64, 300, 7, None, 64, 2),
    ("long-doc-max-anchors", 2100, False, 8, 2100, 0, 300, None, 0),
    ("tiny", 3, False, 8, 3, 0, None, None, 0),
]


def _wgmma_fwd_bwd(q, k, v, ctx, lay, go, window, sink):
    """out, LSE (the forward op itself) and every gradient of one wgmma fwd + bwd."""
    ins = [q, k, v] + list(ctx.values())
    out = cod_attention(q, k, v, lay, window=window, sink=sink, **ctx)
    grads = torch.autograd.grad(out, ins, go)
    meta = cod_attention_metadata(lay, cross=bool(ctx), window=window, sink=sink)
    _, lse = torch.ops.peagle.cod_attention_fwd(
        q.detach(),
        k.detach(),
        v.detach(),
        ctx.get("context_k"),
        ctx.get("context_v"),
        meta.ranges,
        meta.chains,
        meta.depth_offsets,
        1 / math.sqrt(q.shape[-1]),
        meta.use_sink,
    )
    return [out.detach(), lse] + list(grads)


@requires_cuda
@requires_wgmma
@pytest.mark.parametrize("d,bwd", [(64, "wgmma"), (128, "wgmma"), (128, "wgmma64")])
@pytest.mark.parametrize("case", PIPE_BITWISE_LAYOUTS, ids=[c[0] for c in PIPE_BITWISE_LAYOUTS])
def test_cuda_wgmma_pipe_bitwise_equal(monkeypatch, case, d, bwd):
    """PEAGLE_ATTN_WGMMA_PIPE=1 and 2 compute exactly what 0 does (the same wgmma and elementwise
    operations in the same order, only the waits move): out, LSE, dq, dk, dv (+ context grads)
    bitwise equal to PIPE=0, with the wgmma forward and backward, on padding, window + sink, cross
    mode, K = 64 chains, many full key blocks, T not a multiple of 64 and a tiny T."""
    name, n, cross, depths, max_doc, pad, max_anchors, window, sink = case
    g = torch.Generator().manual_seed(61 + d + len(name))
    lay = make_layout(
        g, n, cross=cross, num_depths=depths, max_doc_len=max_doc, pad_tail=pad, max_anchors=max_anchors, device="cuda"
    )
    assert name == "tiny" or lay.num_tokens % 64 != 0, "layout should end with a partial tile"
    dtype = torch.float16 if name == "cross-window" else torch.bfloat16
    q, k, v, ctx = make_inputs(g, lay, 8, 2, d, dtype, "cuda", cross)
    go = torch.randn(q.shape, generator=g).to("cuda", dtype)
    names = ["out", "lse", "dq", "dk", "dv"] + ["d" + x for x in ctx]
    res = {}
    for level in ("0", "1", "2"):
        set_fwd_config(monkeypatch, "fwd_wgmma")
        set_bwd_variant(monkeypatch, bwd)
        monkeypatch.setenv("PEAGLE_ATTN_WGMMA_PIPE", level)
        res[level] = _wgmma_fwd_bwd(q, k, v, ctx, lay, go, window, sink)
    assert all(torch.isfinite(x).all() for x in res["0"][2:]), f"{name}: non-finite gradients"
    for level in ("1", "2"):
        diff = [nm for nm, a, b in zip(names, res[level], res["0"]) if not torch.equal(a, b)]
        assert not diff, f"{name} D={d} {bwd}: PIPE={level} differs from PIPE=0 in {diff} (T={lay.num_tokens})"


def _pipe_level_of(kernel_name):
    """The PIPE template argument of a wgmma kernel name as the profiler reports it, demangled
    (cod_attn_dkv_wgmma_kernel<128, __nv_bfloat16, 64, 2, 0>(...)) or mangled (...Li128E13__nv_
    bfloat16Li64ELi2ELi0EEEv...). The forward <D, dtype, 64, PIPE> and the dK/dV pass <D, dtype, BMQ,
    PIPE, DQ_ADD> have it 4th, the dQ pass <D, dtype, PIPE> 3rd (its integer literals: D, PIPE)."""
    import re

    dq = "dq_wgmma_kernel" in kernel_name
    m = re.search(r"_kernel<([^<>]*)>\(", kernel_name)
    if m:
        args = [a.strip() for a in m.group(1).split(",")]
        pos = 2 if dq else 3
        return int(args[pos]) if len(args) > pos and args[pos].isdigit() else None
    ints = re.findall(r"Li(\d+)E", kernel_name)
    pos = 1 if dq else 2
    return int(ints[pos]) if len(ints) > pos else None


@requires_cuda
@requires_wgmma
@pytest.mark.parametrize("bwd", ["wgmma", "wgmma64"])
@pytest.mark.parametrize("level", [0, 1, 2, "unset"])
def test_cuda_wgmma_pipe_selects_kernels(monkeypatch, level, bwd):
    """PEAGLE_ATTN_WGMMA_PIPE really picks the kernels (profiler, D = 128): the wgmma forward and the
    dK/dV pass with PIPE = level (the 64-query dK/dV pass: min(level, 1)), the dQ pass with
    min(level, 1); unset = level 2. Without this the bitwise test above would also pass if the glue
    ignored the env."""
    set_fwd_config(monkeypatch, "fwd_wgmma")
    set_bwd_variant(monkeypatch, bwd)
    if level == "unset":
        monkeypatch.delenv("PEAGLE_ATTN_WGMMA_PIPE")
        level = 2
    else:
        monkeypatch.setenv("PEAGLE_ATTN_WGMMA_PIPE", str(level))
    g = torch.Generator().manual_seed(67)
    lay = make_layout(g, 400, max_doc_len=200, device="cuda")
    q, k, v, _ = make_inputs(g, lay, 4, 2, 128, torch.bfloat16, "cuda", False)
    go = torch.randn(q.shape, generator=g).to("cuda", torch.bfloat16)
    names = profiled_kernel_names(
        lambda: torch.autograd.grad(cod_attention(q, k, v, lay, window=50, sink=2), [q, k, v], go), "wgmma_kernel"
    )
    want = {
        "cod_attn_fwd_wgmma_kernel": level,
        "cod_attn_dq_wgmma_kernel": min(level, 1),
        "cod_attn_dkv_wgmma_kernel": min(level, 1) if bwd == "wgmma64" else level,
    }
    got = {kern: sorted({_pipe_level_of(n) for n in names if kern in n}) for kern in want}
    assert got == {kern: [lv] for kern, lv in want.items()}, sorted(names)


@requires_cuda
@requires_wgmma
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cross", [False, True], ids=["sym", "cross"])
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_auto_is_bitwise_mma(monkeypatch, d, cross, dtype):
    """What the README promises: on sm_90 the default (auto: wgmma forward, wgmma backward with
    64-query blocks at D = 128) gives the mma.sync kernels' out and every gradient bit for bit at
    D = 128 (same 64-row query tiles, key blocks and per-element k-order of the fp32 sums). At D = 64
    the mma.sync forward runs 128-row query tiles (8 warps), so its key blocks differ and out agrees
    to rounding only; the backward, given the same forward, is still bit for bit. Window + sink,
    GQA 4, padding."""
    g = torch.Generator().manual_seed(59 + d + int(cross))
    lay = make_layout(g, 2500, cross=cross, max_doc_len=1100, pad_tail=9, device="cuda")
    q, k, v, ctx = make_inputs(g, lay, 8, 2, d, dtype, "cuda", cross)
    ins = [q, k, v] + list(ctx.values())
    go = torch.randn(q.shape, generator=g).to("cuda", dtype)
    res, fwd_only = {}, {}
    for name in ("mma", "auto"):
        set_fwd_config(monkeypatch, name)
        with torch.no_grad():
            fwd_only[name] = cod_attention(q, k, v, lay, window=600, sink=3, **ctx)
        set_fwd_config(monkeypatch, name if d == 128 else "mma")
        set_bwd_variant(monkeypatch, name)
        out = cod_attention(q, k, v, lay, window=600, sink=3, **ctx)
        res[name] = [out.detach()] + list(torch.autograd.grad(out, ins, go))
    names = ["out", "dq", "dk", "dv"] + ["d" + n for n in ctx]
    what = f"auto vs mma (D={d} cross={cross} {dtype})"
    for name, a, b in zip(names, res["auto"], res["mma"]):
        assert torch.equal(a, b), f"{what}: {name} differs, max |diff| {(a.float() - b.float()).abs().max().item():.3e}"
    a, b = fwd_only["auto"], fwd_only["mma"]
    if d == 128:
        assert torch.equal(a, b), f"{what}: forward differs"
    else:
        assert_rows_close(a, b, f"{what}: forward")
        assert rel_l2(a, b) <= 1e-3, f"{what}: forward rel err {rel_l2(a, b):.2e}"


@requires_cuda
@pytest.mark.parametrize(
    "var,value", [("PEAGLE_ATTN_FWD", "wgmmma"), ("PEAGLE_ATTN_BWD", "fast"), ("PEAGLE_ATTN_WGMMA_PIPE", "3")]
)
def test_cuda_unknown_kernel_env_refused(monkeypatch, var, value):
    """A misspelt kernel choice is a ValueError naming the variable and its value (the forward reads
    PEAGLE_ATTN_FWD and PEAGLE_ATTN_WGMMA_PIPE, the backward PEAGLE_ATTN_BWD), never a silent
    fallback to some other kernel."""
    set_fwd_config(monkeypatch, "auto")
    set_bwd_variant(monkeypatch, "auto")
    monkeypatch.setenv(var, value)
    g = torch.Generator().manual_seed(71)
    lay = make_layout(g, 200, device="cuda")
    q, k, v, _ = make_inputs(g, lay, 4, 2, 64, torch.bfloat16, "cuda", False)
    with pytest.raises(ValueError, match=f"{var}={value}"):
        out = cod_attention(q, k, v, lay)
        torch.autograd.grad(out.float().sum(), [q, k, v])


@requires_cuda
def test_cuda_bwd_wgmma_refused_off_sm90(monkeypatch):
    """Where wgmma cannot run (not compute capability 9.0, or a build without sm_90a), the backward
    raises a sentence naming the requirement instead of running anything."""
    if HAS_WGMMA:
        pytest.skip("this GPU runs PEAGLE_ATTN_BWD=wgmma")
    set_bwd_variant(monkeypatch, "wgmma")
    g = torch.Generator().manual_seed(43)
    lay = make_layout(g, 200, device="cuda")
    q, k, v, _ = make_inputs(g, lay, 4, 2, 64, torch.bfloat16, "cuda", False)
    out = cod_attention(q, k, v, lay)
    with pytest.raises(RuntimeError, match="PEAGLE_ATTN_BWD=wgmma needs an sm_90 GPU"):
        torch.autograd.grad(out.float().sum(), [q, k, v])


@requires_cuda
@pytest.mark.parametrize("cross", [False, True], ids=["sym", "cross"])
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_bwd_atomic_agrees_with_default(monkeypatch, d, cross):
    """Same function as the deterministic backward: out identical (same forward), dk / dv from the
    same key-major kernel code (asserted to rounding level, reported if not bitwise), dq per
    (row, head) to 2e-2 (other key partition and summation order). Window + sink, GQA 4, padding
    rows (symmetric), documents up to 1400 tokens (up to 22 key blocks, i.e. atomic adds, per dq
    element)."""
    g = torch.Generator().manual_seed(31 + d + int(cross))
    lay = make_layout(g, 3000, cross=cross, max_doc_len=1400, pad_tail=13, device="cuda")
    q, k, v, ctx = make_inputs(g, lay, 8, 2, d, torch.bfloat16, "cuda", cross)
    ins = [q, k, v] + list(ctx.values())
    go = torch.randn(q.shape, generator=g).to("cuda", torch.bfloat16)
    res = {}
    for name in ("mma", "atomic"):
        set_bwd_variant(monkeypatch, name)
        out = cod_attention(q, k, v, lay, window=700, sink=3, **ctx)
        res[name] = [out.detach()] + list(torch.autograd.grad(out, ins, go))
    names = ["out", "dq", "dk", "dv"] + ["d" + n for n in ctx]
    what = f"atomic vs default D={d} cross={cross}"
    assert torch.equal(res["atomic"][0], res["mma"][0]), f"{what}: forward differs"
    for name, a, b in zip(names[1:], res["atomic"][1:], res["mma"][1:]):
        if name == "dq":
            assert_rows_close(a, b, f"{what}: dq")
        else:
            assert rel_l2(a, b) <= 1e-3, (
                f"{what}: {name} rel err {rel_l2(a, b):.2e} (bitwise equal: {torch.equal(a, b)})"
            )
    pad = lay.document_ids[lay.anchor.long()] < 0
    assert cross or pad.any(), "symmetric layout should have padding rows"
    assert torch.equal(res["atomic"][1][pad], torch.zeros_like(res["atomic"][1][pad])), f"{what}: padding dq not 0"


@requires_cuda
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("bwd", ["mma", "atomic", WGMMA, WGMMA_PIPE])
def test_cuda_bwd_variants_deep_chains(monkeypatch, bwd, cross):
    """K = 64 depths (the most chain keys per query: the atomic variant's finish kernel sums them
    per row) with window + sink, fwd and bwd against the CPU op in float32 on bf16-rounded inputs."""
    set_bwd_variant(monkeypatch, bwd)
    g = torch.Generator().manual_seed(23 + int(cross))
    lay = make_layout(g, 500, cross=cross, num_depths=64, max_doc_len=300, pad_tail=7)
    assert len(lay.depth_offsets) - 1 == 64
    q, k, v, ctx = make_inputs(g, lay, 4, 2, 128, torch.bfloat16, "cpu", cross, requires_grad=False)
    go = torch.randn(q.shape, generator=g).bfloat16()
    gin = [x.cuda().requires_grad_(True) for x in [q, k, v] + list(ctx.values())]
    gctx = dict(zip(ctx.keys(), gin[3:]))
    out = cod_attention(*gin[:3], lay.to("cuda"), window=64, sink=2, **gctx)
    grads = torch.autograd.grad(out, gin, go.cuda())
    cin = [x.float().requires_grad_(True) for x in [q, k, v] + list(ctx.values())]
    cctx = dict(zip(ctx.keys(), cin[3:]))
    cout = cod_attention(*cin[:3], lay, window=64, sink=2, **cctx)
    cgrads = torch.autograd.grad(cout, cin, go.float())
    names = ["out", "dq", "dk", "dv"] + ["d" + n for n in ctx]
    assert_close_all(
        names,
        [out.cpu()] + [x.cpu() for x in grads],
        [cout] + list(cgrads),
        tol=1e-2,
        what=f"K=64 bwd={bwd} cross={cross}",
    )


@requires_cuda
@pytest.mark.parametrize("bwd", ["auto", "mma", "atomic", WGMMA])
def test_cuda_bwd_variants_select_kernels(monkeypatch, bwd):
    """The env switch really picks the backward: the kernels launched by one fwd+bwd (profiler)
    are the query-major dQ kernel for the default and the dQ finish kernel (no dQ kernel) for
    "atomic"; "wgmma" runs the wgmma dQ and dK/dV kernels instead of the mma.sync ones.
    Without this, every variant test above would also pass if the glue ignored the env."""
    set_bwd_variant(monkeypatch, bwd)
    g = torch.Generator().manual_seed(41)
    lay = make_layout(g, 400, max_doc_len=200, device="cuda")
    q, k, v, _ = make_inputs(g, lay, 4, 2, 64, torch.bfloat16, "cuda", False)
    go = torch.randn(q.shape, generator=g).to("cuda", torch.bfloat16)
    names = profiled_kernel_names(
        lambda: torch.autograd.grad(cod_attention(q, k, v, lay, window=50, sink=2), [q, k, v], go), "cod_attn_"
    )
    has_dq = any("cod_attn_dq_kernel" in n for n in names)
    has_dq_wgmma = any("cod_attn_dq_wgmma_kernel" in n for n in names)
    has_finish = any("cod_attn_dq_finish_kernel" in n for n in names)
    kind = ("wgmma" if HAS_WGMMA else "mma") if bwd == "auto" else bwd
    want_dq = {"mma": (True, False, False), "atomic": (False, False, True), "wgmma": (False, True, False)}[kind]
    assert (has_dq, has_dq_wgmma, has_finish) == want_dq, sorted(set(names))
    has_wgmma = any("cod_attn_dkv_wgmma_kernel" in n for n in names)
    has_dkv = any("cod_attn_dkv_kernel" in n for n in names)
    assert (has_wgmma, has_dkv) == ((True, False) if kind == "wgmma" else (False, True)), sorted(set(names))


@requires_cuda
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("window,sink", [(None, 0), (40, 0), (9, 4), (2, 0)])
def test_cuda_metadata_equals_cpu(rng, cross, window, sink):
    lay = make_layout(rng, 3000, cross=cross, max_doc_len=500, pad_tail=40)
    cpu = cod_attention_metadata(lay, cross=cross, window=window, sink=sink)
    gpu = cod_attention_metadata(lay.to("cuda"), cross=cross, window=window, sink=sink)
    assert torch.equal(cpu.ranges, gpu.ranges.cpu()), "ranges differ between CPU and CUDA"
    assert torch.equal(cpu.chains[0], gpu.chains[0].cpu()), "chain table differs between CPU and CUDA"
    assert torch.equal(cpu.chains[1], gpu.chains[1].cpu()), "reverse chain table differs between CPU and CUDA"


@requires_cuda
@pytest.mark.parametrize(
    "cfg,bwd",
    [
        ("auto", "auto"),
        ("mma", "mma"),
        ("mf2w4", "mma"),
        ("mma", "atomic"),
        pytest.param("mma", "wgmma", marks=requires_wgmma),
        pytest.param("fwd_wgmma", "mma", marks=requires_fwd_wgmma),
        pytest.param("fwd_wgmma", "wgmma", marks=requires_wgmma),
    ],
)
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_matches_cpu_float32(rng, monkeypatch, d, cfg, bwd):
    """Same algorithm on both devices: CUDA bf16 vs the CPU path in float32 on bf16-rounded inputs."""
    set_fwd_config(monkeypatch, cfg)
    set_bwd_variant(monkeypatch, bwd)
    lay = make_layout(rng, 1500, max_doc_len=600, pad_tail=11)
    q, k, v, _ = make_inputs(rng, lay, 8, 2, d, torch.bfloat16, "cuda", False)
    go = torch.randn(q.shape, generator=rng).to("cuda", torch.bfloat16)
    out = cod_attention(q, k, v, lay.to("cuda"), window=200, sink=4)
    gq = torch.autograd.grad(out, [q, k, v], go)
    cq, ck, cv = (x.detach().cpu().float().requires_grad_(True) for x in (q, k, v))
    cout = cod_attention(cq, ck, cv, lay, window=200, sink=4)
    cg = torch.autograd.grad(cout, [cq, ck, cv], go.cpu().float())
    assert_close_all(
        ["out", "dq", "dk", "dv"],
        [out.cpu()] + [x.cpu() for x in gq],
        [cout] + list(cg),
        tol=1e-2,
        what=f"cuda vs cpu D={d} fwd {cfg} bwd {bwd}",
    )


@requires_cuda
@pytest.mark.parametrize("bwd", ["mma", "atomic", WGMMA])
@pytest.mark.parametrize("cross", [False, True])
def test_cuda_tiny_and_padding(monkeypatch, cross, bwd):
    set_bwd_variant(monkeypatch, bwd)
    g = torch.Generator().manual_seed(11)
    for n in (1, 2, 3, 5, 9):  # T = 1, N < K
        doc = torch.zeros(n, dtype=torch.int32)
        lay = cod_sample(
            doc, torch.ones(n, dtype=torch.bool), num_depths=8, depth0="anchors" if cross else "all", seed=3
        ).to("cuda")
        if lay.num_tokens == 0:
            continue
        for d in (64, 128):
            q, k, v, ctx = make_inputs(g, lay, 4, 2, d, torch.bfloat16, "cuda", cross)
            names, ours, refs, go = run_both(g, lay, q, k, v, ctx, window=2, return_go=True)
            what = f"cuda tiny n={n} D={d} cross={cross} bwd={bwd}"
            # With 1-3 keys per row the gradients are differences of nearly equal terms (at T = 1
            # the exact dq is 0). The backward takes delta = rowsum(dO * O) from the rounded bf16
            # output, as FlashAttention does; that rounding alone then costs ~1e-2 relative error
            # in dq/dk (seen: 1.3e-2 at n=2). So: the gradients must match this algorithm run
            # exactly in float64 on our own output to 1e-2, and the exact math to 3e-2. Norms are
            # floored at an RMS of 1e-3 per element (gradients here are O(1) per element): at T = 1
            # both references are ~0 and only rounding noise (~1e-7) is left to compare.
            algo = flash_backward_reference(q, k, v, ctx, lay, go, ours[0], window=2)
            assert_close_all(names[:1], ours[:1], refs[:1], tol=1e-2, what=what)
            assert_close_all(
                names[1:], ours[1:], algo, tol=1e-2, floor=1e-3, what=what + " (vs its algorithm in float64)"
            )
            assert_close_all(names[1:], ours[1:], refs[1:], tol=3e-2, floor=1e-3, what=what + " (vs exact gradients)")
    doc = torch.tensor([-1] * 7 + [0] * 40 + [-1] * 5 + [1] * 30 + [-1] * 9, dtype=torch.int32)
    lay = cod_sample(doc, doc >= 0, num_depths=5, depth0="anchors" if cross else "all", seed=2).to("cuda")
    q, k, v, ctx = make_inputs(g, lay, 4, 1, 64, torch.float16, "cuda", cross)
    names, ours, refs = run_both(g, lay, q, k, v, ctx, window=6, sink=2)
    assert_close_all(names, ours, refs, tol=1e-2, what=f"cuda padding cross={cross} bwd={bwd}")
    out = cod_attention(q, k, v, lay, window=6, sink=2, **ctx)
    pad = lay.document_ids[lay.anchor.long()] < 0
    if pad.any():
        assert torch.equal(out[pad], torch.zeros_like(out[pad]))


@requires_cuda
@pytest.mark.parametrize(
    "cfg,bwd",
    [
        ("auto", "auto"),
        ("mma", "mma"),
        ("mf2w4", "mma"),
        ("mma", "atomic"),
        pytest.param("mma", "wgmma", marks=requires_wgmma),
        pytest.param("fwd_wgmma", "mma", marks=requires_fwd_wgmma),
    ],
)
def test_cuda_all_padding_gives_zeros(monkeypatch, cfg, bwd):
    set_fwd_config(monkeypatch, cfg)
    set_bwd_variant(monkeypatch, bwd)
    doc = torch.full((300,), -1, dtype=torch.int32)
    lay = cod_sample(doc, torch.zeros(300, dtype=torch.bool), num_depths=4, seed=0).to("cuda")
    g = torch.Generator().manual_seed(1)
    q, k, v, _ = make_inputs(g, lay, 4, 2, 128, torch.bfloat16, "cuda", False)
    out = cod_attention(q, k, v, lay)
    grads = torch.autograd.grad(out.float().sum(), [q, k, v])
    assert torch.equal(out, torch.zeros_like(out))
    for gr in grads:
        assert torch.equal(gr, torch.zeros_like(gr))


@requires_cuda
@pytest.mark.parametrize("bwd", ["auto", "mma", "atomic", WGMMA, WGMMA64_PIPE])
@pytest.mark.parametrize("cross", [False, True])
def test_cuda_backward_is_deterministic(monkeypatch, cross, bwd):
    """Default and wgmma backward: bitwise reproducible. Atomic: out, dk, dv (and context grads) still are
    (no atomics there); dq is summed with fp32 atomics in a run-dependent order, so two runs agree
    to one 16-bit rounding step per element."""
    set_bwd_variant(monkeypatch, bwd)
    g = torch.Generator().manual_seed(5)
    lay = make_layout(g, 4000, cross=cross, max_doc_len=1500, device="cuda")
    q, k, v, ctx = make_inputs(g, lay, 8, 2, 128, torch.bfloat16, "cuda", cross)
    ins = [q, k, v] + list(ctx.values())
    go = torch.randn(q.shape, generator=g).to("cuda", torch.bfloat16)
    runs = []
    for _ in range(2):
        out = cod_attention(q, k, v, lay, window=512, sink=4, **ctx)
        runs.append([out] + list(torch.autograd.grad(out, ins, go)))
    names = ["out", "dq", "dk", "dv"] + ["d" + n for n in ctx]
    for name, a, b in zip(names, *runs):
        if bwd == "atomic" and name == "dq":
            assert_bf16_rounding_close(a, b, f"atomic dq run to run, cross={cross}")
        else:
            assert torch.equal(a, b), f"{name} differs between runs (bwd={bwd}, cross={cross})"


@requires_cuda
@pytest.mark.parametrize(
    "bwd", ["auto", "mma", "atomic", WGMMA, pytest.param("wgmma64", marks=requires_wgmma), WGMMA64_PIPE]
)
def test_cuda_graph_capture(monkeypatch, bwd):
    """fwd + bwd captured in a CUDA graph (the atomic variant's workspace zeroing is a
    cudaMemsetAsync on the capturing stream) and replayed: same results as eager (dq of the atomic
    variant to rounding: summation order)."""
    set_bwd_variant(monkeypatch, bwd)
    g = torch.Generator().manual_seed(9)
    lay = make_layout(g, 2000, max_doc_len=700, device="cuda")
    q, k, v, _ = make_inputs(g, lay, 8, 2, 64, torch.bfloat16, "cuda", False)
    go = torch.randn(q.shape, generator=g).to("cuda", torch.bfloat16)

    def step():
        out = cod_attention(q, k, v, lay, window=300, sink=2)
        grads = torch.autograd.grad(out, [q, k, v], go)
        # detached: an autograd graph kept alive past the step keeps the leaves' AccumulateGrad
        # nodes, made on the default stream, and the captured backward would then sync with the
        # legacy stream (cudaErrorStreamCaptureImplicit; torch warns about exactly this)
        return [out.detach()] + list(grads)

    eager = step()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up on the side stream, as torch.cuda.graphs asks
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()

    def assert_same(expected, what):
        # the atomic backward's dq is summed in a varying order: equal up to rounding
        for name, a, b in zip(["out", "dq", "dk", "dv"], expected, static):
            if bwd == "atomic" and name == "dq":
                assert_bf16_rounding_close(b, a, f"{what}, atomic dq")
            else:
                assert torch.equal(a, b), f"{name}: {what} differs (bwd={bwd})"

    graph.replay()
    torch.cuda.synchronize()
    assert_same(eager, "graph replay vs eager")
    # a second replay overwrites the static outputs in place: still the same function (the
    # workspace is zeroed inside the graph, not once at capture)
    first = [x.clone() for x in static]
    graph.replay()
    torch.cuda.synchronize()
    assert_same(first, "second replay")


def _row_reference(q, k, v, lay, rows, go, window, sink, scale):
    """Exact float64 outputs and dq for selected query rows (keys from the rules, not the kernel)."""
    doc = lay.document_ids.long()
    a, d = lay.anchor.long(), lay.depth.long()
    starts = document_starts(doc)
    n = doc.shape[0]
    group = q.shape[1] // k.shape[1]
    outs, dqs = [], []
    for i in rows.tolist():
        if doc[a[i]] < 0:
            outs.append(torch.zeros(q.shape[1:], dtype=torch.float64, device=q.device))
            dqs.append(torch.zeros(q.shape[1:], dtype=torch.float64, device=q.device))
            continue
        pos = torch.arange(n, device=q.device)
        ok = (pos <= a[i]) & (pos >= starts[a[i]])
        if window is not None:
            w = pos > a[i] + d[i] - window
            if sink > 0:
                w |= (pos - starts[a[i]]) < sink
            ok &= w
        keys = set(pos[ok].tolist())
        chain = ((a == a[i]) & (d <= d[i])).nonzero().flatten().tolist()
        keys |= set(chain)  # depth-0 rows are rows 0..N-1 (symmetric)
        idx = torch.tensor(sorted(keys), device=q.device)
        kk = k[idx].double().repeat_interleave(group, 1)  # [J, Hq, D]
        vv = v[idx].double().repeat_interleave(group, 1)
        qi = q[i].double()
        s = torch.einsum("hd,jhd->hj", qi, kk) * scale
        p = torch.softmax(s, -1)
        o = torch.einsum("hj,jhd->hd", p, vv)
        dp = torch.einsum("hd,jhd->hj", go[i].double(), vv)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        outs.append(o)
        dqs.append(torch.einsum("hj,jhd->hd", ds, kk) * scale)
    return torch.stack(outs), torch.stack(dqs)


@requires_cuda
@pytest.mark.parametrize(
    "n,window,max_anchors,cfg",
    [
        (32768, None, None, "auto"),
        (32768, None, None, "mma"),
        (32768, None, None, "mf2w4"),
        (65536, 2048, 1024, "auto"),
        (131072, 4096, None, "auto"),
        (131072, 4096, None, "mf2w4"),
        (32768, None, None, "atomic"),
        (131072, 4096, None, "atomic"),
        pytest.param(32768, None, None, "wgmma", marks=requires_wgmma),
        pytest.param(32768, None, None, "fwd_wgmma", marks=requires_fwd_wgmma),
        pytest.param(131072, 4096, None, "wgmma", marks=requires_wgmma),
    ],
)
def test_cuda_large_n_spot_checks(monkeypatch, n, window, max_anchors, cfg):
    """Large layouts (bench sizes): sampled rows of out/dq against an exact per-row reference, and
    the global identities sum_j dV_j = sum_i dO_i (valid rows) and sum_j dK_j = 0 per kv head.
    cfg "auto": what runs without the env; "mma": the mma.sync forward and backward; "atomic": the
    mma.sync forward with the atomic-dQ backward (documents up to 8192 tokens: up to 128 key
    blocks, i.e. atomic adds, per dq element); "wgmma": the mma.sync forward with the wgmma dQ +
    dK/dV backward; "mf2w4" / "fwd_wgmma": that forward with the auto backward."""
    bwd = cfg if cfg in ("atomic", "wgmma", "mma") else "auto"
    set_fwd_config(monkeypatch, "mma" if bwd != "auto" else cfg)
    set_bwd_variant(monkeypatch, bwd)
    g = torch.Generator().manual_seed(n)
    lay = make_layout(g, n, max_anchors=max_anchors, max_doc_len=8192, pad_tail=100, device="cuda")
    hq, hkv, d = 8, 2, 128
    q, k, v, _ = make_inputs(g, lay, hq, hkv, d, torch.bfloat16, "cuda", False)
    go = torch.randn(q.shape, generator=g).to("cuda", torch.bfloat16)
    sink = 4 if window else 0
    out = cod_attention(q, k, v, lay, window=window, sink=sink)
    dq, dk, dv = torch.autograd.grad(out, [q, k, v], go)
    for x, name in ((out, "out"), (dq, "dq"), (dk, "dk"), (dv, "dv")):
        assert torch.isfinite(x).all(), f"{name} has non-finite values"
    t = lay.num_tokens
    o = lay.depth_offsets
    picks = [torch.randint(o[e], o[e + 1], (24,), generator=g) for e in range(len(o) - 1) if o[e + 1] > o[e]]
    rows = torch.cat(picks + [torch.tensor([0, t - 1])]).unique().to("cuda")
    ro, rdq = _row_reference(q.detach(), k.detach(), v.detach(), lay, rows, go, window, sink, 1 / math.sqrt(d))
    assert rel_l2(out[rows], ro) <= 1e-2, f"out rows rel err {rel_l2(out[rows], ro):.2e}"
    assert rel_l2(dq[rows], rdq) <= 1e-2, f"dq rows rel err {rel_l2(dq[rows], rdq):.2e}"
    valid = lay.document_ids[lay.anchor.long()] >= 0
    want_dv = (go.double() * valid[:, None, None]).reshape(t, hkv, hq // hkv, d).sum((0, 2))
    got_dv = dv.double().sum(0)
    assert rel_l2(got_dv, want_dv) <= 1e-2, f"sum dV identity rel err {rel_l2(got_dv, want_dv):.2e}"
    dk_sum = dk.double().sum(0).norm().item()
    dk_scale = dk.double().norm().item()
    assert dk_sum <= 0.05 * dk_scale, f"sum dK identity: |sum| {dk_sum:.3e} vs |dK| {dk_scale:.3e}"
