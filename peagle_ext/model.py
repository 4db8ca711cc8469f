"""The P-EAGLE draft model (DESIGN.md sections 1, 4, 5, 7).

One forward trains every depth of the drafter at once on a COD-sampled token set:

    depth 0 (anchor p):  embed(token p+1) ; fc(verifier aux hidden at p)
    depth d >= 1:        embed(MASK)      ; fc(mask_hidden)            at position anchor + d

Layer 0 reads [embeds ; hidden] (2H) into q/k/v (EAGLE-3's first layer: input_layernorm on the
embeds, hidden_norm on the hidden part, residual = the hidden part), layers 1.. are plain
llama- or qwen3-style decoder layers, RoPE sits at position anchor + depth, and the loss is
KL(verifier || draft) through `peagle_ext.loss.fused_linear_kl` with the verifier's final norm and
lm_head held as frozen, never-saved buffers.

Attention goes through `peagle_ext.attention.cod_attention`:
- "symmetric": one call over every layout token (depth 0 at all N positions first).
- "cross": the depth-0 stream over all N positions is run as its own causal pass and only
  provides context K/V per layer; the layout (depth 0 only at the anchors, then the deeper
  tokens) attends that context plus its own chain.

Sequence partition (`forward_backward(..., segments=S)`): the layout is cut by anchor ranges into
S segments that run forward+backward one after another. The depth-0 stream is computed once; its
per-layer K/V enter every segment as detached leaves whose gradients are accumulated and pushed
back through the stream once at the end, so the summed gradient is exact (a symmetric query's
keys are exactly "stream positions <= its anchor" plus its own chain, i.e. the cross rule).
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from transformers import AutoConfig, LlamaConfig, PretrainedConfig, Qwen3Config
from transformers.activations import ACT2FN

from .cod import CodLayout, cod_sample

LAYER_TYPES = ("llama", "qwen3")
ATTENTION_MODES = ("symmetric", "cross")
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


# ---------------------------------------------------------------------------------------------
# Config (speculators format, DESIGN.md section 5)
# ---------------------------------------------------------------------------------------------
def _layer_config_class(model_type: str):
    if model_type == "llama":
        return LlamaConfig
    if model_type == "qwen3":
        return Qwen3Config
    raise ValueError(f"transformer_layer_config.model_type must be one of {LAYER_TYPES}, got {model_type!r}")


class PEagleConfig(PretrainedConfig):
    """Speculators-format config of a P-EAGLE drafter.

    `to_dict()` is exactly the config.json of DESIGN.md section 5; `from_dict` reads it back.
    transformer_layer_config is a LlamaConfig or Qwen3Config whose num_hidden_layers is the
    number of DRAFT layers and whose vocab_size is the embedding's row count (the verifier's
    vocab, plus one when the MASK token is a new id past it).
    """

    model_type = "peagle"

    def __init__(self, transformer_layer_config=None, draft_vocab_size: int | None = None,
                 target_hidden_size: int | None = None, norm_before_residual: bool = False,
                 norm_before_fc: bool = False, eagle_aux_hidden_state_layer_ids=None,
                 mask_token_id: int | None = None, embed_requires_grad: bool = True,
                 speculators_config: dict | None = None, **kwargs):
        if transformer_layer_config is None:
            transformer_layer_config = LlamaConfig()
        if isinstance(transformer_layer_config, dict):
            d = dict(transformer_layer_config)
            cls = _layer_config_class(d.pop("model_type", "llama"))
            d.pop("transformers_version", None)
            transformer_layer_config = cls(**d)
        if not isinstance(transformer_layer_config, PretrainedConfig):
            raise TypeError("transformer_layer_config must be a transformers config or a dict, "
                            f"got {type(transformer_layer_config).__name__}")
        _layer_config_class(transformer_layer_config.model_type)  # validates llama|qwen3
        self.transformer_layer_config = transformer_layer_config
        self.draft_vocab_size = int(draft_vocab_size if draft_vocab_size is not None
                                    else transformer_layer_config.vocab_size)
        self.target_hidden_size = target_hidden_size
        self.norm_before_residual = bool(norm_before_residual)
        self.norm_before_fc = bool(norm_before_fc)
        self.eagle_aux_hidden_state_layer_ids = (None if eagle_aux_hidden_state_layer_ids is None
                                                 else [int(x) for x in eagle_aux_hidden_state_layer_ids])
        self.mask_token_id = None if mask_token_id is None else int(mask_token_id)
        self.embed_requires_grad = bool(embed_requires_grad)
        self.speculators_config = copy.deepcopy(speculators_config) if speculators_config else \
            make_speculators_config(8, None, None)
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
        return cls(**d)

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
            d = json.loads(f.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{f} is not valid JSON ({e}): a corrupt or partial checkpoint?") from None
        if not isinstance(d, dict):
            raise ValueError(f"{f} must hold a JSON object (a speculators config), got {type(d).__name__}")
        return cls.from_dict(d, **kwargs)


_PRETRAINED_FIELDS = {f.name for f in fields(PretrainedConfig)} if hasattr(PretrainedConfig, "__dataclass_fields__") else set()


def make_speculators_config(num_depths: int, verifier_name_or_path, verifier_architectures) -> dict:
    return {
        "algorithm": "peagle",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(num_depths)}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": None if verifier_name_or_path is None else str(verifier_name_or_path),
                     "architectures": list(verifier_architectures or [])},
    }


# ---------------------------------------------------------------------------------------------
# Training options (not part of the checkpoint format)
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # fp32 statistics like the HF llama/qwen3 norms, output in the input's dtype
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _rope_inv_freq(tl: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    params = getattr(tl, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", getattr(tl, "rope_theta", 10000.0)))
    if rope_type == "default":
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        return inv.float(), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    cfg = copy.deepcopy(tl)
    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    return inv.float(), float(scale)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, heads, D]; cos/sin [T, 1, D]; HF's rotate_half convention
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class DraftAttention(nn.Module):
    def __init__(self, tl: PretrainedConfig, in_dim: int):
        super().__init__()
        h = tl.hidden_size
        self.num_heads = tl.num_attention_heads
        self.num_kv_heads = getattr(tl, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(tl, "head_dim", None) or h // self.num_heads
        bias = bool(getattr(tl, "attention_bias", False))
        self.q_proj = nn.Linear(in_dim, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        if tl.model_type == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, tl.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, tl.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def q(self, x):
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))
        return self.q_norm(q) if self.q_norm is not None else q

    def kv(self, x):
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.k_norm is not None:
            k = self.k_norm(k)
        return k, v


class DraftMLP(nn.Module):
    def __init__(self, tl: PretrainedConfig):
        super().__init__()
        bias = bool(getattr(tl, "mlp_bias", False))
        self.gate_proj = nn.Linear(tl.hidden_size, tl.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(tl.hidden_size, tl.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(tl.intermediate_size, tl.hidden_size, bias=bias)
        self.act = ACT2FN[tl.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """A llama/qwen3 decoder layer; layer 0 is EAGLE-3's first layer on [embeds ; hidden]."""

    def __init__(self, tl: PretrainedConfig, layer_idx: int, norm_before_residual: bool):
        super().__init__()
        self.first = layer_idx == 0
        h = tl.hidden_size
        self.input_layernorm = RMSNorm(h, tl.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, tl.rms_norm_eps)
        self.self_attn = DraftAttention(tl, 2 * h if self.first else h)
        self.mlp = DraftMLP(tl)
        self.norm_before_residual = norm_before_residual
        if self.first:
            self.hidden_norm = RMSNorm(h, tl.rms_norm_eps)

    def pre_attention(self, x, hid=None):
        """(attention input, residual). Layer 0 takes x = embeds and hid = fc(hidden)."""
        if not self.first:
            return self.input_layernorm(x), x
        hn = self.hidden_norm(hid)
        residual = hn if self.norm_before_residual else hid
        return torch.cat([self.input_layernorm(x), hn], dim=-1), residual

    def post_attention(self, attn_out, residual):
        h = residual + self.self_attn.o_proj(attn_out.flatten(-2))
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, layer_pass, *args, **kwargs):
        """One pass of this layer, `layer_pass(self, *args, **kwargs)` (built by the model, which
        owns the attention layout and RoPE tables). Going through the module call lets module hooks
        see the whole layer: FSDP2's per-layer all-gather/reshard (peagle_ext.distributed), and
        activation checkpointing wrappers."""
        return layer_pass(self, *args, **kwargs)


@dataclass
class _Tokens:
    """Which tokens one pass computes: layout (the attention op's view), the unique layer-0 input
    row of each token (depth 0: its position; deeper: the MASK row N), and RoPE tables."""

    layout: CodLayout
    rows: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    meta: object = None  # attention metadata, built on first use


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------
class PEagleDraftModel(nn.Module):
    config_class = PEagleConfig

    def __init__(self, config: PEagleConfig, options: PEagleOptions | None = None):
        super().__init__()
        self.config = config
        try:
            k = config.num_depths
        except (KeyError, IndexError, TypeError, ValueError):
            raise ValueError("config: speculators_config needs proposal_methods[0].speculative_tokens (K)") from None
        if not 1 <= k <= 64:
            raise ValueError(f"config: speculators_config proposal_methods[0].speculative_tokens (K) must be in "
                             f"[1, 64], got {k}")
        self.options = (options or PEagleOptions()).validate(config.num_depths)
        tl = config.transformer_layer_config
        h = tl.hidden_size
        if config.target_hidden_size is not None and int(config.target_hidden_size) != h:
            raise ValueError(
                f"verifier/draft hidden size mismatch: target_hidden_size {config.target_hidden_size} != "
                f"draft hidden_size {h} (this drafter reuses the verifier's lm_head and needs them equal)")
        if config.mask_token_id is None:
            raise ValueError("mask_token_id must be set (see resolve_mask_token_id)")
        if not 0 <= config.mask_token_id < tl.vocab_size:
            raise ValueError(f"mask_token_id {config.mask_token_id} is outside the embedding "
                             f"(transformer_layer_config.vocab_size = {tl.vocab_size})")
        if not 1 <= config.draft_vocab_size <= tl.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {tl.vocab_size}], got {config.draft_vocab_size}")
        n_aux = config.num_aux
        self.embed_tokens = nn.Embedding(tl.vocab_size, h)
        self.input_norm = RMSNorm(n_aux * h, tl.rms_norm_eps) if config.norm_before_fc else None
        self.fc = nn.Linear(n_aux * h, h, bias=False)
        self.layers = nn.ModuleList(DraftLayer(tl, i, config.norm_before_residual)
                                    for i in range(tl.num_hidden_layers))
        self.norm = RMSNorm(h, tl.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, n_aux * h))
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(tl.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        inv_freq, self.rope_scale = _rope_inv_freq(tl, self.layers[0].self_attn.head_dim)
        self.register_buffer("rope_inv_freq", inv_freq, persistent=False)
        # the verifier's final norm and lm_head rows of the draft vocab: frozen, never saved
        self.register_buffer("verifier_norm_weight", torch.ones(h), persistent=False)
        self.register_buffer("verifier_lm_head_weight", torch.zeros(config.draft_vocab_size, h), persistent=False)
        self.verifier_norm_eps = float(tl.rms_norm_eps)
        self.has_verifier = False
        self._init_weights(float(getattr(tl, "initializer_range", 0.02)))
        mode = self.options.train_embeddings if config.embed_requires_grad else "none"
        self.embed_tokens.weight.requires_grad_(mode == "all")
        # "mask" mode: the MASK row lives in its own parameter and is written back into
        # embed_tokens.weight in every checkpoint (checkpoint_state_dict)
        self.mask_embed = nn.Parameter(self.embed_tokens.weight.detach()[config.mask_token_id].clone()) \
            if mode == "mask" else None
        self.lm_head.weight.requires_grad_(self.options.train_lm_head)

    def _init_weights(self, std: float):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=std)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_verifier(cls, verifier_config, *, num_layers: int = 1, num_depths: int = 8,
                      mask_token_id: int, draft_vocab_size: int | None = None,
                      aux_layer_ids=None, layer_type: str | None = None, d2t: torch.Tensor | None = None,
                      verifier_name_or_path=None, options: PEagleOptions | None = None,
                      norm_before_residual: bool = False, norm_before_fc: bool = False) -> "PEagleDraftModel":
        """A fresh drafter shaped after `verifier_config` (a transformers config or its dict).

        mask_token_id: an id below the verifier's vocab_size (e.g. the tokenizer's mask token),
        or exactly vocab_size, which grows the embedding by one row. draft_vocab_size: None = the
        verifier's vocab; smaller needs `d2t` (see build_vocab_mapping) or takes ids 0..Vd-1.
        layer_type: "llama"|"qwen3", default the verifier's model_type when it is one of them.
        """
        if isinstance(verifier_config, dict):
            verifier_config = AutoConfig.for_model(**verifier_config)
        vc = getattr(verifier_config, "text_config", None) or verifier_config
        for name in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size", "num_hidden_layers"):
            if getattr(vc, name, None) is None:
                raise ValueError(f"verifier config has no {name}: is it a causal-LM config?")
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}")
        if isinstance(num_depths, bool) or not isinstance(num_depths, int) or not 1 <= num_depths <= 64:
            raise ValueError(f"num_depths must be an int in [1, 64], got {num_depths!r}")
        v = int(vc.vocab_size)
        if isinstance(mask_token_id, bool) or not isinstance(mask_token_id, int):
            raise TypeError(f"mask_token_id must be an int, got {type(mask_token_id).__name__}")
        if not 0 <= mask_token_id <= v:
            raise ValueError(f"mask_token_id must be in [0, {v}] (an id of the vocab, or {v} = a new id "
                             f"past it, growing the embedding by one), got {mask_token_id}")
        emb_rows = v + 1 if mask_token_id == v else v
        if layer_type is None:
            layer_type = vc.model_type if vc.model_type in LAYER_TYPES else "llama"
        cls_tl = _layer_config_class(layer_type)
        head_dim = getattr(vc, "head_dim", None) or vc.hidden_size // vc.num_attention_heads
        rope = getattr(vc, "rope_parameters", None)
        if not rope:
            rope = {"rope_type": "default", "rope_theta": float(getattr(vc, "rope_theta", 10000.0))}
        tl = cls_tl(
            vocab_size=emb_rows, hidden_size=vc.hidden_size, intermediate_size=vc.intermediate_size,
            num_hidden_layers=num_layers, num_attention_heads=vc.num_attention_heads,
            num_key_value_heads=getattr(vc, "num_key_value_heads", None) or vc.num_attention_heads,
            head_dim=head_dim, hidden_act=getattr(vc, "hidden_act", "silu"),
            max_position_embeddings=getattr(vc, "max_position_embeddings", 2048),
            rms_norm_eps=getattr(vc, "rms_norm_eps", 1e-6), rope_parameters=dict(rope),
            attention_bias=bool(getattr(vc, "attention_bias", False)), tie_word_embeddings=False,
            bos_token_id=getattr(vc, "bos_token_id", None), eos_token_id=getattr(vc, "eos_token_id", None),
            pad_token_id=getattr(vc, "pad_token_id", None))
        if layer_type == "llama":
            tl.mlp_bias = bool(getattr(vc, "mlp_bias", False))
        if draft_vocab_size is None:
            draft_vocab_size = v
        if not 1 <= int(draft_vocab_size) <= v:
            raise ValueError(f"draft_vocab_size must be in [1, {v}], got {draft_vocab_size}")
        if aux_layer_ids is None:
            n = int(vc.num_hidden_layers)
            aux_layer_ids = [2, n // 2, n - 3] if n >= 6 else [min(2, n - 1), n // 2, max(n - 3, 0)]
        cfg = PEagleConfig(
            transformer_layer_config=tl, draft_vocab_size=int(draft_vocab_size),
            target_hidden_size=int(vc.hidden_size), norm_before_residual=norm_before_residual,
            norm_before_fc=norm_before_fc, eagle_aux_hidden_state_layer_ids=list(aux_layer_ids),
            mask_token_id=mask_token_id, embed_requires_grad=True,
            speculators_config=make_speculators_config(
                num_depths, verifier_name_or_path or getattr(verifier_config, "_name_or_path", None) or None,
                getattr(verifier_config, "architectures", None)))
        model = cls(cfg, options)
        if d2t is not None:
            model.set_vocab_mapping(d2t)
        elif int(draft_vocab_size) != v:
            model.set_vocab_mapping(torch.zeros(int(draft_vocab_size), dtype=torch.long))
        return model

    def set_vocab_mapping(self, d2t: torch.Tensor):
        """d2t[i] = target id of draft id i minus i (speculators / vLLM); t2d follows from it."""
        d2t = torch.as_tensor(d2t, dtype=torch.long).cpu()
        vd = self.config.draft_vocab_size
        if d2t.shape != (vd,):
            raise ValueError(f"d2t must have shape ({vd},), got {tuple(d2t.shape)}")
        ids = torch.arange(vd) + d2t
        rows = self.config.transformer_layer_config.vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= rows:
            raise ValueError(f"d2t maps a draft id outside the vocab [0, {rows})")
        if vd > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError("d2t must map draft ids to strictly increasing target ids")
        t2d = torch.zeros(self.config.transformer_layer_config.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @property
    def draft_token_ids(self) -> torch.Tensor:
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    @property
    def num_depths(self) -> int:
        return self.config.num_depths

    def attach_verifier(self, *, norm_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                        norm_eps: float | None = None, embed_weight: torch.Tensor | None = None,
                        init_from_verifier: bool = True):
        """Hold the verifier's final norm and lm_head (rows of the draft vocab) as frozen buffers
        for the loss; with init_from_verifier also start the draft embeddings and lm_head from
        the verifier's (as speculators does). The MASK row, when grown, starts at the mean embedding."""
        h = self.config.hidden_size
        if norm_weight.shape != (h,):
            raise ValueError(f"verifier/draft hidden size mismatch: verifier norm has shape "
                             f"{tuple(norm_weight.shape)}, draft hidden_size is {h}")
        if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != h:
            raise ValueError(f"verifier/draft hidden size mismatch: verifier lm_head has shape "
                             f"{tuple(lm_head_weight.shape)}, draft hidden_size is {h}")
        ids = self.draft_token_ids.to(lm_head_weight.device)
        if int(ids.max()) >= lm_head_weight.shape[0]:
            raise ValueError(f"draft vocab maps to target id {int(ids.max())} but the verifier lm_head "
                             f"has only {lm_head_weight.shape[0]} rows")
        with torch.no_grad():
            self.verifier_norm_weight.copy_(norm_weight.detach().float())
            self.verifier_lm_head_weight.copy_(lm_head_weight.detach()[ids].float())
            if norm_eps is not None:
                self.verifier_norm_eps = float(norm_eps)
            if init_from_verifier:
                # the draft head starts as the verifier's head on the verifier's normed scale
                self.lm_head.weight.copy_(lm_head_weight.detach()[ids].float())
                self.norm.weight.copy_(norm_weight.detach().float())
                if embed_weight is not None:
                    v = embed_weight.shape[0]
                    rows = self.embed_tokens.weight.shape[0]
                    if embed_weight.shape[1] != h or v > rows or v < rows - 1:
                        raise ValueError(f"verifier embedding shape {tuple(embed_weight.shape)} does not fit "
                                         f"the draft embedding {tuple(self.embed_tokens.weight.shape)}")
                    self.embed_tokens.weight[:v].copy_(embed_weight.detach().float())
                    if v < rows:
                        self.embed_tokens.weight[v:].copy_(embed_weight.detach().float().mean(0, keepdim=True))
                    if self.mask_embed is not None:
                        self.mask_embed.copy_(self.embed_tokens.weight[self.config.mask_token_id])
        self.has_verifier = True
        return self

    # -- checkpoint (DESIGN.md section 5) -----------------------------------------------------
    def checkpoint_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        out = {}
        for k, t in self.state_dict().items():
            if k.startswith("verifier_") or k == "mask_embed":
                continue
            t = t.detach().cpu()
            if k == "embed_tokens.weight" and self.mask_embed is not None:
                t = t.clone()
                t[self.config.mask_token_id] = self.mask_embed.detach().cpu()
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            out[k] = t.contiguous()
        return out

    def save_pretrained(self, directory, *, dtype: torch.dtype | None = None):
        from safetensors.torch import save_file
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        save_file(self.checkpoint_state_dict(dtype), str(d / WEIGHTS_NAME), metadata={"format": "pt"})
        os.chmod(d / WEIGHTS_NAME, 0o644)  # a server running as another user must be able to read it
        self.config.save_pretrained(d)

    @classmethod
    def from_pretrained(cls, directory, *, options: PEagleOptions | None = None,
                        map_location="cpu") -> "PEagleDraftModel":
        from safetensors.torch import load_file
        d = Path(directory)
        if not (d / CONFIG_NAME).is_file():
            raise FileNotFoundError(f"{d} is not a P-EAGLE checkpoint: no {CONFIG_NAME}")
        if not (d / WEIGHTS_NAME).is_file():
            raise FileNotFoundError(f"{d} is not a P-EAGLE checkpoint: no {WEIGHTS_NAME}")
        config = PEagleConfig.from_pretrained(d)
        model = cls(config, options)
        try:
            sd = load_file(str(d / WEIGHTS_NAME), device=str(map_location))
        except OSError:
            raise
        except Exception as e:  # safetensors' SafetensorError is no ValueError: name the file
            raise ValueError(f"{d / WEIGHTS_NAME} is not a readable safetensors file ({e}): a corrupt or "
                             "partially written checkpoint?") from None
        model.load_checkpoint_state_dict(sd)
        return model

    def load_checkpoint_state_dict(self, sd: dict[str, torch.Tensor]):
        want = self.checkpoint_state_dict().keys()
        missing = sorted(set(want) - set(sd))
        extra = sorted(set(sd) - set(want))
        if missing or extra:
            raise ValueError(f"checkpoint keys do not match the config: missing {missing}, unexpected {extra}")
        own = self.state_dict()
        for k, t in sd.items():
            if tuple(t.shape) != tuple(own[k].shape):
                raise ValueError(f"checkpoint tensor {k} has shape {tuple(t.shape)}, the config needs {tuple(own[k].shape)}")
            if own[k].is_floating_point() != t.is_floating_point() or (own[k].dtype == torch.bool) != (t.dtype == torch.bool):
                raise ValueError(f"checkpoint tensor {k} has dtype {str(t.dtype).replace('torch.', '')}, "
                                 f"expected {'a floating dtype' if own[k].is_floating_point() else own[k].dtype}")
        self._check_vocab_mapping(sd["d2t"], sd["t2d"])
        with torch.no_grad():
            for k, t in sd.items():
                own[k].copy_(t.to(own[k].dtype))
            if self.mask_embed is not None:
                self.mask_embed.copy_(self.embed_tokens.weight[self.config.mask_token_id])

    def _check_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor):
        """A loaded d2t/t2d pair must be what set_vocab_mapping makes: draft id i -> target id
        i + d2t[i] inside the vocab, strictly increasing, and t2d marking exactly those ids
        (out-of-range ids would index out of bounds in vLLM's draft -> target mapping)."""
        vd = self.config.draft_vocab_size
        rows = self.config.transformer_layer_config.vocab_size
        ids = torch.arange(vd) + d2t.cpu().long()
        if vd and (int(ids.min()) < 0 or int(ids.max()) >= rows):
            raise ValueError(f"checkpoint d2t maps a draft id outside the vocab [0, {rows}): corrupt checkpoint?")
        if vd > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError("checkpoint d2t must map draft ids to strictly increasing target ids")
        want = torch.zeros(rows, dtype=torch.bool)
        want[ids] = True
        if not torch.equal(t2d.cpu().bool(), want):
            raise ValueError("checkpoint t2d does not mark exactly the target ids of d2t")

    # -- data checks ----------------------------------------------------------------------------
    def check_mask_token_unused(self, input_ids: torch.Tensor, where: str = "the training data"):
        """Refuse data that uses the MASK id as a real token (it would be indistinguishable)."""
        if bool((input_ids == self.config.mask_token_id).any()):
            raise ValueError(f"mask_token_id {self.config.mask_token_id} occurs as a real token in {where}; "
                             "pick a mask token the data never uses (--mask-token-id)")

    # -- forward pieces ---------------------------------------------------------------------------
    def sample_layout(self, example, *, seed: int | None = None) -> CodLayout:
        o = self.options
        return cod_sample(example.document_ids, example.loss_mask, num_depths=self.num_depths,
                          down_sample_ratio=o.down_sample_ratio, down_sample_ratio_min=o.down_sample_ratio_min,
                          max_anchors=o.max_anchors, depth0="all" if o.attention == "symmetric" else "anchors",
                          seed=seed)

    def _layer0_rows(self, example):
        """Unique layer-0 inputs: rows 0..N-1 are the real tokens/hidden, row N the MASK."""
        n = example.input_ids.shape[0]
        dev = self.fc.weight.device
        if self.mask_embed is not None:
            emb = torch.cat([self.embed_tokens(example.input_ids.to(dev, torch.long)), self.mask_embed[None]], 0)
        else:
            ids = torch.cat([example.input_ids.to(dev, torch.long),
                             torch.tensor([self.config.mask_token_id], device=dev, dtype=torch.long)])
            emb = self.embed_tokens(ids)
        mask = self.mask_hidden.reshape(1, -1)
        hidden = example.hidden.to(dev)
        if hidden.dim() != 2 or hidden.shape[0] != n:
            raise ValueError(f"example.hidden must have shape [N={n}, n_aux*H], got {tuple(hidden.shape)}")
        if hidden.shape[1] != mask.shape[1]:
            raise ValueError(f"verifier/draft hidden size mismatch: example.hidden has {hidden.shape[1]} features, "
                             f"the drafter's fc expects {mask.shape[1]} ({self.config.num_aux} aux layers x "
                             f"hidden {self.config.hidden_size})")
        amp_dt = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else None
        if self.input_norm is None and amp_dt is not None and hidden.dtype == amp_dt:
            # autocast casts fc's input to amp_dt anyway: concatenating in amp_dt gives the same
            # values without an fp32 copy of the [N, n_aux * H] states (~13 GB at N=128K, 3x4096)
            hid = torch.cat([hidden, mask.to(amp_dt)], 0)
        else:
            hid = torch.cat([hidden.to(mask.dtype), mask], 0)
        if self.input_norm is not None:
            hid = self.input_norm(hid)
        hid = self.fc(hid)
        assert emb.shape[0] == n + 1
        return emb, hid

    def _tokens(self, layout: CodLayout, rows: torch.Tensor) -> _Tokens:
        pos = (layout.anchor.long() + layout.depth.long())
        freqs = pos.to(self.rope_inv_freq.dtype)[:, None] * self.rope_inv_freq[None, :]
        emb = torch.cat([freqs, freqs], -1)
        cos = (emb.cos() * self.rope_scale)[:, None, :]
        sin = (emb.sin() * self.rope_scale)[:, None, :]
        return _Tokens(layout, rows, cos, sin)

    def _attend(self, q, k, v, tok: _Tokens, context=None):
        from .attention import cod_attention, cod_attention_metadata
        o = self.options
        dt, in_dt = self._compute_dtype(q), q.dtype
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
        if context is not None:
            context = (context[0].to(dt), context[1].to(dt))
        if tok.meta is None:  # the key ranges / chain tables serve every layer of the pass
            tok.meta = cod_attention_metadata(tok.layout, cross=context is not None, window=o.window, sink=o.sink)
        out = cod_attention(q, k, v, tok.layout,
                            context_k=None if context is None else context[0],
                            context_v=None if context is None else context[1],
                            window=o.window, sink=o.sink, metadata=tok.meta)
        # fp32 parameters on CUDA without autocast: the kernel ran in bf16, o_proj is fp32
        return out.to(in_dt)

    def _compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        """One dtype for the attention and loss ops: the autocast dtype when autocast is on;
        else the activations' (fp32 on CPU; the CUDA attention kernels take bf16/fp16 only)."""
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            return torch.get_autocast_dtype(dev)
        if dev == "cuda" and x.dtype == torch.float32:
            return torch.bfloat16
        return x.dtype

    def _qkv(self, layer: DraftLayer, x, tok: _Tokens, *, l0, want_q=True):
        """q/k/v of the pass's tokens at `layer` (after RoPE), and the residual."""
        if layer.first:
            emb, hid = l0
            a_in, res_u = layer.pre_attention(emb, hid)
            q = layer.self_attn.q(a_in)[tok.rows] if want_q else None
            k, v = layer.self_attn.kv(a_in)
            k, v = k[tok.rows], v[tok.rows]
            res = res_u[tok.rows]
        else:
            a_in, res = layer.pre_attention(x)
            q = layer.self_attn.q(a_in) if want_q else None
            k, v = layer.self_attn.kv(a_in)
        cos, sin = tok.cos.to(k.dtype), tok.sin.to(k.dtype)
        k = _rotate(k, cos, sin)
        if q is not None:
            q = _rotate(q, cos.to(q.dtype), sin.to(q.dtype))
        return q, k, v, res

    def _run(self, tok: _Tokens, l0, contexts=None, *, collect_kv=False, last_full=True):
        """Run the layers over one pass's tokens. contexts[l] = (k, v) of the stream at layer l
        (cross mode). collect_kv returns this pass's per-layer (k, v); last_full=False stops at the
        last layer's k/v (the stream in cross mode needs nothing more)."""
        x = None
        kvs = []
        n_layers = len(self.layers)
        for li, layer in enumerate(self.layers):
            kv_only = li == n_layers - 1 and not last_full
            x, kv = layer(self._layer_pass, x, l0, None if contexts is None else contexts[li], tok, kv_only=kv_only)
            if collect_kv:
                kvs.append(kv)
            if kv_only:
                return None, kvs
        return x, kvs

    def _layer_pass(self, layer: DraftLayer, x, l0, ctx, tok: _Tokens, *, kv_only: bool):
        """(layer output or None when kv_only, (k, v) of this pass) for one layer."""
        q, k, v, res = self._qkv(layer, x, tok, l0=l0, want_q=not kv_only)
        if kv_only:
            return None, (k, v)
        return layer.post_attention(self._attend(q, k, v, tok, ctx), res), (k, v)

    def _loss_terms(self, h, layout: CodLayout, example, target_normed):
        """(weighted loss SUM, weight sum, correct[K], total[K]) over the tokens of `layout`."""
        from .loss import fused_linear_kl
        pos = (layout.anchor.long() + layout.depth.long())
        weight = example.loss_mask.to(pos.device)[pos].float()
        hn = self.norm(h)
        dt = self._compute_dtype(hn)
        hn = hn.to(dt)
        tgt = target_normed[pos].to(dt)
        head = self.lm_head.weight.to(dt)
        vhead = self.verifier_lm_head_weight.to(dt)
        loss, m = fused_linear_kl(hn, head, tgt, vhead, weight, layout.depth, num_depths=self.num_depths,
                                  kind=self.options.loss_kind, validate=hn.device.type == "cpu")
        wsum = weight.sum()
        return loss * wsum, wsum, m["correct"], m["total"]

    def _target_normed(self, example):
        if not self.has_verifier:
            raise RuntimeError("the drafter has no verifier head attached: call attach_verifier(...) first")
        last = example.last_hidden.to(self.verifier_norm_weight.device)
        if last.shape[-1] != self.config.hidden_size:
            raise ValueError(f"verifier/draft hidden size mismatch: example.last_hidden has {last.shape[-1]} "
                             f"features, the drafter's hidden_size is {self.config.hidden_size}")
        with torch.no_grad():
            return rms_norm(last.float(), self.verifier_norm_weight, self.verifier_norm_eps)

    def _check_layout(self, layout: CodLayout, n: int):
        if layout.num_depths != self.num_depths:
            raise ValueError(f"layout has {layout.num_depths} depths, the drafter {self.num_depths}")
        want_all = self.options.attention == "symmetric"
        if layout.depth0_all != want_all:
            raise ValueError(f"{self.options.attention} attention needs a layout sampled with "
                             f"depth0={'all' if want_all else 'anchors'}")
        if layout.seq_len != n:
            raise ValueError(f"layout is for N={layout.seq_len}, the example has N={n}")

    def _stream_tokens(self, example, dev) -> _Tokens:
        n = example.input_ids.shape[0]
        doc = example.document_ids.to(dev, torch.int32)
        zero = torch.zeros(n, dtype=torch.int32, device=dev)
        lay = CodLayout(torch.arange(n, dtype=torch.int32, device=dev), zero, [0, n], doc, True)
        return self._tokens(lay, torch.arange(n, device=dev))

    def _layout_rows(self, layout: CodLayout) -> torch.Tensor:
        n = layout.seq_len
        return torch.where(layout.depth == 0, layout.anchor.long(), torch.full_like(layout.anchor, n).long())

    # -- public forward -------------------------------------------------------------------------
    def forward(self, example, layout: CodLayout | None = None, *, seed: int | None = None):
        """(loss, metrics) for one packed sequence: loss = KL summed over the loss-masked layout
        tokens / their count (0 when there are none); metrics holds per-depth argmax-agreement
        counts "correct"/"total" (int64[K]), "loss_sum", "weight" and "num_tokens"."""
        loss_sum, m = self._forward_sum(example, layout, seed)
        w = m["weight"]
        loss = loss_sum / w if w > 0 else loss_sum * 0.0
        return loss, {**m, "loss": float(loss.detach())}

    def _forward_sum(self, example, layout, seed):
        n = example.input_ids.shape[0]
        layout = self.sample_layout(example, seed=seed) if layout is None else layout
        self._check_layout(layout, n)
        dev = self.fc.weight.device
        layout = layout.to(dev)
        tgt = self._target_normed(example)
        l0 = self._layer0_rows(example)
        tok = self._tokens(layout, self._layout_rows(layout))
        if self.options.attention == "symmetric":
            h, _ = self._run(tok, l0)
        else:
            _, kvs = self._run(self._stream_tokens(example, dev), l0, collect_kv=True, last_full=False)
            h, _ = self._run(tok, l0, contexts=kvs)
        loss_sum, wsum, correct, total = self._loss_terms(h, layout, example, tgt)
        return loss_sum, {"weight": float(wsum), "correct": correct.cpu(), "total": total.cpu(),
                          "loss_sum": float(loss_sum.detach()), "num_tokens": layout.num_tokens}

    def forward_backward(self, example, layout: CodLayout | None = None, *, seed: int | None = None,
                         segments: int = 1, loss_scale: float | None = None,
                         autocast_dtype: torch.dtype | None = None) -> dict:
        """Forward + backward of `loss_sum * loss_scale` (default 1 / weight, i.e. the mean),
        accumulating into .grad. segments > 1 = sequence partition: the layout runs in that many
        anchor-range segments with exact gradients (module docstring). autocast_dtype: forward
        passes run under torch.autocast with it (backward outside). Returns the metrics."""
        self._amp_dtype = autocast_dtype
        if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
            raise ValueError(f"segments must be an int >= 1, got {segments!r}")
        n = example.input_ids.shape[0]
        layout = self.sample_layout(example, seed=seed) if layout is None else layout
        self._check_layout(layout, n)
        if segments == 1:
            with self._amp():
                loss_sum, m = self._forward_sum(example, layout, None)
            scale = loss_scale if loss_scale is not None else (1.0 / m["weight"] if m["weight"] > 0 else 0.0)
            (loss_sum * scale).backward()
            return m
        return self._partitioned(example, layout, segments, loss_scale)

    def _amp(self):
        dt = getattr(self, "_amp_dtype", None)
        if dt is None:
            return contextlib.nullcontext()
        return torch.autocast(self.fc.weight.device.type, dtype=dt)

    def _partitioned(self, example, layout: CodLayout, segments: int, loss_scale):
        o = self.options
        if o.attention == "symmetric" and o.window is not None and o.window < self.num_depths:
            raise ValueError(f"sequence partition in symmetric mode needs window >= num_depths "
                             f"({self.num_depths}) so a chain's own depth-0 token stays in its window")
        dev = self.fc.weight.device
        layout = layout.to(dev)
        tgt = self._target_normed(example)
        weight_all = example.loss_mask.to(dev)[(layout.anchor.long() + layout.depth.long())].float()
        scale = loss_scale if loss_scale is not None else (1.0 / float(weight_all.sum()) if float(weight_all.sum()) > 0 else 0.0)
        stream = self._stream_tokens(example, dev)
        symmetric = o.attention == "symmetric"
        with self._amp():
            l0 = self._layer0_rows(example)
            h_stream, kvs = self._run(stream, l0, collect_kv=True, last_full=symmetric)
        leaves = [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in kvs]
        total_sum = 0.0
        wsum_all = 0.0
        correct = torch.zeros(self.num_depths, dtype=torch.int64)
        total = torch.zeros(self.num_depths, dtype=torch.int64)
        roots, grads = [], []
        if symmetric:
            # depth 0 = the stream itself; its loss joins the final backward through the stream
            with self._amp():
                s_sum, s_w, c, t = self._loss_terms(h_stream, stream.layout, example, tgt)
            roots.append(s_sum * scale)
            grads.append(None)
            total_sum += float(s_sum.detach())
            wsum_all += float(s_w)
            correct += c.cpu()
            total += t.cpu()
            keep = layout.depth > 0
        else:
            keep = torch.ones_like(layout.depth, dtype=torch.bool)
        for sub in _segment_layouts(layout, keep, segments):
            tok = self._tokens(sub, self._layout_rows(sub))
            with self._amp():
                h, _ = self._run(tok, self._layer0_rows(example), contexts=leaves)
                s_sum, s_w, c, t = self._loss_terms(h, sub, example, tgt)
            (s_sum * scale).backward()
            total_sum += float(s_sum.detach())
            wsum_all += float(s_w)
            correct += c.cpu()
            total += t.cpu()
        for (k, v), (lk, lv) in zip(kvs, leaves):
            for t_, leaf in ((k, lk), (v, lv)):
                if leaf.grad is not None:
                    roots.append(t_)
                    grads.append(leaf.grad)
        if roots:
            torch.autograd.backward(roots, [g if g is not None else torch.ones_like(r) for r, g in zip(roots, grads)])
        return {"weight": wsum_all, "correct": correct, "total": total, "loss_sum": total_sum,
                "num_tokens": layout.num_tokens}


def _segment_layouts(layout: CodLayout, keep: torch.Tensor, segments: int):
    """Split the kept layout tokens into <= `segments` sub-layouts of contiguous anchor ranges with
    about equal token counts; a chain (one anchor) never straddles two segments. Each keeps the
    depth-major, anchor-sorted order and is marked depth0_all=False (cross-mode layout)."""
    a = layout.anchor[keep]
    d = layout.depth[keep]
    if a.numel() == 0:
        return []
    a_sorted = a.sort().values
    cuts = sorted({int(a_sorted[(s * a.numel()) // segments]) for s in range(1, segments)})
    bounds = [int(a_sorted[0])] + cuts + [int(a_sorted[-1]) + 1]
    subs = []
    k = layout.num_depths
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        sel = (a >= lo) & (a < hi)
        if not bool(sel.any()):
            continue
        sa, sd = a[sel], d[sel]
        counts = torch.bincount(sd.long(), minlength=k)[:k].tolist()
        offs = [0]
        for c in counts:
            offs.append(offs[-1] + int(c))
        subs.append(CodLayout(sa.contiguous(), sd.contiguous(), offs, layout.document_ids, False))
    return subs


# ---------------------------------------------------------------------------------------------
# Vocab mapping and mask token
# ---------------------------------------------------------------------------------------------
def build_vocab_mapping(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) from token frequencies (speculators' rule): the draft vocab is the
    `draft_vocab_size` most frequent ids (ties to the lower id), topped up with the lowest unseen
    ids, sorted; d2t[i] = target_id(i) - i; t2d[target] = True for the kept ids."""
    counts = torch.as_tensor(token_counts).long().cpu()
    v = counts.shape[0]
    if not 1 <= draft_vocab_size <= v:
        raise ValueError(f"draft_vocab_size must be in [1, {v}], got {draft_vocab_size}")
    seen = (counts > 0).nonzero().flatten()
    order = sorted(seen.tolist(), key=lambda t: (-int(counts[t]), t))[:draft_vocab_size]
    chosen = set(order)
    t = 0
    while len(order) < draft_vocab_size:
        if t not in chosen:
            order.append(t)
            chosen.add(t)
        t += 1
    ids = torch.tensor(sorted(order), dtype=torch.long)
    d2t = ids - torch.arange(draft_vocab_size)
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def resolve_mask_token_id(tokenizer, vocab_size: int, requested: int | None = None) -> tuple[int, str]:
    """(mask_token_id, how). An explicit id must be in [0, vocab_size]; else the tokenizer's own
    mask token; else an id no tokenizer string maps to: len(tokenizer) when the embedding has an
    unused row there, else vocab_size (the drafter's embedding grows by one)."""
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or not 0 <= requested <= vocab_size:
            raise ValueError(f"mask_token_id must be an int in [0, {vocab_size}], got {requested!r}")
        return requested, "given"
    mid = getattr(tokenizer, "mask_token_id", None)
    if mid is not None and 0 <= int(mid) < vocab_size:
        return int(mid), "the tokenizer's mask token"
    n = len(tokenizer)
    if n < vocab_size:
        return n, f"an unused embedding row ({n}; the tokenizer has {n} tokens)"
    return vocab_size, f"a new id past the vocab ({vocab_size}; the drafter's embedding grows by one)"


def acceptance_length(acc: list[float]) -> float:
    """Estimated accepted draft tokens per step: sum_k prod_{j<=k} acc_j (add 1 for the bonus token)."""
    total, run = 0.0, 1.0
    for a in acc:
        run *= float(a)
        total += run
    return total
