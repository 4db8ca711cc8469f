"""Drives the CUDA COD attention kernels (metadata, forward, backward) for compute-sanitizer
(memcheck / racecheck / initcheck / synccheck):
    compute-sanitizer --tool racecheck --error-exitcode 99 python3 tools/sanitize/sanitize_attention.py
`run()` is also called by tools/sanitize/sanitize_ops.py. It runs sanitize_case() (both
modes, D 64 and 128, window + sink, GQA) and then a few more shapes that reach the other paths
(no window, window without sink, GQA 1 and 8, padding rows, T = 1, an all-padding layout, tile
tails), each checked against the CPU op in float32 (bf16 tolerance), and adversarial inputs
whose values are unspecified but whose accesses must stay in bounds: hand-built garbage layouts,
the raw forward / backward with garbage ranges and chains (peagle_ext.testing.garbage_metadata)
and with the metadata of another layout. Every shape runs for both kernel families: the chosen
one and PEAGLE_ATTN_KERNEL=portable. Small on purpose: the sanitizers slow kernels down 10-100x.

    python3 tools/sanitize/sanitize_attention.py [--soft] [--variant K=V[,K=V...]]...
--variant runs the shapes once per variant with those extra environment settings; --soft reports CPU-vs-CUDA tolerance misses and goes on (for
compute-sanitizer runs, whose verdict is the sanitizer's; the GPU tests judge the values) and
ends with "tolerance misses: N"."""

import argparse
import math
import os
import sys

import torch

from peagle_ext.attention import cod_attention, cod_attention_metadata
from peagle_ext.cod import cod_sample
from peagle_ext.reference import reference_cod_attention
from peagle_ext.testing import garbage_layout, garbage_metadata

FAMILIES = ("auto", "portable")  # PEAGLE_ATTN_KERNEL unset, and the portable override


def sanitize_case():
    """A small fwd+bwd through every kernel (symmetric and cross, both head dims, sink, GQA)."""
    for cross in (False, True):
        for d in (64, 128):
            doc = torch.tensor([0] * 150 + [-1] * 10 + [1] * 90, dtype=torch.int32)
            lay = cod_sample(doc, doc >= 0, num_depths=4, depth0="anchors" if cross else "all", seed=1).to("cuda")
            t, n = lay.num_tokens, lay.seq_len
            mk = lambda r, h: torch.randn(r, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
            q, k, v = mk(t, 4), mk(t, 2), mk(t, 2)
            ctx = dict(context_k=mk(n, 2), context_v=mk(n, 2)) if cross else {}
            out = cod_attention(q, k, v, lay, window=40, sink=3, **ctx)
            out.float().sum().backward()
    torch.cuda.synchronize()
    print("sanitize case done")


def _check(doc, *, cross, d, hq, hkv, window, sink, num_depths=4, seed=3):
    g = torch.Generator().manual_seed(seed)
    lay = cod_sample(doc, doc >= 0, num_depths=num_depths, depth0="anchors" if cross else "all", seed=seed)
    t, n = lay.num_tokens, lay.seq_len
    shapes = [(t, hq, d), (t, hkv, d), (t, hkv, d)] + ([(n, hkv, d), (n, hkv, d)] if cross else [])
    cpu = [torch.randn(*s, generator=g).bfloat16().float().requires_grad_(True) for s in shapes]
    gpu = [x.detach().cuda().bfloat16().requires_grad_(True) for x in cpu]
    go = torch.randn(t, hq, d, generator=g).bfloat16()

    def call(ins, layout):
        ctx = dict(context_k=ins[3], context_v=ins[4]) if cross else {}
        return cod_attention(ins[0], ins[1], ins[2], layout, window=window, sink=sink, **ctx)

    out_g = call(gpu, lay.to("cuda"))
    grads_g = torch.autograd.grad(out_g, gpu, go.cuda()) if t else [torch.zeros_like(x) for x in gpu]
    out_c = call(cpu, lay)
    grads_c = torch.autograd.grad(out_c, cpu, go.float()) if t else [torch.zeros_like(x) for x in cpu]
    # torch's own SDPA (dense mask) on the same bf16 inputs, on the CPU (so no torch kernel runs
    # under the sanitizer): with 1-3 keys per row (T = 1: the exact dq is 0) bf16 rounding alone
    # exceeds a relative bound, so the bound is 2e-2 relative or twice torch's own error
    base = [x.detach().bfloat16().requires_grad_(True) for x in cpu]
    bctx = dict(context_k=base[3], context_v=base[4]) if cross else {}
    out_t = reference_cod_attention(base[0], base[1], base[2], lay, window=window, sink=sink, **bctx)
    grads_t = torch.autograd.grad(out_t, base, go) if t else [torch.zeros_like(x) for x in base]
    torch.cuda.synchronize()
    names = ["out", "dq", "dk", "dv", "dck", "dcv"]
    for name, a, b, c in zip(names, [out_g] + list(grads_g), [out_c] + list(grads_c), [out_t] + list(grads_t)):
        a, b, c = a.detach().float().cpu(), b.detach(), c.detach().float().cpu()
        assert torch.isfinite(a).all(), (name, cross, d, hq, hkv, window, sink)
        if not b.numel():
            continue
        err, torch_err = float((a - b).norm()), float((c - b).norm())
        # + a floor of 1e-4 x |grad_out| (the natural scale of every gradient here, inputs are
        # unit-variance): at T = 1 torch's bf16 path cancels to exactly 0 while the delta-based
        # backward leaves fp32 rounding (~1e-6); a real indexing bug is of order |grad_out|
        bound = max(2e-2 * float(b.norm()), 2.0 * torch_err, 1e-4 * float(go.float().norm()))
        if bound > 0:
            assert err <= bound, (name, err, bound, cross, d, hq, hkv, window, sink)
        else:
            assert float(a.abs().max()) == 0.0, (name, "expected zeros")


def run():
    assert torch.cuda.is_available(), "needs a GPU and the CUDA build"
    saved = os.environ.pop("PEAGLE_ATTN_KERNEL", None)
    try:
        for family in FAMILIES:
            if family != "auto":
                os.environ["PEAGLE_ATTN_KERNEL"] = family
            _run_shapes()
            print(f"sanitize_attention: {family} kernels done", flush=True)
    finally:
        os.environ.pop("PEAGLE_ATTN_KERNEL", None)
        if saved is not None:
            os.environ["PEAGLE_ATTN_KERNEL"] = saved
    print("sanitize_attention: ok")


def _run_shapes():
    sanitize_case()
    two_docs = torch.tensor([0] * 130 + [-1] * 5 + [1] * 61, dtype=torch.int32)  # tile tails, padding rows
    for cross in (False, True):
        _check(two_docs, cross=cross, d=64, hq=8, hkv=1, window=None, sink=0)
        _check(two_docs, cross=cross, d=128, hq=4, hkv=4, window=17, sink=0)
        _check(two_docs, cross=cross, d=64, hq=2, hkv=1, window=5, sink=2, num_depths=8)
        _check(torch.tensor([0, 0], dtype=torch.int32), cross=cross, d=64, hq=2, hkv=2, window=None, sink=0)
    _check(torch.zeros(1, dtype=torch.int32), cross=False, d=64, hq=2, hkv=1, window=None, sink=0)  # T = 1
    _check(torch.full((40,), -1, dtype=torch.int32), cross=False, d=128, hq=2, hkv=1, window=8, sink=1)
    _garbage_layouts()
    _garbage_metadata()


def _garbage_layouts():
    """Hand-built layouts that break every content rule (unchecked on CUDA unless validate=True):
    values are unspecified, but memcheck must see no out-of-bounds access."""
    g = torch.Generator().manual_seed(5)
    for cross in (False, True):
        for n, t, k, d in [(50, 80, 4, 64), (130, 200, 8, 128)]:
            lay = garbage_layout(g, n, t, k, cross, "cuda")
            t = lay.num_tokens
            ins = [torch.randn(t, 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
            ctx = {}
            if cross:
                ctx = {
                    name: torch.randn(n, 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    for name in ("context_k", "context_v")
                }
            out = cod_attention(*ins, lay, window=9, sink=1, **ctx)
            torch.autograd.grad(out.float().sum(), ins + list(ctx.values()))
    torch.cuda.synchronize()


def _garbage_metadata():
    """The raw ops with ranges / chains no metadata build gives (bounds far outside [0, N] and the
    int32 limits, unsorted, chain entries outside [-1, T)) and with another layout's metadata (a
    4000-position document's ranges against a 40-position context): the kernels clamp, so
    memcheck must see no out-of-bounds access."""
    ops = torch.ops.peagle
    g = torch.Generator().manual_seed(7)
    for t, n, k, cross, d in [(120, 40, 4, False, 64), (90, 30, 8, True, 128), (300, 100, 64, True, 64)]:
        ranges, chains = garbage_metadata(g, t, n, k, "cuda")
        if cross:
            offsets = [0] + sorted(torch.randint(0, t + 1, (k - 1,), generator=g).tolist()) + [t]
        else:
            offsets = [0, n] + sorted(torch.randint(n, t + 1, (k - 2,), generator=g).tolist()) + [t]
        mk = lambda r, h: torch.randn(r, h, d, generator=g).to("cuda", torch.bfloat16)  # noqa: E731
        q, kk, v = mk(t, 4), mk(t, 2), mk(t, 2)
        ck, cv = (mk(n, 2), mk(n, 2)) if cross else (None, None)
        for use_sink in (False, True):
            out, lse = ops.cod_attention_fwd(q, kk, v, ck, cv, ranges, chains, offsets, 1 / math.sqrt(d), use_sink)
            ops.cod_attention_bwd(
                torch.ones_like(out), q, kk, v, ck, cv, out, lse, ranges, chains, offsets, 1 / math.sqrt(d), use_sink
            )
    lm_short = torch.zeros(40, dtype=torch.bool)
    lm_short[1:11] = True
    lm_long = torch.zeros(4000, dtype=torch.bool)
    lm_long[3980:3990] = True
    short = cod_sample(torch.zeros(40, dtype=torch.int32), lm_short, num_depths=4, depth0="anchors", seed=1)
    long = cod_sample(torch.zeros(4000, dtype=torch.int32), lm_long, num_depths=4, depth0="anchors", seed=1)
    meta = cod_attention_metadata(long.to("cuda"), cross=True)
    q = torch.randn(short.num_tokens, 2, 64, generator=g).to("cuda", torch.bfloat16)
    ctx = torch.randn(short.seq_len, 2, 64, generator=g).to("cuda", torch.bfloat16)
    out, lse = ops.cod_attention_fwd(q, q, q, ctx, ctx, meta.ranges, meta.chains, meta.depth_offsets, 0.125, False)
    ops.cod_attention_bwd(
        torch.ones_like(out), q, q, q, ctx, ctx, out, lse, meta.ranges, meta.chains, meta.depth_offsets, 0.125, False
    )
    torch.cuda.synchronize()


def main(argv=()):
    """argv: the command line (sanitize_ops.py calls main() with none)."""
    global _check
    ap = argparse.ArgumentParser(description="COD attention shapes for compute-sanitizer")
    ap.add_argument("--soft", action="store_true", help="report tolerance misses instead of stopping")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="K=V[,K=V...]",
        help="environment settings of one run of the shapes (repeatable; default: one run as is)",
    )
    args = ap.parse_args(list(argv))
    variants = [dict(kv.split("=", 1) for kv in v.split(",")) for v in args.variant] or [{}]
    misses = []
    if args.soft:
        strict = _check

        def soft_check(*a, **k):
            try:
                strict(*a, **k)
            except AssertionError as e:
                misses.append(repr(e))
                print("tolerance miss (not a sanitizer error):", repr(e), flush=True)

        _check = soft_check
    for env in variants:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            run()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        print("variant", env or "(default)", "done", flush=True)
    if args.soft:
        print("tolerance misses:", len(misses))


if __name__ == "__main__":
    main(sys.argv[1:])
