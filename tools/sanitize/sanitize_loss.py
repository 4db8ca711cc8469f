"""Drives the CUDA fused linear-KL op through a few shapes for compute-sanitizer
(memcheck / racecheck / initcheck / synccheck), checking each result against the CPU op:
    compute-sanitizer --tool memcheck --error-exitcode 99 python3 tools/sanitize/sanitize_loss.py
Small sizes on purpose (the sanitizers slow kernels down 10-100x). Every path of the row
kernel is reached: fp32/fp16/bf16, vocab sizes whose rows start off a 16-byte boundary (scalar
head and tail) and aligned ones (vectors only), a vocab below one vector, zero-weight rows,
kind kl and ce, with and without the in-place gradient, d2t, one and many chunks, and a target
index whose draft rows share target rows across chunk edges (draft and target rows at
different offsets from a 16-byte boundary)."""

import itertools

import torch

import peagle_ext  # noqa: F401
from peagle_ext.loss import fused_linear_kl


def case(g, t, h, vd, v, dtype):
    xd = torch.randn(t, h, generator=g) / h**0.5 * 3
    w_d = torch.randn(vd, h, generator=g)
    xt = torch.randn(t, h, generator=g) / h**0.5 * 3
    w_t = torch.randn(v, h, generator=g)
    weight = torch.rand(t, generator=g) + 0.5
    weight[::4] = 0
    depth = torch.randint(0, 3, (t,), generator=g, dtype=torch.int32)
    d2t = None
    if vd < v:
        d2t = torch.randperm(v, generator=g)[:vd].sort().values - torch.arange(vd)
    return [x.to(dtype) for x in (xd, w_d, xt, w_t)], weight, depth, d2t


def run(inputs, weight, depth, d2t, device, kind, chunk, grad, index=None):
    xd, w_d, xt, w_t = (x.to(device) for x in inputs)
    if index is not None:  # draft row t against target row index[t] of the first rows of xt
        xt = xt[: int(index.max()) + 1].contiguous()
        index = index.to(device)
    xd = xd.clone().requires_grad_(grad)
    w_d = w_d.clone().requires_grad_(grad)
    loss, m = fused_linear_kl(
        xd,
        w_d,
        xt,
        w_t,
        weight.to(device),
        depth.to(device),
        num_depths=3,
        d2t=None if d2t is None else d2t.to(device),
        target_index=index,
        chunk_size=chunk,
        kind=kind,
    )
    if grad:
        loss.backward()
        return loss.float().cpu(), m["total"].cpu(), xd.grad.float().cpu(), w_d.grad.float().cpu()
    return loss.float().cpu(), m["total"].cpu(), None, None


def main():
    assert torch.cuda.is_available() and peagle_ext.has_cuda_kernels(), "needs a GPU and the CUDA build"
    g = torch.Generator().manual_seed(0)
    shapes = [(9, 32, 3, 3, 4), (17, 32, 101, 101, 5), (40, 64, 1024, 1024, 16), (33, 64, 777, 1000, 40)]
    for t, h, vd, v, chunk in shapes:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            inputs, weight, depth, d2t = case(g, t, h, vd, v, dtype)
            # the CPU op on the same (rounded) values in fp32 is the reference
            ref_inputs = [x.float() for x in inputs]
            shared = torch.randint(0, max(1, t // 3), (t,), generator=g)
            for kind, grad, index in itertools.product(("kl", "ce"), (True, False), (None, shared)):
                # marks each case in the sanitizer's log (its reports are printed in order)
                print(
                    f"case t={t} h={h} vd={vd} v={v} chunk={chunk} {dtype} {kind} grad={grad} index={index is not None}",
                    flush=True,
                )
                got = run(inputs, weight, depth, d2t, "cuda", kind, chunk, grad, index)
                want = run(ref_inputs, weight, depth, d2t, "cpu", kind, chunk, grad, index)
                tol = 1e-4 if dtype == torch.float32 else 3e-2
                assert torch.allclose(got[0], want[0], rtol=tol, atol=1e-5), (t, vd, dtype, kind, got[0], want[0])
                assert torch.equal(got[1], want[1]), (t, vd, dtype, kind)
                if grad:
                    for a, b in zip(got[2:], want[2:]):
                        err = float((a - b).norm() / b.norm().clamp_min(1e-20))
                        assert err <= tol, (t, vd, dtype, kind, err)
    torch.cuda.synchronize()
    print("fused_linear_kl sanitizer drive: OK")


if __name__ == "__main__":
    main()
