"""Distributed training step (peagle_ext.distributed): 1 GPU vs 2 (or more) GPUs under DDP and FSDP2.

    torchrun --standalone --nproc_per_node 2 bench/bench_distributed.py [--sizes 8192,32768]
             [--steps 3] [--warmup 1] [--modes ddp,fsdp] [--out DIR]
    torchrun --standalone --nproc_per_node 2 bench/bench_distributed.py --tiny      # CPU/gloo dry run

Writes DIR/bench_distributed.json and DIR/bench_distributed.md (DIR: --out, else $OUT, else
./bench_out). On shared hosts keep NVLink multicast off: NCCL_NVLS_ENABLE=0 (also
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1); set here when unset.

The drafter: Qwen3-8B-shaped (hidden 4096, 32 query / 8 KV heads of 128, intermediate 12288,
vocab 151936 = draft vocab, 3 aux layers), 1 decoder layer, K = 8, random weights, random
verifier hidden states (no verifier model), bf16 autocast, the whole embedding trained (the GPU
default). A step's global batch is 2 packed rows of N tokens ("units"), or one per rank on more
than 2 ranks: 1 GPU runs them all (gradient accumulation), each rank one, as `peagle train` does (units assigned by
peagle_ext.distributed, loss over the global token count, sum-reduced gradients).

Reported per (mode, GPUs, N): step time (mean of --steps after --warmup), tokens/s per GPU,
peak memory per GPU (max over ranks, everything: weights, optimizer, activations), and scaling
efficiency = 2-GPU throughput / (2 x 1-GPU throughput). The 1-GPU baseline is the
single-process trainer path (no wrapper). Communication per step: DDP all-reduces the trainable
gradients (fp32, bytes below); FSDP2 all-gathers bf16 parameters (forward and backward) and
reduce-scatters fp32 gradients.

Correctness: from the same initial weights, 3 AdamW steps on the same global batch on 1 GPU and on
2 GPUs; reported: max |p_2gpu - p_1gpu| and ||p_2gpu - p_1gpu|| / ||p_1gpu - p_0|| (relative to
the update). DDP runs the trainer's bf16 autocast on both sides; FSDP2 runs with fp32 parameters
on both sides (FSDP2's bf16 parameter policy computes differently from 1-GPU autocast, so it is not
an equality check; its speed is what the timing rows measure). GPU kernels are the same on both
sides; only the reduction order of the 2 units' gradients can differ.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from peagle_ext.data import TrainingExample
from peagle_ext.model import PEagleDraftModel, PEagleOptions
from peagle_ext.train.distributed import DistContext
from peagle_ext.train.optim import make_adamw

GIB = 2**30

FULL = dict(
    hidden=4096,
    heads=32,
    kv_heads=8,
    head_dim=128,
    intermediate=12288,
    vocab=151936,
    verifier_layers=36,
    num_depths=8,
    sizes=[8192, 32768],
)
TINY = dict(
    hidden=128,
    heads=2,
    kv_heads=1,
    head_dim=64,
    intermediate=256,
    vocab=512,
    verifier_layers=8,
    num_depths=4,
    sizes=[256, 512],
)


def build_model(shape: dict, device: torch.device, seed: int = 0) -> PEagleDraftModel:
    from transformers import Qwen3Config

    vc = Qwen3Config(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["verifier_layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        rms_norm_eps=1e-6,
        max_position_embeddings=65536,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it runs (same seed, same values on every rank)
        m = PEagleDraftModel.from_verifier(
            vc,
            num_layers=1,
            num_depths=shape["num_depths"],
            mask_token_id=shape["vocab"],
            layer_type="qwen3",
            options=PEagleOptions(train_embeddings="all"),
        )
        g = torch.Generator(device=device).manual_seed(seed + 1)
        h, v = shape["hidden"], shape["vocab"]
        m.attach_verifier(
            norm_weight=torch.rand(h, generator=g, device=device) + 0.5,
            lm_head_weight=torch.randn(v, h, generator=g, device=device) * 0.02,
            embed_weight=torch.randn(v, h, generator=g, device=device) * 0.02,
        )
    return m.to(device)


def make_units(shape: dict, n: int, count: int, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """`count` packed rows of n tokens: documents of 1/8..1/2 of the row, ~3% padding at the end,
    80% of the tokens loss-masked; random hidden states (unit scale)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    h = shape["hidden"]
    for _ in range(count):
        doc = torch.full((n,), -1, dtype=torch.int32)
        p, k = 0, 0
        end = n - max(1, n // 32)
        while p < end:
            ln = min(int(torch.randint(n // 8, n // 2 + 1, (1,), generator=g)), end - p)
            doc[p : p + ln] = k
            p, k = p + ln, k + 1
        lm = (torch.rand(n, generator=g) < 0.8) & (doc >= 0)
        ids = torch.randint(0, shape["vocab"], (n,), generator=g)
        gd = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))
        hid = torch.randn(n, 3 * h, generator=gd, device=device, dtype=dtype)
        last = torch.randn(n, h, generator=gd, device=device, dtype=dtype)
        out.append(TrainingExample(ids.to(device), doc.to(device), lm.to(device), hid, last))
    return out


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Run:
    """One configuration: a fresh model, wrapped by `ctx`, an AdamW like the trainer's."""

    def __init__(self, ctx: DistContext, shape, device, amp, *, fsdp_bf16_params=None, lr=1e-3, seed=0):
        self.ctx, self.device, self.amp = ctx, device, amp
        self.model = build_model(shape, device, seed)
        ctx.wrap(self.model, amp, fsdp_bf16_params=fsdp_bf16_params)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = make_adamw(self.params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)

    def step(self, units, layouts, seq_partition: int = 1, grads_out: dict | None = None):
        """One optimizer step over the global batch; returns this rank's real tokens. grads_out:
        filled with the summed gradients (full fp32 CPU tensors, before clipping; collective)."""
        ctx = self.ctx
        mine = ctx.my_units([int((u.document_ids >= 0).sum()) for u in units])
        w = [float(units[u].loss_mask[(layouts[u].anchor.long() + layouts[u].depth.long())].sum()) for u in mine]
        wtot = ctx.sum_scalar(sum(w))
        self.opt.zero_grad(set_to_none=True)
        for j, u in enumerate(mine):
            ctx.forward_backward(
                self.model,
                units[u],
                layouts[u],
                segments=seq_partition,
                loss_scale=1.0 / wtot,
                autocast_dtype=self.amp,
                last=j == len(mine) - 1,
            )
        if grads_out is not None:
            for n, p in self.model.named_parameters():
                if p.grad is not None:
                    g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    grads_out[n] = g.detach().float().cpu()
        ctx.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        return sum(int((units[u].document_ids >= 0).sum()) for u in mine)

    def full_params(self) -> dict:
        """name -> full fp32 CPU tensor (FSDP2: gathered; collective)."""
        out = {}
        for n, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            # copy=True: on CPU with fp32 parameters .float().cpu() would return the live tensor,
            # and the initial snapshot would follow the optimizer (update 0: ratios meaningless)
            out[n] = t.detach().to("cpu", torch.float32, copy=True)
        return out

    def close(self):
        # the 1-process context is reused for every size: without this the previous model (11.3
        # GiB at this shape) stays allocated on rank 0 into the next measurement
        self.ctx.unwrap()
        del self.model, self.params, self.opt
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def units_per_step(world: int) -> int:
    """Packed rows in a step's global batch: 2, or one per rank on more than 2 ranks (the 1-rank
    baseline then accumulates them all)."""
    return max(2, world)


def time_config(ctx, shape, device, amp, n, steps, warmup, count):
    units = make_units(shape, n, count, device, amp or torch.float32, seed=n)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    run = Run(ctx, shape, device, amp)
    layouts = [run.model.sample_layout(u, seed=1000 + i) for i, u in enumerate(units)]
    layout_tokens = sum(lay.num_tokens for lay in layouts)
    times, toks, peak_first = [], 0, 0.0
    for i in range(warmup + steps):
        if ctx.world > 1:
            dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        toks = run.step(units, layouts)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        if i == 0 and device.type == "cuda":
            # the first step also holds one-off allocations (DDP rebuilds its buckets after it,
            # AdamW creates its state): reported apart from the steady-state peak
            peak_first = torch.cuda.max_memory_allocated(device) / GIB
            torch.cuda.reset_peak_memory_stats(device)
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else 0.0
    grad_bytes = sum(p.numel() for p in run.params) * 4
    run.close()
    step_s = statistics.mean(times)
    return {
        "n": n,
        "step_s": step_s,
        "step_s_min": min(times),
        "tokens_per_step_per_rank": toks,
        "tokens_per_s_per_rank": toks / step_s,
        "peak_gib": peak,
        "peak_gib_first_step": peak_first,
        "layout_tokens_global": layout_tokens,
        "trainable_grad_gib": grad_bytes / GIB,
    }


def _rel_l2(a: dict, b: dict, base: dict | None = None) -> tuple[float, float]:
    """(||a - b|| / ||b - base|| (base None: / ||b||), max |a - b|) over all tensors."""
    num = den = worst = 0.0
    for k in b:
        d = a[k].double() - b[k].double()
        num += float((d * d).sum())
        ref = b[k].double() if base is None else b[k].double() - base[k].double()
        den += float((ref * ref).sum())
        worst = max(worst, float(d.abs().max()))
    return (num**0.5) / max(den**0.5, 1e-30), worst


def check_config(mode, ctx1, ctx2, shape, device, n, steps, rank, count):
    """1 GPU (rank 0 alone) vs all ranks from the same init on the same global batch: the first
    step's summed gradient, and the parameters after `steps` AdamW steps."""
    amp = torch.bfloat16 if (device.type == "cuda" and mode == "ddp") else None
    units = make_units(shape, n, count, device, amp or torch.float32, seed=7 + n)

    def train(ctx, **kw):
        run = Run(ctx, shape, device, amp, **kw)
        p0 = run.full_params()
        layouts = [run.model.sample_layout(u, seed=2000 + i) for i, u in enumerate(units)]
        g1 = {}
        for i in range(steps):
            run.step(units, layouts, grads_out=g1 if i == 0 else None)
        p = run.full_params()
        run.close()
        return p0, g1, p

    ref = train(ctx1) if rank == 0 else None
    dist.barrier()
    got = train(ctx2, fsdp_bf16_params=False)
    if rank != 0:
        return None
    (p0, g_ref, p_ref), (_, g_got, p_got) = ref, got
    grad_rel, grad_abs = _rel_l2(g_got, g_ref)
    par_rel, par_abs = _rel_l2(p_got, p_ref, p0)
    gpu = device.type == "cuda"
    # GPU: bf16 compute and atomics (gather backward) make the units' own gradients differ at the
    # bf16 level; AdamW then turns near-zero gradient elements into +-lr steps. A missing or doubled
    # reduction shows as O(1) in either number (the gradient check also sees a wrong scale, which
    # AdamW would hide).
    tol_grad, tol_par = (2e-2, 1e-1) if gpu else (1e-5, 1e-4)
    return {
        "mode": mode,
        "n": n,
        "steps": steps,
        "precision": "bf16 autocast" if amp else "fp32 params",
        "grad_rel_l2": grad_rel,
        "grad_max_abs_diff": grad_abs,
        "max_abs_diff": par_abs,
        "rel_to_update": par_rel,
        "tolerance": {"grad_rel_l2": tol_grad, "rel_to_update": tol_par},
        "passed": grad_rel <= tol_grad and par_rel <= tol_par,
    }


def write_outputs(args, world, device, shape, sizes, steps, runs, correctness):
    """bench_distributed.json / .md under args.out (rank 0; called after the timing and again after the check,
    so a failing check still leaves the timing)."""
    base = {r["n"]: r for r in runs if r["mode"] == "single"}
    for r in runs:
        b = base.get(r["n"])
        if r["mode"] != "single" and b:
            # throughput of the ranks / (ranks x throughput of 1 GPU); both process the same global batch
            r["scaling_efficiency"] = b["step_s"] / (r["gpus"] * r["step_s"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "world_size": world,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": shape,
        "sizes": sizes,
        "steps": steps,
        "warmup": args.warmup,
        "units_per_step": units_per_step(world),
        "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
    }
    (out / "bench_distributed.json").write_text(
        json.dumps({**meta, "runs": runs, "correctness": correctness}, indent=1)
    )
    lines = [
        "| mode | GPUs | N | step ms | tokens/s per GPU | peak GiB per GPU | first-step peak GiB | scaling efficiency |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        eff = f"{r['scaling_efficiency']:.2f}" if "scaling_efficiency" in r else "-"
        lines.append(
            f"| {r['mode']} | {r['gpus']} | {r['n']} | {r['step_s'] * 1e3:.1f} | "
            f"{r['tokens_per_s_per_rank']:.0f} | {r['peak_gib']:.1f} | {r.get('peak_gib_first_step', 0.0):.1f} | {eff} |"
        )
    if correctness:
        lines += [
            "",
            "| check | N | precision | step-1 grad rel. L2 | param max abs diff | param diff / update | pass |",
            "|---|---|---|---|---|---|---|",
        ]
        for c in correctness:
            lines.append(
                f"| {c['mode']} {world} vs 1 | {c['n']} | {c['precision']} | {c['grad_rel_l2']:.3g} | "
                f"{c['max_abs_diff']:.3g} | {c['rel_to_update']:.3g} | {c['passed']} |"
            )
    table = "\n".join(lines) + "\n"
    (out / "bench_distributed.md").write_text(f"# bench_distributed ({meta['device']})\n\n" + table)
    print(table)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU/gloo dry run of this script)")
    ap.add_argument("--sizes", help="comma-separated N (tokens per row); default 8192,32768 (tiny: 256,512)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps (default 3, tiny 2)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--modes", default="ddp,fsdp")
    ap.add_argument("--check-steps", type=int, default=3)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None)
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    args = ap.parse_args()
    # NVLink multicast (NVLS / symmetric-memory multicast) off: on a shared host it can take the GPUs
    # out of service for others; set before the NCCL communicators are created
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    shape = dict(TINY if args.tiny else FULL)
    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else shape["sizes"]
    steps = args.steps if args.steps is not None else (2 if args.tiny else 3)
    device_kind = args.device or ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        sys.exit("run under torchrun --nproc_per_node 2 (or more): it compares 1 rank with all of them")
    torch.set_num_threads(1 if device_kind == "cpu" else torch.get_num_threads())

    # the process group: NCCL on GPUs, gloo on CPU; every context below shares it
    probe = DistContext.from_env("ddp", device_kind)
    rank, world, device = probe.rank, probe.world, probe.device
    amp = torch.bfloat16 if device.type == "cuda" else None
    single = DistContext("ddp", device=device)  # world 1: the single-process trainer path
    modes = [m for m in args.modes.split(",") if m]
    runs = []

    def say(msg):
        if rank == 0:
            print(msg, flush=True)

    say(
        f"bench_distributed: {'tiny' if args.tiny else 'Qwen3-8B-shaped'} drafter, {world} ranks on {device.type}, "
        f"sizes {sizes}, K={shape['num_depths']}, {steps} steps after {args.warmup} warm-up"
    )
    for n in sizes:
        if rank == 0:
            r = time_config(single, shape, device, amp, n, steps, args.warmup, units_per_step(world))
            runs.append({"mode": "single", "gpus": 1, **r})
            say(
                f"  N={n} 1 rank : {r['step_s'] * 1e3:8.1f} ms/step, {r['tokens_per_s_per_rank']:10.0f} tok/s, "
                f"peak {r['peak_gib']:.1f} GiB (first step {r['peak_gib_first_step']:.1f})"
            )
        dist.barrier()
        for mode in modes:
            r = time_config(
                DistContext.from_env(mode, device.type),
                shape,
                device,
                amp,
                n,
                steps,
                args.warmup,
                units_per_step(world),
            )
            per_rank = [None] * world
            dist.all_gather_object(per_rank, r)
            if rank == 0:
                agg = {
                    **r,
                    "step_s": max(x["step_s"] for x in per_rank),
                    "tokens_per_s_per_rank": statistics.mean(x["tokens_per_s_per_rank"] for x in per_rank),
                    "peak_gib": max(x["peak_gib"] for x in per_rank),
                    "peak_gib_first_step": max(x["peak_gib_first_step"] for x in per_rank),
                    "per_rank": [
                        {k: x[k] for k in ("step_s", "tokens_per_step_per_rank", "peak_gib", "peak_gib_first_step")}
                        for x in per_rank
                    ],
                }
                runs.append({"mode": mode, "gpus": world, **agg})
                say(
                    f"  N={n} {world} ranks {mode:4s}: {agg['step_s'] * 1e3:8.1f} ms/step, "
                    f"{agg['tokens_per_s_per_rank']:10.0f} tok/s per rank, peak {agg['peak_gib']:.1f} GiB "
                    f"(first step {agg['peak_gib_first_step']:.1f})"
                )
            dist.barrier()

    correctness = []
    if rank == 0:
        write_outputs(args, world, device, shape, sizes, steps, runs, correctness)
    if not args.no_check:
        n_check = sizes[0]
        for mode in modes:
            res = check_config(
                mode,
                single,
                DistContext.from_env(mode, device.type),
                shape,
                device,
                n_check,
                args.check_steps,
                rank,
                units_per_step(world),
            )
            if rank == 0:
                correctness.append(res)
                say(
                    f"  check {mode}: {world} ranks vs 1 ({res['precision']}): step-1 gradient |dg|/|g| "
                    f"{res['grad_rel_l2']:.3g}; after {res['steps']} steps max |dp| {res['max_abs_diff']:.3g}, "
                    f"|dp| / |update| {res['rel_to_update']:.3g} -> {'PASS' if res['passed'] else 'FAIL'}"
                )
            dist.barrier()

    if rank == 0:
        write_outputs(args, world, device, shape, sizes, steps, runs, correctness)
    failed = rank == 0 and any(not c["passed"] for c in correctness)
    dist.barrier()
    probe.close()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
