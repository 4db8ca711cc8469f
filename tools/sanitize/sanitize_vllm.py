"""Runs prepare_parallel_draft_inputs on CUDA over shapes that reach every code path (16/8/4/2-byte
copies, misaligned pointers, many rows per block, query_start_loc beyond shared memory,
CUDA graph replay, garbage metadata) for compute-sanitizer:
    compute-sanitizer --tool memcheck --error-exitcode 99 python tools/sanitize/sanitize_vllm.py
(also racecheck / initcheck / synccheck). `run()` can be imported by a shared sanitizer driver."""

import os

import torch

from peagle_ext.testing import random_draft_batch
from peagle_ext.vllm import DraftBatch, prepare_parallel_draft_inputs


def run():
    g = torch.Generator().manual_seed(0)
    cases = [
        (4, 3, 4096, torch.bfloat16, {}),
        (9, 5, 4095, torch.bfloat16, {}),
        (9, 5, 6, torch.bfloat16, {}),
        (9, 5, 4, torch.bfloat16, {}),
        (9, 2, 3, torch.float32, {"general": True, "near_max": True}),
        (2, 4, 16, torch.float32, {"prefill_frac": 1.0, "max_prefill": 700}),
        (8200, 2, 8, torch.float32, {"prefill_frac": 0.0}),
    ]
    for B, K, H, dtype, extra in cases:
        args, kw = random_draft_batch(g, B=B, K=K, H=H, dtype=dtype, device="cuda", **extra)
        got = prepare_parallel_draft_inputs(*args.values(), **kw)
        want = prepare_parallel_draft_inputs(*[None if v is None else v.cpu() for v in args.values()], **kw)
        for a, b in zip(got.as_tuple(), want.as_tuple()):
            assert torch.equal(a.cpu(), b), (B, K, H)
    # graph replay of the out= form (not with PYTORCH_NO_CUDA_MEMORY_CACHING=1, which
    # tools/sanitize/sanitize_all.sh sets for one memcheck pass: graph capture needs the caching allocator)
    args, kw = random_draft_batch(g, B=16, K=4, H=256, dtype=torch.bfloat16, device="cuda", prefill_frac=0.0)
    out = DraftBatch.empty(args["target_token_ids"].shape[0], 16, 4, 256, dtype=torch.bfloat16, device="cuda")
    prepare_parallel_draft_inputs(*args.values(), **kw, out=out)
    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") in ("", "0"):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            prepare_parallel_draft_inputs(*args.values(), **kw, out=out)
        graph.replay()
    # garbage metadata: unchecked on CUDA, must stay in bounds
    t_in = args["target_token_ids"].shape[0]
    args["query_start_loc"] = torch.randint(-20, t_in + 20, (17,), device="cuda", dtype=torch.int32)
    args["num_rejected_tokens"] = torch.randint(-9, 9, (16,), device="cuda", dtype=torch.int32)
    prepare_parallel_draft_inputs(*args.values(), **kw)
    # positions at the int64 limit (the draft positions wrap: unchecked on CUDA without
    # validate=True) and block ids at the int32 limit with the largest block_size accepted
    args["target_positions"] = torch.randint(2**63 - 64, 2**63 - 1, (t_in,), device="cuda", dtype=torch.int64)
    args["target_positions"][::3] = torch.randint(-(2**63), -(2**62), (len(range(0, t_in, 3)),), device="cuda")
    args["block_table"] = torch.full_like(args["block_table"], 2**31 - 1)
    prepare_parallel_draft_inputs(*args.values(), **{**kw, "block_size": 2**31 - 1})
    torch.cuda.synchronize()
    print("sanitize_vllm: ok")


if __name__ == "__main__":
    run()
