"""`peagle export`: a vLLM-loadable bf16 copy of a trained drafter."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .. import data as D
from ..model import PEagleDraftModel
from .checkpoint import CHECKPOINT_PREFIX, fsync_dir, list_checkpoints
from .settings import TrainError


def export(src: str, dst: str, *, dtype: str = "bfloat16", verifier: str | None = None) -> Path:
    """Write a vLLM-loadable speculators checkpoint (config.json + model.safetensors) from a
    final/ dir, a checkpoint-<step>/ dir, or a training output dir (its final/, else its newest
    complete checkpoint). verifier: the name the export records for its verifier (default: the
    checkpoint's, which names it by what resolves it; see peagle_ext.data.verifier_name)."""
    p = Path(src)
    if not p.exists():
        raise TrainError(f"export: {src} does not exist")
    if (p / "config.json").is_file():
        pick = p
    elif (p / "final" / "config.json").is_file():
        pick = p / "final"
    else:
        ck = list_checkpoints(p)
        if not ck:
            raise TrainError(
                f"export: {src} holds no P-EAGLE checkpoint (no config.json, final/ or complete "
                f"{CHECKPOINT_PREFIX}<step>/)"
            )
        pick = ck[-1][1]
    dt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(dtype)
    if dt is None:
        raise TrainError(f"export: --dtype must be bfloat16|float16|float32, got {dtype!r}")
    model = PEagleDraftModel.from_pretrained(pick)
    named = model.config.speculators_config["verifier"]
    if verifier is not None or named.get("name_or_path") == "smollm2":  # "smollm2": a name only peagle resolves
        named["name_or_path"] = D.verifier_name(verifier or "smollm2")
        if verifier is not None:
            named.pop("revision", None)  # the recorded revision is the trained verifier's
    for name, t in model.checkpoint_state_dict().items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise TrainError(f"export: {pick} has non-finite values in {name}")
    d = Path(dst)
    check_export_destination(d, pick, Path(src))
    # a fresh, uniquely named sibling: never a directory that already exists (DST.tmp may be a user's)
    tmp = Path(tempfile.mkdtemp(prefix=f".{d.name}.export-", dir=d.parent if d.parent.is_dir() else None))
    try:
        model.save_pretrained(tmp, dtype=dt)
        _swap_in(tmp, d)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise TrainError(f"export: cannot write {dst}: {e.strerror or e} ({e.filename or tmp})") from None
    return d


# what an export of ours holds: replacing a directory with anything else would lose data
EXPORT_FILES = {"config.json", "model.safetensors"}


def check_export_destination(d: Path, pick: Path, src: Path) -> None:
    """DST may be absent, an empty directory, or an earlier export of ours (exactly config.json
    with speculators_model_type "peagle" + model.safetensors, not a symlink); never the source,
    an ancestor of it, a verifier's directory or anything else."""
    if d.is_symlink():
        raise TrainError(f"export: {d} is a symlink; refusing to replace it (give the real directory)")
    if not d.exists():
        if not d.parent.is_dir():
            raise TrainError(f"export: the parent directory of {d} does not exist")
        return
    rd = d.resolve()
    for s in (pick.resolve(), src.resolve()):
        if rd == s or rd in s.parents:
            raise TrainError(f"export: destination equals the source or contains it ({d}); refusing to replace it")
    if not d.is_dir():
        raise TrainError(f"export: {d} exists and is not a directory; refusing to replace it")
    names = {p.name for p in d.iterdir()}
    if not names:
        return
    ours = False
    if names == EXPORT_FILES and not any((d / n).is_symlink() for n in names):
        try:
            cfg = json.loads((d / "config.json").read_text(encoding="utf-8"))
            ours = isinstance(cfg, dict) and cfg.get("speculators_model_type") == "peagle"
        except (OSError, ValueError, RecursionError):
            ours = False
    if not ours:
        raise TrainError(
            f"export: {d} exists and is not a P-EAGLE export (only config.json + model.safetensors of a "
            "peagle drafter are replaced); refusing to replace it"
        )


def _swap_in(tmp: Path, d: Path) -> None:
    """Move the written export `tmp` to `d`; an earlier export goes to a uniquely named sibling
    first and is deleted last, so a kill leaves the old or the new export and nothing else of
    the user's is ever deleted."""
    if not d.exists():
        os.replace(tmp, d)
    else:
        old = Path(tempfile.mkdtemp(prefix=f".{d.name}.old-", dir=d.parent))
        os.replace(d, old / "x")
        os.replace(tmp, d)
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(d.parent)


def vllm_serve_command(export_dir) -> str:
    """The `vllm serve` line that serves an export with its verifier (P-EAGLE in vLLM is method
    eagle3 with parallel_drafting), quoted for a POSIX shell."""
    import json as _json
    import shlex

    d = Path(export_dir).resolve()
    cfg = _json.loads((d / "config.json").read_text())["speculators_config"]
    k = cfg["proposal_methods"][0]["speculative_tokens"]
    spec = {"model": str(d), "method": "eagle3", "num_speculative_tokens": k, "parallel_drafting": True}
    verifier = cfg["verifier"].get("name_or_path") or "<verifier>"
    rev = cfg["verifier"].get("revision")
    pin = f" --revision {shlex.quote(str(rev))}" if rev else ""
    return f"vllm serve {shlex.quote(verifier)}{pin} --speculative-config {shlex.quote(_json.dumps(spec))}"
