"""The optimizer side of a run: the learning-rate schedule."""

from __future__ import annotations

import math

from .settings import TrainSettings


def lr_lambda(s: TrainSettings):
    def f(step: int) -> float:
        if s.warmup_steps and step < s.warmup_steps:
            return (step + 1) / s.warmup_steps
        if s.schedule == "constant":
            return 1.0
        span = max(1, s.max_steps - s.warmup_steps)
        t = min(1.0, (step - s.warmup_steps) / span)
        shape = 0.5 * (1 + math.cos(math.pi * t)) if s.schedule == "cosine" else 1.0 - t
        return s.min_lr_ratio + (1 - s.min_lr_ratio) * shape

    return f
