"""Checkpoints of a run: DIR/checkpoint-<step>/ (the section-5 model plus the trainer state),
written to a .tmp directory, marked complete and renamed into place, so a process killed at any
moment leaves only complete checkpoints; listing, pruning and reading them back."""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from ..model import PEagleDraftModel
from .settings import TrainError

CHECKPOINT_PREFIX = "checkpoint-"
COMPLETE_MARKER = "COMPLETE"
TRAINER_STATE = "trainer_state.pt"


def rng_state() -> dict:
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict):
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def list_checkpoints(out: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first (a .tmp dir or one without its marker is not one)."""
    found = []
    if not out.is_dir():
        return found
    for p in out.iterdir():
        name = p.name
        if not p.is_dir() or not name.startswith(CHECKPOINT_PREFIX):
            continue
        tail = name[len(CHECKPOINT_PREFIX) :]
        if not tail.isdigit():
            continue
        if not (p / COMPLETE_MARKER).is_file() or not (p / TRAINER_STATE).is_file():
            continue
        found.append((int(tail), p))
    return sorted(found)


def save_checkpoint(out: Path, step: int, model: PEagleDraftModel, opt, sched, state: dict, keep: int) -> Path:
    for name, p in model.named_parameters():
        if not bool(torch.isfinite(p).all()):
            raise TrainError(f"refusing to write checkpoint {step}: parameter {name} is not finite")
    tmp = out / f"{CHECKPOINT_PREFIX}{step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    test_pause("weights", step)
    torch.save(
        {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "rng": rng_state(), **state},
        tmp / TRAINER_STATE,
    )
    return publish_checkpoint(out, step, tmp, keep)


def publish_checkpoint(out: Path, step: int, tmp: Path, keep: int) -> Path:
    """Mark the written tmp dir complete, rename it to checkpoint-<step>, prune old ones."""
    final = out / f"{CHECKPOINT_PREFIX}{step}"
    (tmp / COMPLETE_MARKER).write_text(f"{step}\n")
    fsync_dir(tmp)
    test_pause("written", step)
    replace_dir(tmp, final)
    for _step, p in list_checkpoints(out)[:-keep]:
        remove_checkpoint(p)
    return final


def replace_dir(tmp: Path, dst: Path):
    """Move the complete directory `tmp` to `dst` (replacing an older `dst`) so that a kill at any
    instant leaves `dst` absent, the old complete one, or the new complete one; never a mix."""
    if dst.exists():
        old = dst.with_name(dst.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(dst, old)
        os.replace(tmp, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dst)
    fsync_dir(dst.parent)


def remove_checkpoint(p: Path):
    """Prune a checkpoint: its COMPLETE marker goes first, so a kill in the middle of the
    rmtree leaves an incomplete directory (ignored, later pruned) rather than a marked one
    with missing files."""
    try:
        (p / COMPLETE_MARKER).unlink(missing_ok=True)
        fsync_dir(p)
    except OSError:
        pass
    shutil.rmtree(p, ignore_errors=True)


def test_pause(point: str, step: int):
    """Test hook, used only by tests/train/test_crash_safety.py to SIGKILL the trainer at a known
    point: PEAGLE_TEST_PAUSE="<point>:<step>:<flag file>" makes the trainer create the flag file
    and sleep (10 min) when it reaches <point> at <step>. Points: "weights" (checkpoint tmp dir
    holds the weights only), "written" (tmp dir complete, before its rename), "step" (after step
    <step>, its checkpoint included). Unset (always, outside those tests): does nothing."""
    spec = os.environ.get("PEAGLE_TEST_PAUSE")
    if not spec:
        return
    want_point, want_step, flag = spec.split(":", 2)
    if want_point == point and int(want_step) == step:
        Path(flag).touch()
        time.sleep(600)


def read_checkpoint_state(ck: Path) -> dict:
    """The trainer state of a complete checkpoint, after checking that its files are readable.
    A complete checkpoint was fsynced before its rename, so this fails only on later damage
    (disk errors, manual edits): say which checkpoint, and how to go back to the one before."""
    try:
        from safetensors import safe_open

        with safe_open(str(ck / "model.safetensors"), "pt"):
            pass
        json.loads((ck / "config.json").read_text())
        return read_trainer_state(ck)
    except Exception as e:  # noqa: BLE001  (pickle, safetensors and OS errors alike)
        raise TrainError(
            f"--resume: checkpoint {ck} is marked complete but cannot be read ({type(e).__name__}: "
            f"{e}); move it out of the output directory to resume from the checkpoint before it"
        ) from None


def fsync_dir(d: Path):
    try:
        for f in d.iterdir() if d.is_dir() else []:
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def read_trainer_state(ck: Path) -> dict:
    """The trainer state (optimizer, scheduler, RNG states, data position) of checkpoint `ck`."""
    return torch.load(ck / TRAINER_STATE, map_location="cpu", weights_only=False)
