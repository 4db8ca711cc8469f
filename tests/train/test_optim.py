"""peagle_ext.train.optim.make_adamw: fused on CUDA, torch's default on the CPU, same update."""

import torch

from peagle_ext.train.optim import make_adamw
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
