"""Where does the bf16 gradient error of tiny COD layouts (T <= 10, 1-3 keys per row) come from?
Prints, per layout row, |dq| error of the CUDA kernel against (a) exact float64 gradients and
(b) the kernels' algorithm in float64 on the kernel's own output (delta from the rounded O),
plus the row's metadata (ranges, chain keys), for the n=2 case that misses 1e-2 (issue 3).
    python3 bench/diag_attention_tiny.py    (needs a GPU and the CUDA build)"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python_tests"))
import test_attention as T  # noqa: E402
from peagle_ext.attention import cod_attention_metadata  # noqa: E402
from peagle_ext.cod import cod_sample  # noqa: E402


def main():
    for n, d in [(2, 64), (2, 128), (3, 64), (9, 64)]:
        g = torch.Generator().manual_seed(11)
        doc = torch.zeros(n, dtype=torch.int32)
        lay = cod_sample(doc, torch.ones(n, dtype=torch.bool), num_depths=8, depth0="all", seed=3).to("cuda")
        q, k, v, ctx = T.make_inputs(g, lay, 4, 2, d, torch.bfloat16, "cuda", False)
        names, ours, refs, go = T.run_both(g, lay, q, k, v, ctx, window=2, return_go=True)
        algo = T.flash_backward_reference(q, k, v, ctx, lay, go, ours[0], window=2)
        meta = cod_attention_metadata(lay, window=2)
        print(f"== n={n} D={d} T={lay.num_tokens} anchors={lay.anchor.tolist()} depths={lay.depth.tolist()}")
        print("ranges", meta.ranges.cpu().tolist())
        print("chains", meta.chains.cpu().tolist())
        for name, a, ex, al in zip(names[1:], ours[1:], refs[1:], algo):
            a = a.double()
            print(f"{name}: rel vs exact {T.rel_l2(a, ex):.2e}, vs algorithm {T.rel_l2(a, al):.2e}, "
                  f"algorithm vs exact {T.rel_l2(al, ex):.2e}; |exact| {ex.norm():.3e}")
            for i in range(a.shape[0]):
                e1 = (a[i] - ex[i]).norm().item()
                e2 = (a[i] - al[i]).norm().item()
                print(f"   row {i}: |err vs exact| {e1:.3e} |err vs algo| {e2:.3e} |exact row| {ex[i].norm().item():.3e}"
                      f" per head vs exact {[round((a[i, h] - ex[i, h]).norm().item(), 4) for h in range(a.shape[1])]}")


if __name__ == "__main__":
    main()
