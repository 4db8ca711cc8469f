"""Is an initcheck report on a buffer that cuBLAS wrote a false positive? Writes C = A @ B^T with
torch.mm(out=C) into a fresh (never written) buffer, for each dtype, then reads all of C with a
plain torch kernel and checks the values against a float64 matmul. Under
    compute-sanitizer --tool initcheck python3 bench/initcheck_cublas_probe.py
an "Uninitialized __global__ memory read" in the read kernel, while the values are right, means
initcheck did not see cuBLAS's writes (e.g. TMA bulk stores), not that C was uninitialized.
Shapes: the ones bench/sanitize_loss.py gives the fused loss (its target-logit GEMM)."""
import torch


def main():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for m, k, n in [(16, 64, 1024), (5, 32, 101), (8, 64, 1000)]:
            a = torch.randn(m, k, generator=g).to("cuda", dtype)
            b = torch.randn(n, k, generator=g).to("cuda", dtype)
            c = torch.empty(m, n, device="cuda", dtype=dtype)
            torch.mm(a, b.t(), out=c)
            want = a.double() @ b.double().t()
            err = float((c.double() - want).abs().max() / want.abs().max())
            print(f"{dtype} {m}x{k}x{n}: max rel err {err:.2e}", flush=True)
            assert err < 2e-2
    # the fused loss's own sequence (csrc/loss/cpu/loss_cpu.cpp): one [chunk, V] buffer from
    # at::empty, each chunk's GEMM into its leading rows (narrow + mm out=), then a full read
    for t, h, v, chunk in [(17, 32, 101, 5), (40, 64, 1024, 16), (33, 64, 1000, 40), (33, 64, 777, 40)]:
        for dtype in (torch.float16, torch.bfloat16):
            x = torch.randn(t, h, generator=g).to("cuda", dtype)
            w = torch.randn(v, h, generator=g).to("cuda", dtype)
            buf = torch.empty(chunk, v, device="cuda", dtype=dtype)
            for r0 in range(0, t, chunk):
                rows = min(chunk, t - r0)
                tl = buf.narrow(0, 0, rows)
                torch.mm(x.narrow(0, r0, rows), w.t(), out=tl)
                got = tl.double().cpu()
                want = x[r0:r0 + rows].double().cpu() @ w.double().cpu().t()
                err = float((got - want).abs().max() / want.abs().max())
                print(f"loss-sequence {dtype} t={t} v={v} chunk={chunk} r0={r0}: max rel err {err:.2e}", flush=True)
                assert err < 2e-2
    torch.cuda.synchronize()
    print("probe ok")


if __name__ == "__main__":
    main()
