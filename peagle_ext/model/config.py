"""The drafter's configuration: the speculators-format checkpoint config (docs/design.md,
"Checkpoints") and the training options that are not part of it."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from transformers import LlamaConfig, PretrainedConfig, Qwen3Config

LAYER_TYPES = ("llama", "qwen3")
ATTENTION_MODES = ("symmetric", "cross")
CONFIG_NAME = "config.json"


def layer_config_class(model_type: str):
    if model_type == "llama":
        return LlamaConfig
    if model_type == "qwen3":
        return Qwen3Config
    raise ValueError(f"transformer_layer_config.model_type must be one of {LAYER_TYPES}, got {model_type!r}")


class PEagleConfig(PretrainedConfig):
    """Speculators-format config of a P-EAGLE drafter.

    `to_dict()` is exactly the config.json of docs/design.md section 5; `from_dict` reads it back.
    transformer_layer_config is a LlamaConfig or Qwen3Config whose num_hidden_layers is the
    number of DRAFT layers and whose vocab_size is the embedding's row count (the verifier's
    vocab, plus one when the MASK token is a new id past it).
    """

    model_type = "peagle"

    def __init__(
        self,
        transformer_layer_config=None,
        draft_vocab_size: int | None = None,
        target_hidden_size: int | None = None,
        norm_before_residual: bool = False,
        norm_before_fc: bool = False,
        eagle_aux_hidden_state_layer_ids=None,
        mask_token_id: int | None = None,
        embed_requires_grad: bool = True,
        speculators_config: dict | None = None,
        **kwargs,
    ):
        if transformer_layer_config is None:
            transformer_layer_config = LlamaConfig()
        if isinstance(transformer_layer_config, dict):
            d = dict(transformer_layer_config)
            cls = layer_config_class(d.pop("model_type", "llama"))
            d.pop("transformers_version", None)
            transformer_layer_config = cls(**d)
        if not isinstance(transformer_layer_config, PretrainedConfig):
            raise TypeError(
                "transformer_layer_config must be a transformers config or a dict, "
                f"got {type(transformer_layer_config).__name__}"
            )
        layer_config_class(transformer_layer_config.model_type)  # validates llama|qwen3
        self.transformer_layer_config = transformer_layer_config
        self.draft_vocab_size = int(
            draft_vocab_size if draft_vocab_size is not None else transformer_layer_config.vocab_size
        )
        self.target_hidden_size = target_hidden_size
        self.norm_before_residual = bool(norm_before_residual)
        self.norm_before_fc = bool(norm_before_fc)
        self.eagle_aux_hidden_state_layer_ids = (
            None if eagle_aux_hidden_state_layer_ids is None else [int(x) for x in eagle_aux_hidden_state_layer_ids]
        )
        self.mask_token_id = None if mask_token_id is None else int(mask_token_id)
        self.embed_requires_grad = bool(embed_requires_grad)
        self.speculators_config = (
            copy.deepcopy(speculators_config) if speculators_config else make_speculators_config(8, None, None)
        )
        for k in ("speculators_model_type", "architectures", "speculators_version"):
            kwargs.pop(k, None)
        super().__init__(**{k: v for k, v in kwargs.items() if k in _PRETRAINED_FIELDS})

    # -- derived ------------------------------------------------------------------------------
    @property
    def num_depths(self) -> int:
        return int(self.speculators_config["proposal_methods"][0]["speculative_tokens"])

    @property
    def hidden_size(self) -> int:
        return int(self.transformer_layer_config.hidden_size)

    @property
    def num_aux(self) -> int:
        ids = self.eagle_aux_hidden_state_layer_ids
        return len(ids) if ids else 3

    @property
    def layer_type(self) -> str:
        return self.transformer_layer_config.model_type

    # -- speculators json ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        tl = self.transformer_layer_config.to_diff_dict()
        tl.pop("transformers_version", None)
        tl["model_type"] = self.transformer_layer_config.model_type
        rope = tl.get("rope_parameters") or getattr(self.transformer_layer_config, "rope_parameters", None) or {}
        if "rope_theta" in rope and "rope_theta" not in tl:
            # readers built on transformers < 5 (older vLLM) know only the flat key
            tl["rope_theta"] = rope["rope_theta"]
        return {
            "speculators_model_type": "peagle",
            "architectures": ["PEagleSpeculator"],
            "transformer_layer_config": tl,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "norm_before_residual": self.norm_before_residual,
            "norm_before_fc": self.norm_before_fc,
            "eagle_aux_hidden_state_layer_ids": self.eagle_aux_hidden_state_layer_ids,
            "mask_token_id": self.mask_token_id,
            "embed_requires_grad": self.embed_requires_grad,
            "speculators_config": copy.deepcopy(self.speculators_config),
        }

    def to_diff_dict(self) -> dict[str, Any]:
        return self.to_dict()

    def to_json_string(self, use_diff: bool = True) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        d = {**config_dict, **kwargs}
        kind = d.get("speculators_model_type")
        if kind != "peagle":
            raise ValueError(f"not a P-EAGLE speculators config: speculators_model_type is {kind!r}, expected 'peagle'")
        # a file without these would silently get defaults (a 4096-wide llama layer, K = 8)
        missing = [k for k in ("transformer_layer_config", "speculators_config") if not isinstance(d.get(k), dict)]
        if missing:
            raise ValueError(f"not a complete P-EAGLE speculators config: missing {', '.join(missing)}")
        check_config_dict(d)
        try:
            return cls(**d)
        except Exception as e:  # noqa: BLE001
            # transformers' own config checks (strict dataclass fields, rope validation) raise
            # types of their own, not all of them ValueError
            raise ValueError(f"config: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else e!r}") from None

    def save_pretrained(self, save_directory, **kwargs):
        Path(save_directory).mkdir(parents=True, exist_ok=True)
        (Path(save_directory) / CONFIG_NAME).write_text(self.to_json_string())

    @classmethod
    def from_pretrained(cls, path, **kwargs):
        p = Path(path)
        f = p / CONFIG_NAME if p.is_dir() else p
        if not f.is_file():
            raise FileNotFoundError(f"no {CONFIG_NAME} in {path}")
        try:
            d = json.loads(f.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{f} is not valid JSON ({e}): a corrupt or partial checkpoint?") from None
        except RecursionError:
            raise ValueError(f"{f} is nested too deeply to be a speculators config") from None
        if not isinstance(d, dict):
            raise ValueError(f"{f} must hold a JSON object (a speculators config), got {type(d).__name__}")
        try:
            return cls.from_dict(d, **kwargs)
        except ValueError as e:
            raise ValueError(f"{f}: {e}") from None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_config_dict(d: dict) -> None:
    """The types and ranges of every field the drafter reads from a config.json. Without this,
    "false" loads as True, true as mask id 1, 2.9 as K = 2, [] as three aux layers, NaN eps
    and zero heads reach the model (a ZeroDivisionError or NaN outputs)."""

    def need(cond, what):
        if not cond:
            raise ValueError(what)

    for k in ("norm_before_residual", "norm_before_fc", "embed_requires_grad"):
        if k in d:
            need(isinstance(d[k], bool), f"{k} must be true or false, got {d[k]!r}")
    for k in ("draft_vocab_size", "target_hidden_size"):
        if d.get(k) is not None:
            need(_is_int(d[k]) and d[k] >= 1, f"{k} must be an int >= 1, got {d[k]!r}")
    m = d.get("mask_token_id")
    need(m is None or (_is_int(m) and m >= 0), f"mask_token_id must be an int >= 0 or null, got {m!r}")
    aux = d.get("eagle_aux_hidden_state_layer_ids")
    need(
        aux is None or (isinstance(aux, list) and aux and all(_is_int(x) and x >= 0 for x in aux)),
        f"eagle_aux_hidden_state_layer_ids must be null or a non-empty list of layer ids >= 0, got {aux!r}",
    )
    sc = d["speculators_config"]
    pm = sc.get("proposal_methods")
    need(
        isinstance(pm, list) and pm and isinstance(pm[0], dict),
        "speculators_config needs proposal_methods: a non-empty list of objects",
    )
    k = pm[0].get("speculative_tokens")
    need(
        _is_int(k) and 1 <= k <= 64,
        f"speculators_config.proposal_methods[0].speculative_tokens (K) must be in [1, 64] (an int), got {k!r}",
    )
    v = sc.get("verifier")
    need(v is None or isinstance(v, dict), "speculators_config.verifier must be an object")
    tl = d["transformer_layer_config"]
    mt = tl.get("model_type", "llama")
    need(mt in LAYER_TYPES, f"transformer_layer_config.model_type must be one of {LAYER_TYPES}, got {mt!r}")
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
    ):
        if tl.get(key) is not None:
            need(
                _is_int(tl[key]) and tl[key] >= 1,
                f"transformer_layer_config.{key} must be an int >= 1, got {tl[key]!r}",
            )
    heads = tl.get("num_attention_heads") or 32  # transformers' default when absent
    kv = tl.get("num_key_value_heads") or heads
    need(
        heads % kv == 0,
        f"transformer_layer_config.num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv})",
    )
    from transformers.activations import ACT2FN

    act = tl.get("hidden_act", "silu")
    need(isinstance(act, str) and act in ACT2FN, f"transformer_layer_config.hidden_act {act!r} is not an activation")
    eps = tl.get("rms_norm_eps", 1e-6)
    need(
        isinstance(eps, (int, float)) and not isinstance(eps, bool) and 0 < eps < 1,
        f"transformer_layer_config.rms_norm_eps must be a number in (0, 1), got {eps!r}",
    )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for rk in ("rope_parameters", "rope_scaling"):
        rp = tl.get(rk)
        if rp is None:
            continue
        need(isinstance(rp, dict), f"transformer_layer_config.{rk} must be an object, got {rp!r}")
        rt = rp.get("rope_type", rp.get("type", "default"))
        need(
            rt == "default" or (isinstance(rt, str) and rt in ROPE_INIT_FUNCTIONS),
            f"transformer_layer_config.{rk}.rope_type {rt!r} is not one transformers knows",
        )
        th = rp.get("rope_theta")
        need(
            th is None or (isinstance(th, (int, float)) and not isinstance(th, bool) and 0 < th < float("inf")),
            f"transformer_layer_config.{rk}.rope_theta must be a finite number > 0, got {th!r}",
        )
    th = tl.get("rope_theta")
    need(
        th is None or (isinstance(th, (int, float)) and not isinstance(th, bool) and 0 < th < float("inf")),
        f"transformer_layer_config.rope_theta must be a finite number > 0, got {th!r}",
    )


_PRETRAINED_FIELDS = (
    {f.name for f in fields(PretrainedConfig)} if hasattr(PretrainedConfig, "__dataclass_fields__") else set()
)


def make_speculators_config(num_depths: int, verifier_name_or_path, verifier_architectures) -> dict:
    return {
        "algorithm": "peagle",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(num_depths)}],
        "default_proposal_method": "greedy",
        "verifier": {
            "name_or_path": None if verifier_name_or_path is None else str(verifier_name_or_path),
            "architectures": list(verifier_architectures or []),
        },
    }


@dataclass
class PEagleOptions:
    """How the drafter is trained; the architecture lives in PEagleConfig."""

    down_sample_ratio: float = 0.7
    down_sample_ratio_min: float = 0.2
    max_anchors: int | None = None
    attention: str = "symmetric"  # "symmetric" | "cross"
    window: int | None = None
    sink: int = 0
    loss_kind: str = "kl"  # "kl" | "ce"
    train_lm_head: bool = False  # speculators keeps the (verifier-initialised) lm_head frozen
    # "all": the whole embedding trains (P-EAGLE's embed_requires_grad); "mask": only the MASK
    # row (a [V, H] gradient + AdamW update per step is the largest CPU cost of a small drafter);
    # "none": frozen
    train_embeddings: str = "all"

    def validate(self, num_depths: int):
        if not 0.0 < float(self.down_sample_ratio) <= 1.0:
            raise ValueError(f"down_sample_ratio must be in (0, 1], got {self.down_sample_ratio}")
        if not 0.0 <= float(self.down_sample_ratio_min) <= 1.0:
            raise ValueError(f"down_sample_ratio_min must be in [0, 1], got {self.down_sample_ratio_min}")
        if self.max_anchors is not None and int(self.max_anchors) < 1:
            raise ValueError(f"max_anchors must be >= 1 or None, got {self.max_anchors}")
        if self.attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {self.attention!r}")
        if self.window is not None and int(self.window) < 1:
            raise ValueError(f"window must be >= 1 or None, got {self.window}")
        if int(self.sink) < 0:
            raise ValueError(f"sink must be >= 0, got {self.sink}")
        if self.loss_kind not in ("kl", "ce"):
            raise ValueError(f"loss_kind must be 'kl' or 'ce', got {self.loss_kind!r}")
        if self.train_embeddings not in ("all", "mask", "none"):
            raise ValueError(f"train_embeddings must be 'all', 'mask' or 'none', got {self.train_embeddings!r}")
        return self
