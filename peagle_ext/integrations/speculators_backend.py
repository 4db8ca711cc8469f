"""peagle_ext's ops as the training backend of speculators' own P-EAGLE model (0.9.x).

    from peagle_ext.integrations.speculators import enable_backend
    enable_backend(draft_model)   # or enable_backend() before speculators builds its model

What is replaced, on that instance (`model=None`: on the class `PEagleDraftModel`, so every
instance, including the one speculators' CLI builds):
- `PEagleDraftModel.forward` (and its torch.compile wrapper) by `backend_forward` below, which
  keeps speculators' signature, modules, sampler and returned metrics and changes three parts:
  - the COD sample (speculators' `generate_cod_sample_indices`, looked up at call time, or
    `sampler="peagle"`: our `cod_sample`, which keeps chains inside their document) becomes a
    `CodLayout`; no `create_peagle_mask_mod`, no `create_block_mask`, no [T, T] mask;
  - attention: every decoder layer's `self_attn.config` becomes a shallow copy whose
    `_attn_implementation` is "peagle_cod", a transformers attention function that runs
    `peagle_ext.attention.cod_attention` (O(T) metadata, built once per forward for all layers);
    given any other mask it calls the layer's original implementation;
  - the loss: `peagle_ext.loss.fused_linear_kl` over the final normed states and the verifier's
    normed last hidden states (one chunk of logits at a time, target logits once per position)
    instead of [T, V] draft logits and [N, V] target logits. Loss terms it computes: "kl_div"
    and "ce" (speculators' eager or fused functions of those names, any weights); any other
    term falls back to speculators' own `compute_metrics` over full logits.
- The layer-0 inputs are built once per position plus one MASK row (a slice and a broadcast)
  instead of gathering T rows; the values are the same.

What does not change: parameters, buffers, state_dict and checkpoints, the model config, the
decoder layers and RoPE modules (speculators' own), the loss value (sum of masked terms /
(mask sum + 1e-5), as speculators divides), the metrics' keys and meaning, and speculators'
trainer, optimizer, FSDP and gradient checkpointing.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import types
from dataclasses import dataclass

import torch

from ..cod import CodLayout, cod_sample
from ..ops.attention import cod_attention, cod_attention_metadata
from ..ops.loss import fused_linear_kl
from .speculators import import_speculators

ATTN_NAME = "peagle_cod"
_LOSS_EPS = 1e-5  # speculators' loss denominator is sum(mask) + 1e-5 (losses/utils.py)
_CORE = "speculators.models.peagle.core"


@dataclass(frozen=True)
class BackendOptions:
    """sampler: "speculators" (its generate_cod_sample_indices, so its draws and semantics) or
    "peagle" (peagle_ext.cod.cod_sample: chains never leave their document, no anchor -1; seeded
    from torch's default generator). chunk_size: rows per loss chunk ("auto": see chunk_plan)."""

    sampler: str = "speculators"
    chunk_size: int | str = "auto"

    def __post_init__(self):
        if self.sampler not in ("speculators", "peagle"):
            raise ValueError(f"sampler must be 'speculators' or 'peagle', got {self.sampler!r}")


_class_options: BackendOptions | None = None


# ---------------------------------------------------------------------------------------------
# Attention
@dataclass
class CodMask:
    """What the layers receive as attention_mask: the layout and the window of that layer kind;
    the metadata is built by the first layer and reused by the others (and by recomputation)."""

    layout: CodLayout
    window: int | None = None
    metadata: object = None


def _attn_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    if dev == "cuda" and x.dtype == torch.float32:
        return torch.bfloat16  # the CUDA kernels take bf16/fp16
    return x.dtype


def cod_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A transformers attention function: query [1, Hq, T, D], key/value [1, Hkv, T, D] ->
    ([1, T, Hq, D], None)."""
    if not isinstance(attention_mask, CodMask):
        return _fallback(module)(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if dropout:
        raise NotImplementedError("peagle_cod attention has no dropout (speculators' drafters use 0.0)")
    if query.shape[0] != 1:
        raise ValueError(f"peagle_cod attention takes one packed row (batch 1), got batch {query.shape[0]}")
    m = attention_mask
    if m.metadata is None:
        m.metadata = cod_attention_metadata(m.layout, window=m.window)
    dt = _attn_dtype(query)
    q, k, v = (x[0].transpose(0, 1).to(dt) for x in (query, key, value))
    out = cod_attention(q, k, v, m.layout, window=m.window, scale=scaling, metadata=m.metadata)
    return out.to(query.dtype)[None], None


def _fallback(module):
    """The attention function the layer used before it was routed here."""
    from transformers.modeling_utils import AttentionInterface

    name = getattr(module, "_peagle_orig_config", module.config)._attn_implementation
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    return AttentionInterface().get_interface(name, eager)


def _register_attention():
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTN_NAME, cod_attention_forward)


def _route_attention(model):
    for layer in model.layers:
        attn = layer.self_attn
        if getattr(attn, "_peagle_orig_config", None) is not None:
            continue
        mine = copy.copy(attn.config)
        mine._attn_implementation_internal = ATTN_NAME
        attn._peagle_orig_config = attn.config
        attn.config = mine


def _unroute_attention(model):
    for layer in model.layers:
        attn = layer.self_attn
        orig = getattr(attn, "_peagle_orig_config", None)
        if orig is not None:
            attn.config = orig
            del attn._peagle_orig_config


# ---------------------------------------------------------------------------------------------
# COD sample -> CodLayout
def layout_from_speculators(anchor, depth, document_ids, num_depths: int) -> CodLayout:
    """speculators' (anchor_pos, depth) (depth-major, depth 0 at every position, anchors
    increasing within a depth) as a CodLayout over `document_ids` [N]. One host sync."""
    n = document_ids.shape[0]
    counts = torch.bincount(depth.long(), minlength=num_depths)
    low = anchor.min().reshape(1) if anchor.numel() else counts.new_zeros(1)
    stats = torch.cat([counts, low.to(counts.dtype)]).tolist()
    counts, low = stats[:-1], stats[-1]
    if len(counts) != num_depths:
        raise ValueError(f"the COD sample has depths up to {len(counts) - 1}, num_depths is {num_depths}")
    if counts[0] != n:
        raise ValueError(f"the COD sample must hold depth 0 at all N={n} positions, it holds {counts[0]}")
    if low < 0:
        raise ValueError(
            "speculators' COD sample has an anchor < 0: its sampler starts a chain at position 0 when "
            "loss_mask[0] == 1 (anchor -1). peagle_ext's attention cannot express that token; mask "
            "position 0 out of the loss or enable the backend with sampler='peagle'"
        )
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    i32 = torch.int32
    return CodLayout(anchor.to(i32).contiguous(), depth.to(i32).contiguous(), offsets, document_ids.to(i32), True)


def _sample(opts, n, loss_mask, document_ids, num_depths, ratio, ratio_min, max_anchors) -> CodLayout:
    doc = document_ids.reshape(-1)
    if opts.sampler == "peagle":
        return cod_sample(
            doc,
            loss_mask.reshape(-1) == 1,
            num_depths=num_depths,
            down_sample_ratio=ratio,
            down_sample_ratio_min=ratio_min,
            max_anchors=max_anchors,
        )
    anchor, depth = sys.modules[_CORE].generate_cod_sample_indices(
        seq_length=n,
        loss_mask=loss_mask,
        num_depths=num_depths,
        down_sample_ratio=ratio,
        down_sample_ratio_min=ratio_min,
        max_anchors=max_anchors,
    )
    return layout_from_speculators(anchor, depth, doc.to(anchor.device), num_depths)


# ---------------------------------------------------------------------------------------------
# Loss and metrics
def fused_terms(loss_config):
    """[(name, kind, weight)] when every term of speculators' loss config is one the fused op
    computes; None otherwise. None config: speculators' default (kl_div, weight 1)."""
    if loss_config is None:
        return [("kl_div", "kl", 1.0)]
    from speculators.losses import eager
    from speculators.losses import utils as loss_utils

    known = {
        "kl_div": ("kl", (eager.kl_div_loss, loss_utils.kl_div_loss)),
        "ce": ("ce", (eager.ce_loss, loss_utils.ce_loss)),
    }
    terms = []
    for name, (fn, weight) in loss_config.items():
        kind, fns = known.get(name, (None, ()))
        if not any(fn is f for f in fns):
            return None
        terms.append((name, kind, float(weight)))
    return terms


def _frozen(model, name, w, dtype):
    """w in dtype for a weight no gradient reaches, cast once while w is unchanged."""
    if w.dtype == dtype:
        return w.detach()
    cache = model.__dict__.setdefault("_peagle_frozen", {})
    key = (w.data_ptr(), w._version, w.device, dtype)
    hit = cache.get(name)
    if hit is None or hit[0] != key:
        cache.pop(name, None)
        hit = cache[name] = (key, w.detach().to(dtype))
    return hit[1]


def _loss_and_metrics(model, h, layout, loss_mask, last_hidden, loss_config, num_depths, chunk_size):
    anchor, depth = layout.anchor.long(), layout.depth.long()
    pos = anchor + depth
    terms = fused_terms(loss_config)
    if terms is None:  # a term the fused op does not compute: speculators' own loss over full logits
        logits = model.lm_head(model.norm(h))[None]
        with torch.no_grad():
            targets = model.verifier_lm_head(model.verifier_norm(last_hidden))[:, pos]
        return sys.modules[_CORE].compute_metrics(
            logits=logits,
            targets=targets,
            loss_mask=loss_mask,
            anchor_pos=anchor,
            depth=depth,
            num_depths=num_depths,
            loss_config=loss_config,
        )
    device = h.device
    hn = model.norm(h)
    dev = device.type
    dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hn.dtype
    with torch.no_grad():
        tgt = model.verifier_norm(last_hidden[0]).to(dt)
    w = model.lm_head.weight
    head = w.to(dt) if w.requires_grad else _frozen(model, "lm_head", w, dt)
    vhead = _frozen(model, "verifier_lm_head", model.verifier_lm_head.weight, dt)
    weight = loss_mask[0, pos]
    wsum = weight.sum()
    total = torch.tensor(0.0, device=device, dtype=torch.float32)
    term_losses = {}
    for name, kind, coef in terms:
        mean, m = fused_linear_kl(
            hn.to(dt),
            head,
            tgt,
            vhead,
            weight,
            depth,
            num_depths=num_depths,
            target_index=pos,
            kind=kind,
            chunk_size=chunk_size,
            validate=dev == "cpu",
        )
        term = mean * (wsum / (wsum + _LOSS_EPS)).to(mean.dtype)
        if len(terms) > 1:
            term_losses[f"{name}_loss"] = term.detach()
        total = total + coef * term
    correct, count = m["correct"].float(), m["total"].float()
    ones = torch.tensor(1.0, device=device)
    metrics = {
        "loss_sum": total.detach(),
        "loss_total": ones,
        "full_acc_sum": correct.sum(),
        "full_acc_total": count.sum(),
    }
    for name, val in term_losses.items():
        metrics[f"{name}_sum"] = val
        metrics[f"{name}_total"] = ones.clone()
    for d in range(num_depths):
        metrics[f"position_{d}_acc_sum"] = correct[d]
        metrics[f"position_{d}_acc_total"] = count[d]
    return total, metrics


# ---------------------------------------------------------------------------------------------
# The forward
def backend_forward(
    self,
    hidden_states: torch.Tensor,
    input_ids: torch.Tensor,
    document_ids: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    verifier_last_hidden_states: torch.Tensor | None = None,
    loss_config=None,
    max_anchors: int | None = None,
    num_depths: int = 8,
    down_sample_ratio: float = 0.7,
    down_sample_ratio_min: float = 0.2,
    **kwargs,
):
    """speculators' PEagleDraftModel.forward (same arguments and return value: (None, loss,
    metrics)) on peagle_ext's ops; the module docstring says what differs inside."""
    if verifier_last_hidden_states is None:
        raise ValueError("verifier_last_hidden_states required for training")
    if input_ids.shape[0] != 1:
        raise ValueError(f"speculators' P-EAGLE forward takes one packed row (batch 1), got {input_ids.shape[0]}")
    opts = self.__dict__.get("_peagle_backend") or _class_options or BackendOptions()
    _route_attention(self)
    n = input_ids.shape[1]
    if loss_mask is None:
        loss_mask = torch.ones_like(input_ids, dtype=torch.float32)
    layout = _sample(
        opts, n, loss_mask, document_ids, num_depths, down_sample_ratio, down_sample_ratio_min, max_anchors
    )
    t = layout.num_tokens
    dev = hidden_states.device

    # layer-0 inputs of the N positions (depth 0, in order) and of one MASK row (every deeper token)
    ids = torch.cat([input_ids[0], input_ids.new_full((1,), self.mask_token_id)])
    emb = self.embed_tokens(ids).to(hidden_states.dtype)
    mask_hidden = self.mask_hidden.reshape(1, -1).to(device=dev, dtype=hidden_states.dtype)
    hid = torch.cat([hidden_states[0], mask_hidden])
    if self.input_norm is not None:
        hid = self.input_norm(hid)
    if self.fc_norm is not None:
        chunks = hid.chunk(len(self.fc_norm), dim=-1)
        hid = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], dim=-1)
    rows = torch.cat([emb, self.fc(hid)], dim=-1)  # [N + 1, 2H]
    x = torch.cat([rows[:n], rows[n:].expand(t - n, -1)])[None]

    position_ids = (layout.anchor.long() + layout.depth.long())[None]
    position_embeddings = self.rotary_emb(x, position_ids)
    full = CodMask(layout) if self.uses_full_attn else None
    sliding = CodMask(layout, self.sliding_window) if self.uses_sliding_window_attn else None
    for i, layer in enumerate(self.layers):
        x = layer(
            x,
            attention_mask=sliding if i in self.sliding_window_indices else full,
            position_ids=position_ids,
            position_embeddings=position_embeddings,
            **kwargs,
        )
    loss, metrics = _loss_and_metrics(
        self, x[0], layout, loss_mask, verifier_last_hidden_states, loss_config, num_depths, opts.chunk_size
    )
    return None, loss, metrics


# ---------------------------------------------------------------------------------------------
# Switching it on and off
def _model_class():
    return import_speculators()[0]


def enable_backend(model=None, *, sampler: str = "speculators", chunk_size="auto"):
    """Train speculators' P-EAGLE model on peagle_ext's ops (module docstring). model: a
    PEagleDraftModel (returned), or None for every instance of the class. Undo: disable_backend."""
    global _class_options
    opts = BackendOptions(sampler, chunk_size)
    cls = _model_class()
    _register_attention()
    if model is None:
        if "_peagle_orig_forward" not in cls.__dict__:
            cls._peagle_orig_forward = cls.__dict__["forward"]
        cls.forward = backend_forward
        _class_options = opts
        return None
    if not isinstance(model, cls):
        raise TypeError(f"enable_backend: expected speculators' PEagleDraftModel, got {type(model).__name__}")
    model._peagle_backend = opts
    model.forward = types.MethodType(backend_forward, model)
    _route_attention(model)
    return model


def disable_backend(model=None):
    """Undo enable_backend(model) (None: the class-wide switch)."""
    global _class_options
    if model is None:
        cls = _model_class()
        orig = cls.__dict__.get("_peagle_orig_forward")
        if orig is not None:
            cls.forward = orig
            del cls._peagle_orig_forward
        _class_options = None
        return
    model.__dict__.pop("forward", None)
    model.__dict__.pop("_peagle_backend", None)
    model.__dict__.pop("_peagle_frozen", None)
    _unroute_attention(model)


@contextlib.contextmanager
def backend(model=None, **options):
    """enable_backend(model, **options) for the duration of the block."""
    enable_backend(model, **options)
    try:
        yield model
    finally:
        disable_backend(model)
