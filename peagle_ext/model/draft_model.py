"""PEagleDraftModel: the P-EAGLE drafter's modules, its construction from a verifier config, and
its checkpoint in the speculators format (docs/design.md section 5). The training forward
is in forward.py, the sequence partition in partition.py."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn as nn
from transformers import AutoConfig

from ..ops.cod import CodLayout, cod_sample
from .config import LAYER_TYPES, PEagleConfig, PEagleOptions, layer_config_class, make_speculators_config
from .forward import TrainingForward
from .layers import DraftLayer, RMSNorm, rope_inv_freq

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


class PEagleDraftModel(TrainingForward, nn.Module):
    config_class = PEagleConfig

    def __init__(self, config: PEagleConfig, options: PEagleOptions | None = None):
        super().__init__()
        self.config = config
        try:
            k = config.num_depths
        except (KeyError, IndexError, TypeError, ValueError):
            raise ValueError("config: speculators_config needs proposal_methods[0].speculative_tokens (K)") from None
        if not 1 <= k <= 64:
            raise ValueError(
                f"config: speculators_config proposal_methods[0].speculative_tokens (K) must be in [1, 64], got {k}"
            )
        self.options = (options or PEagleOptions()).validate(config.num_depths)
        tl = config.transformer_layer_config
        h = tl.hidden_size
        if config.target_hidden_size is not None and int(config.target_hidden_size) != h:
            raise ValueError(
                f"verifier/draft hidden size mismatch: target_hidden_size {config.target_hidden_size} != "
                f"draft hidden_size {h} (this drafter reuses the verifier's lm_head and needs them equal)"
            )
        if config.mask_token_id is None:
            raise ValueError("mask_token_id must be set (see resolve_mask_token_id)")
        if not 0 <= config.mask_token_id < tl.vocab_size:
            raise ValueError(
                f"mask_token_id {config.mask_token_id} is outside the embedding "
                f"(transformer_layer_config.vocab_size = {tl.vocab_size})"
            )
        if not 1 <= config.draft_vocab_size <= tl.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {tl.vocab_size}], got {config.draft_vocab_size}")
        n_aux = config.num_aux
        self.embed_tokens = nn.Embedding(tl.vocab_size, h)
        self.input_norm = RMSNorm(n_aux * h, tl.rms_norm_eps) if config.norm_before_fc else None
        self.fc = nn.Linear(n_aux * h, h, bias=False)
        self.layers = nn.ModuleList(DraftLayer(tl, i, config.norm_before_residual) for i in range(tl.num_hidden_layers))
        self.norm = RMSNorm(h, tl.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, n_aux * h))
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(tl.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        inv_freq, self.rope_scale = rope_inv_freq(tl, self.layers[0].self_attn.head_dim)
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
        self.mask_embed = (
            nn.Parameter(self.embed_tokens.weight.detach()[config.mask_token_id].clone()) if mode == "mask" else None
        )
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
    def from_verifier(
        cls,
        verifier_config,
        *,
        num_layers: int = 1,
        num_depths: int = 8,
        mask_token_id: int,
        draft_vocab_size: int | None = None,
        aux_layer_ids=None,
        layer_type: str | None = None,
        d2t: torch.Tensor | None = None,
        verifier_name_or_path=None,
        options: PEagleOptions | None = None,
        norm_before_residual: bool = False,
        norm_before_fc: bool = False,
    ) -> PEagleDraftModel:
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
            raise ValueError(
                f"mask_token_id must be in [0, {v}] (an id of the vocab, or {v} = a new id "
                f"past it, growing the embedding by one), got {mask_token_id}"
            )
        emb_rows = v + 1 if mask_token_id == v else v
        if layer_type is None:
            layer_type = vc.model_type if vc.model_type in LAYER_TYPES else "llama"
        cls_tl = layer_config_class(layer_type)
        head_dim = getattr(vc, "head_dim", None) or vc.hidden_size // vc.num_attention_heads
        rope = getattr(vc, "rope_parameters", None)
        if not rope:
            rope = {"rope_type": "default", "rope_theta": float(getattr(vc, "rope_theta", 10000.0))}
        tl = cls_tl(
            vocab_size=emb_rows,
            hidden_size=vc.hidden_size,
            intermediate_size=vc.intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=vc.num_attention_heads,
            num_key_value_heads=getattr(vc, "num_key_value_heads", None) or vc.num_attention_heads,
            head_dim=head_dim,
            hidden_act=getattr(vc, "hidden_act", "silu"),
            max_position_embeddings=getattr(vc, "max_position_embeddings", 2048),
            rms_norm_eps=getattr(vc, "rms_norm_eps", 1e-6),
            rope_parameters=dict(rope),
            attention_bias=bool(getattr(vc, "attention_bias", False)),
            tie_word_embeddings=False,
            bos_token_id=getattr(vc, "bos_token_id", None),
            eos_token_id=getattr(vc, "eos_token_id", None),
            pad_token_id=getattr(vc, "pad_token_id", None),
        )
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
            transformer_layer_config=tl,
            draft_vocab_size=int(draft_vocab_size),
            target_hidden_size=int(vc.hidden_size),
            norm_before_residual=norm_before_residual,
            norm_before_fc=norm_before_fc,
            eagle_aux_hidden_state_layer_ids=list(aux_layer_ids),
            mask_token_id=mask_token_id,
            embed_requires_grad=True,
            speculators_config=make_speculators_config(
                num_depths,
                verifier_name_or_path or getattr(verifier_config, "_name_or_path", None) or None,
                getattr(verifier_config, "architectures", None),
            ),
        )
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
        # on the CPU explicitly: models are built under torch.device(...) contexts
        ids = torch.arange(vd, device="cpu") + d2t
        rows = self.config.transformer_layer_config.vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= rows:
            raise ValueError(f"d2t maps a draft id outside the vocab [0, {rows})")
        if vd > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError("d2t must map draft ids to strictly increasing target ids")
        t2d = torch.zeros(self.config.transformer_layer_config.vocab_size, dtype=torch.bool, device="cpu")
        t2d[ids] = True
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @property
    def draft_token_ids(self) -> torch.Tensor:
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    @property
    def num_depths(self) -> int:
        return self.config.num_depths

    def attach_verifier(
        self,
        *,
        norm_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        norm_eps: float | None = None,
        embed_weight: torch.Tensor | None = None,
        init_from_verifier: bool = True,
    ):
        """Hold the verifier's final norm and lm_head (rows of the draft vocab) as frozen buffers
        for the loss; with init_from_verifier also start the draft embeddings and lm_head from
        the verifier's (as speculators does). The MASK row, when grown, starts at the mean embedding."""
        h = self.config.hidden_size
        if norm_weight.shape != (h,):
            raise ValueError(
                f"verifier/draft hidden size mismatch: verifier norm has shape "
                f"{tuple(norm_weight.shape)}, draft hidden_size is {h}"
            )
        if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != h:
            raise ValueError(
                f"verifier/draft hidden size mismatch: verifier lm_head has shape "
                f"{tuple(lm_head_weight.shape)}, draft hidden_size is {h}"
            )
        ids = self.draft_token_ids.to(lm_head_weight.device)
        if int(ids.max()) >= lm_head_weight.shape[0]:
            raise ValueError(
                f"draft vocab maps to target id {int(ids.max())} but the verifier lm_head "
                f"has only {lm_head_weight.shape[0]} rows"
            )
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
                        raise ValueError(
                            f"verifier embedding shape {tuple(embed_weight.shape)} does not fit "
                            f"the draft embedding {tuple(self.embed_tokens.weight.shape)}"
                        )
                    self.embed_tokens.weight[:v].copy_(embed_weight.detach().float())
                    if v < rows:
                        self.embed_tokens.weight[v:].copy_(embed_weight.detach().float().mean(0, keepdim=True))
                    if self.mask_embed is not None:
                        self.mask_embed.copy_(self.embed_tokens.weight[self.config.mask_token_id])
        self.has_verifier = True
        return self

    # -- checkpoint (docs/design.md section 5) -----------------------------------------------------
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
    def from_pretrained(
        cls, directory, *, options: PEagleOptions | None = None, map_location="cpu"
    ) -> PEagleDraftModel:
        from safetensors.torch import load_file

        d = Path(directory)
        if not (d / CONFIG_NAME).is_file():
            raise FileNotFoundError(f"{d} is not a P-EAGLE checkpoint: no {CONFIG_NAME}")
        if not (d / WEIGHTS_NAME).is_file():
            raise FileNotFoundError(f"{d} is not a P-EAGLE checkpoint: no {WEIGHTS_NAME}")
        config = PEagleConfig.from_pretrained(d)
        try:
            model = cls(config, options)
        except (TypeError, KeyError, ValueError, ZeroDivisionError, IndexError, RuntimeError) as e:
            raise ValueError(
                f"{d / CONFIG_NAME}: cannot build the drafter it describes ({type(e).__name__}: {e})"
            ) from None
        try:
            sd = load_file(str(d / WEIGHTS_NAME), device=str(map_location))
        except OSError:
            raise
        except Exception as e:  # safetensors' SafetensorError is no ValueError: name the file
            raise ValueError(
                f"{d / WEIGHTS_NAME} is not a readable safetensors file ({e}): a corrupt or "
                "partially written checkpoint?"
            ) from None
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
                raise ValueError(
                    f"checkpoint tensor {k} has shape {tuple(t.shape)}, the config needs {tuple(own[k].shape)}"
                )
            if own[k].is_floating_point() != t.is_floating_point() or (own[k].dtype == torch.bool) != (
                t.dtype == torch.bool
            ):
                raise ValueError(
                    f"checkpoint tensor {k} has dtype {str(t.dtype).replace('torch.', '')}, "
                    f"expected {'a floating dtype' if own[k].is_floating_point() else own[k].dtype}"
                )
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
            raise ValueError(
                f"mask_token_id {self.config.mask_token_id} occurs as a real token in {where}; "
                "pick a mask token the data never uses (--mask-token-id)"
            )

    # -- COD layout ---------------------------------------------------------------------------------

    def sample_layout(self, example, *, seed: int | None = None) -> CodLayout:
        o = self.options
        return cod_sample(
            example.document_ids,
            example.loss_mask,
            num_depths=self.num_depths,
            down_sample_ratio=o.down_sample_ratio,
            down_sample_ratio_min=o.down_sample_ratio_min,
            max_anchors=o.max_anchors,
            depth0="all" if o.attention == "symmetric" else "anchors",
            seed=seed,
        )
