"""COD attention vs the dense-mask SDPA reference (peagle_ext.reference), CPU and CUDA.

CPU: forward and every gradient in float64 against reference_cod_attention (tight), float32 /
bf16 loosely. CUDA (skipped without a GPU): bf16/fp16 kernels against the float64 reference with
relative L2 error <= 1e-2 on out, dq, dk, dv (+ context grads), for symmetric and cross layouts,
windows, sinks, GQA 1/4/8, D 64/128, odd sizes; determinism; CUDA-graph capture; large N spot
checks; metadata equal on both devices. A failing GPU case names its configuration.
"""
import math
import os

import pytest
import torch

from conftest import HAS_CUDA, random_documents, requires_cuda
from peagle_ext.attention import cod_attention, cod_attention_metadata
from peagle_ext.cod import CodLayout, cod_sample
from peagle_ext.reference import dense_cod_mask, document_starts, reference_cod_attention


# ---------------------------------------------------------------- helpers
def make_layout(g, n, *, cross=False, num_depths=8, max_anchors=None, max_doc_len=120, pad_tail=0, r=0.7,
                device="cpu"):
    doc, lm = random_documents(n, g, max_doc_len=max_doc_len, pad_tail=pad_tail)
    seed = int(torch.randint(0, 2**31, (1,), generator=g))
    lay = cod_sample(doc, lm, num_depths=num_depths, down_sample_ratio=r, max_anchors=max_anchors,
                     depth0="anchors" if cross else "all", seed=seed)
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


def run_both(g, lay, q, k, v, ctx, *, window=None, sink=0, scale=None):
    """(ours, reference) outputs and gradients; the reference runs in float64 on the same device."""
    ins = [q, k, v] + list(ctx.values())
    out = cod_attention(q, k, v, lay, window=window, sink=sink, scale=scale, **ctx)
    go = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.device)
    grads = torch.autograd.grad(out, ins, go.to(out.dtype)) if out.numel() else [torch.zeros_like(x) for x in ins]
    ref_ins = [x.detach().double().requires_grad_(True) for x in ins]
    rctx = dict(zip(ctx.keys(), ref_ins[3:]))
    ref = reference_cod_attention(*ref_ins[:3], lay, window=window, sink=sink, scale=scale, **rctx)
    rgrads = torch.autograd.grad(ref, ref_ins, go) if ref.numel() else [torch.zeros_like(x) for x in ref_ins]
    names = ["out", "dq", "dk", "dv"] + ["d" + n for n in ctx.keys()]
    return names, [out] + list(grads), [ref] + list(rgrads)


def rel_l2(x, ref):
    x, ref = x.double(), ref.double()
    den = ref.norm().item()
    num = (x - ref).norm().item()
    return num / den if den > 0 else num


def assert_close_all(names, ours, refs, *, tol, what, rel=True):
    for name, a, b in zip(names, ours, refs):
        assert a.shape == b.shape, f"{what}: {name} shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert torch.isfinite(a).all(), f"{what}: {name} has non-finite values"
        if rel:
            err = rel_l2(a, b)
        else:
            err = (a.double() - b.double()).abs().max().item()
        assert err <= tol, f"{what}: {name} error {err:.3e} > {tol:.1e}"


# ---------------------------------------------------------------- metadata
def _mask_from_metadata(lay, meta, cross):
    """Dense [T, N+T] count of how often each (query, key) pair is visited: range keys in the
    first N columns, layout tokens after them (symmetric depth-0 range rows map to tokens 0..N-1)."""
    t, n = lay.num_tokens, lay.seq_len
    rg = meta.ranges.cpu().long()
    ch = meta.chains[0].cpu().long()
    cnt = torch.zeros(t, n + t, dtype=torch.long)
    pos = torch.arange(n)
    for i in range(t):
        if not rg[4, i]:
            continue
        inr = ((pos >= rg[0, i]) & (pos < rg[1, i])) | ((pos >= rg[2, i]) & (pos < rg[3, i]))
        if not meta.use_sink:
            inr = (pos >= rg[0, i]) & (pos < rg[1, i])
        cnt[i, :n] += inr.long()
        for c in ch[i].tolist():
            if c >= 0:
                cnt[i, n + c] += 1
    if not cross:  # fold the symmetric depth-0 range keys onto their layout rows
        cnt[:, n:2 * n] += cnt[:, :n]
        cnt = cnt[:, n:]
    return cnt


@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("window,sink", [(None, 0), (9, 0), (6, 2), (1, 0), (3, 50)])
def test_metadata_is_the_dense_mask_each_pair_once(rng, cross, window, sink):
    lay = make_layout(rng, 160, cross=cross, max_doc_len=50, pad_tail=5)
    meta = cod_attention_metadata(lay, cross=cross, window=window, sink=sink)
    cnt = _mask_from_metadata(lay, meta, cross)
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
        seg = meta.ranges[:4, o[e]:o[e + 1]]
        if seg.shape[1] > 1:
            assert bool((seg[:, 1:] >= seg[:, :-1]).all()), f"depth {e}: bounds not monotone"


# ---------------------------------------------------------------- CPU correctness
CPU_CASES = [
    # (n, cross, window, sink, hq, hkv, d, max_anchors, num_depths, pad_tail)
    (150, False, None, 0, 2, 1, 16, None, 8, 0),
    (150, False, 7, 0, 4, 1, 8, None, 8, 6),
    (150, False, 5, 3, 4, 4, 8, None, 6, 4),
    (150, False, 2, 1, 8, 1, 8, None, 8, 0),      # window <= depth: own depth-0 token via the chain
    (200, False, None, 0, 2, 2, 16, 20, 8, 10),   # max_anchors
    (130, True, None, 0, 4, 1, 16, None, 8, 3),
    (130, True, 6, 2, 2, 1, 8, None, 8, 0),
    (130, True, 1, 0, 8, 1, 8, 15, 5, 7),
    (70, False, 3, 5, 2, 1, 64, None, 8, 2),      # D 64
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_cpu_float64_matches_reference(rng, case):
    n, cross, window, sink, hq, hkv, d, max_anchors, k_depths, pad = case
    lay = make_layout(rng, n, cross=cross, max_anchors=max_anchors, num_depths=k_depths, max_doc_len=60,
                      pad_tail=pad)
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
    lay = CodLayout(torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), [0, 1],
                    torch.zeros(1, dtype=torch.int32))
    q, k, v, _ = make_inputs(rng, lay, 1, 1, 4, torch.float64, "cpu", False)
    out = cod_attention(q, k, v, lay)
    assert torch.allclose(out, v.detach())  # one key: the output is its value


def test_padding_rows_are_zero_with_zero_grads(rng):
    doc = torch.tensor([0] * 10 + [-1] * 5 + [1] * 8 + [-1] * 4, dtype=torch.int32)
    lm = doc >= 0
    lay = cod_sample(doc, lm, num_depths=4, seed=5)
    q, k, v, _ = make_inputs(rng, lay, 2, 2, 8, torch.float64, "cpu", False)
    out = cod_attention(q, k, v, lay, window=3, sink=1)
    pad = (doc[lay.anchor.long()] < 0)
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
    empty = CodLayout(torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), [0, 0],
                      torch.zeros(0, dtype=torch.int32))
    q, k, v, _ = make_inputs(rng, empty, 2, 1, 8, torch.float32, "cpu", False)
    assert cod_attention(q, k, v, empty).shape == (0, 2, 8)


def test_opcheck_and_compile(rng):
    from peagle_ext import ops
    lay = make_layout(rng, 60, max_doc_len=30)
    meta = cod_attention_metadata(lay, window=5, sink=1)
    q, k, v, _ = make_inputs(rng, lay, 2, 1, 8, torch.float64, "cpu", False)
    args = (q, k, v, None, None, meta.ranges, meta.chains, meta.depth_offsets, 0.3, True)
    torch.library.opcheck(ops.cod_attention_fwd, args, test_utils=("test_schema", "test_faketensor",
                                                                   "test_autograd_registration"))
    torch.library.opcheck(ops.cod_attention_metadata,
                          (lay.anchor, lay.depth, lay.document_ids, lay.depth_offsets, False, 5, 1),
                          test_utils=("test_schema", "test_faketensor"))


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
    split = CodLayout(lay.anchor, lay.depth, lay.depth_offsets,
                      torch.where(torch.arange(lay.seq_len) < 10, 0, lay.document_ids + 100).int().contiguous())
    split.document_ids[-3:] = 0  # document 0 in two runs
    with pytest.raises(ValueError, match="contiguous run"):
        cod_attention(q, k, v, split)
    unsorted = CodLayout(lay.anchor.flip(0).contiguous(), lay.depth, lay.depth_offsets, lay.document_ids)
    with pytest.raises(ValueError):
        cod_attention(q, k, v, unsorted)
    assert t > 0
    if HAS_CUDA:
        with pytest.raises(ValueError, match="device"):
            cod_attention(q.cuda(), k.cuda(), v.cuda(), lay)


def test_cpu_moderate_size_is_fast(rng):
    """A CPU-training-sized call (T ~ 3K, D 64, 4 heads) stays well under a few seconds."""
    import time
    lay = make_layout(rng, 1024, max_doc_len=400)
    q, k, v, _ = make_inputs(rng, lay, 4, 2, 64, torch.float32, "cpu", False)
    t0 = time.perf_counter()
    out = cod_attention(q, k, v, lay, window=256)
    out.sum().backward()
    assert time.perf_counter() - t0 < 20.0
