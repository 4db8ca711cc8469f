"""When a run ends before --max-steps: the validation loss has stopped improving (an early stop)
or the wall-clock budget is spent. Either way the run saves its checkpoint and final/ as at
--max-steps, so `peagle eval` and `--resume` find them."""

from __future__ import annotations

import time


class StopRule:
    """patience: validation evaluations in a row whose loss is not below best * (1 - min_delta)
    (None = never stop early); max_minutes: wall-clock budget of this process (None = none)."""

    def __init__(self, patience: int | None, min_delta: float, max_minutes: float | None, t_start: float):
        self.patience, self.min_delta, self.max_minutes = patience, float(min_delta), max_minutes
        self.t_start = t_start
        self.best = float("inf")
        self.bad = 0

    def after_val(self, loss: float) -> str | None:
        if self.patience is None:
            return None
        if loss < self.best * (1.0 - self.min_delta):
            self.best, self.bad = loss, 0
            return None
        self.bad += 1
        if self.bad >= self.patience:
            return (
                f"validation loss {loss:.4f} has not improved on {self.best:.4f} by {100 * self.min_delta:g}% "
                f"for {self.bad} evaluations (--early-stop-patience {self.patience})"
            )
        return None

    def over_time(self) -> bool:
        return self.max_minutes is not None and (time.time() - self.t_start) / 60.0 > self.max_minutes
