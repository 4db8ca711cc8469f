"""Where a training step's peak memory goes, 1 process vs DDP rank 0 (issue 9's memory table).

    torchrun --standalone --nproc_per_node 2 bench/memory_trace_distributed.py --tokens 8192 --out DIR
        (GPU) records the CUDA caching allocator's alloc/free trace (torch.cuda.memory
        _record_memory_history) over one warm step of bench_distributed's Qwen3-8B-shaped drafter:
        first on rank 0 alone (the single-process trainer path), then on rank 0 under DDP.
        Writes DIR/memtrace_{single,ddp}.pickle (torch's snapshot format).
    python bench/memory_trace_distributed.py --analyze DIR
        replays each trace: the step's peak, and the blocks live at that moment grouped by the
        innermost peagle_ext / bench / torch.nn frame that allocated them.
"""
from __future__ import annotations

import argparse
import collections
import os
import pickle
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

GIB = 2**30


def record(args):
    import torch
    import torch.distributed as dist
    import bench_distributed as bd
    from peagle_ext.distributed import DistContext
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    probe = DistContext.from_env("ddp", "cuda")
    rank, device = probe.rank, probe.device
    shape, amp = dict(bd.FULL), torch.bfloat16
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def one(ctx, tag):
        units = bd.make_units(shape, args.tokens, 2, device, amp, seed=args.tokens)
        run = bd.Run(ctx, shape, device, amp)
        layouts = [run.model.sample_layout(u, seed=1000 + i) for i, u in enumerate(units)]
        run.step(units, layouts)  # warm: AdamW state, DDP bucket rebuild
        torch.cuda.synchronize(device)
        rest = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        if rank == 0:
            torch.cuda.memory._record_memory_history(max_entries=500000, stacks="python")
        run.step(units, layouts)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        if rank == 0:
            torch.cuda.memory._dump_snapshot(str(out / f"memtrace_{tag}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
            print(f"{tag}: rest {rest / GIB:.2f} GiB, step peak {peak / GIB:.2f} GiB", flush=True)
        run.close()
        del units, layouts

    if rank == 0:
        one(DistContext("ddp", device=device), "single")
    dist.barrier()
    one(DistContext.from_env("ddp", "cuda"), "ddp")
    dist.barrier()
    probe.close()


def _frame(frames):
    keep = ("peagle_ext/", "bench/", "torch/nn/", "torch/optim/", "torch/distributed/", "torch/autograd/")
    for f in frames:
        fn = f.get("filename", "")
        if any(k in fn for k in keep):
            return f"{fn.split('/site-packages/')[-1].split('/work/main/')[-1]}:{f.get('line')} {f.get('name')}"
    return frames[0]["filename"] + ":" + str(frames[0].get("line")) if frames else "?"


def analyze(d: Path):
    for p in sorted(d.glob("memtrace_*.pickle")):
        snap = pickle.loads(p.read_bytes())
        trace = snap["device_traces"][0]
        # blocks live before recording started: the snapshot's segments minus what the trace allocated
        live, cur, peak, at_peak = {}, 0, 0, {}
        allocated_in_trace = set()
        for ev in trace:
            if ev["action"] == "alloc":
                allocated_in_trace.add(ev["addr"])
        base = 0
        for seg in snap["segments"]:
            for b in seg["blocks"]:
                if b["state"] == "active_allocated":
                    base += b["size"]
        # replay: start from the live blocks not created in the trace (approximate base)
        for ev in trace:
            a = ev["action"]
            if a == "alloc":
                live[ev["addr"]] = (ev["size"], _frame(ev.get("frames", [])))
                cur += ev["size"]
            elif a in ("free_requested",):
                if ev["addr"] in live:
                    cur -= live.pop(ev["addr"])[0]
            if cur > peak:
                peak, at_peak = cur, dict(live)
        groups = collections.Counter()
        for size, fr in at_peak.values():
            groups[fr] += size
        print(f"== {p.name}: step peak above the start of recording {peak / GIB:.2f} GiB "
              f"({len(trace)} events; end-of-step live {base / GIB:.2f} GiB)")
        for fr, size in groups.most_common(14):
            print(f"  {size / GIB:7.2f} GiB  {fr}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192, help="N, tokens per packed row")
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    ap.add_argument("--analyze", metavar="DIR")
    args = ap.parse_args()
    if args.analyze:
        analyze(Path(args.analyze))
    else:
        record(args)


if __name__ == "__main__":
    main()
