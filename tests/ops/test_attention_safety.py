"""Memory safety of the COD attention ops: metadata bound to its layout, and the raw ops
(torch.ops.peagle.cod_attention_fwd / _bwd / _metadata) with entries that index outside their
inputs. CPU: a ValueError naming what is wrong. CUDA (skipped without a GPU): no fault and no
out-of-bounds access whatever the values (compute-sanitizer runs tools/sanitize/
sanitize_attention.py on the same inputs), outputs finite where the inputs are."""

import math

import pytest
import torch

from peagle_ext.attention import cod_attention, cod_attention_metadata
from peagle_ext.cod import CodLayout, cod_sample
from peagle_ext.testing import garbage_metadata
from tests.helpers import requires_cuda
from tests.ops.attention_cases import make_inputs, make_layout

ops = torch.ops.peagle


def _cross_pair(device="cpu"):
    """Two cross-mode layouts with the same depth_offsets (the same seed count) over documents of
    very different lengths: one's ranges reach keys the other does not have."""
    lm_short = torch.zeros(40, dtype=torch.bool)
    lm_short[1:11] = True
    lm_long = torch.zeros(4000, dtype=torch.bool)
    lm_long[3980:3990] = True
    short = cod_sample(torch.zeros(40, dtype=torch.int32), lm_short, num_depths=4, depth0="anchors", seed=1)
    long = cod_sample(torch.zeros(4000, dtype=torch.int32), lm_long, num_depths=4, depth0="anchors", seed=1)
    assert short.depth_offsets == long.depth_offsets
    return short.to(device), long.to(device)


def test_metadata_of_another_layout_is_refused():
    short, long = _cross_pair()
    meta = cod_attention_metadata(long, cross=True)
    q = torch.randn(short.num_tokens, 2, 8)
    ctx = torch.randn(short.seq_len, 2, 8)
    with pytest.raises(ValueError, match="metadata was built for another layout"):
        cod_attention(q, q, q, short, context_k=ctx, context_v=ctx, metadata=meta)
    # symmetric mode, same documents, another seed: same depth_offsets, other chains
    doc = torch.zeros(300, dtype=torch.int32)
    lm = torch.ones(300, dtype=torch.bool)
    a, b = (cod_sample(doc, lm, num_depths=4, seed=s) for s in (1, 2))
    assert a.depth_offsets == b.depth_offsets
    q = torch.randn(a.num_tokens, 2, 8)
    with pytest.raises(ValueError, match="another layout"):
        cod_attention(q, q, q, b, metadata=cod_attention_metadata(a))
    # the same tensors in a new CodLayout object are the same layout
    same = CodLayout(a.anchor, a.depth, list(a.depth_offsets), a.document_ids)
    out = cod_attention(q, q, q, same, metadata=cod_attention_metadata(a))
    assert torch.equal(out, cod_attention(q, q, q, a))


def test_raw_ops_with_metadata_of_another_layout_are_refused_on_cpu():
    """The raw op gets only ranges / chains: their entries are checked against N and T."""
    short, long = _cross_pair()
    meta = cod_attention_metadata(long, cross=True)
    q = torch.randn(short.num_tokens, 2, 8)
    ctx = torch.randn(short.seq_len, 2, 8)
    with pytest.raises(ValueError, match="ranges: window range .* outside the N=40 keys"):
        ops.cod_attention_fwd(q, q, q, ctx, ctx, meta.ranges, meta.chains, meta.depth_offsets, 0.3, False)


@pytest.mark.parametrize("which", ["lo", "hi", "slo", "shi", "chain", "rchain", "order"])
def test_edited_metadata_is_refused_on_cpu(rng, which):
    lay = make_layout(rng, 200, max_doc_len=80)
    meta = cod_attention_metadata(lay, window=20, sink=2)
    ranges, chains = meta.ranges.clone(), meta.chains.clone()
    t, n = lay.num_tokens, lay.seq_len
    valid_row = int((ranges[4] != 0).nonzero()[-1])
    if which == "lo":
        ranges[0, valid_row] = -5
    elif which == "hi":
        ranges[1, valid_row] = n + 1
    elif which == "slo":
        ranges[2, valid_row], ranges[3, valid_row] = -3, 1
    elif which == "shi":
        ranges[3, valid_row] = n + 7
    elif which == "chain":
        chains[0, 3, 0] = t
    elif which == "rchain":
        chains[1, 5, 1] = -2
    else:
        ranges[:, 10:20] = ranges[:, 10:20].flip(1)  # bounds no longer sorted within depth 0
    q, k, v, _ = make_inputs(rng, lay, 2, 1, 8, torch.float32, "cpu", False, requires_grad=False)
    args = (q, k, v, None, None, ranges, chains, meta.depth_offsets, 0.3, True)
    match = {"chain": "chains", "rchain": "chains", "order": "nondecreasing"}.get(which, "outside the N=")
    with pytest.raises(ValueError, match=match):
        ops.cod_attention_fwd(*args)
    out, lse = ops.cod_attention_fwd(q, k, v, None, None, meta.ranges, meta.chains, meta.depth_offsets, 0.3, True)
    with pytest.raises(ValueError, match=match):
        ops.cod_attention_bwd(
            torch.ones_like(out), q, k, v, None, None, out, lse, ranges, chains, meta.depth_offsets, 0.3, True
        )


def test_garbage_metadata_is_refused_on_cpu(rng):
    for t, n, k in [(50, 20, 4), (9, 3, 3), (300, 100, 8)]:
        ranges, chains = garbage_metadata(rng, t, n, k, "cpu")
        offsets = [0, n] + sorted(torch.randint(n, t + 1, (k - 2,), generator=rng).tolist()) + [t]
        q = torch.randn(t, 2, 8)
        with pytest.raises(ValueError, match="cod_attention_fwd: (ranges|chains)"):
            ops.cod_attention_fwd(q, q, q, None, None, ranges, chains, offsets, 0.3, True)


def test_bad_depth_offsets_are_refused_on_every_device(rng):
    """depth_offsets size the kernels' host-side tables (at most 64 depths) and their tiles."""
    lay = make_layout(rng, 60, max_doc_len=30)
    meta = cod_attention_metadata(lay)
    t = lay.num_tokens
    q = torch.randn(t, 2, 8)
    o = meta.depth_offsets
    for bad, match in [
        ([0] + [t] * 65, "1 <= K <= 64"),
        ([1] + o[1:], "run from 0"),
        ([0, o[2], o[1]] + o[3:], "nondecreasing"),
    ]:
        k = len(bad) - 1
        chains = torch.full((2, t, k), -1, dtype=torch.int32)
        with pytest.raises(ValueError, match=match):
            ops.cod_attention_fwd(q, q, q, None, None, meta.ranges, chains, bad, 0.3, False)


def test_huge_window_and_sink_do_not_overflow(rng):
    """window / sink near 2^63: the range arithmetic stays in range (a sink past the document is the
    whole document, a window past it is no window)."""
    lay = make_layout(rng, 150, max_doc_len=60)
    q, k, v, _ = make_inputs(rng, lay, 2, 1, 8, torch.float64, "cpu", False, requires_grad=False)
    want = cod_attention(q, k, v, lay)
    for window, sink in [(2**62, 0), (2**63 - 1, 0), (3, 2**63 - 1), (2**62, 2**62)]:
        got = cod_attention(q, k, v, lay, window=window, sink=sink)
        if window >= 2**62:
            assert torch.allclose(got, want), (window, sink)
        else:
            assert torch.allclose(got, cod_attention(q, k, v, lay, window=3, sink=10**6))


# ---------------------------------------------------------------- CUDA: no fault, whatever the values
@requires_cuda
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("family", ["auto", "portable"])
def test_cuda_raw_ops_with_garbage_metadata_stay_in_bounds(monkeypatch, family, d):
    if family == "portable":
        monkeypatch.setenv("PEAGLE_ATTN_KERNEL", "portable")
    else:
        monkeypatch.delenv("PEAGLE_ATTN_KERNEL", raising=False)
    g = torch.Generator().manual_seed(3 + d)
    for t, n, k, cross in [(300, 100, 8, False), (200, 70, 4, True), (9, 3, 3, False), (700, 300, 64, True)]:
        ranges, chains = garbage_metadata(g, t, n, k, "cuda")
        if cross:
            offsets = [0] + sorted(torch.randint(0, t + 1, (k - 1,), generator=g).tolist()) + [t]
        else:
            offsets = [0, n] + sorted(torch.randint(n, t + 1, (k - 2,), generator=g).tolist()) + [t]
        mk = lambda r, h: torch.randn(r, h, d, generator=g).to("cuda", torch.bfloat16)  # noqa: E731
        q, kk, v = mk(t, 4), mk(t, 2), mk(t, 2)
        ck, cv = (mk(n, 2), mk(n, 2)) if cross else (None, None)
        for use_sink in (False, True):
            out, lse = ops.cod_attention_fwd(q, kk, v, ck, cv, ranges, chains, offsets, 1 / math.sqrt(d), use_sink)
            ops.cod_attention_bwd(
                torch.ones_like(out), q, kk, v, ck, cv, out, lse, ranges, chains, offsets, 1 / math.sqrt(d), use_sink
            )
        torch.cuda.synchronize()  # a fault surfaces here


@requires_cuda
def test_cuda_metadata_of_another_layout_stays_in_bounds():
    """The raw forward / backward given another layout's metadata (ranges reaching 4000 keys
    against 40 context rows): clamped, no fault. cod_attention itself refuses it (CPU test)."""
    short, long = _cross_pair("cuda")
    meta = cod_attention_metadata(long, cross=True)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(short.num_tokens, 2, 64, generator=g).to("cuda", torch.bfloat16)
    ctx = torch.randn(short.seq_len, 2, 64, generator=g).to("cuda", torch.bfloat16)
    out, lse = ops.cod_attention_fwd(q, q, q, ctx, ctx, meta.ranges, meta.chains, meta.depth_offsets, 0.125, False)
    ops.cod_attention_bwd(
        torch.ones_like(out), q, q, q, ctx, ctx, out, lse, meta.ranges, meta.chains, meta.depth_offsets, 0.125, False
    )
    torch.cuda.synchronize()
    assert bool(torch.isfinite(out.float()).all())
