"""peagle_ext's drafter vs speculators 0.9.0's PEagleDraftModel on the same weights, row and COD
layout: same loss, same per-depth accuracy counts, same gradients (fp32, CPU).

Needs speculators importable (its wheel installed with --no-deps, e.g.
`pip install --no-deps --target /tmp/specsite <wheels>` and PYTHONPATH=/tmp/specsite); skipped
otherwise. speculators' flex path has no CPU backward, so gradients are compared through its
own `--draft-attn-impl sdpa` backend (its mask_mod evaluated densely); its flex forward is
compared without gradients.
"""

import importlib.util
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("speculators") is None,
        reason="speculators is not installed (see the module docstring)",
    ),
    pytest.mark.usefixtures("one_thread"),
]


def _pair(layer_type, num_layers, k, attn_impl, seed, pad_token_id=None):
    import peagle_ext.integrations.speculators as E
    import peagle_ext.testing as TT

    cls = Qwen3Config if layer_type == "qwen3" else LlamaConfig
    vc = cls(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=300,
        rms_norm_eps=1e-6,
        pad_token_id=pad_token_id,
    )
    ours = TT.make_peagle(vc, num_layers=num_layers, num_depths=k, mask_token_id=299, seed=seed)
    spec, core = E.make_speculators_twin(ours, attn_impl=attn_impl)
    ex = TT.synthetic_example(230, hidden=64, vocab=299, dtype=torch.float32, doc_len=(25, 90), avoid_id=299, seed=seed)
    return E, ours, spec, core, ex


@pytest.mark.parametrize(
    "layer_type,num_layers,k,pad", [("qwen3", 1, 8, None), ("llama", 2, 4, None), ("qwen3", 3, 6, 7)]
)
def test_same_loss_metrics_and_gradients(layer_type, num_layers, k, pad):
    """pad: the verifier's pad id is a real token of the data (SmolLM2: <|im_end|>): the twin
    must still train that embedding row, as speculators' own CLI-built model does."""
    from peagle_ext.cod import cod_sample

    E, ours, spec, core, ex = _pair(layer_type, num_layers, k, "sdpa", seed=num_layers, pad_token_id=pad)
    if pad is not None:
        ex.input_ids[:40:3] = pad  # make sure the pad id occurs as a real token
        assert ours.config.transformer_layer_config.pad_token_id == pad
    lay = cod_sample(ex.document_ids, ex.loss_mask, num_depths=k, seed=11)
    assert int((ex.document_ids < 0).sum()) > 0, "the row must contain padding (EAGLE-shift ends)"
    ls, ms = E.speculators_forward(
        spec,
        core,
        E.speculators_batch(ex, "cpu"),
        num_depths=k,
        loss_config=E.speculators_loss_config("eager"),
        layout=lay,
    )
    lo, mo = ours(ex, lay)
    # speculators divides by (count + 1e-5)
    assert abs(float(ls) - float(lo)) <= 1e-5 * abs(float(lo)) + 1e-6
    c, t = E.speculators_per_depth(ms, k)
    assert [int(x) for x in t] == mo["total"].tolist()
    assert [int(x) for x in c] == mo["correct"].tolist()
    ls.backward()
    lo.backward()
    sp = dict(spec.named_parameters())
    checked = 0
    for n, p in ours.named_parameters():
        if not p.requires_grad:
            continue
        g2 = sp[n].grad
        assert p.grad is not None and g2 is not None, n
        scale = float(p.grad.abs().max()) + 1e-12
        assert float((p.grad - g2).abs().max()) <= 1e-4 * scale, n
        checked += 1
    assert checked >= 10


def test_flex_forward_equals_sdpa_forward():
    """speculators' default flex_attention path (forward only on CPU) gives the same loss as its
    sdpa path and as ours."""
    from peagle_ext.cod import cod_sample

    E, ours, spec_flex, core, ex = _pair("qwen3", 1, 8, "simple_flex_attention", seed=5)
    lay = cod_sample(ex.document_ids, ex.loss_mask, num_depths=8, seed=2)
    with torch.no_grad():
        lf, _ = E.speculators_forward(
            spec_flex,
            core,
            E.speculators_batch(ex, "cpu"),
            num_depths=8,
            loss_config=E.speculators_loss_config("eager"),
            layout=lay,
        )
        lo, _ = ours(ex, lay)
    assert abs(float(lf) - float(lo)) <= 1e-5 * abs(float(lo)) + 1e-6


def test_layout_patch_is_scoped():
    """The layout replacement only lasts for the call: afterwards speculators samples again."""
    from peagle_ext.cod import cod_sample

    E, ours, spec, core, ex = _pair("qwen3", 1, 4, "sdpa", seed=7)
    orig = core.generate_cod_sample_indices
    lay = cod_sample(ex.document_ids, ex.loss_mask, num_depths=4, seed=1)
    with E.speculators_layout(core, lay):
        assert core.generate_cod_sample_indices is not orig
        a, d = core.generate_cod_sample_indices(seq_length=lay.seq_len, loss_mask=ex.loss_mask.float()[None])
        assert torch.equal(a, lay.anchor.long()) and torch.equal(d, lay.depth.long())
    assert core.generate_cod_sample_indices is orig


_LOAD_EXPORT = """
import sys
import torch
from safetensors.torch import load_file
import peagle_ext.integrations.speculators as E
E.install_stubs()
from speculators import SpeculatorModel
out, vdir = sys.argv[1:]
spec = SpeculatorModel.from_pretrained(out)
assert type(spec).__name__ == "PEagleDraftModel", type(spec)
exported, loaded = load_file(out + "/model.safetensors"), spec.state_dict()
for name in ("fc.weight", "mask_hidden", "layers.0.self_attn.q_proj.weight", "lm_head.weight"):
    assert torch.equal(loaded[name].to(exported[name].dtype), exported[name]), name
vw = load_file(vdir + "/model.safetensors")  # the verifier head comes from the cached verifier
head, got = vw.get("lm_head.weight", vw["model.embed_tokens.weight"]), loaded["verifier_lm_head.weight"]
assert torch.equal(got, head.to(got.dtype))  # speculators holds it in the export's bf16
print("loaded")
"""


def test_speculator_model_loads_our_export_offline(tmp_path):
    """speculators' SpeculatorModel.from_pretrained reads `peagle export`'s output, resolving the
    verifier it names (a hub id) through a fake Hugging Face cache in offline mode, with our
    weights. A subprocess, because the hub client reads offline mode once, at its import."""
    from transformers import AutoConfig

    from peagle_ext.cli import main
    from peagle_ext.testing import make_fake_hub_cache, make_peagle, make_tiny_verifier
    from tests.helpers import subprocess_env

    # 8 layers: speculators wants distinct aux layers, and the default [2, L // 2, L - 3] are from L = 6 on
    vdir = make_tiny_verifier(tmp_path / "verifier", layers=8)
    make_fake_hub_cache(tmp_path / "hf", "tiny-org/tiny-llama", vdir)
    vc = AutoConfig.from_pretrained(vdir)
    ours = make_peagle(vc, num_layers=1, num_depths=3, mask_token_id=vc.vocab_size - 1)
    ours.config.speculators_config["verifier"]["name_or_path"] = "tiny-org/tiny-llama"
    ours.save_pretrained(tmp_path / "ckpt")
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0

    env = subprocess_env(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    env.pop("HF_HUB_CACHE", None)
    r = subprocess.run(
        [sys.executable, "-c", _LOAD_EXPORT, str(tmp_path / "out"), str(vdir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0 and "loaded" in r.stdout, r.stderr[-3000:]
