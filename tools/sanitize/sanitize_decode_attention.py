"""Drives the CUDA decode-attention kernel through every path of its plan for compute-sanitizer
(memcheck / racecheck / initcheck / synccheck), checking each result against the CPU op:
    compute-sanitizer --tool racecheck --error-exitcode 99 python3 tools/sanitize/sanitize_decode_attention.py
One block per (token, KV head) over one tile and over several (many query tokens fill the device
unsplit), runs split one tile a block and several tiles a block (the last block of each pair
combines the others' partials through the workspace), runs of no key and runs clamped to the
cache, head dims 64 and 128, groups 1, 3 and 8. Small sizes on purpose (the sanitizers slow
kernels down 10-100x)."""

import torch

import peagle_ext
from peagle_ext.ops import decode_attention


def case(t, hq, hkv, d, rows, g):
    q = torch.randn(t, hq, d, generator=g).bfloat16()
    k = torch.randn(rows, hkv, d, generator=g).bfloat16()
    v = torch.randn(rows, hkv, d, generator=g).bfloat16()
    count = torch.randint(0, rows + 1, (t,), generator=g)
    count[0] = rows
    if t > 1:
        count[1] = 0
    start = torch.stack([torch.randint(0, rows - int(c) + 1, (1,), generator=g)[0] for c in count])
    return q, k, v, start.int(), count.int()


def main():
    assert torch.cuda.is_available() and peagle_ext.has_cuda_kernels(), "needs a GPU and the CUDA build"
    g = torch.Generator().manual_seed(0)
    # (tokens, query heads, kv heads, head dim, key rows)
    shapes = [
        (1, 9, 3, 64, 1),
        (4, 9, 3, 64, 130),
        (2, 8, 1, 128, 3000),
        (300, 4, 4, 64, 200),
        (3, 16, 2, 64, 700),
        (1, 8, 1, 128, 20000),
    ]
    for t, hq, hkv, d, rows in shapes:
        q, k, v, start, count = case(t, hq, hkv, d, rows, g)
        want = decode_attention(q.float(), k.float(), v.float(), start, count, d**-0.5)
        got = decode_attention(q.cuda(), k.cuda(), v.cuda(), start.cuda(), count.cuda(), d**-0.5)
        err = float((got.float().cpu() - want).abs().max())
        assert err < 3e-2, ((t, hq, hkv, d, rows), err)
    # runs past the cache's rows: clamped on the device (the CPU op rejects them)
    q, k = torch.randn(3, 9, 64, device="cuda").bfloat16(), torch.randn(50, 3, 64, device="cuda").bfloat16()
    start = torch.tensor([40, -3, 60], dtype=torch.int32, device="cuda")
    count = torch.tensor([100, 5, 4], dtype=torch.int32, device="cuda")
    out = decode_attention(q, k, k, start, count, 0.125)
    assert torch.isfinite(out).all() and float(out[1:].abs().max()) == 0.0
    torch.cuda.synchronize()
    print("decode_attention sanitizer drive: OK")


if __name__ == "__main__":
    main()
