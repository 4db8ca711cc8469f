"""Drives the CUDA COD sampler through a few shapes for compute-sanitizer
(memcheck / racecheck / initcheck / synccheck), checking each result against the CPU op:
    compute-sanitizer --tool racecheck --error-exitcode 99 python3 tools/sanitize/sanitize_cod.py
Small sizes on purpose (the sanitizers slow kernels down 10-100x): whole-bin thresholds and
partial bins ranked in shared memory are reached; the radix select of threshold bins over 1024
keys needs ~2^26 positions and is left to the GPU tests (test_cod.py)."""

import torch

import peagle_ext
from peagle_ext.testing import random_documents


def main():
    assert torch.cuda.is_available() and peagle_ext.has_cuda_kernels(), "needs a GPU and the CUDA build"
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 3000, 5000, 20000):
        doc, lm = random_documents(n, g, max_doc_len=500, pad_tail=n // 20)
        for args in [(8, 0.7, 0.2, -1, True, 1), (5, 0.9, 0.3, n // 2, False, -7)]:
            got = torch.ops.peagle.cod_sample(doc.cuda(), lm.cuda(), *args)
            want = torch.ops.peagle.cod_sample(doc, lm, *args)
            assert torch.equal(got[2], want[2]), (n, args)
            assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1]), (n, args)
    torch.cuda.synchronize()
    print("cod_sample sanitizer drive: OK")


if __name__ == "__main__":
    main()
