"""What the training step computes and how it reads shared rows: the layer-0 row map
(peagle_ext.model.rows: slice + MASK broadcast, or distinct anchors) against a plain index
gather, no duplicate-index gather in the step's autograd graph, the last layer past its
attention on the weighted rows only, and the frozen heads cast once."""

import pytest
import torch

from peagle_ext.model import PEagleOptions
from peagle_ext.model.rows import LayerZeroRows, gather_distinct_rows, weighted_rows
from tests.helpers import make_model
from tests.model.test_exactness import make_example

pytestmark = pytest.mark.usefixtures("one_thread")


def old_rows(layout):
    """Each token's layer-0 row as one index: depth 0 its anchor, deeper the MASK row N."""
    n = layout.seq_len
    return torch.where(layout.depth == 0, layout.anchor.long(), torch.full_like(layout.anchor, n).long())


@pytest.mark.parametrize("mode", ["symmetric", "cross"])
def test_take_equals_index_gather_with_gradients(rng, mode):
    m = make_model(rng, options=PEagleOptions(attention=mode))
    ex = make_example(rng, 70, (30, 1, 25))
    lay = m.sample_layout(ex, seed=3)
    rows = LayerZeroRows.of_layout(lay)
    assert (rows.real_rows is None) == (mode == "symmetric")
    x = torch.randn(71, 3, 5, generator=rng, dtype=torch.float64, requires_grad=True)
    g = torch.randn(lay.num_tokens, 3, 5, generator=rng, dtype=torch.float64)
    got = rows.take(x)
    (gx,) = torch.autograd.grad(got, x, g)
    want = x[old_rows(lay)]
    (wx,) = torch.autograd.grad(want, x, g)
    assert torch.equal(got, want)
    torch.testing.assert_close(gx, wx, rtol=1e-12, atol=1e-12)


def test_take_mask_only_and_empty():
    x = torch.arange(12.0).reshape(4, 3).requires_grad_()
    only_mask = LayerZeroRows(3, 0, 5, None).take(x)
    assert only_mask.is_contiguous() and torch.equal(only_mask, x[3:4].expand(5, 3))
    only_mask.sum().backward()
    assert x.grad[:3].abs().sum() == 0 and torch.equal(x.grad[3], torch.full((3,), 5.0))
    assert LayerZeroRows(3, 0, 0, None).take(x).shape == (0, 3)


def test_gather_distinct_rows_backward_scatters():
    x = torch.randn(6, 2, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([0, 2, 5])
    y = gather_distinct_rows(x, idx)
    g = torch.randn(3, 2, dtype=torch.float64)
    y.backward(g)
    want = torch.zeros(6, 2, dtype=torch.float64)
    want[idx] = g
    assert torch.equal(x.grad, want) and torch.equal(y, x.detach()[idx])
    assert weighted_rows(torch.tensor([1.0, 0.0, 2.0])).tolist() == [0, 2]
    assert weighted_rows(torch.ones(4)) is None


def _graph_nodes(t):
    seen, names, stack = set(), set(), [t.grad_fn]
    while stack:
        f = stack.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        names.add(type(f).__name__)
        stack.extend(nf for nf, _ in f.next_functions)
    return names


@pytest.mark.parametrize("mode", ["symmetric", "cross"])
def test_step_has_no_duplicate_index_gather(rng, mode):
    """No IndexBackward (its backward is index_put with accumulate: a sort of the indices and a
    serial sum over each run of equal ones) anywhere in the step's graph."""
    m = make_model(rng, options=PEagleOptions(attention=mode))
    ex = make_example(rng, 80, (40, 30))
    loss_sum, _ = m.forward_sum(ex, m.sample_layout(ex, seed=2))
    names = _graph_nodes(loss_sum)
    assert not any(n.startswith(("IndexBackward", "IndexPutBackward")) for n in names), names
    assert "ExpandBackward0" in names  # the MASK row's broadcast


@pytest.mark.parametrize("mode,segments", [("symmetric", 1), ("cross", 1), ("symmetric", 3), ("cross", 2)])
def test_last_layer_runs_the_weighted_rows_only(rng, mode, segments):
    """o_proj and the MLP of the last layer see only rows of weight > 0 (their output feeds
    nothing but the loss); the first layer sees every token."""
    m = make_model(rng, num_layers=2, options=PEagleOptions(attention=mode))
    ex = make_example(rng, 90, (50, 1, 30))
    lay = m.sample_layout(ex, seed=4)
    seen = {0: 0, 1: 0}
    hooks = [
        m.layers[i].mlp.register_forward_pre_hook(lambda mod, a, i=i: seen.__setitem__(i, seen[i] + a[0].shape[0]))
        for i in (0, 1)
    ]
    m.forward_backward(ex, lay, segments=segments)
    for h in hooks:
        h.remove()
    weighted = int(ex.loss_mask[(lay.anchor + lay.depth).long()].sum())
    assert weighted < lay.num_tokens
    assert seen[1] == weighted
    # layer 0 runs every token (cross: plus the stream's N positions, symmetric partition: the
    # stream holds depth 0)
    assert seen[0] == lay.num_tokens + (ex.input_ids.shape[0] if mode == "cross" else 0)


def test_frozen_heads_are_cast_once_and_follow_in_place_writes(rng):
    m = make_model(rng)
    w = m.verifier_lm_head_weight
    a = m.frozen_copy("verifier_lm_head", w, torch.bfloat16)
    assert a.dtype == torch.bfloat16 and torch.equal(a, w.to(torch.bfloat16))
    assert m.frozen_copy("verifier_lm_head", w, torch.bfloat16) is a
    with torch.no_grad():
        w.mul_(2)  # e.g. attach_verifier or a checkpoint load writing in place
    b = m.frozen_copy("verifier_lm_head", w, torch.bfloat16)
    assert b is not a and torch.equal(b, w.to(torch.bfloat16))
    assert m.frozen_copy("verifier_lm_head", w, torch.float32) is w  # no cast needed
    # a trainable lm_head is never cached: the loss casts it under autograd
    m.lm_head.weight.requires_grad_(True)
    ex = make_example(rng, 40, (40,))
    m.forward_backward(ex, m.sample_layout(ex, seed=1))
    assert m.lm_head.weight.grad is not None
