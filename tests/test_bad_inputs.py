"""Bad inputs at every public entry point and what each gets (docs/bad_inputs.md is the table;
every row there names its test, here or in the op's own test file).

The rule: a bad argument raises ValueError/TypeError naming it (the CLI turns those into exit
code 2 and a one-line message, no traceback); data-like values the op cannot check cheaply
(NaN/inf in activations) follow a documented propagation rule instead, which is tested here;
a corrupt or partial file on disk raises ValueError naming the file, never loads silently.
"""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from peagle_ext.attention import cod_attention
from peagle_ext.cod import CodLayout, cod_sample
from peagle_ext.loss import fused_linear_kl
from peagle_ext.model import PEagleDraftModel
from peagle_ext.reference import dense_cod_mask
from peagle_ext.testing import garbage_layout
from peagle_ext.vllm import prepare_parallel_draft_inputs
from tests.helpers import requires_cuda, run_cli, tiny_run_inputs, train_settings

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------
# cod_sample
# ------------------------------------------------------------------------------------------
def _doc_lm(n=40):
    doc = torch.tensor([0] * (n // 2) + [1] * (n - n // 2 - 3) + [-1] * 3, dtype=torch.int32)
    return doc, doc >= 0


def test_cod_sample_document_ids_beyond_int32():
    doc, lm = _doc_lm()
    big = doc.long()
    big[:5] = 2**31
    with pytest.raises(ValueError, match="document_ids must fit in int32"):
        cod_sample(big, lm)


def test_cod_sample_nan_loss_mask_is_rejected():
    doc, lm = _doc_lm()
    for bad in (float("nan"), float("inf"), 0.5):
        m = lm.float()
        m[3] = bad
        with pytest.raises(ValueError, match="loss_mask must hold only 0 and 1"):
            cod_sample(doc, m)


def test_cod_sample_non_contiguous_inputs_are_accepted():
    doc, lm = _doc_lm(60)
    wide_doc = torch.stack([doc, doc + 100], 1)[:, 0]  # stride 2
    wide_lm = torch.stack([lm, ~lm], 1)[:, 0]
    assert not wide_doc.is_contiguous() and not wide_lm.is_contiguous()
    a = cod_sample(wide_doc, wide_lm, num_depths=4, seed=3)
    b = cod_sample(doc, lm, num_depths=4, seed=3)
    assert a.depth_offsets == b.depth_offsets and torch.equal(a.anchor, b.anchor)


def test_cod_sample_bad_seed():
    doc, lm = _doc_lm()
    with pytest.raises(ValueError, match="seed"):
        cod_sample(doc, lm, seed=2**63)
    with pytest.raises(TypeError, match="seed"):
        cod_sample(doc, lm, seed=1.5)


# ------------------------------------------------------------------------------------------
# cod_attention
# ------------------------------------------------------------------------------------------
def _attn_case(g, *, dtype=torch.float64, cross=False, requires_grad=False):
    doc = torch.tensor([0] * 20 + [-1] * 3 + [1] * 15 + [-1] * 2, dtype=torch.int32)
    lay = cod_sample(doc, doc >= 0, num_depths=3, depth0="anchors" if cross else "all", seed=1)
    t, n = lay.num_tokens, lay.seq_len

    def rnd(r):
        return torch.randn(r, 2, 8, generator=g, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)

    q, k, v = rnd(t), rnd(t), rnd(t)
    ctx = dict(context_k=rnd(n), context_v=rnd(n)) if cross else {}
    return lay, q, k, v, ctx


def test_cod_attention_non_contiguous_inputs_equal_contiguous(rng):
    lay, q, k, v, _ = _attn_case(rng)
    want = cod_attention(q, k, v, lay)
    # [T, H, D] views with permuted strides (e.g. slices of a fused qkv projection)
    qn, kn, vn = (x.transpose(0, 1).contiguous().transpose(0, 1) for x in (q, k, v))
    assert not qn.is_contiguous()
    assert torch.equal(cod_attention(qn, kn, vn, lay), want)
    qkv = torch.cat([q, k, v], dim=-1)
    assert torch.equal(cod_attention(qkv[..., :8], qkv[..., 8:16], qkv[..., 16:], lay), want)


def test_cod_attention_device_mismatch_is_named(rng):
    lay, q, k, v, _ = _attn_case(rng, dtype=torch.float32)
    with pytest.raises(ValueError, match="layout must be on q's device"):
        cod_attention(q.to("meta"), k.to("meta"), v.to("meta"), lay)
    with pytest.raises(ValueError, match="k must be on"):
        cod_attention(q, k.to("meta"), v, lay)


def test_cod_attention_corrupt_layouts_are_rejected(rng):
    lay, q, k, v, _ = _attn_case(rng)
    n = lay.seq_len
    oob = lay.anchor.clone()
    oob[-1] = n + 5
    with pytest.raises(ValueError):
        cod_attention(q, k, v, CodLayout(oob, lay.depth, lay.depth_offsets, lay.document_ids))
    with pytest.raises(ValueError, match="layout.anchor must have shape"):
        bad_offsets = list(lay.depth_offsets)
        bad_offsets[-1] += 1
        cod_attention(q, k, v, CodLayout(lay.anchor, lay.depth, bad_offsets, lay.document_ids))
    with pytest.raises(ValueError, match="depth_offsets"):
        shuffled = [0, lay.depth_offsets[2], lay.depth_offsets[1], lay.depth_offsets[3]]
        cod_attention(q, k, v, CodLayout(lay.anchor, lay.depth, shuffled, lay.document_ids))
    with pytest.raises(TypeError, match="layout.anchor must have dtype"):
        cod_attention(q, k, v, CodLayout(lay.anchor.long(), lay.depth, lay.depth_offsets, lay.document_ids))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cross", [False, True])
def test_cod_attention_nan_propagates_only_along_the_mask(rng, dtype, cross):
    """NaN in q row i: exactly out row i is NaN. NaN in k or v row j (or context row c): exactly
    the rows that attend it are NaN. Every other row equals the clean result; rows without
    keys stay exactly 0. (+-inf in k is a limit, not an error: a row whose score is -inf just
    ignores that key; see the table.)"""
    lay, q, k, v, ctx = _attn_case(rng, dtype=dtype, cross=cross)
    mask = dense_cod_mask(lay, cross=cross)
    n = lay.seq_len
    clean = cod_attention(q, k, v, lay, **ctx)
    t = lay.num_tokens
    targets = [("q", 5), ("k", 7), ("v", t - 2)]
    if cross:
        targets += [("context_k", 6), ("context_v", n - 5)]
    for name, row in targets:
        ins = dict(q=q.clone(), k=k.clone(), v=v.clone(), **{kk: x.clone() for kk, x in ctx.items()})
        ins[name][row, 1, 3] = float("nan")
        out = cod_attention(ins.pop("q"), ins.pop("k"), ins.pop("v"), lay, **ins)
        bad = torch.isnan(out).any(-1).any(-1)
        if name == "q":
            want = torch.zeros(t, dtype=torch.bool)
            want[row] = bool(mask[row].any())
        else:
            col = row if name.startswith("context") or not cross else n + row
            want = mask[:, col].clone()
        assert want.any(), "the poisoned element must be attended by someone"
        assert torch.equal(bad, want), (name, bad.nonzero().flatten().tolist(), want.nonzero().flatten().tolist())
        assert torch.equal(out[~bad], clean[~bad])
        no_key = ~mask.any(1)
        assert torch.equal(out[no_key], torch.zeros_like(out[no_key]))


def test_cod_attention_nan_in_padding_rows_is_ignored(rng):
    """Rows whose anchor is padding attend nothing and are attended by nothing: garbage there
    (NaN/inf q/k/v) changes no output and no gradient outside those rows, which stay 0."""
    lay, q, k, v, _ = _attn_case(rng, requires_grad=False)
    pad = lay.document_ids[lay.anchor.long()] < 0
    assert pad.any()
    clean = cod_attention(q, k, v, lay)
    qp, kp, vp = q.clone(), k.clone(), v.clone()
    qp[pad] = float("nan")
    kp[pad] = float("inf")
    vp[pad] = float("nan")
    ins = [x.requires_grad_(True) for x in (qp, kp, vp)]
    out = cod_attention(*ins, lay)
    assert torch.equal(out[~pad], clean[~pad]) and torch.equal(out[pad], torch.zeros_like(out[pad]))
    grads = torch.autograd.grad(out.sum(), ins)
    for g_ in grads:
        assert torch.isfinite(g_[~pad]).all() and torch.equal(g_[pad], torch.zeros_like(g_[pad]))


@requires_cuda
@pytest.mark.parametrize("cross", [False, True])
def test_cuda_cod_attention_nan_rules(cross):
    """CUDA keeps the guaranteed part of the rule: a NaN q row gives exactly that NaN row, a NaN
    k/v row makes every row that attends it NaN (never a silently finite wrong value), padding
    rows stay 0. (Rows that share a key tile with a NaN key may ALSO become NaN on CUDA,
    0 * NaN in P @ V; that part is only guaranteed on the CPU.)"""
    g = torch.Generator().manual_seed(11)
    doc = torch.tensor([0] * 100 + [-1] * 7 + [1] * 90 + [-1] * 3, dtype=torch.int32)
    lay = cod_sample(doc, doc >= 0, num_depths=4, depth0="anchors" if cross else "all", seed=2).to("cuda")
    t, n = lay.num_tokens, lay.seq_len
    mask = dense_cod_mask(lay.to("cpu"), cross=cross)

    def rnd(r):
        return torch.randn(r, 2, 64, generator=g).to("cuda", torch.bfloat16)

    q, k, v = rnd(t), rnd(t), rnd(t)
    ctx = dict(context_k=rnd(n), context_v=rnd(n)) if cross else {}
    pad = (lay.document_ids[lay.anchor.long()] < 0).cpu()
    for name, row in [("q", 150 if not cross else 10), ("k", 40), ("v", t - 5)]:
        ins = dict(q=q.clone(), k=k.clone(), v=v.clone(), **{kk: x.clone() for kk, x in ctx.items()})
        ins[name][row, 0, 7] = float("nan")
        out = cod_attention(ins.pop("q"), ins.pop("k"), ins.pop("v"), lay, **ins).cpu()
        bad = torch.isnan(out.float()).any(-1).any(-1)
        if name == "q":
            assert bad.nonzero().flatten().tolist() == ([row] if bool(mask[row].any()) else [])
        else:
            col = n + row if cross else row
            assert bool(bad[mask[:, col]].all()), "a row attending a NaN key came out finite"
        assert torch.equal(out[pad], torch.zeros_like(out[pad]))


@requires_cuda
@pytest.mark.parametrize("cross", [False, True])
def test_cuda_cod_attention_garbage_layout_is_memory_safe(cross, monkeypatch):
    """On CUDA the layout's CONTENTS are trusted (checking them costs a host sync): a layout
    from cod_sample is always valid. A hand-built garbage one gives unspecified (finite) values
    but never a fault or an out-of-bounds access; validate=True turns the check on."""
    g = torch.Generator().manual_seed(5)
    for n, t, k in [(50, 80, 4), (200, 333, 8), (7, 9, 3)]:
        lay = garbage_layout(g, n, t, k, cross, "cuda")
        t = lay.num_tokens
        q, kk, v = (
            torch.randn(t, 4, 64, generator=g).to("cuda", torch.bfloat16).requires_grad_(True) for _ in range(3)
        )
        ctx = {}
        if cross:
            ctx = {
                name: torch.randn(n, 4, 64, generator=g).to("cuda", torch.bfloat16).requires_grad_(True)
                for name in ("context_k", "context_v")
            }
        out = cod_attention(q, kk, v, lay, window=9, sink=1, **ctx)
        torch.autograd.grad(out.float().sum(), [q, kk, v, *ctx.values()])
        torch.cuda.synchronize()
        assert bool(torch.isfinite(out.float()).all())
        with pytest.raises(ValueError, match="layout"):
            cod_attention(q, kk, v, lay, window=9, sink=1, validate=True, **ctx)


def test_cpu_cod_attention_garbage_layout_is_rejected(rng):
    for cross in (False, True):
        for n, t, k in [(50, 80, 4), (7, 9, 3)]:
            lay = garbage_layout(rng, n, t, k, cross, "cpu")
            t = lay.num_tokens
            q = torch.randn(t, 2, 8)
            ctx = dict(context_k=torch.randn(n, 2, 8), context_v=torch.randn(n, 2, 8)) if cross else {}
            with pytest.raises(ValueError):
                cod_attention(q, q, q, lay, **ctx)


# ------------------------------------------------------------------------------------------
# fused_linear_kl
# ------------------------------------------------------------------------------------------
def _kl_inputs(g, t=12, h=8, v=20, dtype=torch.float64):
    xd, wd, xt, wt = (
        torch.randn(*s, generator=g, dtype=torch.float64).to(dtype) for s in ((t, h), (v, h), (t, h), (v, h))
    )
    weight = torch.ones(t, dtype=torch.float64)
    depth = torch.randint(0, 3, (t,), generator=g)
    return xd, wd, xt, wt, weight, depth


def test_fused_linear_kl_non_contiguous_inputs_equal_contiguous(rng):
    xd, wd, xt, wt, weight, depth = _kl_inputs(rng)
    want, wm = fused_linear_kl(xd, wd, xt, wt, weight, depth, num_depths=3, chunk_size=5)
    nc = [x.t().contiguous().t() for x in (xd, wd, xt, wt)]
    assert not nc[0].is_contiguous()
    got, gm = fused_linear_kl(*nc, weight[::1], depth, num_depths=3, chunk_size=5)
    assert float(got) == float(want) and torch.equal(gm["correct"], wm["correct"])
    strided_w = torch.stack([weight, weight], 1)[:, 0]
    got2, _ = fused_linear_kl(xd, wd, xt, wt, strided_w, depth, num_depths=3, chunk_size=5)
    assert float(got2) == float(want)


def test_fused_linear_kl_device_mismatch_is_named(rng):
    xd, wd, xt, wt, weight, depth = _kl_inputs(rng)
    for name, over in [
        ("draft_head", dict(wd=wd.to("meta"))),
        ("weight", dict(weight=weight.to("meta"))),
        ("depth", dict(depth=depth.to("meta"))),
    ]:
        a = {**dict(xd=xd, wd=wd, xt=xt, wt=wt, weight=weight, depth=depth), **over}
        with pytest.raises(ValueError, match=f"{name} must be on"):
            fused_linear_kl(a["xd"], a["wd"], a["xt"], a["wt"], a["weight"], a["depth"], num_depths=3)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_fused_linear_kl_non_finite_activations_give_non_finite_loss(rng, bad):
    """NaN/inf in a counted row of draft_hidden / target_hidden (or anywhere in a head) is not an
    error (checking costs a pass): the loss comes out non-finite, and the trainer skips that
    step (test_train.py::test_nan_step_is_skipped)."""
    for which in range(4):
        args = list(_kl_inputs(rng))
        args[which][3 if which in (0, 2) else 5, 2] = bad
        xd = args[0].requires_grad_(True)
        loss, m = fused_linear_kl(*args, num_depths=3, chunk_size=4)
        assert not math.isfinite(float(loss)), which
        loss.backward()
        assert not bool(torch.isfinite(xd.grad).all())
        assert int(m["total"].sum()) == 12  # counts are still integers, whatever the values


def test_fused_linear_kl_non_finite_zero_weight_row(rng):
    """A zero-weight row is not in the loss and is not computed at all (no GEMM row): NaN there,
    on either side, leaves the loss and both gradients finite."""
    xd, wd, xt, wt, weight, depth = _kl_inputs(rng)
    weight[3] = 0
    clean, _ = fused_linear_kl(xd, wd, xt, wt, weight, depth, num_depths=3, chunk_size=4)
    xt_bad = xt.clone()
    xt_bad[3] = float("nan")
    loss_t, _ = fused_linear_kl(xd, wd, xt_bad, wt, weight, depth, num_depths=3, chunk_size=4)
    assert float(loss_t) == float(clean)
    xd_bad = xd.clone()
    xd_bad[3, 1] = float("nan")
    xg, wg = xd_bad.requires_grad_(True), wd.clone().requires_grad_(True)
    loss, _ = fused_linear_kl(xg, wg, xt, wt, weight, depth, num_depths=3, chunk_size=4)
    assert float(loss) == float(clean)
    loss.backward()
    assert torch.isfinite(xg.grad).all() and torch.equal(xg.grad[3], torch.zeros_like(xg.grad[3]))
    assert bool(torch.isfinite(wg.grad).all())


def test_fused_linear_kl_validate_false_stays_memory_safe(rng):
    """validate=False skips the value checks (each a host sync): out-of-range depths are simply
    not counted, and d2t's range is still checked by the native op (it indexes with it)."""
    xd, wd, xt, wt, weight, depth = _kl_inputs(rng)
    want, wm = fused_linear_kl(xd, wd, xt, wt, weight, depth, num_depths=3)
    wild = depth.clone()
    wild[0], wild[1] = -1, 10**6
    loss, m = fused_linear_kl(xd, wd, xt, wt, weight, wild, num_depths=3, validate=False)
    assert float(loss) == float(want)
    assert int(m["total"].sum()) == 10
    with pytest.raises(ValueError, match="d2t"):
        fused_linear_kl(
            xd,
            wd[:15],
            xt,
            wt,
            weight,
            depth,
            num_depths=3,
            validate=False,
            d2t=torch.full((15,), 10**6, dtype=torch.int64),
        )


# ------------------------------------------------------------------------------------------
# prepare_parallel_draft_inputs
# ------------------------------------------------------------------------------------------
def test_prepare_parallel_draft_inputs_copies_non_finite_hidden_bitwise():
    """The op moves data: NaN/inf (and their payload bits) are copied as they are, never checked."""
    from peagle_ext.reference.parallel_draft import parallel_draft_loop

    h = 4
    th = torch.randn(7, h)
    th[1, 0], th[4, 2], th[6, 3] = float("nan"), float("inf"), -float("inf")
    mh = torch.full((h,), float("nan"))
    args = (
        torch.arange(7, dtype=torch.int32),
        torch.arange(7, dtype=torch.int64),
        torch.tensor([11, 12], dtype=torch.int32),
        torch.tensor([0, 3, 7], dtype=torch.int32),
        torch.tensor([1, 0], dtype=torch.int32),
        th,
        mh,
        torch.arange(8, dtype=torch.int32).view(2, 4),
    )
    kw = dict(num_spec_tokens=3, mask_token_id=99, block_size=4, max_model_len=16)
    got = prepare_parallel_draft_inputs(*args, **kw)
    want = parallel_draft_loop(*args, **kw)
    assert torch.equal(got.hidden.view(torch.int32), want.hidden.view(torch.int32))
    assert bool(torch.isnan(got.hidden[got.is_masked]).all())


def test_prepare_parallel_draft_inputs_token_ids_are_not_range_checked():
    """Token ids are data for the op (any int32, negative included): copied, never indexed."""
    args = (
        torch.tensor([-5, 2**31 - 1, 7], dtype=torch.int32),
        torch.arange(3, dtype=torch.int64),
        torch.tensor([-1], dtype=torch.int32),
        torch.tensor([0, 3], dtype=torch.int32),
        None,
        torch.randn(3, 2),
        torch.zeros(2),
        torch.zeros(1, 4, dtype=torch.int32),
    )
    got = prepare_parallel_draft_inputs(*args, num_spec_tokens=2, mask_token_id=0, block_size=4, max_model_len=16)
    assert got.input_ids.tolist() == [2**31 - 1, 7, -1, 0]


# ------------------------------------------------------------------------------------------
# PEagleDraftModel.from_pretrained: missing, corrupt and partial checkpoints
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    from tests.helpers import make_model

    d = tmp_path_factory.mktemp("ckpt") / "good"
    m = make_model(torch.Generator().manual_seed(0), num_layers=1, k=3, draft_vocab=200, d2t=None)
    m.save_pretrained(d)
    return d


def _mutated(saved_model, tmp_path, mutate):
    d = tmp_path / "ck"
    shutil.copytree(saved_model, d)
    mutate(d)
    return d


def _edit_config(fn):
    def mutate(d):
        c = json.loads((d / "config.json").read_text())
        fn(c)
        (d / "config.json").write_text(json.dumps(c))

    return mutate


def _edit_weights(fn):
    def mutate(d):
        from safetensors.torch import load_file, save_file

        sd = load_file(str(d / "model.safetensors"))
        fn(sd)
        save_file(sd, str(d / "model.safetensors"))

    return mutate


def _truncate(name, keep):
    def mutate(d):
        b = (d / name).read_bytes()
        (d / name).write_bytes(b[: keep(len(b))])

    return mutate


FROM_PRETRAINED_CASES = [
    # id, mutation, exception, message
    ("no_config", lambda d: (d / "config.json").unlink(), FileNotFoundError, "no config.json"),
    ("no_weights", lambda d: (d / "model.safetensors").unlink(), FileNotFoundError, "no model.safetensors"),
    (
        "garbage_weights",
        lambda d: (d / "model.safetensors").write_bytes(b"\x00garbage" * 9),
        ValueError,
        "model.safetensors is not a readable safetensors file",
    ),
    ("empty_weights", lambda d: (d / "model.safetensors").write_bytes(b""), ValueError, "not a readable safetensors"),
    (
        "half_written_weights",
        _truncate("model.safetensors", lambda n: n // 2),
        ValueError,
        "not a readable safetensors",
    ),
    ("truncated_header", _truncate("model.safetensors", lambda n: 12), ValueError, "not a readable safetensors"),
    ("half_written_config", _truncate("config.json", lambda n: n // 2), ValueError, "config.json is not valid JSON"),
    ("empty_config", lambda d: (d / "config.json").write_text(""), ValueError, "not valid JSON"),
    ("config_not_an_object", lambda d: (d / "config.json").write_text("[1, 2]"), ValueError, "JSON object"),
    (
        "other_model_type",
        _edit_config(lambda c: c.update(speculators_model_type="eagle3")),
        ValueError,
        "speculators_model_type is 'eagle3'",
    ),
    (
        "no_layer_config",
        _edit_config(lambda c: c.pop("transformer_layer_config")),
        ValueError,
        "missing transformer_layer_config",
    ),
    (
        "no_speculators_config",
        _edit_config(lambda c: c.pop("speculators_config")),
        ValueError,
        "missing speculators_config",
    ),
    (
        "k_zero",
        _edit_config(lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=0)),
        ValueError,
        r"speculative_tokens \(K\) must be in \[1, 64\]",
    ),
    (
        "no_proposal_methods",
        _edit_config(lambda c: c["speculators_config"].update(proposal_methods=[])),
        ValueError,
        "needs proposal_methods",
    ),
    (
        "layer_type_gpt2",
        _edit_config(lambda c: c["transformer_layer_config"].update(model_type="gpt2")),
        ValueError,
        "model_type must be one of",
    ),
    (
        "hidden_size_mismatch",
        _edit_config(lambda c: c.update(target_hidden_size=96)),
        ValueError,
        "verifier/draft hidden size mismatch",
    ),
    (
        "mask_token_out_of_vocab",
        _edit_config(lambda c: c.update(mask_token_id=10**6)),
        ValueError,
        "mask_token_id 1000000 is outside",
    ),
    (
        "draft_vocab_mismatch",
        _edit_config(lambda c: c.update(draft_vocab_size=100)),
        ValueError,
        "checkpoint tensor .* has shape",
    ),
    ("missing_tensor", _edit_weights(lambda sd: sd.pop("fc.weight")), ValueError, r"missing \['fc.weight'\]"),
    (
        "verifier_tensor_inside",
        _edit_weights(lambda sd: sd.update({"verifier_lm_head.weight": torch.zeros(2, 2)})),
        ValueError,
        "unexpected",
    ),
    (
        "wrong_shape",
        _edit_weights(lambda sd: sd.update({"fc.weight": sd["fc.weight"][:, :7].contiguous()})),
        ValueError,
        "fc.weight has shape",
    ),
    (
        "int_weights",
        _edit_weights(lambda sd: sd.update({"norm.weight": sd["norm.weight"].int()})),
        ValueError,
        "norm.weight has dtype int32",
    ),
    ("float_d2t", _edit_weights(lambda sd: sd.update({"d2t": sd["d2t"].float()})), ValueError, "d2t has dtype"),
    (
        "d2t_out_of_vocab",
        _edit_weights(lambda sd: sd.update({"d2t": sd["d2t"] + 10**6})),
        ValueError,
        "d2t maps a draft id outside the vocab",
    ),
    (
        "d2t_not_increasing",
        _edit_weights(lambda sd: sd.update({"d2t": sd["d2t"].flip(0) * 0 - torch.arange(200)})),
        ValueError,
        "strictly increasing",
    ),
    ("t2d_mismatch", _edit_weights(lambda sd: sd["t2d"].logical_not_()), ValueError, "t2d does not mark exactly"),
]


@pytest.mark.parametrize("case,mutate,exc,match", FROM_PRETRAINED_CASES, ids=[c[0] for c in FROM_PRETRAINED_CASES])
def test_from_pretrained_rejects_corrupt_checkpoints(saved_model, tmp_path, case, mutate, exc, match):
    d = _mutated(saved_model, tmp_path, mutate)
    with pytest.raises(exc, match=match):
        PEagleDraftModel.from_pretrained(d)


def test_from_pretrained_missing_directory_and_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a P-EAGLE checkpoint"):
        PEagleDraftModel.from_pretrained(tmp_path / "nope")
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(FileNotFoundError, match="not a P-EAGLE checkpoint"):
        PEagleDraftModel.from_pretrained(f)


def test_from_pretrained_loads_non_finite_weights_but_export_refuses(saved_model, tmp_path):
    """A checkpoint is data: from_pretrained loads NaN weights as they are (to inspect them);
    `peagle export` refuses to publish them, and the trainer never writes them
    (test_train.py::test_checkpoints_are_atomic_and_pruned)."""
    from peagle_ext.train import TrainError, export

    d = _mutated(saved_model, tmp_path, _edit_weights(lambda sd: sd["fc.weight"].__setitem__((0, 0), float("nan"))))
    m = PEagleDraftModel.from_pretrained(d)
    assert math.isnan(float(m.fc.weight[0, 0]))
    with pytest.raises(TrainError, match="non-finite values in fc.weight"):
        export(str(d), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


# ------------------------------------------------------------------------------------------
# export
# ------------------------------------------------------------------------------------------
def test_export_bad_sources_and_destinations(saved_model, tmp_path):
    from peagle_ext.train import TrainError, export

    with pytest.raises(TrainError, match="does not exist"):
        export(str(tmp_path / "missing"), str(tmp_path / "x"))
    run = tmp_path / "run"
    (run / "checkpoint-5.tmp").mkdir(parents=True)  # a killed write: not a checkpoint
    shutil.copytree(saved_model, run / "checkpoint-6")  # no COMPLETE marker: not one either
    with pytest.raises(TrainError, match="holds no P-EAGLE checkpoint"):
        export(str(run), str(tmp_path / "x"))
    with pytest.raises(TrainError, match="destination equals the source"):
        export(str(saved_model), str(saved_model))
    with pytest.raises(TrainError, match="--dtype"):
        export(str(saved_model), str(tmp_path / "x"), dtype="int8")
    # never replace something that is not an earlier export
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(TrainError, match="refusing to replace"):
        export(str(saved_model), str(precious))
    afile = tmp_path / "a_file"
    afile.write_text("keep me too")
    with pytest.raises(TrainError, match="refusing to replace"):
        export(str(saved_model), str(afile))
    assert (precious / "notes.txt").read_text() == "keep me" and afile.read_text() == "keep me too"
    # an earlier export (or an empty directory) is replaced
    out = export(str(saved_model), str(tmp_path / "exp"))
    out2 = export(str(saved_model), str(tmp_path / "exp"), dtype="float32")
    assert out == out2 and not (tmp_path / "exp.old").exists() and not (tmp_path / "exp.tmp").exists()
    corrupt = _mutated(saved_model, tmp_path, _truncate("model.safetensors", lambda n: n - 100))
    with pytest.raises(ValueError, match="not a readable safetensors"):
        export(str(corrupt), str(tmp_path / "y"))


# ------------------------------------------------------------------------------------------
# the trainer and the CLI
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_run_inputs(tmp_path_factory.mktemp("tiny"), n=10, words=(4, 10))


def test_verifier_with_corrupt_files(tiny, tmp_path):
    from peagle_ext.data import DataError, load_verifier

    v, _ = tiny
    half = tmp_path / "half"
    shutil.copytree(v, half)
    b = (half / "model.safetensors").read_bytes()
    (half / "model.safetensors").write_bytes(b[: len(b) // 2])
    with pytest.raises(DataError, match="cannot load the model"):
        load_verifier(str(half))
    badcfg = tmp_path / "badcfg"
    shutil.copytree(v, badcfg)
    (badcfg / "config.json").write_text("{truncated")
    with pytest.raises(DataError, match="config"):
        load_verifier(str(badcfg))


def test_data_file_that_is_not_text(tmp_path):
    import gzip

    from peagle_ext.data import DataError, load_conversations

    b = tmp_path / "binary.jsonl"
    b.write_bytes(b"\xff\xfe\x00\x81 not utf-8\n")
    with pytest.raises(DataError, match="not UTF-8 text"):
        load_conversations(str(b))
    gz = tmp_path / "cut.jsonl.gz"
    line = json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
    gz.write_bytes(gzip.compress((line + "\n").encode() * 50)[:40])
    with pytest.raises(DataError, match="corrupt or truncated gzip"):
        load_conversations(str(gz))


def test_train_settings_out_of_range_are_named():
    from peagle_ext.train import TrainError, TrainSettings

    cases = [
        (dict(num_depths=0), "--num-depths"),
        (dict(num_depths=65), "--num-depths"),
        (dict(lr=float("nan")), "--lr"),
        (dict(lr=0.0), "--lr"),
        (dict(max_steps=0), "--max-steps"),
        (dict(val_fraction=1.0), "--val-fraction"),
        (dict(batch_size=0), "--batch-size"),
        (dict(window=0), "--window"),
        (dict(down_sample_ratio=0.0), "--down-sample-ratio"),
        (dict(attention="full"), "--attention"),
        (dict(schedule="step"), "--schedule"),
        (dict(loss="mse"), "--loss"),
        (dict(keep_checkpoints=0), "--keep-checkpoints"),
        (dict(profile_steps=-1), "--profile-steps"),
        (dict(profile_warmup=-1), "--profile-warmup"),
        (dict(dedup=1), "--dedup"),
    ]
    if not torch.cuda.is_available():
        cases.append((dict(device="cuda"), "no CUDA GPU"))
    for kw, match in cases:
        with pytest.raises(TrainError, match=match):
            TrainSettings(**kw).validate()


def test_token_ids_outside_the_verifier_vocab(tiny, tmp_path):
    """A tokenizer that does not belong to the verifier (ids past its vocab) is refused."""
    from transformers import AutoTokenizer

    from peagle_ext.train import RunLog, TrainError, prepare_data

    v, _ = tiny
    tok = AutoTokenizer.from_pretrained(str(v))
    log = RunLog(tmp_path / "log.jsonl", echo=False)
    try:
        with pytest.raises(TrainError, match="outside the verifier vocab"):
            prepare_data(train_settings(tiny, tmp_path / "o"), tok, 40, log)
    finally:
        log.close()


def test_mask_token_that_the_data_uses(tiny, tmp_path):
    from transformers import AutoTokenizer

    from peagle_ext.train import TrainError, train

    v, _ = tiny
    used = AutoTokenizer.from_pretrained(str(v)).convert_tokens_to_ids("<|im_start|>")  # in every conversation
    with pytest.raises(TrainError, match=f"mask_token_id {used} .* occurs as a real token"):
        train(train_settings(tiny, tmp_path / "o", mask_token_id=used))


@pytest.mark.parametrize("bad", ["missing.jsonl", "notes.txt", "folder"])
def test_bad_train_data_is_named_before_the_output_directory_exists(tiny, tmp_path, bad):
    """A missing --data file, one of an unknown format and a directory datasets did not write are
    named before the run makes anything: no output directory, lock or log is left."""
    from peagle_ext.data import DataError
    from peagle_ext.train import train

    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "folder").mkdir()
    out = tmp_path / "run"
    with pytest.raises(DataError, match=bad):
        train(train_settings(tiny, out, data=str(tmp_path / bad)))
    assert not out.exists()


def test_train_output_that_is_a_file(tiny, tmp_path):
    from peagle_ext.train import TrainError, train

    f = tmp_path / "out"
    f.write_text("x")
    with pytest.raises(TrainError, match="exists and is not a directory"):
        train(train_settings(tiny, f))


def test_resume_from_a_damaged_complete_checkpoint(tiny, tmp_path):
    """A checkpoint is fsynced before it is marked complete, so this needs damage after the
    fact (disk, hand edits): --resume names it and says how to fall back, it never loads it."""
    from peagle_ext.train import TrainError, train

    out = tmp_path / "run"
    train(train_settings(tiny, out, max_steps=2))
    newest = out / "checkpoint-2"
    for victim, damage in [("trainer_state.json", b"{not json"), ("model.safetensors", b"")]:
        backup = (newest / victim).read_bytes()
        (newest / victim).write_bytes(damage)
        with pytest.raises(TrainError, match="checkpoint-2 is marked complete but cannot be read"):
            train(train_settings(tiny, out, max_steps=3, resume=True))
        (newest / victim).write_bytes(backup)
    # moving it away (as the message says) resumes from the one before
    shutil.move(str(newest), str(tmp_path / "moved"))
    r = train(train_settings(tiny, out, max_steps=3, resume=True))
    assert r.steps == 3 and r.final_dir is not None


def test_pruning_removes_the_complete_marker_first(tmp_path, monkeypatch):
    """A kill in the middle of pruning an old checkpoint must not leave a directory that still
    says COMPLETE but misses files."""
    import peagle_ext.train as T
    from tests.helpers import make_model

    m = make_model(torch.Generator().manual_seed(1), num_layers=1, k=2)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad])
    sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    seen = []
    real_rmtree = shutil.rmtree

    def spy(p, *a, **k):
        p = Path(p)
        if p.name.startswith(T.CHECKPOINT_PREFIX) and p.name[len(T.CHECKPOINT_PREFIX) :].isdigit():
            seen.append((p.name, (p / T.COMPLETE_MARKER).exists()))
        return real_rmtree(p, *a, **k)

    monkeypatch.setattr(shutil, "rmtree", spy)
    for step in (1, 2, 3):
        T.save_checkpoint(tmp_path, step, m, opt, sch, {"step": step}, keep=1)
    assert seen == [("checkpoint-1", False), ("checkpoint-2", False)]
    assert [s for s, _ in T.list_checkpoints(tmp_path)] == [3]


def test_cli_bad_inputs_exit_2_without_traceback(tiny, tmp_path, saved_model):
    v, data = tiny
    afile = tmp_path / "afile"
    afile.write_text("x")
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\xfe\x00")
    corrupt = _mutated(saved_model, tmp_path, _truncate("model.safetensors", lambda n: n // 3))
    runs = [
        (
            ["train", "--verifier", str(v), "--data", str(data), "--output", str(afile), "--max-steps", "1"],
            "is not a directory",
        ),
        (
            [
                "train",
                "--verifier",
                str(v),
                "--data",
                str(binary),
                "--output",
                str(tmp_path / "o"),
                "--max-steps",
                "1",
                "--seq-len",
                "64",
            ],
            "not UTF-8",
        ),
        (["export", str(corrupt), str(tmp_path / "e")], "not a readable safetensors"),
    ]
    for args, match in runs:
        r = run_cli(args)
        assert r.returncode == 2, (args, r.stderr[-2000:])
        assert match in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


# ------------------------------------------------------------------------------------------
# peagle eval (when the eval subcommand is installed)
# ------------------------------------------------------------------------------------------
def _has_eval():
    from peagle_ext.cli import SUBCOMMANDS, build_parser

    build_parser()
    return "eval" in SUBCOMMANDS


@pytest.mark.skipif(not _has_eval(), reason="peagle eval is not part of this build")
def test_eval_bad_inputs(tiny, tmp_path):
    v, _ = tiny
    runs = [
        (["--draft", str(tmp_path / "missing")], "no such directory"),
        (["--draft", str(tmp_path), "--num-prompts", "0"], "--num-prompts must be an int >= 1"),
        (["--draft", str(tmp_path)], "not a P-EAGLE checkpoint"),
    ]
    # a drafter for this verifier: --attention flash cannot run on the CPU, and says so
    from transformers import AutoConfig

    from peagle_ext.model import PEagleDraftModel

    cfg = AutoConfig.from_pretrained(v)
    PEagleDraftModel.from_verifier(cfg, num_depths=2, mask_token_id=cfg.vocab_size).save_pretrained(tmp_path / "d")
    runs += [
        (["--draft", str(tmp_path / "d"), "--attention", "flash"], "--attention: attention='flash' cannot run"),
        (["--draft", str(tmp_path / "d"), "--attention", "flash", "--verifier-impl", "hf"], "--attention flash needs"),
    ]
    for extra, match in runs:
        r = run_cli(["eval", "--verifier", str(v), "--bench", "mtbench", "--max-new-tokens", "4", *extra])
        assert r.returncode == 2, (extra, r.stderr[-2000:])
        assert match in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
