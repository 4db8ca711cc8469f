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
    torch.cuda.synchronize()
    print("probe ok")


if __name__ == "__main__":
    main()
