"""The fused training step equals the plain-PyTorch drafter (peagle_ext.reference.draft_model:
every token builds its own inputs, SDPA over the dense COD mask, full logits) in float64 on the
CPU: loss, per-depth counts and every gradient, for each attention mode and option, sequence
partition, zero-weight rows, one-token documents and tiny rows."""

import dataclasses

import pytest
import torch

from peagle_ext.data import TrainingExample
from peagle_ext.model import PEagleOptions, build_vocab_mapping
from peagle_ext.reference.draft_model import plain_model_class, reference_forward_sum
from tests.helpers import H, V, make_model

pytestmark = pytest.mark.usefixtures("one_thread")


def make_example(g, n, docs, p_loss=0.75):
    """A packed row of `docs` lengths (the rest padding), random loss mask, float64 states."""
    doc = torch.full((n,), -1, dtype=torch.int32)
    p = 0
    for k, ln in enumerate(docs):
        doc[p : p + ln] = k
        p += ln
    lm = (torch.rand(n, generator=g) < p_loss) & (doc >= 0)
    ids = torch.randint(0, V, (n,), generator=g)
    hidden = torch.randn(n, 3 * H, generator=g, dtype=torch.float64)
    last = torch.randn(n, H, generator=g, dtype=torch.float64)
    return TrainingExample(ids, doc, lm, hidden, last)


def fused_step(m, ex, lay, segments):
    m.zero_grad(set_to_none=True)
    met = m.forward_backward(ex, lay, segments=segments)
    return met, {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}


def reference_step(m, ex, lay):
    m.zero_grad(set_to_none=True)
    loss_sum, met = reference_forward_sum(m, ex, lay)
    scale = 1.0 / met["weight"] if met["weight"] > 0 else 0.0
    (loss_sum * scale).backward()
    return met, {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}


def assert_same_step(got, want):
    (gm, gg), (wm, wg) = got, want
    assert gm["total"].tolist() == wm["total"].tolist()
    assert gm["correct"].tolist() == wm["correct"].tolist()
    assert gm["weight"] == wm["weight"] and gm["num_tokens"] == wm["num_tokens"]
    assert abs(gm["loss_sum"] - wm["loss_sum"]) <= 1e-6 * abs(wm["loss_sum"]) + 1e-12
    assert set(gg) == set(wg)
    for k, w in wg.items():
        # relative to the tensor's largest entry: rms_norm keeps fp32 statistics even for float64
        # inputs, so sums with cancellation (the embedding rows) agree to ~1e-8 of that, not 1e-15
        scale = float(w.abs().max())
        torch.testing.assert_close(gg[k], w, rtol=1e-6, atol=1e-6 * scale + 1e-15, msg=k)


def _d2t():
    counts = torch.zeros(V, dtype=torch.long)
    counts[torch.arange(0, V, 7)] = torch.arange(0, V, 7) % 5 + 1
    return build_vocab_mapping(counts, 48)[0]


# (id, make_model kwargs, options, segments)
CASES = [
    ("symmetric", {}, {}, 1),
    ("symmetric-3-layers", {"num_layers": 3}, {}, 1),
    ("symmetric-partition", {}, {}, 3),
    ("cross", {}, {"attention": "cross"}, 1),
    ("cross-partition", {}, {"attention": "cross"}, 4),
    ("window-sink-qwen3", {"layer_type": "qwen3"}, {"window": 12, "sink": 2}, 1),
    ("window-sink-partition", {}, {"window": 9, "sink": 1}, 2),
    ("cross-window-sink", {"layer_type": "qwen3"}, {"attention": "cross", "window": 10, "sink": 3}, 1),
    ("d2t", {"draft_vocab": 48, "d2t": "d2t"}, {}, 1),
    ("ce", {}, {"loss_kind": "ce"}, 1),
    ("mask-embedding", {}, {"train_embeddings": "mask"}, 1),
    ("trained-lm-head", {"k": 3}, {"train_lm_head": True}, 2),
]


@pytest.mark.parametrize("name,kw,opts,segments", CASES, ids=[c[0] for c in CASES])
def test_fused_step_equals_plain_pytorch_fp64(rng, name, kw, opts, segments):
    kw = dict(kw)
    if kw.get("d2t") == "d2t":
        kw["d2t"] = _d2t()
    m = make_model(rng, k=kw.pop("k", 4), options=PEagleOptions(**opts), **kw).double()
    # one-token documents, a padding tail, prompt (zero-weight) positions everywhere
    ex = make_example(rng, 120, (47, 1, 30, 1, 25))
    lay = m.sample_layout(ex, seed=5)
    assert lay.num_tokens > ex.input_ids.shape[0]
    weight = ex.loss_mask[(lay.anchor + lay.depth).long()]
    assert 0 < int(weight.sum()) < lay.num_tokens  # zero-weight rows are in the layout
    assert_same_step(fused_step(m, ex, lay, segments), reference_step(m, ex, lay))


@pytest.mark.parametrize("mode", ["symmetric", "cross"])
@pytest.mark.parametrize("n,docs", [(1, (1,)), (3, (3,)), (6, (2, 4)), (9, (9,))])
def test_tiny_rows_fp64(rng, mode, n, docs):
    """N below K, a single token, rows where no chain reaches the last depth."""
    m = make_model(rng, k=5, options=PEagleOptions(attention=mode)).double()
    ex = make_example(rng, n, docs, p_loss=1.0)
    lay = m.sample_layout(ex, seed=1)
    assert_same_step(fused_step(m, ex, lay, 1), reference_step(m, ex, lay))


def test_no_loss_tokens_fp64(rng):
    m = make_model(rng).double()
    ex = make_example(rng, 40, (40,))
    ex = dataclasses.replace(ex, loss_mask=torch.zeros_like(ex.loss_mask))
    lay = m.sample_layout(ex, seed=2)
    got, want = fused_step(m, ex, lay, 1), reference_step(m, ex, lay)
    assert got[0]["loss_sum"] == 0.0 and got[0]["weight"] == 0.0
    assert_same_step(got, want)


def test_plain_model_class_is_the_reference(rng, monkeypatch):
    """The benchmarks' plain-PyTorch drafter trains through reference_forward_sum, never the fused
    layers or loss (its step is bitwise the reference's), and refuses a sequence partition it does
    not implement."""
    cls = plain_model_class()
    m = make_model(rng).double()
    plain = cls(m.config, m.options).double()
    plain.load_state_dict(m.state_dict(), strict=False)
    plain.attach_verifier(
        norm_weight=m.verifier_norm_weight, lm_head_weight=torch.zeros(V, H), init_from_verifier=False
    )
    plain.verifier_lm_head_weight.copy_(m.verifier_lm_head_weight)
    ex = make_example(rng, 64, (40, 20))
    lay = m.sample_layout(ex, seed=3)

    def fused(*a, **k):
        raise AssertionError("the plain drafter ran a fused path")

    for name in ("run_layers", "loss_terms"):
        monkeypatch.setattr(plain, name, fused)
    got = plain.forward_backward(ex, lay)
    got_grads = {k: p.grad for k, p in plain.named_parameters() if p.grad is not None}
    want, want_grads = reference_step(plain, ex, lay)
    assert got["loss_sum"] == want["loss_sum"] and got["weight"] == want["weight"]
    assert got["correct"].tolist() == want["correct"].tolist()
    assert set(got_grads) == set(want_grads)
    for k, w in want_grads.items():
        assert torch.equal(got_grads[k], w), k
    with pytest.raises(ValueError, match="segments=1"):
        plain.forward_backward(ex, lay, segments=2)
