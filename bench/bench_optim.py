"""One optimizer step of a drafter's trainable parameters: AdamW (make_adamw: fused on CUDA),
torch.optim.Muon + AdamW, and peagle's MuonAdamW (BatchedMuon + AdamW, `--optimizer muon`).

pytest-benchmark:  PYTHONPATH=. python -m pytest bench/bench_optim.py --benchmark-only
table + JSON:      PYTHONPATH=. python bench/bench_optim.py [--layers 1,4] [--reps 50]
                   (writes $OUT/bench_optim.json, or ./bench_out/bench_optim.json; QUICK=1 in the
                   environment: 4 layers only, fewer repetitions)

The drafter is the SmolLM2 study's (hidden 576, intermediate 1536, 9 q / 3 kv heads, draft vocab
32K, the 49,153-row embedding trained): its matrices are small, so a Muon step is a few MFLOP of
GEMM per matrix and its time on a GPU is mostly the host launching kernels. The table gives the
wall time of one step (synchronized) and the aten ops it dispatches, counted with a
TorchDispatchMode on the step's own tensors; on a GPU almost every one is a kernel launch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import peagle_ext
from peagle_ext.train.optim import MuonAdamW, make_adamw, muon_split

LR, BETAS, WEIGHT_DECAY, MUON_WEIGHT_DECAY = 1e-3, (0.9, 0.95), 0.0, 0.1
IMPLS = ("adamw", "torch_muon", "muon")


def _devices():
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() and peagle_ext.has_cuda_kernels() else [])


def study_drafter(num_layers: int, device: str):
    """The SmolLM2 study's drafter (K=4, 32K draft vocab), a random gradient on every trainable
    parameter."""
    from peagle_ext.testing import make_peagle, smollm2_config

    m = make_peagle(
        smollm2_config(),
        num_layers=num_layers,
        num_depths=4,
        mask_token_id=49_152,
        draft_vocab_size=32_000,
        device=device,
    )
    torch.manual_seed(0)
    for p in m.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p) * 1e-3
    return m


class _TorchMuonAdamW:
    """The reference: torch.optim.Muon (one matrix at a time) beside the same AdamW."""

    def __init__(self, named):
        muon, adamw = muon_split(named)
        self.muon = torch.optim.Muon(muon, lr=LR, weight_decay=MUON_WEIGHT_DECAY, adjust_lr_fn="match_rms_adamw")
        self.adamw = make_adamw(adamw, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)

    def step(self):
        self.muon.step()
        self.adamw.step()


def make(impl: str, model):
    named = list(model.named_parameters())
    if impl == "adamw":
        return make_adamw([p for _, p in named if p.requires_grad], lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    if impl == "torch_muon":
        return _TorchMuonAdamW(named)
    muon, adamw = muon_split(named)
    return MuonAdamW(muon, adamw, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, muon_weight_decay=MUON_WEIGHT_DECAY)


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def ops_per_step(opt) -> int:
    with _CountOps() as c:
        opt.step()
    return c.n


def step_ms(opt, device: str, reps: int) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        opt.step()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        opt.step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# ---- pytest-benchmark ------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_bench_optimizer_step(benchmark, device, impl):
    if device not in _devices():
        pytest.skip("needs a CUDA GPU and the CUDA build of peagle_ext")
    opt = make(impl, study_drafter(4, device))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def one_step():
        opt.step()
        sync()

    benchmark.group = f"optimizer step, 4-layer study drafter, {device}"
    benchmark.pedantic(one_step, rounds=20 if device == "cuda" else 3, warmup_rounds=2)


# ---- table + JSON ---------------------------------------------------------------------------
def main():
    quick = os.environ.get("QUICK", "0") == "1"
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="4" if quick else "1,4", help="drafter layer counts, comma-separated")
    ap.add_argument("--reps", type=int, default=20 if quick else 50, help="timed steps per case (CPU: a fifth)")
    ap.add_argument("--devices", default=",".join(_devices()))
    args = ap.parse_args()
    rows = []
    print("one optimizer step of the SmolLM2 study drafter: median wall ms (synchronized), aten ops dispatched")
    print(f"{'layers':>6} {'device':>6} {'impl':>11} {'params M':>9} {'Muon mats':>9} {'ms':>9} {'ops':>6}")
    for device in args.devices.split(","):
        reps = args.reps if device == "cuda" else max(3, args.reps // 5)
        for layers in (int(x) for x in args.layers.split(",")):
            model = study_drafter(layers, device)
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            mats = len(muon_split(model.named_parameters())[0])
            for impl in IMPLS:
                opt = make(impl, model)
                ms = step_ms(opt, device, reps)
                row = dict(
                    layers=layers,
                    device=device,
                    impl=impl,
                    trainable_params=trainable,
                    muon_matrices=mats if impl != "adamw" else 0,
                    step_ms=ms,
                    ops=ops_per_step(opt),
                    reps=reps,
                )
                rows.append(row)
                print(
                    f"{layers:>6} {device:>6} {impl:>11} {trainable / 1e6:>9.1f} {row['muon_matrices']:>9} "
                    f"{ms:>9.3f} {row['ops']:>6}"
                )
    out = Path(os.environ.get("OUT", "bench_out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_optim.json").write_text(json.dumps({"rows": rows}, indent=1))
    print(f"wrote {out / 'bench_optim.json'}")


if __name__ == "__main__":
    main()
