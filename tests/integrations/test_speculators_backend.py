"""speculators 0.9.0's PEagleDraftModel with and without peagle_ext's backend
(peagle_ext.integrations.speculators_backend): same loss, metrics and gradients in float64 on the
CPU, on speculators' own COD samples (same torch seed) and on ours.

The reference is speculators' unmodified forward with its `sdpa` attention (its mask_mod
evaluated densely; its flex path has no CPU backward) and a float64 KL (its eager KL computes in
float32 whatever the input dtype), so any difference is the backend's, not rounding. Needs
speculators importable (see test_speculators.py); skipped otherwise.
"""

import copy
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from tests.integrations.test_speculators import _pair

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("speculators") is None,
        reason="speculators is not installed (see the module docstring)",
    ),
    pytest.mark.usefixtures("one_thread"),
]

LOSS_RTOL = 1e-10
GRAD_RTOL = 1e-9


def kl64(logits, targets):
    """speculators' eager KL (losses/eager.py) in float64."""
    logq = F.log_softmax(logits.double(), dim=-1)
    return F.kl_div(logq, F.softmax(targets.double(), dim=-1), reduction="none").sum(-1)


def ce64(logits, targets):
    return F.cross_entropy(logits.double().transpose(1, 2), targets.argmax(-1), reduction="none")


def _models(layer_type, num_layers, k, seed, window=None):
    """(E, reference speculators model, the same model with the backend, float64 batch)."""
    E, _ours, spec, core, ex = _pair(layer_type, num_layers, k, "sdpa", seed=seed)
    spec = spec.double()
    if window is not None:  # layer 0 a sliding-window layer, the others full (both paths read these)
        spec.sliding_window, spec.sliding_window_indices, spec.uses_sliding_window_attn = window, [0], True
        spec.uses_full_attn = num_layers > 1
    fast = E.enable_backend(copy.deepcopy(spec))
    batch = E.speculators_batch(ex, "cpu")
    for key in ("hidden_states", "verifier_last_hidden_states", "loss_mask"):
        batch[key] = batch[key].double()
    return E, spec, fast, core, batch


def _run(model, batch, k, loss_config, seed, **kw):
    torch.manual_seed(seed)  # speculators' sampler draws from torch's default generator
    _, loss, metrics = model(**batch, loss_config=loss_config, num_depths=k, **kw)
    loss.backward()
    return loss, metrics


def _same(ref, got, m_ref, m_got, spec, fast, loss_rtol=LOSS_RTOL, grad_rtol=GRAD_RTOL):
    assert got.dtype == ref.dtype
    got, ref = float(got.detach()), float(ref.detach())
    assert abs(got - ref) <= loss_rtol * abs(ref)
    assert list(m_got) == list(m_ref)  # the same keys in the same order
    for key, v in m_ref.items():
        assert m_got[key].dtype == v.dtype, key
        assert abs(float(m_got[key]) - float(v)) <= loss_rtol * abs(float(v)), key
    grads = dict(fast.named_parameters())
    checked = 0
    for name, p in spec.named_parameters():
        if not p.requires_grad:
            continue
        g_ref, g = p.grad, grads[name].grad
        assert g_ref is not None and g is not None, name
        scale = float(g_ref.abs().max()) + 1e-300
        assert float((g - g_ref).abs().max()) <= grad_rtol * scale, name
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize(
    "layer_type,num_layers,k,window", [("qwen3", 1, 8, None), ("llama", 2, 4, None), ("qwen3", 2, 6, 24)]
)
def test_same_loss_metrics_and_gradients_float64(layer_type, num_layers, k, window):
    """window: layer 0 is a sliding-window layer (its own COD metadata), layer 1 full."""
    E, spec, fast, _core, batch = _models(layer_type, num_layers, k, seed=num_layers, window=window)
    ref, m_ref = _run(spec, batch, k, {"kl_div": (kl64, 1.0)}, seed=5)
    got, m_got = _run(fast, batch, k, E.speculators_loss_config("eager"), seed=5)
    assert sum(float(m_ref[f"position_{d}_acc_total"]) for d in range(1, k)) > 100  # the deep tokens count
    _same(ref, got, m_ref, m_got, spec, fast)


def test_loss_terms_and_fallback():
    """A kl_div + ce mix runs on the fused op (per-term metrics as speculators names them); a
    term the op does not compute (tv) falls back to speculators' loss over full logits."""
    from speculators.losses import resolve_loss_config

    E, spec, fast, _core, batch = _models("qwen3", 1, 4, seed=3)
    ref, m_ref = _run(spec, batch, 4, {"kl_div": (kl64, 0.7), "ce": (ce64, 0.3)}, seed=2)
    got, m_got = _run(fast, batch, 4, resolve_loss_config('{"kl_div": 0.7, "ce": 0.3}', "eager"), seed=2)
    assert "kl_div_loss_sum" in m_got and "ce_loss_sum" in m_got
    _same(ref, got, m_ref, m_got, spec, fast)

    spec.zero_grad(set_to_none=True)
    fast.zero_grad(set_to_none=True)
    tv = resolve_loss_config("tv", "eager")  # computes in float32 inside, on both sides
    ref, m_ref = _run(spec, batch, 4, tv, seed=4)
    got, m_got = _run(fast, batch, 4, tv, seed=4)
    _same(ref, got, m_ref, m_got, spec, fast, loss_rtol=1e-6, grad_rtol=1e-5)


def test_peagle_sampler_is_our_cod_sample():
    """sampler='peagle': the layout is cod_sample's (drawn from torch's generator), and the loss
    is speculators' forward on that layout."""
    from peagle_ext.cod import cod_sample

    E, spec, fast, core, batch = _models("qwen3", 1, 6, seed=4)
    E.enable_backend(fast, sampler="peagle")
    torch.manual_seed(9)
    lay = cod_sample(batch["document_ids"][0], batch["loss_mask"][0] == 1, num_depths=6)
    with E.speculators_layout(core, lay):
        _, ref, m_ref = spec(**batch, loss_config={"kl_div": (kl64, 1.0)}, num_depths=6)
    got, m_got = _run(fast, batch, 6, None, seed=9)
    ref.backward()
    _same(ref, got, m_ref, m_got, spec, fast)


def test_anchor_minus_one_is_refused():
    """speculators starts a chain at position 0 when loss_mask[0] == 1 (anchor -1): refused with
    the way out, never silently mis-attended."""
    from peagle_ext.integrations.speculators_backend import layout_from_speculators

    doc = torch.zeros(6, dtype=torch.long)
    anchor = torch.tensor([0, 1, 2, 3, 4, 5, -1, 2])
    depth = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1])
    with pytest.raises(ValueError, match="sampler='peagle'"):
        layout_from_speculators(anchor, depth, doc, 2)
    lay = layout_from_speculators(anchor[[0, 1, 2, 3, 4, 5, 7]], depth[[0, 1, 2, 3, 4, 5, 7]], doc, 3)
    assert lay.depth_offsets == [0, 6, 7, 7] and lay.anchor.dtype == torch.int32


def test_switches_and_gradient_checkpointing():
    """disable_backend restores speculators' forward and attention; the class-wide switch covers
    models built later (speculators' CLI); gradient checkpointing recomputes through our attention."""
    import peagle_ext.integrations.speculators_backend as B

    E, spec, fast, core, batch = _models("qwen3", 2, 4, seed=6)
    assert "forward" in fast.__dict__ and fast.layers[1].self_attn.config._attn_implementation == B.ATTN_NAME
    assert fast.state_dict().keys() == spec.state_dict().keys()
    E.disable_backend(fast)
    assert "forward" not in fast.__dict__
    assert fast.layers[1].self_attn.config is fast.config.transformer_layer_config

    cls = type(spec)
    orig = cls.__dict__["forward"]
    with E.backend():
        assert cls.forward is B.backend_forward
        fast.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        fast.train()
        got, m_got = _run(fast, batch, 4, E.speculators_loss_config("eager"), seed=1)
    assert cls.__dict__["forward"] is orig
    ref, m_ref = _run(spec, batch, 4, {"kl_div": (kl64, 1.0)}, seed=1)
    _same(ref, got, m_ref, m_got, spec, fast)
    # the routed layers still run speculators' own attention under its own forward
    _, loss, _ = fast(**batch, loss_config={"kl_div": (kl64, 1.0)}, num_depths=4)
    assert torch.isfinite(loss)


def test_cli_launcher_enables_the_backend_before_speculators_builds_its_model(monkeypatch):
    """speculators_train runs speculators' CLI entry with the class-wide switch on (its CLI and
    config modules are replaced here: they need speculators' full dependency set)."""
    import sys
    import types

    import peagle_ext.integrations.speculators as E
    import peagle_ext.integrations.speculators_backend as B
    from peagle_ext.integrations import speculators_train

    cls = E.import_speculators()[0]
    seen = []
    cli = types.ModuleType("speculators.train.cli")
    cli.main = lambda cfg: seen.append((cfg, cls.forward is B.backend_forward))
    config = types.ModuleType("speculators.train.config")
    config.TrainConfig = types.SimpleNamespace(resolve=lambda: "cfg")
    monkeypatch.setitem(sys.modules, "speculators.train.cli", cli)
    monkeypatch.setitem(sys.modules, "speculators.train.config", config)
    try:
        speculators_train.main()
    finally:
        E.disable_backend()
    assert seen == [("cfg", True)] and cls.forward is not B.backend_forward
