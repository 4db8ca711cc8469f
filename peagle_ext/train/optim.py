"""The optimizer side of a run: AdamW and the learning-rate schedule."""

from __future__ import annotations

import math

import torch

from .settings import TrainSettings


def make_adamw(params, *, lr: float, betas: tuple[float, float], weight_decay: float) -> torch.optim.AdamW:
    """AdamW over `params`, fused (one multi-tensor kernel per step, at memory speed) when every
    parameter is on CUDA. FSDP2's sharded DTensor parameters are included: DTensor shards the
    fused op like its foreach ops. On the CPU: torch's default implementation, whose results
    the CPU tests and bit-exact resumes pin."""
    params = list(params)
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=fused)


def lr_lambda(s: TrainSettings, clock=None, progress: float = 0.0):
    """The learning-rate factor of a step: a linear warmup over `warmup_steps`, then the schedule's
    shape over progress t in [0, 1], t = the step's share of the steps after warmup. With
    `s.time_schedule`, t is also `clock()`, the share of the time budget's training time spent
    (train/loop.py: from the first step to the end of --max-minutes), whichever is further, and
    never below `progress` nor below any t it has returned: a run that the time budget stops
    ends with its rate decayed however fast its steps turn out, and a resumed run goes on from
    the progress it had. `f.progress()` is that t."""
    state = {"t": float(progress)}

    def f(step: int) -> float:
        if s.warmup_steps and step < s.warmup_steps:
            return (step + 1) / s.warmup_steps
        if s.schedule == "constant":
            return 1.0
        span = max(1, s.max_steps - s.warmup_steps)
        t = min(1.0, (step - s.warmup_steps) / span)
        if s.time_schedule and clock is not None:
            t = max(t, min(1.0, clock()), state["t"])
            state["t"] = t
        shape = 0.5 * (1 + math.cos(math.pi * t)) if s.schedule == "cosine" else 1.0 - t
        return s.min_lr_ratio + (1 - s.min_lr_ratio) * shape

    f.progress = lambda: state["t"]
    return f
