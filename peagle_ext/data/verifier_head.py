"""The parts of a verifier a drafter trains against once its hidden states are cached: the final
norm (as an effective RMSNorm weight), the lm_head and the input embeddings, read from the
verifier's safetensors by name, without building or loading its decoder layers."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass

import torch

from .records import DataError
from .verifier import decoder_parts, resolve_verifier_path


@dataclass
class VerifierHead:
    config: object  # the transformers config (text config for multimodal wrappers)
    architectures: list
    norm_weight: torch.Tensor  # [H] float32: norm(x) == x / rms(x) * norm_weight
    norm_eps: float
    lm_head_weight: torch.Tensor  # [V, H] float32
    embed_weight: torch.Tensor  # [V, H] float32


def _norm_eps(norm, config) -> float:
    for k in ("variance_epsilon", "eps", "epsilon"):
        v = getattr(norm, k, None)
        if isinstance(v, float):
            return v
    return float(getattr(config, "rms_norm_eps", 1e-6))


def effective_norm_weight(norm, eps: float) -> torch.Tensor:
    """The weight w with norm(x) == x / sqrt(mean(x^2) + eps) * w, measured on x = ones (float32
    on the CPU): plain RMSNorms give their weight, Gemma-style ones (x * (1 + w)) give 1 + w."""
    probe = copy.deepcopy(norm).float().cpu()
    h = probe.weight.shape[0]
    with torch.no_grad():
        w = (probe(torch.ones(1, h)).reshape(h) * math.sqrt(1.0 + eps)).float()
        stored = probe.weight.detach().float()
        # the exact stored values when the measurement says which form it is (no rounding from the probe)
        for exact in (stored, 1.0 + stored):
            if torch.allclose(w, exact, rtol=1e-4, atol=1e-5):
                return exact.clone()
    return w


def verifier_head_from_model(verifier) -> VerifierHead:
    """The head parts of a loaded verifier."""
    cfg = getattr(verifier.config, "text_config", None) or verifier.config
    _, _, norm = decoder_parts(verifier)
    eps = _norm_eps(norm, cfg)
    return VerifierHead(
        cfg,
        list(getattr(verifier.config, "architectures", None) or []),
        effective_norm_weight(norm, eps),
        eps,
        verifier.get_output_embeddings().weight.detach().float().cpu(),
        verifier.get_input_embeddings().weight.detach().float().cpu(),
    )


def _tensor_files(path) -> dict[str, str]:
    """checkpoint tensor name -> safetensors file of a transformers directory."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {k: str(path / f) for k, f in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: str(f) for k in h.keys()})
    return out


def load_verifier_head(spec: str, *, revision: str | None = None, cache_dir: str | None = None) -> VerifierHead:
    """A VerifierHead read from the verifier's safetensors by tensor name: the model is built on
    the meta device (no memory, no weights) only to learn the names and the norm's kind."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve_verifier_path(spec, cache_dir=cache_dir, revision=revision)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    names = {id(p): n for n, p in meta.named_parameters()}
    _, _, norm = decoder_parts(meta)
    want = {
        "norm": names[id(norm.weight)],
        "embed": names[id(meta.get_input_embeddings().weight)],
        "lm_head": names[id(meta.get_output_embeddings().weight)],
    }
    files = _tensor_files(path)
    if not files:
        raise DataError(
            f"verifier {spec!r}: {path} has no safetensors weights; the head alone is read from safetensors "
            "(train without a complete --hidden-cache-dir to load the whole model)"
        )
    got = {}
    for part, name in want.items():
        key = name if name in files else next((k for k in files if k.endswith("." + name)), None)
        if key is None:
            raise DataError(f"verifier {spec!r}: tensor {name!r} ({part}) not found in the safetensors of {path}")
        with safe_open(files[key], "pt") as h:
            got[part] = h.get_tensor(key).float()
    cfg = getattr(config, "text_config", None) or config
    eps = _norm_eps(norm, cfg)
    norm_cpu = copy.deepcopy(norm).to_empty(device="cpu")
    with torch.no_grad():
        norm_cpu.weight.copy_(got["norm"])
    return VerifierHead(
        cfg,
        list(getattr(config, "architectures", None) or []),
        effective_norm_weight(norm_cpu, eps),
        eps,
        got["lm_head"],
        got["embed"],
    )
