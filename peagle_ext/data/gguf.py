"""A GGUF causal LM converted once into a plain safetensors transformers directory, keyed by the
GGUF's content: environments that share the cache (different installs of the same package, hence
different mtimes) reuse one conversion, and a changed GGUF is converted afresh."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import shutil
import tempfile
import time

from .records import DataError

log = logging.getLogger("peagle_ext.data")

# Written last into a converted directory: names the GGUF it came from by size and sha256.
CONVERSION_MARKER = "peagle_conversion.json"


def file_sha256(path: pathlib.Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def gguf_fingerprint(gguf: pathlib.Path) -> dict:
    """Size and sha256 of the GGUF (hashing SmolLM2's 94 MB takes a fraction of a second)."""
    return {"gguf_size": gguf.stat().st_size, "gguf_sha256": file_sha256(gguf)}


def converted_dir_is_current(out_dir: pathlib.Path, gguf: pathlib.Path) -> bool:
    """Whether out_dir holds a finished conversion of exactly this GGUF's bytes."""
    marker = out_dir / CONVERSION_MARKER
    if not marker.is_file():
        return False
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if not isinstance(recorded, dict) or recorded.get("gguf_size") != gguf.stat().st_size:
        return False  # cheap check first: a different size never needs the hash
    return recorded.get("gguf_sha256") == file_sha256(gguf)


def convert_gguf_to_hf(gguf: str | os.PathLike, out_dir: str | os.PathLike) -> pathlib.Path:
    """Dequantize a GGUF causal LM into a plain safetensors transformers directory at `out_dir`.

    Atomic: everything is written into a temporary sibling directory which is renamed onto
    `out_dir` at the end, so a crash never leaves a half-written verifier. When another process
    wins the race, its (identical) result is kept. Weights are stored in float32: the dequantized
    GGUF values are exactly representable there, so nothing is lost.

    Uses transformers' GGUF reader (config, tokenizer and tensor name/permutation mapping) but not
    `from_pretrained(gguf_file=...)`, which in transformers 5 demands the `accelerate` package.
    Reads only local files (local_files_only per call; no process-wide hub setting is touched).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf = pathlib.Path(gguf)
    out_dir = pathlib.Path(out_dir)
    if not gguf.is_file():
        raise DataError(f"GGUF file not found: {gguf}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    fingerprint = gguf_fingerprint(gguf)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    log.info("converting %s to a safetensors verifier in %s (one time, ~20 s for SmolLM2)", gguf, out_dir)
    try:
        folder, name = str(gguf.parent), gguf.name
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
            config = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
            model = AutoModelForCausalLM.from_config(config)
            state = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
        except Exception as e:  # gguf/transformers raise struct.error, KeyError, ValueError, ...
            raise DataError(f"cannot convert GGUF {gguf}: {type(e).__name__}: {e}") from e
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
        if set(missing) - tied or unexpected:
            raise DataError(
                f"GGUF {gguf} does not map onto {type(model).__name__}: "
                f"missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}"
            )
        model.tie_weights()
        # The dequantized GGUF was never the model's "original" path; keep the saved config clean.
        model.config.name_or_path = str(out_dir)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / CONVERSION_MARKER).write_text(
            json.dumps({"gguf_name": gguf.name, **fingerprint, "seconds": round(time.perf_counter() - t0, 2)}, indent=1)
        )
        if out_dir.exists():
            # A stale conversion (different GGUF) is replaced; move it aside first so the final
            # rename is still a single atomic step.
            old = pathlib.Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.rename(out_dir, old / "d")
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not converted_dir_is_current(out_dir, gguf):
                raise
            log.info("another process converted %s first; using its copy", gguf.name)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s -> %s in %.1f s", gguf, out_dir, time.perf_counter() - t0)
    return out_dir
