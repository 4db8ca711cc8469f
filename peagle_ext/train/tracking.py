"""Experiment trackers for `peagle train --report-to`: TensorBoard event files under
DIR/tensorboard and Weights & Biases (offline unless WANDB_MODE says otherwise; the run goes to
DIR/wandb, `wandb sync` uploads it). Each gets the same scalars: loss, per-depth accuracy,
estimated acceptance length, lr, tokens/s, grad norm and peak memory, per split."""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

import torch

TRACKERS = ("none", "tensorboard", "wandb")


def check_report_to(report_to) -> list[str]:
    """The trackers asked for, as a list ("none" alone means no tracker)."""
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    names = [n.strip() for x in names for n in str(x).split(",") if n.strip()]
    bad = [n for n in names if n not in TRACKERS]
    if bad:
        raise ValueError(f"--report-to must be among {', '.join(TRACKERS)}, got {bad}")
    if "none" in names and len(set(names)) > 1:
        raise ValueError("--report-to none cannot be combined with a tracker")
    return [n for n in dict.fromkeys(names) if n != "none"]


def peak_memory_gib(device: torch.device) -> float:
    """Peak CUDA memory allocated by torch on `device`, else the process's peak resident size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return kib / (2**30 if sys.platform == "darwin" else 2**20)


def scalars(rec: dict) -> dict[str, float]:
    """The tracked scalars of one log.jsonl record of peagle train."""
    out = {}
    for k in ("loss", "full_acc", "accept_len", "lr", "tokens_per_s", "grad_norm", "memory_gib"):
        if isinstance(rec.get(k), (int, float)):
            out[k] = float(rec[k])
    for d, a in enumerate(rec.get("acc") or []):
        out[f"acc_d{d}"] = float(a)
    return out


class Trackers:
    """The trackers of one run (rank 0 only); log(record) sends a record's scalars to each."""

    def __init__(self, report_to, output: Path, config: dict):
        self.names = check_report_to(report_to)
        self._tb = None
        self._wandb = None
        if "tensorboard" in self.names:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ValueError(
                    "--report-to tensorboard needs the tensorboard package: pip install 'peagle_ext[track]'"
                ) from None
            self._tb = SummaryWriter(log_dir=str(Path(output) / "tensorboard"))
        if "wandb" in self.names:
            try:
                import wandb
            except ImportError:
                raise ValueError("--report-to wandb needs the wandb package: pip install 'peagle_ext[track]'") from None
            self._wandb = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "peagle"),
                name=Path(output).name,
                dir=str(output),
                config=config,
                mode=os.environ.get("WANDB_MODE", "offline"),
                reinit="finish_previous",
            )

    def log(self, rec: dict) -> None:
        if not self.names or "step" not in rec:
            return
        split, step = rec.get("split", "train"), int(rec["step"])
        values = {f"{split}/{k}": v for k, v in scalars(rec).items()}
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
