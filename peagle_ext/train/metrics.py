"""Training metrics: loss, per-depth accuracy and the estimated acceptance length."""

from __future__ import annotations

import torch


def acceptance_length(acc: list[float]) -> float:
    """Estimated tokens per verifier round, counted the way `peagle eval` counts them: the bonus
    token the verifier adds every round plus the expected accepted drafts,
    1 + sum_k prod_{j<=k} acc_j. acc[k] stands in for P(draft k+1 accepted | drafts <= k
    accepted); the per-depth accuracies are unconditional, so this is an estimate."""
    total, run = 1.0, 1.0
    for a in acc:
        run *= float(a)
        total += run
    return total


class Meter:
    """Sums over steps: loss_sum / weight, per-depth correct / total."""

    def __init__(self, k: int):
        self.k = k
        self.reset()

    def reset(self):
        self.loss_sum = 0.0
        self.weight = 0.0
        self.correct = torch.zeros(self.k, dtype=torch.int64)
        self.total = torch.zeros(self.k, dtype=torch.int64)

    def add(self, m: dict):
        self.loss_sum += float(m["loss_sum"])
        self.weight += float(m["weight"])
        self.correct += m["correct"].cpu().long()
        self.total += m["total"].cpu().long()

    def summary(self) -> dict:
        acc = [float(c) / float(t) if int(t) > 0 else 0.0 for c, t in zip(self.correct, self.total)]
        tot = int(self.total.sum())
        return {
            "loss": self.loss_sum / self.weight if self.weight > 0 else float("nan"),
            "acc": acc,
            "full_acc": float(self.correct.sum()) / tot if tot else 0.0,
            "accept_len": acceptance_length(acc),
            "counted": [int(t) for t in self.total],
        }
