"""COD attention vs the dense-mask SDPA reference (peagle_ext.reference), on the CPU, and the
kernel choice of csrc/attention/attention_dispatch.h (which the CUDA ops ask; checked here without
a GPU). CPU: forward and every gradient in float64 against reference_cod_attention (tight), float32
/ bf16 loosely; metadata against the dense mask; torch.compile / opcheck; bad inputs. The CUDA
kernels are tested in test_attention_cuda.py.
"""

import pytest
import torch

from peagle_ext.attention import cod_attention, cod_attention_metadata
from peagle_ext.cod import CodLayout, cod_sample
from peagle_ext.ops.attention import attention_kernel_choice
from peagle_ext.reference import dense_cod_mask
from tests.helpers import HAS_CUDA, mask_from_metadata
from tests.ops.attention_cases import (
    assert_close_all,
    flash_backward_reference,
    make_inputs,
    make_layout,
    run_both,
)


# ---------------------------------------------------------------- kernel choice
def _portable(head_dim):
    # the mma.sync shapes: 8 warps x 16 rows at head dim 64, 4 x 16 at 128; dK/dV steps of 64 / 32
    return {
        "family": "portable",
        "fwd_block_q": 128 if head_dim == 64 else 64,
        "dq_block_q": 64,
        "dkv_block_k": 64,
        "dkv_block_q": 64 if head_dim == 64 else 32,
    }


HOPPER = {"family": "hopper", "fwd_block_q": 64, "dq_block_q": 64, "dkv_block_k": 64, "dkv_block_q": 64}


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("sm90a", [False, True], ids=["no-sm90a", "sm90a"])
@pytest.mark.parametrize(
    "cc", [(8, 0), (8, 6), (8, 7), (8, 9), (9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1)], ids=str
)
def test_kernel_choice_per_arch(cc, sm90a, head_dim):
    """Hopper kernels exactly on compute capability 9.0 with sm_90a in the build; the portable
    mma.sync kernels on Ampere, Ada, Blackwell and later, and on 9.0 without sm_90a code."""
    want = HOPPER if (cc == (9, 0) and sm90a) else _portable(head_dim)
    assert attention_kernel_choice(*cc, head_dim, sm90a) == want


@pytest.mark.parametrize("value", ["", "auto"])
def test_kernel_choice_default_override_values(value):
    assert attention_kernel_choice(9, 0, 128, True, value) == HOPPER
    assert attention_kernel_choice(8, 0, 64, True, value) == _portable(64)


@pytest.mark.parametrize("cc", [(9, 0), (8, 0), (12, 0)], ids=str)
def test_kernel_choice_portable_override(cc):
    """PEAGLE_ATTN_KERNEL=portable: the mma.sync kernels everywhere (the Blackwell path on an H200)."""
    for head_dim in (64, 128):
        assert attention_kernel_choice(*cc, head_dim, True, "portable") == _portable(head_dim)


def test_kernel_choice_unsupported():
    """No kernel before compute capability 8.0 or for head dims other than 64 and 128."""
    none = {"family": "unsupported", "fwd_block_q": 0, "dq_block_q": 0, "dkv_block_k": 0, "dkv_block_q": 0}
    assert attention_kernel_choice(7, 5, 128, True) == none
    for head_dim in (0, 32, 96, 256):
        assert attention_kernel_choice(9, 0, head_dim, True) == none
        assert attention_kernel_choice(8, 0, head_dim, False, "portable") == none


@pytest.mark.parametrize("value", ["wgmma", "mma", "Portable", "hopper", " portable"])
def test_kernel_choice_unknown_override_is_refused(value):
    with pytest.raises(ValueError, match=f"PEAGLE_ATTN_KERNEL={value} is not a kernel choice"):
        attention_kernel_choice(9, 0, 128, True, value)


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
    with pytest.raises(ValueError, match="another mode"):
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
