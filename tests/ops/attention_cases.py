"""Shared pieces of the COD attention tests (tests/ops/test_attention*.py): layouts, inputs, the
float64 references and the comparisons that report every output at once."""

import math

import torch

from peagle_ext.attention import cod_attention
from peagle_ext.cod import cod_sample
from peagle_ext.reference import dense_cod_mask, reference_cod_attention
from peagle_ext.testing import random_documents


def make_layout(g, n, *, cross=False, num_depths=8, max_anchors=None, max_doc_len=120, pad_tail=0, r=0.7, device="cpu"):
    doc, lm = random_documents(n, g, max_doc_len=max_doc_len, pad_tail=pad_tail)
    seed = int(torch.randint(0, 2**31, (1,), generator=g))
    lay = cod_sample(
        doc,
        lm,
        num_depths=num_depths,
        down_sample_ratio=r,
        max_anchors=max_anchors,
        depth0="anchors" if cross else "all",
        seed=seed,
    )
    return lay.to(device)


def make_inputs(g, lay, hq, hkv, d, dtype, device, cross, requires_grad=True):
    t, n = lay.num_tokens, lay.seq_len

    def rnd(*shape):
        x = torch.randn(*shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
        return x.requires_grad_(requires_grad)

    q, k, v = rnd(t, hq, d), rnd(t, hkv, d), rnd(t, hkv, d)
    ctx = {}
    if cross:
        ctx = dict(context_k=rnd(n, hkv, d), context_v=rnd(n, hkv, d))
    return q, k, v, ctx


def run_both(g, lay, q, k, v, ctx, *, window=None, sink=0, scale=None, return_go=False):
    """(ours, reference) outputs and gradients; the reference runs in float64 on the same device.
    return_go: also return the float64 grad_out used."""
    ins = [q, k, v] + list(ctx.values())
    out = cod_attention(q, k, v, lay, window=window, sink=sink, scale=scale, **ctx)
    go = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.device)
    grads = torch.autograd.grad(out, ins, go.to(out.dtype)) if out.numel() else [torch.zeros_like(x) for x in ins]
    ref_ins = [x.detach().double().requires_grad_(True) for x in ins]
    rctx = dict(zip(ctx.keys(), ref_ins[3:]))
    ref = reference_cod_attention(*ref_ins[:3], lay, window=window, sink=sink, scale=scale, **rctx)
    rgrads = torch.autograd.grad(ref, ref_ins, go) if ref.numel() else [torch.zeros_like(x) for x in ref_ins]
    names = ["out", "dq", "dk", "dv"] + ["d" + n for n in ctx.keys()]
    if return_go:
        return names, [out] + list(grads), [ref] + list(rgrads), go
    return names, [out] + list(grads), [ref] + list(rgrads)


def flash_backward_reference(q, k, v, ctx, lay, go, out, *, window=None, sink=0, scale=None):
    """float64 gradients of the flash-style backward as the kernels define it: P from the exact
    scores, dS = P * (dO V^T - delta) with delta = rowsum(dO * out) taken from the given `out`
    (the kernel's rounded 16-bit output, as FlashAttention does). With the exact output this is
    autograd's gradient (test_flash_backward_reference_is_autograd_with_exact_out)."""
    cross = bool(ctx)
    q, k, v, go, out = (x.detach().double() for x in (q, k, v, go, out))
    kk, vv = k, v
    if cross:
        kk = torch.cat([ctx["context_k"].detach().double(), k], 0)
        vv = torch.cat([ctx["context_v"].detach().double(), v], 0)
    group = q.shape[1] // k.shape[1]
    kk, vv = kk.repeat_interleave(group, 1), vv.repeat_interleave(group, 1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    mask = dense_cod_mask(lay, cross=cross, window=window, sink=sink).to(q.device)
    s = torch.einsum("thd,jhd->htj", q, kk) * scale
    s = s.masked_fill(~mask[None], float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)  # rows without keys: 0
    dp = torch.einsum("thd,jhd->htj", go, vv)
    delta = (go * out).sum(-1).transpose(0, 1)  # [H, T]
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("htj,jhd->thd", ds, kk) * scale
    dkk = torch.einsum("htj,thd->jhd", ds, q) * scale
    dvv = torch.einsum("htj,thd->jhd", p, go)
    hkv = k.shape[1]
    dkk = dkk.reshape(dkk.shape[0], hkv, group, -1).sum(2)
    dvv = dvv.reshape(dvv.shape[0], hkv, group, -1).sum(2)
    if not cross:
        return [dq, dkk, dvv]
    n = lay.seq_len
    return [dq, dkk[n:], dvv[n:], dkk[:n], dvv[:n]]


def rel_l2(x, ref, floor=0.0):
    """||x - ref|| / max(||ref||, floor * sqrt(numel)): floor > 0 keeps a reference that cancels
    to ~0 (one key per row: the exact dq is 0) from turning rounding noise into a huge ratio."""
    x, ref = x.double(), ref.double()
    den = max(ref.norm().item(), floor * math.sqrt(ref.numel()))
    num = (x - ref).norm().item()
    return num / den if den > 0 else num


def assert_close_all(names, ours, refs, *, tol, what, rel=True, floor=0.0):
    """Checks every tensor and reports all of them at once (one GPU run should say exactly
    which outputs of which configuration are off, and by how much)."""
    report, bad = [], False
    tols = list(tol) if isinstance(tol, (list, tuple)) else [tol] * len(names)
    for name, a, b, tol in zip(names, ours, refs, tols):
        if a.shape != b.shape:
            report.append(f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}")
            bad = True
            continue
        nonfinite = int((~torch.isfinite(a)).sum())
        if rel:
            err = rel_l2(a, b, floor) if nonfinite == 0 else float("inf")
        else:
            err = (a.double() - b.double()).abs().max().item() if nonfinite == 0 else float("inf")
        worst = ""
        if err > tol and nonfinite == 0 and a.numel():
            diff = (a.double() - b.double()).abs().reshape(a.shape[0], -1).amax(1)
            worst = f" worst rows {diff.topk(min(3, diff.numel())).indices.tolist()}"
        report.append(
            f"{name}: err {err:.2e} (tol {tol:.1e}){' NONFINITE=' + str(nonfinite) if nonfinite else ''}{worst}"
        )
        bad |= not (err <= tol)
    assert not bad, f"{what}: " + "; ".join(report)


def assert_rows_close(a, b, what, tol=2e-2):
    """Per (row, head) relative error of two [T, H, D] gradients computed with different summation
    orders and partitions of the keys (16-bit dS rounding may differ too): <= tol per row, with
    row norms floored at 0.1x the RMS row norm (rows with one key cancel to ~0). A missing or
    misplaced key block costs a row ~sqrt(64 / keys) of its norm, far above tol."""
    a64, b64 = a.double(), b.double()
    assert torch.isfinite(a64).all(), f"{what}: non-finite values"
    rn = b64.norm(dim=-1)
    floor = 0.1 * rn.pow(2).mean().sqrt().item()
    err = (a64 - b64).norm(dim=-1) / rn.clamp_min(max(floor, 1e-30))
    worst = err.flatten().topk(min(3, err.numel()))
    assert worst.values[0].item() <= tol, (
        f"{what}: worst (row, head) rel err {worst.values[0].item():.3e} at flat index "
        f"{worst.indices.tolist()} (tol {tol})"
    )
    assert rel_l2(a, b) <= 5e-3, f"{what}: rel err {rel_l2(a, b):.2e}"
