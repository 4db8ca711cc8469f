"""The COD attention CUDA kernels (skipped without a GPU) against the float64 dense-mask reference:
bf16/fp16, relative L2 error <= 1e-2 on out, dq, dk, dv (+ context grads), symmetric and cross
layouts, windows, sinks, GQA 1/4/8, D 64/128, odd sizes; tiny / padding / all-padding / K = 64
layouts; determinism; CUDA-graph capture; large-N spot checks; metadata equal on both devices.

Each runs for both kernel families (csrc/attention/attention_dispatch.h): "auto", what the
heuristics pick (the Hopper wgmma kernels on an H100/H200), and "portable", the mma.sync kernels
forced by PEAGLE_ATTN_KERNEL=portable (what Ampere, Ada and Blackwell run). On a Hopper GPU the two
are also compared: bit for bit at head dim 128. A failing case names its configuration.
"""

import math

import pytest
import torch

from peagle_ext.attention import cod_attention, cod_attention_metadata
from peagle_ext.cod import cod_sample
from peagle_ext.ops.attention import KERNEL_ENV, attention_kernel, attention_kernel_choice, has_hopper_kernels
from peagle_ext.reference import document_starts
from tests.helpers import HAS_CUDA, requires_cuda
from tests.ops.attention_cases import (
    assert_close_all,
    assert_rows_close,
    flash_backward_reference,
    make_inputs,
    make_layout,
    rel_l2,
    run_both,
)

FAMILIES = ["auto", "portable"]


def set_family(monkeypatch, family):
    """family "auto": the heuristics' choice; "portable": PEAGLE_ATTN_KERNEL=portable."""
    if family == "auto":
        monkeypatch.delenv(KERNEL_ENV, raising=False)
    else:
        monkeypatch.setenv(KERNEL_ENV, family)


def _hopper_runs_here():
    """What the heuristics pick here without the override."""
    if not HAS_CUDA:
        return False
    major, minor = torch.cuda.get_device_capability()
    return attention_kernel_choice(major, minor, 128, has_hopper_kernels())["family"] == "hopper"


HAS_HOPPER = _hopper_runs_here()
requires_hopper = pytest.mark.skipif(not HAS_HOPPER, reason="the Hopper kernels run only on compute capability 9.0")


GPU_SCENARIOS = [
    # (name, n, hq, hkv, window, sink, max_anchors, num_depths, max_doc_len, pad_tail)
    ("plain-gqa1", 1100, 4, 4, None, 0, None, 8, 300, 0),
    ("window-gqa4", 1300, 8, 2, 96, 0, None, 8, 500, 17),
    ("window-sink-gqa8", 1200, 8, 1, 80, 8, None, 8, 700, 5),
    ("tiny-window", 900, 4, 1, 3, 0, None, 8, 200, 9),  # window <= depth: chain depth-0 keys
    ("tiny-window-sink", 900, 4, 2, 2, 3, None, 6, 250, 0),
    ("max-anchors", 1500, 8, 2, None, 0, 60, 8, 400, 33),
    ("long-doc", 2100, 4, 1, None, 0, None, 8, 2100, 0),  # many full key blocks
    ("long-doc-window", 2100, 8, 8, 700, 16, None, 8, 2100, 0),
]


def _gpu_case(dtype, d, cross, scen, seed_extra=0):
    name, n, hq, hkv, window, sink, max_anchors, k_depths, max_doc, pad = scen
    import zlib

    g = torch.Generator().manual_seed(zlib.crc32(f"{dtype}-{d}-{cross}-{name}-{seed_extra}".encode()))
    lay = make_layout(
        g,
        n,
        cross=cross,
        num_depths=k_depths,
        max_anchors=max_anchors,
        max_doc_len=max_doc,
        pad_tail=pad,
        device="cuda",
    )
    q, k, v, ctx = make_inputs(g, lay, hq, hkv, d, dtype, "cuda", cross)
    names, ours, refs = run_both(g, lay, q, k, v, ctx, window=window, sink=sink)
    what = f"cuda {dtype} D={d} cross={cross} {name} T={lay.num_tokens} N={n} Hq={hq} Hkv={hkv} w={window} s={sink}"
    assert_close_all(names, ours, refs, tol=1e-2, what=what)


@requires_cuda
@pytest.mark.parametrize("scen", GPU_SCENARIOS, ids=lambda s: s[0])
@pytest.mark.parametrize("cross", [False, True], ids=["sym", "cross"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_matches_reference(dtype, d, cross, scen, monkeypatch):
    set_family(monkeypatch, "auto")
    _gpu_case(dtype, d, cross, scen)


# The portable kernels on the reference scenarios: every scenario at both head dims, the mode
# alternating so every scenario runs in both modes, dtype alternating by scenario.
PORTABLE_CASES = [(d, (i + d // 64) % 2 == 1, i) for d in (64, 128) for i in range(len(GPU_SCENARIOS))]


@requires_cuda
@pytest.mark.parametrize(
    "d,cross,scen_idx",
    PORTABLE_CASES,
    ids=[f"D{d}-{'cross' if x else 'sym'}-{GPU_SCENARIOS[i][0]}" for d, x, i in PORTABLE_CASES],
)
def test_cuda_portable_matches_reference(monkeypatch, d, cross, scen_idx):
    set_family(monkeypatch, "portable")
    dtype = torch.bfloat16 if scen_idx % 2 == 0 else torch.float16
    _gpu_case(dtype, d, cross, GPU_SCENARIOS[scen_idx], seed_extra="portable")


def profiled_kernel_names(run, contains):
    """Names of the CUDA kernels containing `contains` that one call of run() launches (after a
    warm-up call, under torch.profiler); skips the test where the profiler records no kernels."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if contains in e.name}
    if not names:
        pytest.skip("the profiler recorded no kernels here")
    return names


@requires_cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_family_selects_kernels(monkeypatch, family):
    """The choice really picks the kernels (profiler): the wgmma forward, dQ and dK/dV kernels
    under the Hopper family, the mma.sync ones otherwise; never both."""
    set_family(monkeypatch, family)
    hopper = attention_kernel(128)["family"] == "hopper"
    assert hopper == (family == "auto" and HAS_HOPPER)
    g = torch.Generator().manual_seed(41)
    lay = make_layout(g, 400, max_doc_len=200, device="cuda")
    q, k, v, _ = make_inputs(g, lay, 4, 2, 128, torch.bfloat16, "cuda", False)
    go = torch.randn(q.shape, generator=g).to("cuda", torch.bfloat16)
    names = profiled_kernel_names(
        lambda: torch.autograd.grad(cod_attention(q, k, v, lay, window=50, sink=2), [q, k, v], go), "cod_attn_"
    )
    wgmma = {kern for kern in ("fwd", "dq", "dkv") if any(f"cod_attn_{kern}_wgmma_kernel" in n for n in names)}
    mma = {kern for kern in ("fwd", "dq", "dkv") if any(f"cod_attn_{kern}_kernel" in n for n in names)}
    assert (wgmma, mma) == (({"fwd", "dq", "dkv"}, set()) if hopper else (set(), {"fwd", "dq", "dkv"})), sorted(names)


@requires_cuda
def test_cuda_unknown_override_is_refused(monkeypatch):
    """A misspelt PEAGLE_ATTN_KERNEL is a ValueError naming it, never a silent fallback."""
    monkeypatch.setenv(KERNEL_ENV, "wgmma")
    g = torch.Generator().manual_seed(71)
    lay = make_layout(g, 200, device="cuda")
    q, k, v, _ = make_inputs(g, lay, 4, 2, 64, torch.bfloat16, "cuda", False)
    with pytest.raises(ValueError, match="PEAGLE_ATTN_KERNEL=wgmma"):
        cod_attention(q, k, v, lay)


@requires_cuda
@requires_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cross", [False, True], ids=["sym", "cross"])
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_hopper_is_bitwise_portable(monkeypatch, d, cross, dtype):
    """What the README promises: on sm_90 the Hopper kernels give the portable kernels' out and
    every gradient bit for bit at D = 128 (same 64-row query tiles, key blocks and per-element
    k-order of the fp32 sums). At D = 64 the mma.sync forward runs 128-row query tiles, so its key
    blocks differ and out agrees to rounding only; the gradients then agree per row to 2e-2."""
    g = torch.Generator().manual_seed(59 + d + int(cross))
    lay = make_layout(g, 2500, cross=cross, max_doc_len=1100, pad_tail=9, device="cuda")
    q, k, v, ctx = make_inputs(g, lay, 8, 2, d, dtype, "cuda", cross)
    ins = [q, k, v] + list(ctx.values())
    go = torch.randn(q.shape, generator=g).to("cuda", dtype)
    res = {}
    for family in FAMILIES:
        set_family(monkeypatch, family)
        out = cod_attention(q, k, v, lay, window=600, sink=3, **ctx)
        res[family] = [out.detach()] + list(torch.autograd.grad(out, ins, go))
    names = ["out", "dq", "dk", "dv"] + ["d" + n for n in ctx]
    what = f"hopper vs portable (D={d} cross={cross} {dtype})"
    for name, a, b in zip(names, res["auto"], res["portable"]):
        if d == 128:
            assert torch.equal(a, b), f"{what}: {name} differs, max |diff| {(a.float() - b.float()).abs().max():.3e}"
        else:
            assert_rows_close(a, b, f"{what}: {name}")
    pad = lay.document_ids[lay.anchor.long()] < 0
    assert torch.equal(res["auto"][1][pad], torch.zeros_like(res["auto"][1][pad])), f"{what}: padding dq not 0"


@requires_cuda
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cross", [False, True])
def test_cuda_tiny_and_padding(monkeypatch, cross, family):
    set_family(monkeypatch, family)
    g = torch.Generator().manual_seed(11)
    for n in (1, 2, 3, 5, 9):  # T = 1, N < K
        doc = torch.zeros(n, dtype=torch.int32)
        lay = cod_sample(
            doc, torch.ones(n, dtype=torch.bool), num_depths=8, depth0="anchors" if cross else "all", seed=3
        ).to("cuda")
        if lay.num_tokens == 0:
            continue
        for d in (64, 128):
            q, k, v, ctx = make_inputs(g, lay, 4, 2, d, torch.bfloat16, "cuda", cross)
            names, ours, refs, go = run_both(g, lay, q, k, v, ctx, window=2, return_go=True)
            what = f"cuda tiny n={n} D={d} cross={cross} {family}"
            # With 1-3 keys per row the gradients are differences of nearly equal terms (at T = 1
            # the exact dq is 0). The backward takes delta = rowsum(dO * O) from the rounded bf16
            # output, as FlashAttention does; that rounding alone then costs ~1e-2 relative error
            # in dq/dk. So: the gradients must match this algorithm run exactly in float64 on our
            # own output to 1e-2, and the exact math to 3e-2. Norms are floored at an RMS of 1e-3
            # per element: at T = 1 both references are ~0 and only rounding noise is left.
            algo = flash_backward_reference(q, k, v, ctx, lay, go, ours[0], window=2)
            assert_close_all(names[:1], ours[:1], refs[:1], tol=1e-2, what=what)
            assert_close_all(
                names[1:], ours[1:], algo, tol=1e-2, floor=1e-3, what=what + " (vs its algorithm in float64)"
            )
            assert_close_all(names[1:], ours[1:], refs[1:], tol=3e-2, floor=1e-3, what=what + " (vs exact gradients)")
    doc = torch.tensor([-1] * 7 + [0] * 40 + [-1] * 5 + [1] * 30 + [-1] * 9, dtype=torch.int32)
    lay = cod_sample(doc, doc >= 0, num_depths=5, depth0="anchors" if cross else "all", seed=2).to("cuda")
    q, k, v, ctx = make_inputs(g, lay, 4, 1, 64, torch.float16, "cuda", cross)
    names, ours, refs = run_both(g, lay, q, k, v, ctx, window=6, sink=2)
    assert_close_all(names, ours, refs, tol=1e-2, what=f"cuda padding cross={cross} {family}")
    out = cod_attention(q, k, v, lay, window=6, sink=2, **ctx)
    pad = lay.document_ids[lay.anchor.long()] < 0
    if pad.any():
        assert torch.equal(out[pad], torch.zeros_like(out[pad]))


@requires_cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_all_padding_gives_zeros(monkeypatch, family):
    set_family(monkeypatch, family)
    doc = torch.full((300,), -1, dtype=torch.int32)
    lay = cod_sample(doc, torch.zeros(300, dtype=torch.bool), num_depths=4, seed=0).to("cuda")
    g = torch.Generator().manual_seed(1)
    q, k, v, _ = make_inputs(g, lay, 4, 2, 128, torch.bfloat16, "cuda", False)
    out = cod_attention(q, k, v, lay)
    grads = torch.autograd.grad(out.float().sum(), [q, k, v])
    assert torch.equal(out, torch.zeros_like(out))
    for gr in grads:
        assert torch.equal(gr, torch.zeros_like(gr))


@requires_cuda
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cross", [False, True])
def test_cuda_deep_chains(monkeypatch, family, cross):
    """K = 64 depths (the most chain keys per query, the most chain scratch in shared memory) with
    window + sink, fwd and bwd against the CPU op in float32 on bf16-rounded inputs."""
    set_family(monkeypatch, family)
    g = torch.Generator().manual_seed(23 + int(cross))
    lay = make_layout(g, 500, cross=cross, num_depths=64, max_doc_len=300, pad_tail=7)
    assert len(lay.depth_offsets) - 1 == 64
    q, k, v, ctx = make_inputs(g, lay, 4, 2, 128, torch.bfloat16, "cpu", cross, requires_grad=False)
    go = torch.randn(q.shape, generator=g).bfloat16()
    gin = [x.cuda().requires_grad_(True) for x in [q, k, v] + list(ctx.values())]
    gctx = dict(zip(ctx.keys(), gin[3:]))
    out = cod_attention(*gin[:3], lay.to("cuda"), window=64, sink=2, **gctx)
    grads = torch.autograd.grad(out, gin, go.cuda())
    cin = [x.float().requires_grad_(True) for x in [q, k, v] + list(ctx.values())]
    cctx = dict(zip(ctx.keys(), cin[3:]))
    cout = cod_attention(*cin[:3], lay, window=64, sink=2, **cctx)
    cgrads = torch.autograd.grad(cout, cin, go.float())
    names = ["out", "dq", "dk", "dv"] + ["d" + n for n in ctx]
    assert_close_all(
        names, [out.cpu()] + [x.cpu() for x in grads], [cout] + list(cgrads), tol=1e-2, what=f"K=64 {family} {cross}"
    )


@requires_cuda
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("window,sink", [(None, 0), (40, 0), (9, 4), (2, 0)])
def test_cuda_metadata_equals_cpu(rng, cross, window, sink):
    lay = make_layout(rng, 3000, cross=cross, max_doc_len=500, pad_tail=40)
    cpu = cod_attention_metadata(lay, cross=cross, window=window, sink=sink)
    gpu = cod_attention_metadata(lay.to("cuda"), cross=cross, window=window, sink=sink)
    assert torch.equal(cpu.ranges, gpu.ranges.cpu()), "ranges differ between CPU and CUDA"
    assert torch.equal(cpu.chains[0], gpu.chains[0].cpu()), "chain table differs between CPU and CUDA"
    assert torch.equal(cpu.chains[1], gpu.chains[1].cpu()), "reverse chain table differs between CPU and CUDA"


@requires_cuda
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_matches_cpu_float32(rng, monkeypatch, d, family):
    """Same algorithm on both devices: CUDA bf16 vs the CPU path in float32 on bf16-rounded inputs."""
    set_family(monkeypatch, family)
    lay = make_layout(rng, 1500, max_doc_len=600, pad_tail=11)
    q, k, v, _ = make_inputs(rng, lay, 8, 2, d, torch.bfloat16, "cuda", False)
    go = torch.randn(q.shape, generator=rng).to("cuda", torch.bfloat16)
    out = cod_attention(q, k, v, lay.to("cuda"), window=200, sink=4)
    gq = torch.autograd.grad(out, [q, k, v], go)
    cq, ck, cv = (x.detach().cpu().float().requires_grad_(True) for x in (q, k, v))
    cout = cod_attention(cq, ck, cv, lay, window=200, sink=4)
    cg = torch.autograd.grad(cout, [cq, ck, cv], go.cpu().float())
    assert_close_all(
        ["out", "dq", "dk", "dv"],
        [out.cpu()] + [x.cpu() for x in gq],
        [cout] + list(cg),
        tol=1e-2,
        what=f"cuda vs cpu D={d} {family}",
    )


@requires_cuda
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cross", [False, True])
def test_cuda_backward_is_deterministic(monkeypatch, cross, family):
    """No atomics anywhere: two runs give the same bits."""
    set_family(monkeypatch, family)
    g = torch.Generator().manual_seed(5)
    lay = make_layout(g, 4000, cross=cross, max_doc_len=1500, device="cuda")
    q, k, v, ctx = make_inputs(g, lay, 8, 2, 128, torch.bfloat16, "cuda", cross)
    ins = [q, k, v] + list(ctx.values())
    go = torch.randn(q.shape, generator=g).to("cuda", torch.bfloat16)
    runs = []
    for _ in range(2):
        out = cod_attention(q, k, v, lay, window=512, sink=4, **ctx)
        runs.append([out] + list(torch.autograd.grad(out, ins, go)))
    names = ["out", "dq", "dk", "dv"] + ["d" + n for n in ctx]
    for name, a, b in zip(names, *runs):
        assert torch.equal(a, b), f"{name} differs between runs ({family}, cross={cross})"


@requires_cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_graph_capture(monkeypatch, family):
    """fwd + bwd captured in a CUDA graph and replayed: the same bits as eager, twice."""
    set_family(monkeypatch, family)
    g = torch.Generator().manual_seed(9)
    lay = make_layout(g, 2000, max_doc_len=700, device="cuda")
    q, k, v, _ = make_inputs(g, lay, 8, 2, 64, torch.bfloat16, "cuda", False)
    go = torch.randn(q.shape, generator=g).to("cuda", torch.bfloat16)

    def step():
        out = cod_attention(q, k, v, lay, window=300, sink=2)
        grads = torch.autograd.grad(out, [q, k, v], go)
        # detached: an autograd graph kept alive past the step keeps the leaves' AccumulateGrad
        # nodes, made on the default stream, and the captured backward would then sync with the
        # legacy stream (cudaErrorStreamCaptureImplicit; torch warns about exactly this)
        return [out.detach()] + list(grads)

    eager = step()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up on the side stream, as torch.cuda.graphs asks
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for _ in range(2):  # a second replay overwrites the static outputs in place
        graph.replay()
        torch.cuda.synchronize()
        for name, a, b in zip(["out", "dq", "dk", "dv"], eager, static):
            assert torch.equal(a, b), f"{name}: graph replay differs from eager ({family})"


def _row_reference(q, k, v, lay, rows, go, window, sink, scale):
    """Exact float64 outputs and dq for selected query rows (keys from the rules, not the kernel)."""
    doc = lay.document_ids.long()
    a, d = lay.anchor.long(), lay.depth.long()
    starts = document_starts(doc)
    n = doc.shape[0]
    group = q.shape[1] // k.shape[1]
    outs, dqs = [], []
    for i in rows.tolist():
        if doc[a[i]] < 0:
            outs.append(torch.zeros(q.shape[1:], dtype=torch.float64, device=q.device))
            dqs.append(torch.zeros(q.shape[1:], dtype=torch.float64, device=q.device))
            continue
        pos = torch.arange(n, device=q.device)
        ok = (pos <= a[i]) & (pos >= starts[a[i]])
        if window is not None:
            w = pos > a[i] + d[i] - window
            if sink > 0:
                w |= (pos - starts[a[i]]) < sink
            ok &= w
        keys = set(pos[ok].tolist())
        chain = ((a == a[i]) & (d <= d[i])).nonzero().flatten().tolist()
        keys |= set(chain)  # depth-0 rows are rows 0..N-1 (symmetric)
        idx = torch.tensor(sorted(keys), device=q.device)
        kk = k[idx].double().repeat_interleave(group, 1)  # [J, Hq, D]
        vv = v[idx].double().repeat_interleave(group, 1)
        qi = q[i].double()
        s = torch.einsum("hd,jhd->hj", qi, kk) * scale
        p = torch.softmax(s, -1)
        o = torch.einsum("hj,jhd->hd", p, vv)
        dp = torch.einsum("hd,jhd->hj", go[i].double(), vv)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        outs.append(o)
        dqs.append(torch.einsum("hj,jhd->hd", ds, kk) * scale)
    return torch.stack(outs), torch.stack(dqs)


@requires_cuda
@pytest.mark.parametrize(
    "n,window,max_anchors,family",
    [
        (32768, None, None, "auto"),
        (32768, None, None, "portable"),
        (65536, 2048, 1024, "auto"),
        (131072, 4096, None, "auto"),
        (131072, 4096, None, "portable"),
    ],
)
def test_cuda_large_n_spot_checks(monkeypatch, n, window, max_anchors, family):
    """Large layouts (bench sizes): sampled rows of out/dq against an exact per-row reference, and
    the global identities sum_j dV_j = sum_i dO_i (valid rows) and sum_j dK_j = 0 per kv head.
    Documents up to 8192 tokens (up to 128 key blocks per query tile)."""
    set_family(monkeypatch, family)
    g = torch.Generator().manual_seed(n)
    lay = make_layout(g, n, max_anchors=max_anchors, max_doc_len=8192, pad_tail=100, device="cuda")
    hq, hkv, d = 8, 2, 128
    q, k, v, _ = make_inputs(g, lay, hq, hkv, d, torch.bfloat16, "cuda", False)
    go = torch.randn(q.shape, generator=g).to("cuda", torch.bfloat16)
    sink = 4 if window else 0
    out = cod_attention(q, k, v, lay, window=window, sink=sink)
    dq, dk, dv = torch.autograd.grad(out, [q, k, v], go)
    for x, name in ((out, "out"), (dq, "dq"), (dk, "dk"), (dv, "dv")):
        assert torch.isfinite(x).all(), f"{name} has non-finite values"
    t = lay.num_tokens
    o = lay.depth_offsets
    picks = [torch.randint(o[e], o[e + 1], (24,), generator=g) for e in range(len(o) - 1) if o[e + 1] > o[e]]
    rows = torch.cat(picks + [torch.tensor([0, t - 1])]).unique().to("cuda")
    ro, rdq = _row_reference(q.detach(), k.detach(), v.detach(), lay, rows, go, window, sink, 1 / math.sqrt(d))
    assert rel_l2(out[rows], ro) <= 1e-2, f"out rows rel err {rel_l2(out[rows], ro):.2e}"
    assert rel_l2(dq[rows], rdq) <= 1e-2, f"dq rows rel err {rel_l2(dq[rows], rdq):.2e}"
    valid = lay.document_ids[lay.anchor.long()] >= 0
    want_dv = (go.double() * valid[:, None, None]).reshape(t, hkv, hq // hkv, d).sum((0, 2))
    got_dv = dv.double().sum(0)
    assert rel_l2(got_dv, want_dv) <= 1e-2, f"sum dV identity rel err {rel_l2(got_dv, want_dv):.2e}"
    dk_sum = dk.double().sum(0).norm().item()
    dk_scale = dk.double().norm().item()
    assert dk_sum <= 0.05 * dk_scale, f"sum dK identity: |sum| {dk_sum:.3e} vs |dK| {dk_scale:.3e}"
