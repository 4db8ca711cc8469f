"""speculators (vllm-project/speculators 0.9.x) beside peagle_ext: its P-EAGLE model imported
without its data-pipeline dependencies, a twin of one of our drafters with the same weights,
its forward run on our COD layout, and `enable_backend(model)`: its model trained on peagle_ext's
ops (speculators_backend.py).

speculators 0.9.0 imports `openai`, `datasets` and `hs_connectors` at module level (through
speculators.train.data, which models/eagle3/data.py imports for a type alias), but the model
path (PEagleDraftModel.forward) never calls them. Installed with --no-deps these packages are
absent; `install_stubs()` puts STUB modules in sys.modules (only for names that are not
importable for real). Every stub object raises if it is ever *used*, so a stub can never
silently stand in for real behaviour: it only lets `import` statements and annotations resolve.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import sys
import types

import torch

# the modules speculators 0.9.0 imports at module level on the way to its model classes
_STUBS = ["openai", "openai.types", "openai.types.chat", "openai.types.completion", "datasets", "hs_connectors"]


def _unusable(modname: str, attr: str):
    def fail(*_a, **_k):
        raise RuntimeError(
            f"{modname}.{attr} is a STUB installed by peagle_ext.integrations.speculators "
            "(the P-EAGLE model path must never use it)"
        )

    # a class, so `X | None` annotations and isinstance() evaluate; using it raises
    return type(attr, (), {"__new__": fail, "__call__": fail, "registry": {}, "__doc__": f"STUB for {modname}.{attr}"})


def _make_getattr(mod, modname: str):
    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        obj = _unusable(modname, attr)
        setattr(mod, attr, obj)
        return obj

    return __getattr__


def install_stubs() -> list[str]:
    """Install stubs for the missing modules; returns the names stubbed."""
    stubbed = []
    for name in _STUBS:
        root = name.split(".")[0]
        if root not in stubbed and importlib.util.find_spec(root) is not None:
            continue  # the real package is installed: use it
        mod = types.ModuleType(name, f"STUB module (peagle_ext.integrations.speculators) for {name}")
        mod.__path__ = []  # importable as a package, so submodules resolve to our stubs
        mod.__spec__ = importlib.util.spec_from_loader(name, loader=None, is_package=True)
        mod.__stub__ = True
        # any attribute (`from openai import AsyncClient`, `openai.types.X` in an annotation)
        # resolves to an unusable class, made on first access
        mod.__getattr__ = _make_getattr(mod, name)
        sys.modules[name] = mod
        if "." in name:
            setattr(sys.modules[name.rsplit(".", 1)[0]], name.rsplit(".", 1)[1], mod)
        if root not in stubbed:
            stubbed.append(root)
    return stubbed


def import_speculators_peagle():
    """(PEagleDraftModel, PEagleSpeculatorConfig, module `speculators.models.peagle.core`, stubs)."""
    stubs = install_stubs()
    import speculators.models.peagle.core as core
    from speculators.models.peagle.config import PEagleSpeculatorConfig

    return core.PEagleDraftModel, PEagleSpeculatorConfig, core, stubs


# ---------------------------------------------------------------------------------------------
def import_speculators():
    """(PEagleDraftModel, PEagleSpeculatorConfig, module core, stubbed module names)."""
    return import_speculators_peagle()


def make_speculators_twin(ours, *, attn_impl: str = "simple_flex_attention", device=None):
    """speculators' PEagleDraftModel with our drafter's config and a copy of its weights.

    attn_impl: "simple_flex_attention" (speculators' default), "sdpa" or "eager" (its
    `--draft-attn-impl` choices: a dense mask from its own mask_mod via create_mask)."""
    SpecModel, SpecConfig, core, _stubs = import_speculators()
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    tl = copy.deepcopy(ours.config.transformer_layer_config)
    tl._attn_implementation = attn_impl
    # speculators builds nn.Embedding(padding_idx=tl.pad_token_id): that row never gets a
    # gradient. Its own CLI builds the layer config WITHOUT pad_token_id (None); ours records the
    # verifier's pad id (for SmolLM2 that is <|im_end|>, a real end-of-turn token), so clear it
    # here to get speculators' training behaviour.
    tl.pad_token_id = None
    cfg = SpecConfig(
        transformer_layer_config=tl,
        draft_vocab_size=ours.config.draft_vocab_size,
        norm_before_residual=ours.config.norm_before_residual,
        norm_before_fc=ours.config.norm_before_fc,
        eagle_aux_hidden_state_layer_ids=list(ours.config.eagle_aux_hidden_state_layer_ids),
        mask_token_id=ours.config.mask_token_id,
        speculators_config=SpeculatorsConfig(
            algorithm="peagle",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=ours.num_depths)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=[]),
        ),
    )
    device = device or ours.fc.weight.device
    with torch.device(device):
        spec = SpecModel(cfg)
    spec = spec.to(device)
    copy_weights_to_speculators(ours, spec)
    return spec, core


def copy_weights_to_speculators(ours, spec):
    """Our checkpoint tensors -> speculators' parameters of the same name; the frozen verifier
    norm/head buffers -> verifier_norm / verifier_lm_head. Fails on any unmatched name."""
    src = ours.checkpoint_state_dict()
    dst = spec.state_dict()
    skip = {"d2t", "t2d"}  # full draft vocab: speculators holds no mapping (None buffers)
    missing = [k for k in dst if k not in src and not k.startswith("verifier_") and k not in skip]
    extra = [k for k in src if k not in dst and k not in skip]
    if missing or extra:
        raise RuntimeError(f"weight names differ: speculators-only {missing}, ours-only {extra}")
    with torch.no_grad():
        for k, t in src.items():
            if k in skip:
                continue
            if tuple(dst[k].shape) != tuple(t.shape):
                raise RuntimeError(f"{k}: shape {tuple(t.shape)} (ours) vs {tuple(dst[k].shape)} (speculators)")
            dst[k].copy_(t)
        dst["verifier_norm.weight"].copy_(ours.verifier_norm_weight)
        dst["verifier_lm_head.weight"].copy_(ours.verifier_lm_head_weight)
        spec.verifier_norm.variance_epsilon = ours.verifier_norm_eps
    # speculators trains the embedding and keeps lm_head frozen, as we do with train_embeddings="all"
    spec.embed_tokens.weight.requires_grad_(True)
    spec.lm_head.weight.requires_grad_(False)


@contextlib.contextmanager
def speculators_layout(core, layout):
    """Inside the block, speculators' forward uses OUR COD layout: core.generate_cod_sample_indices
    (looked up by module-global name at call time) returns our (anchor, depth) as int64."""
    if layout is None:
        yield
        return
    orig = core.generate_cod_sample_indices
    anchor = layout.anchor.long()
    depth = layout.depth.long()

    def ours(seq_length, loss_mask, **_kw):
        if seq_length != layout.seq_len:
            raise RuntimeError(f"layout is for N={layout.seq_len}, forward got {seq_length}")
        return anchor.to(loss_mask.device), depth.to(loss_mask.device)

    core.generate_cod_sample_indices = ours
    try:
        yield
    finally:
        core.generate_cod_sample_indices = orig


def speculators_batch(example, device):
    """speculators' batch layout: [1, N, ...] tensors, float loss mask, int64 document ids."""
    return dict(
        hidden_states=example.hidden.to(device)[None],
        input_ids=example.input_ids.to(device).long()[None],
        document_ids=example.document_ids.to(device).long()[None],
        loss_mask=example.loss_mask.to(device).float()[None],
        verifier_last_hidden_states=example.last_hidden.to(device)[None],
    )


def speculators_forward(
    spec,
    core,
    batch,
    *,
    num_depths,
    loss_config,
    layout=None,
    max_anchors=None,
    down_sample_ratio=0.7,
    down_sample_ratio_min=0.2,
):
    """(loss, metrics) of speculators' own forward."""
    with speculators_layout(core, layout):
        _, loss, metrics = spec(
            **batch,
            loss_config=loss_config,
            max_anchors=max_anchors,
            num_depths=num_depths,
            down_sample_ratio=down_sample_ratio,
            down_sample_ratio_min=down_sample_ratio_min,
        )
    return loss, metrics


def speculators_per_depth(metrics, k):
    """(correct[K], total[K]) from speculators' metrics dict."""
    c = [float(metrics[f"position_{d}_acc_sum"]) for d in range(k)]
    t = [float(metrics[f"position_{d}_acc_total"]) for d in range(k)]
    return c, t


def uncompiled(fn):
    """The function under a torch.compile wrapper (speculators' `conditional_torch_compile`
    wraps PEagleDraftModel.forward at class definition when CUDA is available)."""
    inner = getattr(fn, "_torchdynamo_orig_callable", None) or getattr(fn, "__wrapped__", None)
    return inner if inner is not None else fn


def speculators_loss_config(implementation: str):
    """speculators' KL loss config: "fused" (its Triton kernels, the default; CUDA only) or
    "eager" (log_softmax/softmax over the full [T, V] logits)."""
    import_speculators()
    from speculators.losses import resolve_loss_config

    return resolve_loss_config("kl_div", implementation)


# ---------------------------------------------------------------------------------------------
# The training backend (speculators_backend.py; imported on use, since it imports this module)
def enable_backend(model=None, *, sampler: str = "speculators", chunk_size="auto"):
    """Train speculators' PEagleDraftModel on peagle_ext's ops: see speculators_backend."""
    from .speculators_backend import enable_backend as enable

    return enable(model, sampler=sampler, chunk_size=chunk_size)


def disable_backend(model=None):
    """Undo enable_backend(model)."""
    from .speculators_backend import disable_backend as disable

    disable(model)


def backend(model=None, **options):
    """Context manager: the backend on `model` (None: the class) for the duration of the block."""
    from .speculators_backend import backend as ctx

    return ctx(model, **options)
