"""peagle_ext.loss.fused_linear_kl against an eager float64 reference (full logits,
log_softmax, kl_div / cross_entropy, autograd), on CPU (tight, float64) and CUDA (bf16/fp16/
fp32, relative error <= 1e-2). With a target index, the reference gathers the target rows
first (target_hidden[target_index]) and computes every draft row's target logits on its own."""

import math

import pytest
import torch

from peagle_ext.loss import AUTO_CHUNK_BYTES, chunk_plan, fused_linear_kl
from tests.helpers import reference_fused_linear_kl, requires_cuda

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- inputs and the eager reference ------------------------------------------------------
def make_inputs(g, t, h, vd, *, v=None, ht=None, k=3, dtype=torch.float64, device="cpu", p_zero=0.2, scale=1.0):
    """Random draft/target hidden states and heads; weights in [0.5, 1.5) with a share of zeros."""
    v = vd if v is None else v
    ht = h if ht is None else ht

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * s).to(dtype=dtype, device=device)

    xd = rnd(t, h, s=scale / math.sqrt(h) * 4)
    w_d = rnd(vd, h)
    xt = rnd(t, ht, s=scale / math.sqrt(ht) * 4)
    w_t = rnd(v, ht)
    weight = torch.rand(t, generator=g, dtype=torch.float64) + 0.5
    weight[torch.rand(t, generator=g) < p_zero] = 0
    depth = torch.randint(0, k, (t,), generator=g, dtype=torch.int32)
    return xd, w_d, xt, w_t, weight.to(device), depth.to(device)


def random_d2t(g, vd, v, device="cpu"):
    ids = torch.randperm(v, generator=g)[:vd].sort().values
    return (ids - torch.arange(vd)).to(device)


def run(xd, w_d, xt, w_t, weight, depth, k, **kw):
    """fused_linear_kl with grads: (loss, correct, total, grad_xd, grad_wd)."""
    xd = xd.detach().clone().requires_grad_()
    w_d = w_d.detach().clone().requires_grad_()
    loss, m = fused_linear_kl(xd, w_d, xt, w_t, weight, depth, num_depths=k, **kw)
    loss.backward()
    return loss.detach(), m["correct"], m["total"], xd.grad, w_d.grad


def assert_close_fp64(got, want):
    loss, correct, total, gx, gw = got
    rloss, rcorrect, rtotal, rgx, rgw = want
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, rloss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gx, rgx, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(gw, rgw, rtol=1e-9, atol=1e-12)
    assert torch.equal(correct, rcorrect) and torch.equal(total, rtotal)


def rel_err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---- CPU, float64 ---------------------------------------------------------------------------
@pytest.mark.parametrize("chunk_size", [1, 5, 16, 37, 64, "auto", None])
def test_kl_matches_eager_fp64_any_chunking(rng, chunk_size):
    # T = 37 and V = 101 are prime: no chunk boundary lines up with anything.
    inp = make_inputs(rng, 37, 24, 101)
    got = run(*inp, 3, chunk_size=chunk_size)
    assert_close_fp64(got, reference_fused_linear_kl(*inp, 3))


def test_ce_matches_eager_fp64(rng):
    inp = make_inputs(rng, 29, 16, 67, k=4)
    got = run(*inp, 4, chunk_size=6, kind="ce")
    assert_close_fp64(got, reference_fused_linear_kl(*inp, 4, kind="ce"))


@pytest.mark.parametrize("kind", ["kl", "ce"])
def test_d2t_restricts_and_renormalises_target(rng, kind):
    t, h, vd, v = 33, 12, 41, 150
    inp = make_inputs(rng, t, h, vd, v=v, k=5)
    d2t = random_d2t(rng, vd, v)
    got = run(*inp, 5, d2t=d2t, chunk_size=7, kind=kind)
    assert_close_fp64(got, reference_fused_linear_kl(*inp, 5, d2t=d2t, kind=kind))


def test_d2t_int32_and_identity_mapping(rng):
    inp = make_inputs(rng, 10, 8, 20)
    want = reference_fused_linear_kl(*inp, 3)
    got = run(*inp, 3, d2t=torch.zeros(20, dtype=torch.int32), chunk_size=3)
    assert_close_fp64(got, want)


def test_target_hidden_size_may_differ(rng):
    inp = make_inputs(rng, 19, 10, 30, ht=14)
    assert_close_fp64(run(*inp, 3, chunk_size=4), reference_fused_linear_kl(*inp, 3))


def test_zero_weight_rows_get_zero_grad_and_are_not_counted(rng):
    xd, w_d, xt, w_t, weight, depth = make_inputs(rng, 40, 8, 50, p_zero=0.0)
    weight[::3] = 0
    inp = (xd, w_d, xt, w_t, weight, depth)
    got = run(*inp, 3, chunk_size=9)
    assert_close_fp64(got, reference_fused_linear_kl(*inp, 3))
    assert torch.all(got[3][::3] == 0)
    assert int(got[2].sum()) == int((weight > 0).sum())


@pytest.mark.parametrize("kind", ["kl", "ce"])
def test_all_zero_weights_give_zero_loss_and_zero_grads(rng, kind):
    xd, w_d, xt, w_t, weight, depth = make_inputs(rng, 12, 8, 20)
    loss, correct, total, gx, gw = run(
        xd, w_d, xt, w_t, torch.zeros(12, dtype=torch.float64), depth, 3, chunk_size=5, kind=kind
    )
    assert float(loss) == 0.0 and torch.isfinite(loss)
    assert torch.all(gx == 0) and torch.all(gw == 0)
    assert int(correct.sum()) == 0 and int(total.sum()) == 0


def test_single_token(rng):
    inp = make_inputs(rng, 1, 8, 13, p_zero=0.0)
    assert_close_fp64(run(*inp, 3), reference_fused_linear_kl(*inp, 3))


def test_no_tokens(rng):
    xd, w_d, xt, w_t, weight, depth = make_inputs(rng, 0, 8, 13)
    loss, correct, total, gx, gw = run(xd, w_d, xt, w_t, weight, depth, 2)
    assert float(loss) == 0.0 and gx.shape == (0, 8) and torch.all(gw == 0)
    assert correct.tolist() == [0, 0] and total.tolist() == [0, 0]


def test_integer_and_bool_weights_are_a_mask(rng):
    xd, w_d, xt, w_t, _, depth = make_inputs(rng, 25, 8, 31)
    mask = torch.rand(25, generator=rng) < 0.6
    want = reference_fused_linear_kl(xd, w_d, xt, w_t, mask.double(), depth, 3)
    assert_close_fp64(run(xd, w_d, xt, w_t, mask, depth, 3, chunk_size=4), want)
    assert_close_fp64(run(xd, w_d, xt, w_t, mask.to(torch.int64), depth.long(), 3, chunk_size=4), want)


def test_metrics_equal_a_plain_count(rng):
    # Large logits so the two argmaxes often agree and often do not.
    t, h, v, k = 64, 16, 23, 6
    xd, w_d, xt, w_t, weight, depth = make_inputs(rng, t, h, v, k=k, scale=3.0)
    xt = xd.clone()
    w_t = w_d + 0.5 * torch.randn(w_d.shape, generator=rng, dtype=torch.float64)
    _, m = fused_linear_kl(xd, w_d, xt, w_t, weight, depth, num_depths=k, chunk_size=10)
    ld, lt = xd @ w_d.T, xt @ w_t.T
    for d in range(k):
        sel = (depth == d) & (weight > 0)
        assert int(m["total"][d]) == int(sel.sum())
        assert int(m["correct"][d]) == int((ld.argmax(-1) == lt.argmax(-1))[sel].sum())
    assert 0 < int(m["correct"].sum()) < int(m["total"].sum())


def test_argmax_ties_take_the_first_index():
    # Draft logits tie between ids 3 and 10 (identical head rows); the target's argmax is 3.
    h, v = 4, 16
    w_d = torch.zeros(v, h, dtype=torch.float64)
    w_d[:, 1] = torch.linspace(-1, 0, v, dtype=torch.float64)
    w_d[3, 0] = w_d[10, 0] = 5.0
    w_d[3, 1] = w_d[10, 1] = 0.0
    xd = torch.tensor([[1.0, 0.5, 0.0, 0.0]], dtype=torch.float64)
    w_t = torch.zeros(v, h, dtype=torch.float64)
    w_t[3, 0] = 5.0
    _, m = fused_linear_kl(xd, w_d, xd, w_t, torch.ones(1), torch.zeros(1, dtype=torch.int32), num_depths=1)
    assert (xd @ w_d.T)[0, 3] == (xd @ w_d.T)[0, 10] == (xd @ w_d.T).max()
    assert m["correct"].tolist() == [1] and m["total"].tolist() == [1]


# ---- autograd plumbing ------------------------------------------------------------------------
def test_backward_scales_by_grad_output_and_allows_retain_graph(rng):
    xd, w_d, xt, w_t, weight, depth = make_inputs(rng, 15, 8, 21)
    _, _, _, rgx, rgw = reference_fused_linear_kl(xd, w_d, xt, w_t, weight, depth, 3)
    xd = xd.clone().requires_grad_()
    w_d = w_d.clone().requires_grad_()
    loss, _ = fused_linear_kl(xd, w_d, xt, w_t, weight, depth, num_depths=3, chunk_size=4)
    (2.5 * loss).backward(retain_graph=True)
    torch.testing.assert_close(xd.grad, 2.5 * rgx)
    torch.testing.assert_close(w_d.grad, 2.5 * rgw)
    (-1.0 * loss).backward()
    torch.testing.assert_close(xd.grad, 1.5 * rgx)
    torch.testing.assert_close(w_d.grad, 1.5 * rgw)


def test_gradients_only_reach_the_draft_side(rng):
    xd, w_d, xt, w_t, weight, depth = make_inputs(rng, 9, 8, 11)
    w_d.requires_grad_()
    xt.requires_grad_()
    w_t.requires_grad_()
    loss, _ = fused_linear_kl(xd, w_d, xt, w_t, weight, depth, num_depths=3)
    loss.backward()
    assert w_d.grad is not None and xt.grad is None and w_t.grad is None
    _, _, _, _, rgw = reference_fused_linear_kl(xd, w_d, xt, w_t, weight, depth, 3)
    torch.testing.assert_close(w_d.grad, rgw)


def test_without_grad_returns_plain_values(rng):
    inp = make_inputs(rng, 11, 8, 17)
    want = reference_fused_linear_kl(*inp, 3)
    loss, m = fused_linear_kl(*inp, num_depths=3, chunk_size=2)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, want[0])
    xd = inp[0].clone().requires_grad_()
    with torch.no_grad():
        loss2, _ = fused_linear_kl(xd, *inp[1:], num_depths=3, chunk_size=2)
    assert not loss2.requires_grad
    torch.testing.assert_close(loss2, want[0])


def test_opcheck_schema_and_fake(rng):
    xd, w_d, xt, w_t, weight, depth = make_inputs(rng, 7, 8, 9)
    index = torch.tensor([0, 2, 2, 1, 0, 4, 2])
    for grads in (True, False):
        for xt_, ti in ((xt, None), (xt[:5], index)):
            torch.library.opcheck(
                torch.ops.peagle.fused_linear_kl.default,
                (xd, w_d, xt_, w_t, weight, depth, None, ti, 3, 3, "kl", grads, grads),
                test_utils=("test_schema", "test_faketensor"),
            )


# ---- CPU low precision --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["kl", "ce"])
def test_low_precision_cpu_close_to_fp64(rng, dtype, kind):
    # Several chunks: the bf16 head gradient goes through the fp32 accumulator.
    inp = make_inputs(rng, 48, 32, 75, v=90, dtype=dtype)
    d2t = random_d2t(rng, 75, 90)
    got = run(*inp, 3, d2t=d2t, chunk_size=11, kind=kind)
    want = reference_fused_linear_kl(*inp, 3, d2t=d2t, kind=kind)
    assert got[0].dtype == torch.float32
    assert got[3].dtype == dtype and got[4].dtype == dtype
    assert abs(float(got[0]) - float(want[0])) <= 1e-2 * abs(float(want[0]))
    assert rel_err(got[3], want[3]) <= 1e-2
    assert rel_err(got[4], want[4]) <= 1e-2


# ---- memory: never a [T, V] tensor ------------------------------------------------------------
def test_chunk_plan():
    p = chunk_plan(100_000, 151_936, torch.bfloat16)
    assert p.bytes_per_chunk <= AUTO_CHUNK_BYTES and p.rows_per_chunk % 128 == 0
    assert p.num_chunks == math.ceil(100_000 / p.rows_per_chunk)
    assert p.logit_bytes == 2 * p.rows_per_chunk * 151_936 * 2
    assert chunk_plan(10, 151_936, torch.bfloat16).rows_per_chunk == 10
    assert chunk_plan(10, 7, torch.float64, chunk_size=3).num_chunks == 4
    assert chunk_plan(10, 7, torch.float64, chunk_size=None) == chunk_plan(10, 7, torch.float64)
    assert chunk_plan(0, 7, torch.float32).num_chunks == 0
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_plan(10, 7, torch.float32, chunk_size=0)
    with pytest.raises(TypeError, match="chunk_size"):
        chunk_plan(10, 7, torch.float32, chunk_size="big")


def cpu_peak_bytes(fn):
    """Peak of bytes allocated through the CPU allocator while fn runs (profiler memory events)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        from torch._C._profiler import _EventType
    except ImportError:  # pragma: no cover - private API moved
        pytest.skip("torch profiler event tree API not available")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    totals = []

    def walk(e):
        if e.tag == _EventType.Allocation:
            totals.append((e.extra_fields.total_allocated, e.extra_fields.alloc_size))
        for c in e.children:
            walk(c)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    if not totals:
        pytest.skip("the profiler recorded no allocation")
    base = totals[0][0] - totals[0][1]
    return max(t for t, _ in totals) - base


def test_peak_memory_is_chunks_plus_grads_not_t_by_v(rng):
    t, h, v, rows = 512, 16, 3000, 8
    xd, w_d, xt, w_t, weight, depth = make_inputs(rng, t, h, v)
    xd.requires_grad_()
    w_d.requires_grad_()
    plan = chunk_plan(t, v, torch.float64, chunk_size=rows)
    assert plan.num_chunks == 64 and plan.bytes_per_chunk == rows * v * 8

    def step():
        loss, _ = fused_linear_kl(xd, w_d, xt, w_t, weight, depth, num_depths=3, chunk_size=rows)
        loss.backward()

    step()  # warm up
    xd.grad = w_d.grad = None
    peak = cpu_peak_bytes(step)
    grads = 8 * (xd.numel() + w_d.numel())
    # two logit chunks + saved grads + the returned grads + small vectors
    bound = plan.logit_bytes + 2 * grads + 64 * t + 65536
    assert peak <= bound, (peak, bound)
    assert peak < t * v * 8 / 4  # far below one [T, V] float64 tensor


# ---- bad input --------------------------------------------------------------------------------
def test_bad_inputs_name_the_argument(rng):
    xd, w_d, xt, w_t, weight, depth = make_inputs(rng, 6, 8, 10, v=12)
    d2t = random_d2t(rng, 10, 12)
    ok = dict(num_depths=3, d2t=d2t)

    def call(**over):
        a = dict(draft_hidden=xd, draft_head=w_d, target_hidden=xt, target_head=w_t, weight=weight, depth=depth)
        kw = dict(ok)
        for key, val in over.items():
            (a if key in a else kw)[key] = val
        return fused_linear_kl(
            a["draft_hidden"], a["draft_head"], a["target_hidden"], a["target_head"], a["weight"], a["depth"], **kw
        )

    call()  # the baseline is valid
    cases = [
        (TypeError, "draft_hidden", dict(draft_hidden=xd.numpy())),
        (ValueError, "draft_hidden", dict(draft_hidden=xd[0])),
        (TypeError, "draft_hidden", dict(draft_hidden=xd.to(torch.int64))),
        (TypeError, "draft_head", dict(draft_head=w_d.float())),
        (TypeError, "target_head", dict(target_head=w_t.float())),
        (ValueError, "draft_head", dict(draft_head=w_d[:, :5])),
        (ValueError, "target_head", dict(target_head=w_t[:, :5])),
        (ValueError, "target_hidden", dict(target_hidden=xt[:4])),
        (ValueError, "weight", dict(weight=weight[:5])),
        (ValueError, "depth", dict(depth=depth[:5])),
        (TypeError, "depth", dict(depth=depth.double())),
        (ValueError, "weight", dict(weight=torch.full((6,), float("nan"), dtype=torch.float64))),
        (ValueError, "weight", dict(weight=torch.full((6,), float("inf"), dtype=torch.float64))),
        (ValueError, "weight", dict(weight=-weight - 1)),
        (ValueError, "depth", dict(depth=depth + 3)),
        (ValueError, "depth", dict(depth=depth - 1 - depth.max())),
        (ValueError, "num_depths", dict(num_depths=0)),
        (TypeError, "num_depths", dict(num_depths=2.0)),
        (ValueError, "d2t", dict(d2t=None)),
        (ValueError, "d2t", dict(d2t=d2t[:5])),
        (TypeError, "d2t", dict(d2t=d2t.double())),
        (ValueError, "d2t", dict(d2t=d2t + 5)),
        (ValueError, "d2t", dict(d2t=d2t - 1 - d2t.max())),
        (ValueError, "d2t", dict(d2t=torch.full((10,), 0, dtype=torch.int64) - torch.arange(10))),
        (ValueError, "kind", dict(kind="js")),
        (ValueError, "chunk_size", dict(chunk_size=0)),
        (TypeError, "chunk_size", dict(chunk_size=2.5)),
        (ValueError, "draft_head", dict(draft_head=torch.randn(13, 8, dtype=torch.float64))),
    ]
    for exc, name, over in cases:
        with pytest.raises(exc, match=name):
            call(**over)


def test_native_op_checks_too(rng):
    xd, w_d, xt, w_t, weight, depth = make_inputs(rng, 6, 8, 10)
    op = torch.ops.peagle.fused_linear_kl
    with pytest.raises(TypeError, match="weight"):
        op(xd, w_d, xt, w_t, weight.float(), depth, None, None, 3, 2, "kl", True, True)
    with pytest.raises(ValueError, match="d2t"):
        op(xd, w_d, xt, w_t, weight, depth, torch.full((10,), 7, dtype=torch.int64), None, 3, 2, "kl", True, True)
    with pytest.raises(ValueError, match="kind"):
        op(xd, w_d, xt, w_t, weight, depth, None, None, 3, 2, "tv", True, True)
    with pytest.raises(ValueError, match="chunk_rows"):
        op(xd, w_d, xt, w_t, weight, depth, None, None, 3, 0, "kl", True, True)
    with pytest.raises(ValueError, match="draft_head"):
        op(xd, w_d[:, :3].contiguous(), xt, w_t, weight, depth, None, None, 3, 2, "kl", True, True)
    # the native op checks the target index of every row it computes (it indexes with it)
    bad = torch.zeros(6, dtype=torch.int64)
    bad[weight.argmax()] = 6
    with pytest.raises(ValueError, match=r"target_index\[\d\] is outside \[0, 6\)"):
        op(xd, w_d, xt, w_t, weight, depth, None, bad, 3, 2, "kl", True, True)
    with pytest.raises(TypeError, match="target_index must be int64"):
        op(xd, w_d, xt, w_t, weight, depth, None, bad.int(), 3, 2, "kl", True, True)
    with pytest.raises(ValueError, match="target_index must have shape"):
        op(xd, w_d, xt, w_t, weight, depth, None, bad[:4], 3, 2, "kl", True, True)
    with pytest.raises(ValueError, match="target_hidden must have T = 6"):
        op(xd, w_d, xt[:4].contiguous(), w_t, weight, depth, None, None, 3, 2, "kl", True, True)


# ---- CUDA -----------------------------------------------------------------------------------
def _gpu_case(g, t, h, vd, v, dtype, *, k=4, d2t=False, p_zero=0.2):
    inp = make_inputs(g, t, h, vd, v=v, k=k, dtype=dtype, device="cuda", p_zero=p_zero)
    return inp, (random_d2t(g, vd, v, device="cuda") if d2t else None)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", ["kl", "ce"])
@pytest.mark.parametrize(
    "t,h,vd,v,chunk",
    [
        (37, 64, 101, 101, 5),  # odd vocab: rows start misaligned, scalar head/tail paths
        (130, 128, 1024, 1024, 48),  # aligned rows, vector path only
        (257, 96, 4099, 5000, 64),  # d2t, odd vocab, many chunks
        (1, 64, 1000, 1000, "auto"),  # a single token
    ],
)
def test_cuda_matches_fp64_reference(rng, dtype, kind, t, h, vd, v, chunk):
    inp, d2t = _gpu_case(rng, t, h, vd, v, dtype, d2t=vd != v)
    got = run(*inp, 4, d2t=d2t, chunk_size=chunk, kind=kind)
    want = reference_fused_linear_kl(*inp, 4, d2t=d2t, kind=kind)
    torch.cuda.synchronize()
    assert got[0].dtype == torch.float32 and torch.isfinite(got[0])
    assert abs(float(got[0]) - float(want[0])) <= 1e-2 * abs(float(want[0])) + 1e-6
    assert rel_err(got[3], want[3]) <= 1e-2
    assert rel_err(got[4], want[4]) <= 1e-2
    assert torch.equal(got[2].cpu(), want[2].cpu())
    # argmaxes over rounded logits may differ from the fp64 ones on near ties
    assert int((got[1] - want[1]).abs().sum()) <= max(1, t // 50)


@requires_cuda
def test_cuda_full_verifier_vocab_bf16(rng):
    # V = 151,936 (Qwen) with a 32K draft vocab and the full-vocab case.
    t, h = 96, 256
    for vd, v in ((151_936, 151_936), (32_000, 151_936)):
        inp, d2t = _gpu_case(rng, t, h, vd, v, torch.bfloat16, d2t=vd != v)
        got = run(*inp, 4, d2t=d2t, chunk_size=40)
        want = reference_fused_linear_kl(*inp, 4, d2t=d2t)
        assert abs(float(got[0]) - float(want[0])) <= 1e-2 * abs(float(want[0]))
        assert rel_err(got[3], want[3]) <= 1e-2 and rel_err(got[4], want[4]) <= 1e-2
        assert torch.equal(got[2].cpu(), want[2].cpu())


@requires_cuda
def test_cuda_zero_weights_and_ties(rng):
    inp, _ = _gpu_case(rng, 20, 64, 300, 300, torch.bfloat16)
    xd, w_d, xt, w_t, _, depth = inp
    loss, correct, total, gx, gw = run(xd, w_d, xt, w_t, torch.zeros(20, device="cuda"), depth, 4, chunk_size=7)
    assert float(loss) == 0.0 and torch.all(gx == 0) and torch.all(gw == 0) and int(total.sum()) == 0
    # ties: identical head rows 3 and 10 dominate the draft logits; the target argmax is 3
    h, v = 64, 64
    w_d = torch.zeros(v, h, device="cuda", dtype=torch.bfloat16)
    w_d[3, 0] = w_d[10, 0] = 4.0
    w_t = torch.zeros(v, h, device="cuda", dtype=torch.bfloat16)
    w_t[3, 0] = 4.0
    x = torch.zeros(5, h, device="cuda", dtype=torch.bfloat16)
    x[:, 0] = 1
    _, m = fused_linear_kl(
        x, w_d, x, w_t, torch.ones(5, device="cuda"), torch.zeros(5, dtype=torch.int32, device="cuda"), num_depths=1
    )
    assert m["correct"].tolist() == [5] and m["total"].tolist() == [5]


@requires_cuda
def test_cuda_agrees_with_cpu_implementation(rng):
    inp = make_inputs(rng, 70, 32, 333, v=400, dtype=torch.float32)
    d2t = random_d2t(rng, 333, 400)
    cpu = run(*inp, 3, d2t=d2t, chunk_size=9)
    gpu = run(*[x.cuda() for x in inp], 3, d2t=d2t.cuda(), chunk_size=9)
    torch.testing.assert_close(gpu[0].cpu(), cpu[0], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gpu[3].cpu(), cpu[3], rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(gpu[4].cpu(), cpu[4], rtol=1e-3, atol=1e-6)


@requires_cuda
def test_cuda_peak_memory_is_bounded_by_chunks(rng):
    t, h, v, rows = 4096, 512, 32_000, 256
    inp, _ = _gpu_case(rng, t, h, v, v, torch.bfloat16)
    xd, w_d, xt, w_t, weight, depth = inp
    xd.requires_grad_()
    w_d.requires_grad_()
    plan = chunk_plan(t, v, torch.bfloat16, chunk_size=rows)

    def step():
        loss, _ = fused_linear_kl(xd, w_d, xt, w_t, weight, depth, num_depths=4, chunk_size=rows)
        loss.backward()

    step()
    xd.grad = w_d.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    grads_bf16 = 2 * (xd.numel() + w_d.numel())
    # chunks + bf16 grads (saved, then returned) + the fp32 head accumulator + slack
    bound = plan.logit_bytes + 2 * grads_bf16 + 4 * w_d.numel() + (8 << 20)
    assert extra <= bound, (extra, bound)
    assert extra < t * v * 2  # never one [T, V] bf16 tensor


def test_torch_compile_fullgraph(rng):
    # The op's fake impl and the autograd.Function trace without graph breaks (validate=False:
    # the value checks are host syncs).
    xd, w_d, xt, w_t, weight, depth = make_inputs(rng, 21, 8, 19, dtype=torch.float32)

    def f(a, b):
        loss, m = fused_linear_kl(a, b, xt, w_t, weight, depth, num_depths=3, chunk_size=4, validate=False)
        return 2 * loss, m["correct"]

    grads = []
    for fn in (torch.compile(f, fullgraph=True, backend="aot_eager"), f):
        a, b = xd.clone().requires_grad_(), w_d.clone().requires_grad_()
        loss, correct = fn(a, b)
        loss.backward()
        grads.append((loss.detach(), correct, a.grad, b.grad))
    for x, y in zip(*grads):
        torch.testing.assert_close(x, y)
