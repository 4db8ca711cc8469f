"""peagle_ext.train.optim: make_adamw (fused on CUDA, torch's default on the CPU, same update) and the
learning-rate schedule, on the steps and (--time-schedule) on the clock."""

import math

import pytest
import torch

from peagle_ext.train.optim import lr_lambda, make_adamw
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
