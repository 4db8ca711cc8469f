"""fused_linear_kl with a target index: draft row t against target row target_index[t].

Reference: the float64 eager loss over target_hidden[target_index] (every draft row's target
logits computed on its own). Layouts where many draft rows share one target row, groups split by
chunk edges, a target row with more draft rows than a chunk holds, unreferenced target rows and
target rows used only by rows of weight 0; the op's own GEMMs are counted to show the target side
is computed once per distinct target row and rows of weight 0 not at all."""

import pytest
import torch

from peagle_ext.loss import chunk_plan, fused_linear_kl
from tests.helpers import reference_fused_linear_kl, requires_cuda
from tests.ops.test_loss import assert_close_fp64, cpu_peak_bytes, make_inputs, random_d2t, rel_err, run

pytestmark = pytest.mark.usefixtures("one_thread")


def shared_targets(g, t, m, *, k=3, dtype=torch.float64, device="cpu", p_zero=0.2, h=12, vd=37, v=None, skew=False):
    """Inputs with M target rows and T draft rows indexing them (repeats, gaps, any order).
    skew: half of the draft rows share target row 1."""
    xd, w_d, xt, w_t, weight, depth = make_inputs(g, t, h, vd, v=v, k=k, dtype=dtype, device=device, p_zero=p_zero)
    xt = make_inputs(g, m, h, vd, v=v, dtype=dtype, device=device)[2] if m else xt[:0]
    index = torch.randint(0, max(m, 1), (t,), generator=g)
    if skew:
        index[torch.rand(t, generator=g) < 0.5] = 1
    return xd, w_d, xt, w_t, weight, depth, index.to(device)


def reference(xd, w_d, xt, w_t, weight, depth, index, k, **kw):
    return reference_fused_linear_kl(xd, w_d, xt[index.long()], w_t, weight, depth, k, **kw)


def run_indexed(xd, w_d, xt, w_t, weight, depth, index, k, **kw):
    return run(xd, w_d, xt, w_t, weight, depth, k, target_index=index, **kw)


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 7, 16, "auto"])
@pytest.mark.parametrize("skew", [False, True])
def test_shared_target_rows_match_reference_fp64(rng, chunk_size, skew):
    # 53 draft rows over 11 target rows: groups of ~5, split by every chunk size but "auto"
    inp = shared_targets(rng, 53, 11, skew=skew)
    got = run_indexed(*inp, 3, chunk_size=chunk_size)
    assert_close_fp64(got, reference(*inp, 3))


@pytest.mark.parametrize("kind", ["kl", "ce"])
def test_d2t_and_ce_with_index(rng, kind):
    t, m, h, vd, v = 40, 9, 10, 23, 61
    inp = shared_targets(rng, t, m, h=h, vd=vd, v=v, k=4)
    d2t = random_d2t(rng, vd, v)
    got = run_indexed(*inp, 4, d2t=d2t, chunk_size=6, kind=kind)
    assert_close_fp64(got, reference(*inp, 4, d2t=d2t, kind=kind))


def test_one_target_row_larger_than_a_chunk(rng):
    """A target row with more draft rows than a chunk holds keeps its logits across the chunks
    of its own; the rows around it still group normally."""
    xd, w_d, xt, w_t, weight, depth, _ = shared_targets(rng, 30, 4, p_zero=0.0)
    index = torch.tensor([2] * 19 + [0, 3, 1, 0, 3, 3, 1, 0, 0, 2, 3])
    for chunk in (1, 4, 5, 19, 30):
        got = run_indexed(xd, w_d, xt, w_t, weight, depth, index, 3, chunk_size=chunk)
        assert_close_fp64(got, reference(xd, w_d, xt, w_t, weight, depth, index, 3))


def test_calls_of_other_sizes_in_turn_match_reference(rng):
    """The row plan's host scratch is reused from call to call: a call after a larger one (more
    draft rows, more target rows) or a smaller one sees none of its state."""
    for t, m, chunk in ((300, 120, 16), (7, 3, 2), (1, 1, 1), (300, 120, 16), (40, 200, 5), (0, 5, 4), (53, 11, 3)):
        inp = shared_targets(rng, t, m)
        got = run_indexed(*inp, 3, chunk_size=chunk)
        assert_close_fp64(got, reference(*inp, 3))


def test_index_dtypes_order_and_identity(rng):
    """int32 and int64 indices, any order; an arange index equals no index, bit for bit."""
    inp = shared_targets(rng, 25, 25)
    want = reference(*inp, 3)
    xd, w_d, xt, w_t, weight, depth, index = inp
    assert_close_fp64(run_indexed(*inp[:6], index.int(), 3, chunk_size=4), want)
    perm = torch.randperm(25, generator=rng)
    assert_close_fp64(run_indexed(*inp[:6], perm, 3, chunk_size=4), reference(*inp[:6], perm, 3))
    plain = run(xd, w_d, xt, w_t, weight, depth, 3, chunk_size=4)
    ident = run_indexed(xd, w_d, xt, w_t, weight, depth, torch.arange(25), 3, chunk_size=4)
    for a, b in zip(plain, ident):
        assert torch.equal(a, b)


def test_unused_target_rows_may_hold_anything(rng):
    """Target rows that no row of weight > 0 indexes are never read: NaN there changes nothing."""
    xd, w_d, xt, w_t, weight, depth, _ = shared_targets(rng, 12, 6, p_zero=0.0)
    weight[[0, 5]] = 0
    index = torch.tensor([4, 0, 2, 2, 0, 5, 2, 0, 2, 3, 3, 0])  # row 1 unused; 4 and 5: weight 0 only
    want = reference(xd, w_d, xt, w_t, weight, depth, index, 3)
    bad = xt.clone()
    bad[[1, 4, 5]] = float("nan")
    assert_close_fp64(run_indexed(xd, w_d, bad, w_t, weight, depth, index, 3, chunk_size=3), want)


def test_zero_weight_rows_are_not_computed_even_when_non_finite(rng):
    """A row of weight 0 takes no part: NaN in its draft hidden state leaves loss and both
    gradients finite (no 0 * NaN in the head gradient)."""
    xd, w_d, xt, w_t, weight, depth, index = shared_targets(rng, 20, 7, p_zero=0.0)
    weight[[3, 11]] = 0
    want = reference(xd, w_d, xt, w_t, weight, depth, index, 3)
    bad = xd.clone()
    bad[[3, 11]] = float("nan")
    got = run_indexed(bad, w_d, xt, w_t, weight, depth, index, 3, chunk_size=5)
    assert_close_fp64(got, want)
    assert torch.all(got[3][[3, 11]] == 0)


def _gemm_rows(fn, h, ht):
    """(rows of every target-logit GEMM, rows of every draft-logit GEMM) the op ran in fn."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    target, draft = [], []
    for e in prof.events():
        if e.name not in ("aten::mm", "aten::mm.out") or len(e.input_shapes) < 2:
            continue
        a, b = e.input_shapes[0], e.input_shapes[1]
        if len(a) == 2 and len(b) == 2 and a[1] == ht and b == [ht, VD]:
            target.append(a[0])
        elif len(a) == 2 and len(b) == 2 and a[1] == h and b == [h, VD]:
            draft.append(a[0])
    return target, draft


VD = 29


@pytest.mark.parametrize("chunk", [2, 5, 64])
def test_target_side_once_per_distinct_row_and_zero_weight_rows_skipped(rng, chunk):
    t, m, h, ht = 60, 14, 8, 6  # ht != h tells the two GEMMs apart
    xd, w_d, _, w_t, weight, depth = make_inputs(rng, t, h, VD, ht=ht)
    xt = make_inputs(rng, m, h, VD, ht=ht)[2]
    index = torch.randint(1, m - 2, (t,), generator=rng)  # rows m-2, m-1: never indexed
    index[:6] = 0  # target 0: only rows of weight 0
    weight[:6] = 0
    target_rows, draft_rows = _gemm_rows(
        lambda: fused_linear_kl(
            xd.requires_grad_(), w_d, xt, w_t, weight, depth, num_depths=3, target_index=index, chunk_size=chunk
        ),
        h,
        ht,
    )
    used = index[weight > 0].unique().numel()
    assert sum(target_rows) == used < m - 2
    assert sum(draft_rows) == int((weight > 0).sum()) < t
    assert max(target_rows) <= chunk and max(draft_rows) <= chunk


def test_bad_target_index_is_named(rng):
    xd, w_d, xt, w_t, weight, depth, index = shared_targets(rng, 8, 5)

    def call(**kw):
        a = dict(target_index=index, num_depths=3)
        a.update(kw)
        return fused_linear_kl(xd, w_d, a.pop("xt", xt), w_t, weight, depth, **a)

    call()
    for exc, match, kw in [
        (ValueError, "target_index must lie in", dict(target_index=index + 5)),
        (ValueError, "target_index must lie in", dict(target_index=index - 1 - index.max())),
        (ValueError, "target_index must have shape", dict(target_index=index[:3])),
        (TypeError, "target_index", dict(target_index=index.double())),
        (ValueError, "target_index must be on", dict(target_index=index.to("meta"))),
        (ValueError, "target_index must lie in", dict(xt=xt[:0])),
        (ValueError, "no target_index is given", dict(target_index=None)),
    ]:
        with pytest.raises(exc, match=match):
            call(**kw)
    # validate=False: the native op still refuses an index it would read out of bounds
    with pytest.raises(ValueError, match="target_index"):
        call(target_index=torch.full_like(index, 5), validate=False)


def test_no_weighted_rows_and_no_target_rows(rng):
    xd, w_d, xt, w_t, weight, depth, index = shared_targets(rng, 9, 4)
    loss, correct, total, gx, gw = run_indexed(xd, w_d, xt, w_t, torch.zeros(9, dtype=torch.float64), depth, index, 3)
    assert float(loss) == 0.0 and torch.all(gx == 0) and torch.all(gw == 0) and int(total.sum()) == 0
    # M = 0 is fine when no row is computed
    loss, _ = fused_linear_kl(xd[:0], w_d, xt[:0], w_t, weight[:0], depth[:0], num_depths=3, target_index=index[:0])
    assert float(loss) == 0.0


def test_torch_compile_fullgraph_with_index(rng):
    xd, w_d, xt, w_t, weight, depth, index = shared_targets(rng, 21, 6, dtype=torch.float32)

    def f(a, b):
        loss, m = fused_linear_kl(
            a, b, xt, w_t, weight, depth, num_depths=3, target_index=index, chunk_size=4, validate=False
        )
        return 2 * loss, m["correct"]

    grads = []
    for fn in (torch.compile(f, fullgraph=True, backend="aot_eager"), f):
        a, b = xd.clone().requires_grad_(), w_d.clone().requires_grad_()
        loss, correct = fn(a, b)
        loss.backward()
        grads.append((loss.detach(), correct, a.grad, b.grad))
    for x, y in zip(*grads):
        torch.testing.assert_close(x, y)


def test_peak_memory_is_one_chunk_per_side(rng):
    t, m, h, v, rows = 512, 170, 16, 3000, 8
    xd, w_d, xt, w_t, weight, depth, index = shared_targets(rng, t, m, h=h, vd=v, p_zero=0.1)
    xd.requires_grad_()
    w_d.requires_grad_()

    def step():
        loss, _ = fused_linear_kl(xd, w_d, xt, w_t, weight, depth, num_depths=3, target_index=index, chunk_size=rows)
        loss.backward()

    step()
    xd.grad = w_d.grad = None
    peak = cpu_peak_bytes(step)
    plan = chunk_plan(t, v, torch.float64, chunk_size=rows)
    grads = 8 * (xd.numel() + w_d.numel())
    # two logit chunks + saved and returned grads + gathered chunk rows + small vectors
    bound = plan.logit_bytes + 2 * grads + 3 * rows * h * 8 + 96 * t + 65536
    assert peak <= bound, (peak, bound)


# ---- CUDA -----------------------------------------------------------------------------------
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", ["kl", "ce"])
@pytest.mark.parametrize(
    "t,m,h,vd,v,chunk",
    [
        (61, 13, 64, 101, 101, 5),  # odd vocab: draft and target rows at different misalignments
        (300, 40, 128, 1024, 1024, 48),  # aligned rows, vector path only
        (257, 90, 96, 4099, 5000, 64),  # d2t, odd vocab, many chunks
        (40, 1, 64, 1000, 1000, 7),  # every row shares the one target row, across chunks
    ],
)
def test_cuda_index_matches_fp64_reference(rng, dtype, kind, t, m, h, vd, v, chunk):
    inp = shared_targets(rng, t, m, h=h, vd=vd, v=v, k=4, dtype=dtype, device="cuda", skew=m > 1)
    d2t = random_d2t(rng, vd, v, device="cuda") if vd != v else None
    got = run_indexed(*inp, 4, d2t=d2t, chunk_size=chunk, kind=kind)
    want = reference(*inp, 4, d2t=d2t, kind=kind)
    torch.cuda.synchronize()
    assert got[0].dtype == torch.float32 and torch.isfinite(got[0])
    assert abs(float(got[0]) - float(want[0])) <= 1e-2 * abs(float(want[0])) + 1e-6
    assert rel_err(got[3], want[3]) <= 1e-2
    assert rel_err(got[4], want[4]) <= 1e-2
    assert torch.equal(got[2].cpu(), want[2].cpu())
    assert int((got[1] - want[1]).abs().sum()) <= max(1, t // 50)


@requires_cuda
def test_cuda_index_agrees_with_cpu_implementation(rng):
    inp = shared_targets(rng, 90, 31, h=32, vd=333, v=400, dtype=torch.float32, skew=True)
    d2t = random_d2t(rng, 333, 400)
    cpu = run_indexed(*inp, 3, d2t=d2t, chunk_size=9)
    gpu = run_indexed(*[x.cuda() for x in inp[:6]], inp[6].cuda(), 3, d2t=d2t.cuda(), chunk_size=9)
    torch.testing.assert_close(gpu[0].cpu(), cpu[0], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gpu[3].cpu(), cpu[3], rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(gpu[4].cpu(), cpu[4], rtol=1e-3, atol=1e-6)
    assert torch.equal(gpu[1].cpu(), cpu[1]) and torch.equal(gpu[2].cpu(), cpu[2])
