"""peagle_ext.train.optim: make_adamw (fused on CUDA, torch's default on the CPU, same update),
BatchedMuon against torch.optim.Muon, MuonAdamW, and the learning-rate schedule, on the steps and
(--time-schedule) on the clock."""

import copy
import math

import pytest
import torch

from peagle_ext.train.optim import BatchedMuon, MuonAdamW, lr_lambda, make_adamw, make_optimizer, muon_split
from peagle_ext.train.settings import TrainError, TrainSettings
from tests.helpers import requires_cuda


def _params(device):
    g = torch.Generator().manual_seed(0)
    ps = [torch.randn(5, 3, generator=g).to(device).requires_grad_(), torch.randn(7, generator=g).to(device)]
    ps[1].requires_grad_()
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(device)
    return ps


def test_cpu_adamw_is_torch_default_and_bitwise_the_plain_one():
    a, b = _params("cpu"), _params("cpu")
    opt = make_adamw(a, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    assert not opt.defaults["fused"]
    ref = torch.optim.AdamW(b, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(3):
        opt.step()
        ref.step()
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@requires_cuda
def test_cuda_adamw_is_fused_and_matches_cpu():
    a, b = _params("cuda"), _params("cpu")
    opt = make_adamw(a, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    assert opt.defaults["fused"]
    ref = make_adamw(b, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(3):
        opt.step()
        ref.step()
    for x, y in zip(a, b):
        torch.testing.assert_close(x.cpu(), y, rtol=1e-5, atol=1e-6)


# wide, tall, square, a tall/wide pair of one shape, a lone shape, three of one shape
_MUON_SHAPES = [(6, 10), (10, 6), (8, 8), (8, 8), (4, 12), (12, 4), (12, 4), (5, 9)]


def _matrices(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(device).requires_grad_() for s in _MUON_SHAPES]


def _set_grads(groups, step):
    g = torch.Generator().manual_seed(100 + step)
    for i, ps in enumerate(zip(*groups)):
        grad = None if i == 3 and step == 1 else torch.randn(ps[0].shape, generator=g)  # one step without a grad
        for p in ps:
            p.grad = None if grad is None else grad.to(p.device)


@pytest.mark.parametrize(
    "kw",
    [
        dict(lr=3e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
        dict(lr=1e-2, weight_decay=0.0, adjust_lr_fn=None),
        dict(lr=2e-2, nesterov=False, momentum=0.9, adjust_lr_fn="original"),
    ],
)
def test_batched_muon_is_bitwise_torch_muon_on_the_cpu(kw):
    a, b = _matrices("cpu"), _matrices("cpu")
    ours, ref = BatchedMuon(a, **kw), torch.optim.Muon(b, **kw)
    for step in range(4):
        _set_grads((a, b), step)
        ours.step()
        ref.step()
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), _MUON_SHAPES[i]
        assert torch.equal(ours.state[x]["momentum_buffer"], ref.state[y]["momentum_buffer"])
    assert not torch.equal(a[0], _matrices("cpu")[0])


def test_a_prepared_muon_step_is_the_plain_step_and_changes_nothing_until_it_is_taken():
    """prepare() then step() is bitwise torch's step; prepare() alone changes no parameter and no
    state; zero_grad() and load_state_dict() drop what was prepared, so a step on later gradients
    (or a loaded state) uses those."""
    kw = dict(lr=3e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    a, b = _matrices("cpu"), _matrices("cpu")
    ours, ref = BatchedMuon(a, **kw), torch.optim.Muon(b, **kw)
    for step in range(4):
        _set_grads((a, b), step)
        before = [x.clone() for x in a]
        state = {i: ours.state[x]["momentum_buffer"].clone() for i, x in enumerate(a) if x in ours.state}
        ours.prepare()
        assert all(torch.equal(x, y) for x, y in zip(a, before))
        assert {i: ours.state[x]["momentum_buffer"] for i, x in enumerate(a) if x in ours.state}.keys() == state.keys()
        assert all(torch.equal(ours.state[a[i]]["momentum_buffer"], v) for i, v in state.items())
        if step == 2:  # dropped: the step below runs on fresh gradients
            ours.zero_grad()
            _set_grads((a, b), 10)
        ours.step()
        ref.step()
    for x, y in zip(a, b):
        assert torch.equal(x, y)
        assert torch.equal(ours.state[x]["momentum_buffer"], ref.state[y]["momentum_buffer"])
    ours.prepare()
    ours.load_state_dict(copy.deepcopy(ref.state_dict()))
    _set_grads((a, b), 5)
    ours.step()
    ref.step()
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_batched_muon_and_torch_muon_load_each_others_state():
    kw = dict(lr=3e-2, adjust_lr_fn="match_rms_adamw")
    a, b = _matrices("cpu"), _matrices("cpu")
    first, ref = torch.optim.Muon(a, **kw), torch.optim.Muon(b, **kw)
    for step in range(2):
        _set_grads((a, b), step)
        first.step()
        ref.step()
    ours = BatchedMuon(a, **kw)
    ours.load_state_dict(copy.deepcopy(first.state_dict()))
    for step in range(2, 4):
        _set_grads((a, b), step)
        ours.step()
        ref.step()
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    back = torch.optim.Muon(b, **kw)
    back.load_state_dict(copy.deepcopy(ours.state_dict()))
    assert all(torch.equal(back.state[y]["momentum_buffer"], ours.state[x]["momentum_buffer"]) for x, y in zip(a, b))


def test_batched_muon_runs_one_newton_schulz_per_shape_not_per_matrix():
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountGemms(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func.overloadpacket in (torch.ops.aten.bmm, torch.ops.aten.baddbmm, torch.ops.aten.mm)
            return func(*args, **(kwargs or {}))

    def gemms(shapes):
        ps = [torch.randn(s, requires_grad=True) for s in shapes]
        for p in ps:
            p.grad = torch.randn(p.shape)
        opt = BatchedMuon(ps, lr=1e-2)
        with CountGemms() as c:
            opt.step()
        return c.n

    ns_gemms = 3 * 5  # three per Newton-Schulz iteration, five iterations
    assert gemms([(8, 8)]) == ns_gemms
    assert gemms([(8, 8)] * 7 + [(4, 12), (12, 4)]) == 2 * ns_gemms


@requires_cuda
def test_batched_muon_on_cuda_is_torch_muon_up_to_bf16_rounding():
    """In bf16, batched and single GEMMs round differently and Newton-Schulz's five iterations grow
    that, so no fixed tolerance is right: the yardstick is torch's own Muon run on the CPU against
    the same run on CUDA (the same algorithm, other GEMMs). Ours may differ from torch's CUDA run
    by about as much, not more; a wrong transpose or learning-rate scale would differ by the
    whole update."""
    kw = dict(lr=3e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    a, b, c = _matrices("cuda"), _matrices("cuda"), _matrices("cpu")
    opts = BatchedMuon(a, **kw), torch.optim.Muon(b, **kw), torch.optim.Muon(c, **kw)
    start = [p.detach().clone() for p in b]
    for step in range(3):
        _set_grads((a, b, c), step)
        for opt in opts:
            opt.step()
    for x, y, z, x0 in zip(a, b, c, start):
        step_ref = y - x0
        spread = (z.cuda() - y).norm()  # torch's own CPU-against-CUDA rounding of this matrix's update
        assert spread < 0.05 * step_ref.norm()  # the yardstick is rounding, not a different update
        err = (x - y).norm()
        assert err <= 2 * spread + 0.02 * step_ref.norm(), (tuple(x.shape), err.item(), spread.item())


def _schedule_settings(**kw):
    base = dict(max_steps=100, warmup_steps=10, min_lr_ratio=0.1, max_minutes=10.0, time_schedule=True)
    return TrainSettings(**{**base, **kw})


def _cosine(t):
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))


def test_time_schedule_follows_the_clock_when_it_is_ahead_of_the_steps():
    clock = [0.0]
    f = lr_lambda(_schedule_settings(), clock=lambda: clock[0])
    assert f(0) == 0.1 and f(9) == 1.0  # the warmup counts steps only
    assert math.isclose(f(55), _cosine(0.5))  # the steps ahead: step 55 of 10..100
    clock[0] = 0.75  # the clock ahead: 3/4 of the training time
    assert math.isclose(f(56), _cosine(0.75)) and f.progress() == 0.75
    clock[0] = 0.0  # never back (a resumed process restarts its clock)
    assert math.isclose(f(57), _cosine(0.75))
    clock[0] = 9.9
    assert math.isclose(f(58), 0.1) and f.progress() == 1.0
    # a resumed run starts from the progress it had
    assert math.isclose(lr_lambda(_schedule_settings(), clock=lambda: 0.0, progress=0.75)(20), _cosine(0.75))


def test_without_time_schedule_the_steps_alone_set_the_rate():
    late = lambda: 9.9  # noqa: E731
    assert math.isclose(lr_lambda(_schedule_settings(time_schedule=False), clock=late)(55), _cosine(0.5))
    assert lr_lambda(_schedule_settings(schedule="constant"), clock=late)(50) == 1.0


def test_time_schedule_needs_max_minutes():
    with pytest.raises(TrainError, match="--time-schedule needs --max-minutes"):
        _schedule_settings(max_minutes=None).validate()


def _model_with_grads(seed=0):
    from tests.helpers import make_model

    m = make_model(torch.Generator().manual_seed(0), num_layers=2, k=2)
    g = torch.Generator().manual_seed(seed)
    for p in m.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=g)
    return m


def test_muon_split_puts_the_layer_matrices_on_muon_and_the_rest_on_adamw():
    m = _model_with_grads()
    muon, adamw = muon_split(m.named_parameters())
    names = {id(p): n for n, p in m.named_parameters()}
    on_muon = {names[id(p)] for p in muon}
    on_adamw = {names[id(p)] for p in adamw}
    assert "fc.weight" in on_muon and "layers.1.self_attn.q_proj.weight" in on_muon
    assert "layers.0.mlp.down_proj.weight" in on_muon and all(m.get_parameter(n).ndim == 2 for n in on_muon)
    assert {"embed_tokens.weight", "mask_hidden", "norm.weight", "layers.0.input_layernorm.weight"} <= on_adamw
    assert "lm_head.weight" not in on_muon | on_adamw  # frozen
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    assert on_muon | on_adamw == trainable and not on_muon & on_adamw


def test_muon_adamw_is_bitwise_its_two_optimizers_under_one_schedule():
    a, b = _model_with_grads(), _model_with_grads()
    s = TrainSettings(optimizer="muon", lr=3e-3, weight_decay=0.01, muon_weight_decay=0.1)
    opt = make_optimizer(a.named_parameters(), s)
    assert isinstance(opt, MuonAdamW)
    muon_b, adamw_b = muon_split(b.named_parameters())
    ref = [
        torch.optim.Muon(muon_b, lr=3e-3, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
        torch.optim.AdamW(adamw_b, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01),
    ]
    shape = lambda step: 1.0 / (1 + step)  # noqa: E731
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, shape) for o in (opt, *ref)]
    for step in range(3):
        g = torch.Generator().manual_seed(step + 1)
        for pa, pb in zip(a.parameters(), b.parameters()):
            if pa.requires_grad:
                pa.grad = torch.randn(pa.shape, generator=g)
                pb.grad = pa.grad.clone()
        opt.step()
        for o in ref:
            o.step()
        for sc in scheds:
            sc.step()
    assert [g["lr"] for g in opt.param_groups] == [ref[0].param_groups[0]["lr"], ref[1].param_groups[0]["lr"]]
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), n
    # the matrices moved by Muon's orthogonalized step, not by AdamW's
    fresh = _model_with_grads()
    assert not torch.equal(a.fc.weight, fresh.fc.weight)


def test_muon_adamw_state_round_trip_and_a_foreign_state_is_refused():
    s = TrainSettings(optimizer="muon", lr=3e-3)
    a, b = _model_with_grads(), _model_with_grads()
    opt_a = make_optimizer(a.named_parameters(), s)
    opt_a.step()
    opt_b = make_optimizer(b.named_parameters(), s)
    opt_b.step()
    saved = copy.deepcopy(opt_a.state_dict())  # as a checkpoint holds it: not aliasing opt_a's tensors
    opt_c = make_optimizer(b.named_parameters(), s)
    opt_c.load_state_dict(saved)  # b's weights equal a's after one step; now a's optimizer state
    for o in (opt_a, opt_c):
        o.step()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), n
    opt_c.param_groups[1]["lr"] = 0.5  # a scheduler's write reaches the loaded optimizers' groups
    assert opt_c.adamw.param_groups[0]["lr"] == 0.5
    adamw_state = make_optimizer(b.named_parameters(), TrainSettings()).state_dict()
    with pytest.raises(ValueError, match="not --optimizer muon's"):
        opt_c.load_state_dict(adamw_state)


@pytest.mark.parametrize(
    "kw, flag", [({"optimizer": "sgd"}, "--optimizer"), ({"muon_weight_decay": -1.0}, "--muon-weight-decay")]
)
def test_bad_optimizer_settings_name_their_flag(kw, flag):
    with pytest.raises(TrainError, match=flag):
        TrainSettings(**kw).validate()
