"""Checkpoints of a run: DIR/checkpoint-<step>/ (the section-5 model plus the trainer state),
written to a .tmp directory, marked complete and renamed into place, so a process killed at any
moment leaves only complete checkpoints; listing, pruning and reading them back."""

from __future__ import annotations

import json
import math
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
# The trainer state (optimizer, scheduler, RNG states, data position, settings) is JSON plus a
# safetensors file of its tensors: reading it runs no code, unlike a pickle. TRAINER_STATE is
# written last, so its presence means both files are there.
TRAINER_STATE = "trainer_state.json"
TRAINER_TENSORS = "trainer_state.safetensors"
# checkpoints written before that: read with torch.load(weights_only=True) and an allow-list
LEGACY_TRAINER_STATE = "trainer_state.pt"


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
        # a symlink is never one of ours: followed, it would shadow newer checkpoints and pruning
        # would delete whatever it points to, outside the output directory
        if p.is_symlink() or not p.is_dir() or not name.startswith(CHECKPOINT_PREFIX):
            continue
        tail = name[len(CHECKPOINT_PREFIX) :]
        if not (tail.isascii() and tail.isdigit()):
            continue
        if not (p / COMPLETE_MARKER).is_file():
            continue
        if not ((p / TRAINER_STATE).is_file() or (p / LEGACY_TRAINER_STATE).is_file()):
            continue
        found.append((int(tail), p))
    return sorted(found)


def remove_path(p: Path):
    """Delete what `p` names: a symlink or file is unlinked (never its target), a directory
    removed with its contents."""
    if p.is_symlink() or p.is_file():
        p.unlink(missing_ok=True)
    elif p.exists():
        shutil.rmtree(p)


def save_checkpoint(out: Path, step: int, model: PEagleDraftModel, opt, sched, state: dict, keep: int) -> Path:
    for name, p in model.named_parameters():
        if not bool(torch.isfinite(p).all()):
            raise TrainError(f"refusing to write checkpoint {step}: parameter {name} is not finite")
    tmp = out / f"{CHECKPOINT_PREFIX}{step}.tmp"
    try:
        remove_path(tmp)
        model.save_pretrained(tmp)
        test_pause("weights", step)
        save_trainer_state(
            tmp, {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "rng": rng_state(), **state}
        )
        return publish_checkpoint(out, step, tmp, keep)
    except OSError as e:
        raise write_error(f"checkpoint {step}", tmp, e) from None


def write_error(what: str, where: Path, e: OSError) -> TrainError:
    """A failed write (disk full, read-only directory, quota) as one line naming the path; the
    partial directory is removed so that it neither fills the disk nor looks like a result."""
    shutil.rmtree(where, ignore_errors=True)
    reason = e.strerror or str(e)
    path = e.filename or where
    return TrainError(f"cannot write {what} to {where}: {reason} ({path}); the earlier checkpoints are kept")


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
    if dst.exists() or dst.is_symlink():
        old = dst.with_name(dst.name + ".old")
        remove_path(old)
        os.replace(dst, old)
        os.replace(tmp, dst)
        if old.is_symlink():
            old.unlink()
        else:
            shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dst)
    fsync_dir(dst.parent)


def remove_checkpoint(p: Path):
    """Prune a checkpoint: its COMPLETE marker goes first, so a kill in the middle of the
    rmtree leaves an incomplete directory (ignored, later pruned) rather than a marked one
    with missing files."""
    if p.is_symlink():  # never one of ours (list_checkpoints skips them): leave its target alone
        return
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
    except Exception as e:  # noqa: BLE001  (JSON, safetensors and OS errors alike)
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
    """The trainer state (optimizer, scheduler, RNG states, data position) of checkpoint `ck`.
    Runs no code from the files: JSON + safetensors, or for an older checkpoint a
    torch.load(weights_only=True) that allows only the numpy types of the RNG state."""
    if (ck / TRAINER_STATE).is_file():
        st = load_state_files(ck / TRAINER_STATE, ck / TRAINER_TENSORS)
    else:
        st = _read_legacy(ck / LEGACY_TRAINER_STATE)
    check_trainer_state(st, ck)
    return st


def _read_legacy(f: Path) -> dict:
    import numpy.core.multiarray as multiarray  # noqa: PLC0415

    allowed = [multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    with torch.serialization.safe_globals(allowed):
        st = torch.load(f, map_location="cpu", weights_only=True)
    if isinstance(st, dict) and isinstance(st.get("rng"), dict):
        npst = st["rng"].get("numpy")
        if isinstance(npst, tuple) and len(npst) == 5 and isinstance(npst[1], np.ndarray):
            st["rng"]["numpy"] = npst
    return st


# -- trainer state as JSON + safetensors ------------------------------------------------------
_MARKERS = ("__tensor__", "__ndarray__", "__tuple__", "__items__", "__float__")


def save_trainer_state(d: Path, state: dict):
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    doc = _encode(state, tensors)
    save_file(tensors, str(d / TRAINER_TENSORS))
    (d / TRAINER_STATE).write_text(json.dumps(doc, allow_nan=False))


def load_state_files(doc_file: Path, tensor_file: Path) -> dict:
    """Read a trainer state back; any malformed content is a ValueError naming the file."""
    from safetensors.torch import load_file

    try:
        doc = json.loads(doc_file.read_text(encoding="utf-8"))
    except RecursionError:
        raise ValueError(f"{doc_file} is nested too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{doc_file} is not valid JSON ({e})") from None
    try:
        tensors = load_file(str(tensor_file))
    except FileNotFoundError:
        raise ValueError(f"{tensor_file} is missing") from None
    except Exception as e:  # noqa: BLE001  (safetensors raises its own error types)
        raise ValueError(f"{tensor_file} is not a readable safetensors file ({e})") from None
    try:
        st = _decode(doc, tensors)
    except RecursionError:
        raise ValueError(f"{doc_file} is nested too deeply") from None
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{doc_file}: {e}") from None
    if not isinstance(st, dict):
        raise ValueError(f"{doc_file} must hold a JSON object, got {type(st).__name__}")
    return st


def _encode(x, tensors: dict):
    if isinstance(x, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = x.detach().to("cpu").clone().contiguous()
        return {"__tensor__": key}
    if isinstance(x, np.ndarray):
        key = f"t{len(tensors)}"
        tensors[key] = torch.from_numpy(x.astype(np.int64) if x.dtype.kind in "iu" else x.copy())
        return {"__ndarray__": key, "dtype": x.dtype.str}
    if isinstance(x, np.generic):
        x = x.item()
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else {"__float__": repr(x)}
    if isinstance(x, tuple):
        return {"__tuple__": [_encode(v, tensors) for v in x]}
    if isinstance(x, list):
        return [_encode(v, tensors) for v in x]
    if isinstance(x, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in x):
            return {k: _encode(v, tensors) for k, v in x.items()}
        return {"__items__": [[_encode(k, tensors), _encode(v, tensors)] for k, v in x.items()]}
    raise TypeError(f"trainer state: cannot store a {type(x).__name__}")


def _decode(x, tensors: dict):
    if isinstance(x, list):
        return [_decode(v, tensors) for v in x]
    if not isinstance(x, dict):
        return x
    marks = [k for k in _MARKERS if k in x]
    if not marks:
        if any(isinstance(k, str) and k.startswith("__") for k in x):
            raise ValueError(f"unknown entry {next(k for k in x if k.startswith('__'))!r}")
        return {k: _decode(v, tensors) for k, v in x.items()}
    m = marks[0]
    v = x[m]
    if m == "__tensor__":
        if not isinstance(v, str) or v not in tensors:
            raise ValueError(f"tensor {v!r} is not in the tensor file")
        return tensors[v]
    if m == "__ndarray__":
        if not isinstance(v, str) or v not in tensors:
            raise ValueError(f"tensor {v!r} is not in the tensor file")
        dt = x.get("dtype")
        if dt not in ("<u4", "<i8", "<u8", "<i4", "<f8", "<f4"):
            raise ValueError(f"unsupported array dtype {dt!r}")
        return tensors[v].numpy().astype(np.dtype(dt))
    if m == "__tuple__":
        if not isinstance(v, list):
            raise ValueError("__tuple__ must hold a list")
        return tuple(_decode(e, tensors) for e in v)
    if m == "__items__":
        if not isinstance(v, list) or not all(isinstance(e, list) and len(e) == 2 for e in v):
            raise ValueError("__items__ must hold [key, value] pairs")
        out = {}
        for k, e in v:
            k = _decode(k, tensors)
            if not isinstance(k, (str, int, float, bool, type(None), tuple)):
                raise ValueError(f"unusable key {k!r}")
            out[k] = _decode(e, tensors)
        return out
    if v not in ("inf", "-inf", "nan"):
        raise ValueError(f"__float__ must be inf, -inf or nan, got {v!r}")
    return float(v)


def check_trainer_state(st, ck: Path):
    """The shape of what resume reads first: the position, the settings and the RNG states."""

    def need(cond, what):
        if not cond:
            raise ValueError(f"trainer state of {ck}: {what}")

    need(isinstance(st, dict), "not a mapping")
    for k in ("step", "epoch", "cursor"):
        v = st.get(k)
        need(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**62, f"{k} must be an int >= 0, got {v!r}")
    need(isinstance(st.get("settings"), dict), "settings must be a mapping")
    ga, ws = st["settings"].get("grad_accum", 1), st.get("world_size", 1)
    need(
        isinstance(ga, int) and isinstance(ws, int) and ga >= 1 and ws >= 1, "grad_accum / world_size must be ints >= 1"
    )
    need(isinstance(st.get("scheduler"), dict), "scheduler must be a mapping")
    sp = st.get("schedule_progress", 0.0)
    need(
        isinstance(sp, (int, float)) and not isinstance(sp, bool) and 0.0 <= sp <= 1.0,
        f"schedule_progress must be a number in [0, 1], got {sp!r}",
    )
    need(st.get("optimizer") is None or isinstance(st.get("optimizer"), dict), "optimizer must be a mapping")
    rng = st.get("rng")
    need(isinstance(rng, dict), "rng must be a mapping")
    py = rng.get("python")
    need(isinstance(py, tuple) and len(py) == 3 and isinstance(py[1], tuple), "rng.python is not a random state")
    npst = rng.get("numpy")
    need(isinstance(npst, tuple) and len(npst) == 5 and isinstance(npst[1], np.ndarray), "rng.numpy is not a state")
    t = rng.get("torch")
    need(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1, "rng.torch is not a state")
