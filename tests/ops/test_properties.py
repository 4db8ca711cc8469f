"""Property-based tests (hypothesis): every CPU op against its plain-PyTorch reference on
random shapes, documents, masks, K, dtypes, windows/sinks and GQA.

hypothesis draws the STRUCTURE (sizes, document runs, masks, options) so that a failure
shrinks to a small readable case; the tensor VALUES come from a torch generator seeded by a
drawn integer (shrinking those adds nothing). Runs are derandomized and use no example
database, so CI sees the same examples every time; the whole file takes ~20-40 s on 2 cores.
PEAGLE_HYPOTHESIS_SCALE=10 multiplies the example counts for a longer local fuzz, and
PEAGLE_HYPOTHESIS_RANDOM=1 draws fresh random examples instead of the fixed derandomized ones.

A failure found here and shrunk becomes a plain named test (in the op's test file or at the
bottom of this one), so that it keeps being checked without hypothesis.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

from peagle_ext.attention import cod_attention, cod_attention_metadata
from peagle_ext.cod import cod_sample
from peagle_ext.loss import fused_linear_kl
from peagle_ext.reference import dense_cod_mask, reference_cod_attention, reference_cod_sample
from peagle_ext.reference.parallel_draft import parallel_draft_loop
from peagle_ext.vllm import DraftBatch, prepare_parallel_draft_inputs
from tests.helpers import (
    DRAFT_BATCH_FIELDS,
    assert_same_batch,
    check_layout_rules,
    hypothesis_settings,
    mask_from_metadata,
    reference_fused_linear_kl,
)


def fuzz(n: int):
    return hypothesis_settings(n, [HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # tiny tensors on a shared 2-core box: OpenMP hand-offs cost more than they save
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ------------------------------------------------------------------------------------------
# strategies
# ------------------------------------------------------------------------------------------
@st.composite
def packed_sequence(draw, max_n: int = 90, max_runs: int = 7, max_run: int = 30, min_run: int = 1):
    """(document_ids int32[N], loss_mask bool[N]): runs of real documents (each id once: a
    document is one contiguous run, as packing makes it) and padding (-1) runs anywhere, ids
    increasing, shuffled or huge; the loss mask is arbitrary on real tokens (padding: 0)."""
    runs = draw(
        st.lists(
            st.tuples(st.integers(0, 4), st.integers(min_run, max_run)),
            min_size=1 if min_run > 1 else 0,
            max_size=max_runs,
        )
    )
    id_mode = draw(st.sampled_from(["increasing", "shuffled", "huge"]))
    perm = draw(st.permutations(range(max_runs))) if id_mode != "increasing" else range(max_runs)
    doc: list[int] = []
    for j, (kind, length) in enumerate(runs):
        length = min(length, max_n - len(doc))
        if length <= 0:
            break
        if kind == 0:  # 1 in 5 runs is padding
            doc += [-1] * length
            continue
        # distinct ids per document: 0, 1, 2, ... / a permutation / near the int32 maximum
        i = j if id_mode == "increasing" else (perm[j] if id_mode == "shuffled" else 2**31 - 1 - perm[j])
        doc += [i] * length
    n = len(doc)
    p_loss = draw(st.sampled_from([0.0, 0.3, 0.8, 1.0]))
    bits = draw(st.lists(st.floats(0, 1, exclude_max=True), min_size=n, max_size=n)) if 0 < p_loss < 1 else None
    lm = [d >= 0 and (p_loss == 1.0 or (bits is not None and bits[i] < p_loss)) for i, d in enumerate(doc)]
    return torch.tensor(doc, dtype=torch.int32), torch.tensor(lm, dtype=torch.bool)


@st.composite
def cod_options(draw, n: int):
    return dict(
        num_depths=draw(st.integers(1, 10)),
        down_sample_ratio=draw(st.sampled_from([0.25, 0.5, 0.7, 0.9, 1.0])),
        down_sample_ratio_min=draw(st.sampled_from([0.0, 0.2, 0.5, 1.0])),
        max_anchors=draw(st.one_of(st.none(), st.integers(0, max(1, n)))),
        depth0=draw(st.sampled_from(["all", "anchors"])),
        seed=draw(st.integers(-(2**63), 2**63 - 1)),
    )


def _reference_cod_sample(doc, lm, **kw):
    """reference_cod_sample, which cannot take N = 0 (torch.arange(1, 0) raises): an empty
    sequence has no token at any depth."""
    if doc.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), [0] * (kw["num_depths"] + 1)
    return reference_cod_sample(doc, lm, **kw)


def _sample(doc, lm, **kw):
    return cod_sample(doc, lm, **kw)


# ------------------------------------------------------------------------------------------
# cod_sample
# ------------------------------------------------------------------------------------------
_DOC_DTYPES = [torch.int32, torch.int64, torch.int16]
_MASK_DTYPES = [torch.bool, torch.uint8, torch.int64, torch.float32, torch.bfloat16]


@fuzz(200)
@given(data=st.data(), seq=packed_sequence())
def test_cod_sample_equals_reference_and_rules(data, seq):
    doc, lm = seq
    kw = data.draw(cod_options(doc.shape[0]))
    fits16 = not doc.numel() or int(doc.max()) < 2**15
    doc_dtype = data.draw(st.sampled_from(_DOC_DTYPES if fits16 else _DOC_DTYPES[:2]))
    mask_dtype = data.draw(st.sampled_from(_MASK_DTYPES))
    lay = _sample(doc.to(doc_dtype), lm.to(mask_dtype), **kw)
    anchor, depth, offsets = _reference_cod_sample(doc, lm, **kw)
    assert lay.depth_offsets == offsets
    assert torch.equal(lay.anchor.long(), anchor) and torch.equal(lay.depth.long(), depth)
    check_layout_rules(lay, doc, lm, **kw)
    assert torch.equal(lay.position_ids, lay.anchor + lay.depth)
    assert lay.document_ids.dtype == torch.int32 and torch.equal(lay.document_ids, doc)
    # the same seed is the same draw (whatever dtypes carried the inputs)
    again = _sample(doc, lm, **kw)
    assert again.depth_offsets == lay.depth_offsets and torch.equal(again.anchor, lay.anchor)


# ------------------------------------------------------------------------------------------
# attention metadata vs the dense mask
# ------------------------------------------------------------------------------------------
@st.composite
def attention_case(draw, max_n: int = 70, min_run: int = 1):
    doc, lm = draw(packed_sequence(max_n=max_n, max_run=max(30, max_n // 3), min_run=min_run))
    cross = draw(st.booleans())
    n = doc.shape[0]
    kw = dict(
        num_depths=draw(st.integers(1, 9)),
        down_sample_ratio=draw(st.sampled_from([0.5, 0.8, 1.0])),
        down_sample_ratio_min=draw(st.sampled_from([0.0, 0.3])),
        max_anchors=draw(st.one_of(st.none(), st.integers(0, max(1, n)))),
        depth0="anchors" if cross else "all",
        seed=draw(st.integers(0, 2**62)),
    )
    window = draw(st.one_of(st.none(), st.integers(1, max(1, n + 2))))
    sink = draw(st.integers(0, 6))
    return cod_sample(doc, lm, **kw), cross, window, sink


@fuzz(150)
@given(case=attention_case())
def test_attention_metadata_is_the_dense_mask(case):
    lay, cross, window, sink = case
    meta = cod_attention_metadata(lay, cross=cross, window=window, sink=sink)
    t, k = lay.num_tokens, lay.num_depths
    assert meta.ranges.shape == (5, t) and meta.chains.shape == (2, t, k)
    assert meta.ranges.dtype == torch.int32 and meta.chains.dtype == torch.int32
    cnt = mask_from_metadata(lay, meta, cross)
    dense = dense_cod_mask(lay, cross=cross, window=window, sink=sink)
    assert cnt.numel() == 0 or int(cnt.max()) <= 1, "a key is visited twice for one query"
    assert torch.equal(cnt.bool(), dense)
    # a query is "valid" iff it is in a real document; chain entries are real rows
    valid = meta.ranges[4].bool()
    assert torch.equal(valid, lay.document_ids[lay.anchor.long()] >= 0)
    ch, rch = meta.chains[0].long(), meta.chains[1].long()
    assert bool(((ch >= -1) & (ch < t)).all()) and bool(((rch >= -1) & (rch < t)).all())
    pairs = {(i, c) for i in range(t) for c in ch[i].tolist() if c >= 0}
    rpairs = {(i, c) for c in range(t) for i in rch[c].tolist() if i >= 0}
    assert pairs == rpairs
    # ranges lie inside the stream and are ordered
    n = lay.seq_len
    for lo, hi in ((0, 1), (2, 3)):
        a, b = meta.ranges[lo].long(), meta.ranges[hi].long()
        live = valid & (b > a)
        assert bool(((a[live] >= 0) & (b[live] <= n)).all())


# ------------------------------------------------------------------------------------------
# cod_attention on the CPU: float64 fwd + grads vs the SDPA reference, lower precisions loosely
# ------------------------------------------------------------------------------------------
_ATT_TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _rel(a, b):
    """Relative L2 error, with the reference's norm floored at that of an all-ones tensor: a
    gradient that cancels to ~0 in float64 (one key: d softmax = 0) is compared on the scale
    of its O(1) terms instead of its own rounding noise."""
    a, b = a.double(), b.double()
    den = max(float(b.norm()), math.sqrt(b.numel()))
    return float((a - b).norm()) / den if den > 0 else 0.0


@fuzz(120)
@given(
    case=attention_case(max_n=60),
    hkv=st.integers(1, 3),
    group=st.integers(1, 3),
    d=st.sampled_from([1, 3, 8, 16, 64]),
    dtype=st.sampled_from([torch.float64] * 3 + [torch.float32, torch.bfloat16, torch.float16]),
    scale=st.one_of(st.none(), st.floats(0.05, 2.0)),
    value_seed=st.integers(0, 2**31),
)
def test_cod_attention_matches_reference(case, hkv, group, d, dtype, scale, value_seed):
    lay, cross, window, sink = case
    g = torch.Generator().manual_seed(value_seed)
    t, n, hq = lay.num_tokens, lay.seq_len, hkv * group

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)

    ins = [rnd(t, hq, d), rnd(t, hkv, d), rnd(t, hkv, d)]
    ctx = {}
    if cross:
        ins += [rnd(n, hkv, d), rnd(n, hkv, d)]
        ctx = dict(context_k=ins[3], context_v=ins[4])
    out = cod_attention(*ins[:3], lay, window=window, sink=sink, scale=scale, **ctx)
    assert out.shape == (t, hq, d) and out.dtype == dtype
    assert bool(torch.isfinite(out).all()), "cod_attention returned NaN/inf on finite inputs"
    go = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, ins, go.to(dtype), allow_unused=True) if t else [torch.zeros_like(x) for x in ins]

    ref_ins = [x.detach().double().requires_grad_(True) for x in ins]
    rctx = dict(context_k=ref_ins[3], context_v=ref_ins[4]) if cross else {}
    ref = reference_cod_attention(*ref_ins[:3], lay, window=window, sink=sink, scale=scale, **rctx)
    rgrads = torch.autograd.grad(ref, ref_ins, go, allow_unused=True) if t else [torch.zeros_like(x) for x in ref_ins]
    # rows without keys (padding anchors): exactly 0, with exactly 0 gradient
    no_key = ~dense_cod_mask(lay, cross=cross, window=window, sink=sink).any(1)
    assert torch.equal(out[no_key], torch.zeros_like(out[no_key]))
    tol = _ATT_TOL[dtype]
    names = ["out", "dq", "dk", "dv", "dctx_k", "dctx_v"]
    for name, a, b in zip(names, [out] + list(grads), [ref] + list(rgrads)):
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        assert bool(torch.isfinite(a).all()), name
        if dtype == torch.float64:
            err = float((a.double() - b).abs().max()) if a.numel() else 0.0
        else:
            err = _rel(a, b)
        assert err <= tol, (
            f"{name}: err {err:.3e} > {tol:.0e} ({dtype}, T={t}, N={n}, cross={cross}, "
            f"window={window}, sink={sink}, hq={hq}, hkv={hkv}, d={d})"
        )
    if no_key.any():
        assert torch.equal(grads[0][no_key], torch.zeros_like(grads[0][no_key]))


def _rel_plain(a, b):
    """Relative L2 error against the reference's own norm (loss gradients are ~1/T per element:
    no O(1) floor for them)."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30)) if b.numel() else 0.0


# ------------------------------------------------------------------------------------------
# fused_linear_kl on the CPU vs eager
# ------------------------------------------------------------------------------------------
@fuzz(120)
@given(
    t=st.integers(0, 40),
    h=st.integers(1, 24),
    ht=st.one_of(st.none(), st.integers(1, 24)),
    vd=st.integers(1, 60),
    extra_v=st.one_of(st.just(0), st.integers(1, 40)),
    k=st.integers(1, 6),
    chunk=st.one_of(st.just("auto"), st.integers(1, 45)),
    kind=st.sampled_from(["kl", "ce"]),
    weight_kind=st.sampled_from(["float", "bool", "int", "zeros"]),
    d2t_form=st.sampled_from(["int64", "int32"]),
    scale=st.sampled_from([0.1, 1.0, 6.0]),
    value_seed=st.integers(0, 2**31),
)
def test_fused_linear_kl_matches_eager_fp64(
    t, h, ht, vd, extra_v, k, chunk, kind, weight_kind, d2t_form, scale, value_seed
):
    g = torch.Generator().manual_seed(value_seed)
    ht = h if ht is None else ht
    v = vd + extra_v

    def rnd(*shape, s=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * s

    xd = rnd(t, h, s=scale / math.sqrt(h) * 4)
    w_d = rnd(vd, h)
    xt = rnd(t, ht, s=scale / math.sqrt(ht) * 4)
    w_t = rnd(v, ht)
    depth = torch.randint(0, k, (t,), generator=g, dtype=torch.int32)
    on = torch.rand(t, generator=g) < 0.75
    if weight_kind == "float":
        weight = (torch.rand(t, generator=g, dtype=torch.float64) + 0.25) * on
    elif weight_kind == "bool":
        weight = on
    elif weight_kind == "int":
        weight = on.to(torch.int64) * torch.randint(1, 4, (t,), generator=g)
    else:
        weight = torch.zeros(t, dtype=torch.float64)
    d2t = None
    if extra_v:
        ids = torch.randperm(v, generator=g)[:vd].sort().values
        d2t = (ids - torch.arange(vd)).to(torch.int64 if d2t_form == "int64" else torch.int32)

    xg = xd.clone().requires_grad_(True)
    wg = w_d.clone().requires_grad_(True)
    loss, m = fused_linear_kl(xg, wg, xt, w_t, weight, depth, num_depths=k, d2t=d2t, chunk_size=chunk, kind=kind)
    loss.backward()
    rloss, rcorrect, rtotal, rgx, rgw = reference_fused_linear_kl(
        xd, w_d, xt, w_t, weight.double(), depth, k, d2t=d2t, kind=kind
    )
    assert loss.dtype == torch.float64 and loss.dim() == 0 and math.isfinite(float(loss))
    torch.testing.assert_close(loss.detach(), rloss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(xg.grad, rgx, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(wg.grad, rgw, rtol=1e-9, atol=1e-12)
    assert torch.equal(m["total"], rtotal) and torch.equal(m["correct"], rcorrect)
    assert m["total"].shape == (k,) and m["total"].dtype == torch.int64
    # without grad: the same loss and counts
    with torch.no_grad():
        loss2, m2 = fused_linear_kl(xd, w_d, xt, w_t, weight, depth, num_depths=k, d2t=d2t, chunk_size=chunk, kind=kind)
    assert float(loss2) == float(loss) and torch.equal(m2["correct"], m["correct"])


@fuzz(40)
@given(
    t=st.integers(1, 40),
    h=st.integers(1, 24),
    vd=st.integers(2, 60),
    k=st.integers(1, 4),
    chunk=st.one_of(st.just("auto"), st.integers(1, 45)),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    value_seed=st.integers(0, 2**31),
)
def test_fused_linear_kl_low_precision_close(t, h, vd, k, chunk, dtype, value_seed):
    g = torch.Generator().manual_seed(value_seed)
    xd = torch.randn(t, h, generator=g, dtype=torch.float64).to(dtype) / math.sqrt(h) * 2
    w_d = torch.randn(vd, h, generator=g, dtype=torch.float64).to(dtype)
    xt = torch.randn(t, h, generator=g, dtype=torch.float64).to(dtype) / math.sqrt(h) * 2
    w_t = torch.randn(vd, h, generator=g, dtype=torch.float64).to(dtype)
    weight = torch.rand(t, generator=g, dtype=torch.float64) + 0.5
    depth = torch.randint(0, k, (t,), generator=g)
    xg, wg = xd.clone().requires_grad_(True), w_d.clone().requires_grad_(True)
    loss, m = fused_linear_kl(xg, wg, xt, w_t, weight, depth, num_depths=k, chunk_size=chunk)
    loss.backward()
    rloss, _, rtotal, rgx, rgw = reference_fused_linear_kl(xd, w_d, xt, w_t, weight, depth, k)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert loss.dtype == torch.float32 and xg.grad.dtype == dtype and wg.grad.dtype == dtype
    assert abs(float(loss) - float(rloss)) <= tol * max(1.0, abs(float(rloss)))
    assert _rel_plain(xg.grad, rgx) <= tol and _rel_plain(wg.grad, rgw) <= tol
    assert torch.equal(m["total"], rtotal)


# ------------------------------------------------------------------------------------------
# prepare_parallel_draft_inputs vs the per-request loop (and the CUDA schedule's CPU emulation)
# ------------------------------------------------------------------------------------------
@st.composite
def draft_batch(draw):
    b = draw(st.integers(0, 6))
    k = draw(st.integers(1, 6))
    h = draw(st.integers(1, 9))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    max_model_len = draw(st.integers(1, 64))
    lens, nrej, starts = [], [], []
    for _ in range(b):
        ln = draw(st.integers(1, k + 4))
        lens.append(ln)
        nrej.append(draw(st.integers(0, ln - 1)))
        starts.append(draw(st.integers(0, max_model_len + 3)))  # some requests run past max_model_len
    none_rejected = draw(st.booleans())
    extra_rows = draw(st.integers(0, 2))
    extra_blocks = draw(st.integers(0, 2))
    seed = draw(st.integers(0, 2**31))
    g = torch.Generator().manual_seed(seed)
    qsl = torch.zeros(b + 1, dtype=torch.int32)
    if b:
        qsl[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
    t_in = int(qsl[-1])
    pos = [torch.arange(s, s + ln) for s, ln in zip(starts, lens)]
    blocks = -(-max_model_len // block_size) + extra_blocks
    args = dict(
        target_token_ids=torch.randint(0, 2**31 - 1, (t_in,), generator=g, dtype=torch.int32),
        target_positions=torch.cat(pos).long() if pos else torch.zeros(0, dtype=torch.int64),
        next_token_ids=torch.randint(0, 50000, (b,), generator=g, dtype=torch.int32),
        query_start_loc=qsl,
        num_rejected_tokens=None if none_rejected else torch.tensor(nrej, dtype=torch.int32),
        target_hidden=torch.randn(t_in, h, generator=g).to(dtype),
        mask_hidden=torch.randn(h, generator=g).to(dtype),
        block_table=torch.randint(0, 10000, (b + extra_rows, blocks), generator=g, dtype=torch.int32),
    )
    kw = dict(
        num_spec_tokens=k,
        mask_token_id=draw(st.integers(0, 2**31 - 1)),
        block_size=block_size,
        max_model_len=max_model_len,
    )
    return args, kw


def _row_bytes_divisors(h, dtype):
    row = h * torch.empty((), dtype=dtype).element_size()
    return [0] + [v for v in (2, 4, 8, 16) if row % v == 0]


@fuzz(200)
@given(batch=draft_batch(), use_out=st.booleans(), data=st.data())
def test_prepare_parallel_draft_inputs_matches_loop(batch, use_out, data):
    args, kw = batch
    want = parallel_draft_loop(*args.values(), **kw)
    b = args["query_start_loc"].shape[0] - 1
    t_in = args["target_token_ids"].shape[0]
    out = None
    if use_out:
        out = DraftBatch.empty(
            t_in, b, kw["num_spec_tokens"], args["target_hidden"].shape[1], dtype=args["target_hidden"].dtype
        )
        for f in DRAFT_BATCH_FIELDS:  # garbage in the preallocated buffers must not leak into the result
            x = getattr(out, f)
            x.copy_(torch.full_like(x, 7) if x.dtype != torch.bool else torch.ones_like(x))
    got = prepare_parallel_draft_inputs(*args.values(), **kw, out=out)
    assert_same_batch(got, want)
    assert got.num_tokens == t_in + (kw["num_spec_tokens"] - 1) * b
    if use_out:
        assert got is out
    # the CUDA kernel's launch plan, run on the CPU, with every copy unit that divides a row
    vec = data.draw(st.sampled_from(_row_bytes_divisors(args["target_hidden"].shape[1], args["target_hidden"].dtype)))
    emu = DraftBatch(*torch.ops.peagle._parallel_draft_kernel_emulation(*args.values(), *kw.values(), vec))
    assert_same_batch(emu, want, f"emulated kernel (vec {vec}): ")


# ------------------------------------------------------------------------------------------
# larger sequences (fewer examples): long documents, many tiles' worth of tokens
# ------------------------------------------------------------------------------------------
@fuzz(30)
@given(data=st.data(), seq=packed_sequence(max_n=1500, max_runs=6, max_run=700, min_run=100))
def test_cod_sample_long_sequences(data, seq):
    doc, lm = seq
    kw = data.draw(cod_options(doc.shape[0]))
    kw["num_depths"] = data.draw(st.sampled_from([kw["num_depths"], 16, 64]))
    lay = _sample(doc, lm, **kw)
    anchor, depth, offsets = _reference_cod_sample(doc, lm, **kw)
    assert lay.depth_offsets == offsets
    assert torch.equal(lay.anchor.long(), anchor) and torch.equal(lay.depth.long(), depth)
    check_layout_rules(lay, doc, lm, **kw)


@fuzz(15)
@given(
    case=attention_case(max_n=260, min_run=40),
    hkv=st.integers(1, 2),
    group=st.sampled_from([1, 4]),
    value_seed=st.integers(0, 2**31),
)
def test_cod_attention_longer_float64(case, hkv, group, value_seed):
    lay, cross, window, sink = case
    g = torch.Generator().manual_seed(value_seed)
    t, n, hq = lay.num_tokens, lay.seq_len, hkv * group
    shapes = [(t, hq, 8), (t, hkv, 8), (t, hkv, 8)] + ([(n, hkv, 8), (n, hkv, 8)] if cross else [])
    ins = [torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_(True) for s in shapes]
    ctx = dict(context_k=ins[3], context_v=ins[4]) if cross else {}
    out = cod_attention(*ins[:3], lay, window=window, sink=sink, **ctx)
    ref = reference_cod_attention(*ins[:3], lay, window=window, sink=sink, **ctx)
    if t == 0:
        return
    go = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, ins, go)
    rgrads = torch.autograd.grad(ref, ins, go)
    for name, a, b in zip(["out", "dq", "dk", "dv", "dctx_k", "dctx_v"], [out, *grads], [ref, *rgrads]):
        err = float((a - b).abs().max()) if a.numel() else 0.0
        assert err <= 1e-10, f"{name}: {err:.3e} (T={t}, N={n}, cross={cross}, window={window}, sink={sink})"


# ------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU): the same properties against the CPU op / the float64 reference
# ------------------------------------------------------------------------------------------
from tests.helpers import requires_cuda  # noqa: E402


@requires_cuda
@fuzz(60)
@given(data=st.data(), seq=packed_sequence(max_n=3000, max_runs=8, max_run=900, min_run=50))
def test_cuda_cod_sample_equals_cpu(data, seq):
    doc, lm = seq
    kw = data.draw(cod_options(doc.shape[0]))
    cpu = _sample(doc, lm, **kw)
    gpu = _sample(doc.cuda(), lm.cuda(), **kw)
    assert gpu.depth_offsets == cpu.depth_offsets
    assert torch.equal(gpu.anchor.cpu(), cpu.anchor) and torch.equal(gpu.depth.cpu(), cpu.depth)


@requires_cuda
@fuzz(40)
@given(
    case=attention_case(max_n=400, min_run=10),
    hkv=st.integers(1, 2),
    group=st.sampled_from([1, 2, 4, 8]),
    d=st.sampled_from([64, 128]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    value_seed=st.integers(0, 2**31),
)
def test_cuda_cod_attention_matches_reference(case, hkv, group, d, dtype, value_seed):
    lay, cross, window, sink = case
    meta_cpu = cod_attention_metadata(lay, cross=cross, window=window, sink=sink)
    lay_gpu = lay.to("cuda")
    meta_gpu = cod_attention_metadata(lay_gpu, cross=cross, window=window, sink=sink)
    assert torch.equal(meta_gpu.ranges.cpu(), meta_cpu.ranges) and torch.equal(meta_gpu.chains.cpu(), meta_cpu.chains)
    g = torch.Generator().manual_seed(value_seed)
    t, n, hq = lay.num_tokens, lay.seq_len, hkv * group
    shapes = [(t, hq, d), (t, hkv, d), (t, hkv, d)] + ([(n, hkv, d), (n, hkv, d)] if cross else [])
    host = [torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).double() for s in shapes]
    ins = [x.to("cuda", dtype).requires_grad_(True) for x in host]
    ref_ins = [x.clone().requires_grad_(True) for x in host]
    ctx = dict(context_k=ins[3], context_v=ins[4]) if cross else {}
    rctx = dict(context_k=ref_ins[3], context_v=ref_ins[4]) if cross else {}
    out = cod_attention(*ins[:3], lay_gpu, window=window, sink=sink, **ctx)
    ref = reference_cod_attention(*ref_ins[:3], lay, window=window, sink=sink, **rctx)
    if t == 0:
        return
    go = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, ins, go.to("cuda", dtype))
    rgrads = torch.autograd.grad(ref, ref_ins, go)
    # torch's own SDPA in the same dtype on the GPU: with a small window rows have 1-3 keys and
    # the gradients are differences of nearly equal terms, where 16-bit rounding alone exceeds
    # 2e-2; the bound is 2e-2 or twice torch's own error, whichever is larger
    low = [x.detach().clone().requires_grad_(True) for x in ins]
    lctx = dict(context_k=low[3], context_v=low[4]) if cross else {}
    lout = reference_cod_attention(*low[:3], lay_gpu, window=window, sink=sink, **lctx)
    lgrads = torch.autograd.grad(lout, low, go.to("cuda", dtype))
    names = ["out", "dq", "dk", "dv", "dctx_k", "dctx_v"]
    for name, a, b, c in zip(names, [out, *grads], [ref, *rgrads], [lout, *lgrads]):
        a = a.detach().cpu()
        assert bool(torch.isfinite(a).all()), name
        err = _rel(a, b.detach())
        bound = max(2e-2, 2.0 * _rel(c.detach().cpu(), b.detach()))
        assert err <= bound, (
            f"{name}: rel err {err:.3e} > {bound:.3e} ({dtype}, D={d}, T={t}, N={n}, "
            f"cross={cross}, window={window}, sink={sink}, hq={hq}, hkv={hkv})"
        )


@requires_cuda
@fuzz(40)
@given(
    t=st.integers(0, 300),
    h=st.sampled_from([8, 64, 96]),
    vd=st.integers(1, 3000),
    extra_v=st.one_of(st.just(0), st.integers(1, 500)),
    k=st.integers(1, 8),
    chunk=st.one_of(st.just("auto"), st.integers(1, 128)),
    kind=st.sampled_from(["kl", "ce"]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    value_seed=st.integers(0, 2**31),
)
def test_cuda_fused_linear_kl_matches_eager(t, h, vd, extra_v, k, chunk, kind, dtype, value_seed):
    g = torch.Generator().manual_seed(value_seed)
    v = vd + extra_v
    xd, xt = (torch.randn(t, h, generator=g, dtype=torch.float64) * 4 / math.sqrt(h) for _ in range(2))
    w_d, w_t = torch.randn(vd, h, generator=g, dtype=torch.float64), torch.randn(v, h, generator=g, dtype=torch.float64)
    weight = (torch.rand(t, generator=g, dtype=torch.float64) + 0.5) * (torch.rand(t, generator=g) < 0.8)
    depth = torch.randint(0, k, (t,), generator=g, dtype=torch.int32)
    d2t = None
    if extra_v:
        ids = torch.randperm(v, generator=g)[:vd].sort().values
        d2t = ids - torch.arange(vd)
    host = [x.to(dtype) for x in (xd, w_d, xt, w_t)]
    dev = [x.cuda() for x in host]
    xg, wg = dev[0].requires_grad_(True), dev[1].requires_grad_(True)
    loss, m = fused_linear_kl(
        xg,
        wg,
        dev[2],
        dev[3],
        weight.cuda(),
        depth.cuda(),
        num_depths=k,
        d2t=None if d2t is None else d2t.cuda(),
        chunk_size=chunk,
        kind=kind,
    )
    loss.backward()
    rloss, _, rtotal, rgx, rgw = reference_fused_linear_kl(*host, weight, depth, k, d2t=d2t, kind=kind)
    assert math.isfinite(float(loss))
    assert abs(float(loss) - float(rloss)) <= 1e-2 * max(1.0, abs(float(rloss)))
    if float(rgx.norm()) > 0:  # all weights 0: both gradients are exactly 0
        assert _rel_plain(xg.grad.cpu(), rgx) <= 1e-2 and _rel_plain(wg.grad.cpu(), rgw) <= 1e-2
    else:
        assert all(float(x.abs().max()) <= 1e-6 for x in (xg.grad, wg.grad) if x.numel())
    assert torch.equal(m["total"].cpu(), rtotal)


@requires_cuda
@fuzz(80)
@given(batch=draft_batch(), use_out=st.booleans())
def test_cuda_prepare_parallel_draft_inputs_equals_cpu(batch, use_out):
    args, kw = batch
    want = prepare_parallel_draft_inputs(*args.values(), **kw)
    dev = {name: None if x is None else x.cuda() for name, x in args.items()}
    b = args["query_start_loc"].shape[0] - 1
    out = None
    if use_out:
        out = DraftBatch.empty(
            args["target_token_ids"].shape[0],
            b,
            kw["num_spec_tokens"],
            args["target_hidden"].shape[1],
            dtype=args["target_hidden"].dtype,
            device="cuda",
        )
    got = prepare_parallel_draft_inputs(*dev.values(), **kw, out=out)
    assert_same_batch(got, want, "cuda vs cpu: ")
