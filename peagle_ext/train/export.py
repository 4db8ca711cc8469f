"""`peagle export`: a vLLM-loadable bf16 copy of a trained drafter."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from .. import data as D
from ..model import PEagleDraftModel
from .checkpoint import CHECKPOINT_PREFIX, list_checkpoints, replace_dir
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
    for name, t in model.checkpoint_state_dict().items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise TrainError(f"export: {pick} has non-finite values in {name}")
    d = Path(dst)
    if d.resolve() == pick.resolve():
        raise TrainError("export: destination equals the source")
    if d.exists() and not (d.is_dir() and (not any(d.iterdir()) or (d / "config.json").is_file())):
        # only an empty directory or an earlier export is replaced: never a file or another directory
        raise TrainError(f"export: {dst} exists and is not a P-EAGLE checkpoint directory; refusing to replace it")
    tmp = d.with_name(d.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, dtype=dt)
    replace_dir(tmp, d)
    return d


def vllm_serve_command(export_dir) -> str:
    """The `vllm serve` line that serves an export with its verifier (P-EAGLE in vLLM is method
    eagle3 with parallel_drafting), quoted for a POSIX shell."""
    import json
    import shlex

    d = Path(export_dir).resolve()
    cfg = json.loads((d / "config.json").read_text())["speculators_config"]
    k = cfg["proposal_methods"][0]["speculative_tokens"]
    spec = {"model": str(d), "method": "eagle3", "num_speculative_tokens": k, "parallel_drafting": True}
    verifier = cfg["verifier"].get("name_or_path") or "<verifier>"
    return f"vllm serve {shlex.quote(verifier)} --speculative-config {shlex.quote(json.dumps(spec))}"
