"""Drives the CUDA COD sampler through a few shapes for compute-sanitizer
(memcheck / racecheck / initcheck / synccheck), checking each result against the CPU op:
    compute-sanitizer --tool racecheck --error-exitcode 99 python3 tools/sanitize/sanitize_cod.py
Small sizes on purpose (the sanitizers slow kernels down 10-100x); the selection paths are
all reached: whole-bin thresholds, partial bins ranked in shared memory, and (with a 1-bit
histogram) the one-block radix select over thousands of keys."""

import os

import torch

import peagle_ext
from peagle_ext.testing import random_documents


def main():
    assert torch.cuda.is_available() and peagle_ext.has_cuda_kernels(), "needs a GPU and the CUDA build"
    g = torch.Generator().manual_seed(0)
    cases = [(1, None), (7, None), (3000, None), (5000, "1"), (5000, "3"), (20000, None)]
    for n, bin_bits in cases:
        if bin_bits is None:
            os.environ.pop("PEAGLE_COD_BIN_BITS", None)
        else:
            os.environ["PEAGLE_COD_BIN_BITS"] = bin_bits
        doc, lm = random_documents(n, g, max_doc_len=500, pad_tail=n // 20)
        for args in [(8, 0.7, 0.2, -1, True, 1), (5, 0.9, 0.3, n // 2, False, -7)]:
            got = torch.ops.peagle.cod_sample(doc.cuda(), lm.cuda(), *args)
            want = torch.ops.peagle.cod_sample(doc, lm, *args)
            assert torch.equal(got[2], want[2]), (n, bin_bits, args)
            assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1]), (n, bin_bits, args)
    torch.cuda.synchronize()
    print("cod_sample sanitizer drive: OK")


if __name__ == "__main__":
    main()
