"""COD sampling (docs/design.md section 2): the op against the plain-PyTorch reference, the
structural rules checked independently of any implementation, uniformity, edge cases, bad
input, fake tensors. CUDA must return exactly the CPU layout for the same seed."""

import math

import pytest
import torch

import peagle_ext  # noqa: F401  (loads torch.ops.peagle)
from peagle_ext.cod import CodLayout, cod_sample
from peagle_ext.reference import reference_cod_sample
from peagle_ext.testing import random_documents
from tests.helpers import check_layout_rules, devices, expected_size, requires_cuda, seed_positions

ops = torch.ops.peagle


# ---- helpers ------------------------------------------------------------------------------
def sample(doc, lm, device="cpu", **kw):
    return cod_sample(doc.to(device), lm.to(device), **kw)


def assert_equals_reference(layout: CodLayout, doc, lm, **kw):
    anchor, depth, offsets = reference_cod_sample(doc, lm, **kw)
    assert layout.depth_offsets == offsets
    assert torch.equal(layout.anchor.cpu().long(), anchor)
    assert torch.equal(layout.depth.cpu().long(), depth)


def assert_same_layout(a: CodLayout, b: CodLayout):
    assert a.depth_offsets == b.depth_offsets
    assert torch.equal(a.anchor.cpu(), b.anchor.cpu())
    assert torch.equal(a.depth.cpu(), b.depth.cpu())


def random_case(g: torch.Generator, n: int):
    """Random documents, loss mask, and random sampler settings."""

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    doc, lm = random_documents(
        n,
        g,
        max_doc_len=pick([1, 3, 20, 200, 2000]),
        pad_tail=int(torch.randint(0, max(1, n // 4), (1,), generator=g)),
        p_loss=pick([0.1, 0.5, 0.9, 1.0]),
    )
    kw = dict(
        num_depths=pick([1, 2, 3, 5, 8, 12]),
        down_sample_ratio=pick([0.3, 0.7, 0.9, 1.0]),
        down_sample_ratio_min=pick([0.0, 0.2, 0.6]),
        max_anchors=pick([None, None, 0, 1, 7, n // 3, 10 * n]),
        depth0=pick(["all", "anchors"]),
        seed=int(torch.randint(-(2**62), 2**62, (1,), generator=g)),
    )
    return doc, lm, kw


# ---- exactness and the rules ------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 37, 1000, 1024, 1025, 5000])
def test_matches_reference_and_rules(n, rng):
    for _ in range(4):
        doc, lm, kw = random_case(rng, n)
        layout = sample(doc, lm, **kw)
        assert_equals_reference(layout, doc, lm, **kw)
        check_layout_rules(layout, doc, lm, **kw)


@requires_cuda
@pytest.mark.parametrize("n", [1, 2, 37, 1000, 1023, 1024, 1025, 4096, 5000, 40000])
def test_cuda_equals_cpu(n, rng):
    for _ in range(10):
        doc, lm, kw = random_case(rng, n)
        gpu = sample(doc, lm, "cuda", **kw)
        assert gpu.anchor.is_cuda and gpu.depth.is_cuda
        assert_same_layout(gpu, sample(doc, lm, **kw))
        if n <= 5000:
            check_layout_rules(gpu, doc, lm, **kw)


@requires_cuda
def test_cuda_large_threshold_bins_take_the_radix_select():
    """The selection histogram has at most 16 bits, so from n ~ 2^26 positions on the bin holding
    the k-th smallest key has more than 1024 keys (kSmallSelect) and its exact rank takes the
    one-block radix select. At n = 2^27, max_anchors = n / 2: ~2048 keys in level 0's threshold
    bin and ~1024 in depth 1's (more than 1024 with probability ~1 and ~1/2). The draw must still
    be the CPU's, bit for bit."""
    n = 1 << 27
    doc = torch.zeros(n, dtype=torch.int32)
    lm = torch.ones(n, dtype=torch.bool)
    kw = dict(num_depths=2, max_anchors=n // 2, depth0="anchors", seed=5)
    gpu = cod_sample(doc.cuda(), lm.cuda(), **kw)
    cpu = cod_sample(doc, lm, **kw)
    assert gpu.depth_counts() == cpu.depth_counts() == [n // 2, math.floor((n // 2 - 1) * 0.7)]
    assert_same_layout(gpu, cpu)


@pytest.mark.parametrize("device", devices())
def test_speculators_worked_example(device):
    """speculators' create_peagle_mask_mod docstring: N=6, one document, all loss-masked.
    Its example layout obeys our rules (and a broken variant does not), and our samples of
    that sequence have the same structure."""
    doc = torch.zeros(6, dtype=torch.int32)
    lm = torch.ones(6, dtype=torch.bool)
    example = CodLayout(
        torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 3, 4, 0, 3, 0], dtype=torch.int32),
        torch.tensor([0] * 6 + [1] * 4 + [2] * 2 + [3], dtype=torch.int32),
        [0, 6, 10, 12, 13],
        doc,
    )
    assert example.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 1, 2, 4, 5, 2, 5, 3]
    # (its sizes 4, 2, 1 are illustrative: no (r, r_min) gives them from 5 seeds, so only the
    # chain rules are checked on it)
    check_rules_with_sizes(example, doc, lm, [6, 4, 2, 1])
    broken = CodLayout(example.anchor.clone(), example.depth.clone(), list(example.depth_offsets), doc)
    broken.anchor[10] = 2  # (2, 2) without (2, 1)
    with pytest.raises(AssertionError):
        check_rules_with_sizes(broken, doc, lm, [6, 4, 2, 1])

    doc, lm = doc.to(device), lm.to(device)
    for seed in range(50):
        layout = cod_sample(doc, lm, num_depths=4, down_sample_ratio=1.0, down_sample_ratio_min=0.0, seed=seed)
        check_layout_rules(layout, doc, lm, num_depths=4, down_sample_ratio=1.0, down_sample_ratio_min=0.0)
        counts = layout.depth_counts()
        assert counts[:2] == [6, 4]  # all positions; floor(4 * 1.0) of the 5 seeds
        assert set(layout.anchor[6:10].tolist()) <= {0, 1, 2, 3, 4}
        layout = cod_sample(doc, lm, num_depths=4, seed=seed)  # defaults r=0.7, r_min=0.2
        check_layout_rules(layout, doc, lm, num_depths=4)
        assert layout.depth_counts() == [6, 2, 1, 0]  # floor(4*.7), floor(3*.49), floor(2*.343) = 0 -> stop


def check_rules_with_sizes(layout, doc, lm, sizes):
    """The chain rules for a hand-written layout with given per-depth sizes."""
    assert layout.depth_counts() == sizes
    n = doc.shape[0]
    pairs = set(zip(layout.anchor.tolist(), layout.depth.tolist()))
    for a, d in pairs:
        assert 0 <= a and a + d < n
        if d > 0:
            assert (a, d - 1) in pairs, f"({a}, {d}) without ({a}, {d - 1})"
            assert bool(lm[a + d]) and int(doc[a + d]) == int(doc[a])


# ---- uniformity -----------------------------------------------------------------------------
def chi2_critical(dof: int, alpha: float) -> float:
    try:
        from scipy.stats import chi2

        return float(chi2.ppf(1.0 - alpha, dof))
    except ImportError:  # Wilson-Hilferty: accurate to ~1% for dof >= 10
        from statistics import NormalDist

        z = NormalDist().inv_cdf(1.0 - alpha)
        return dof * (1.0 - 2.0 / (9 * dof) + z * math.sqrt(2.0 / (9 * dof))) ** 3


def subset_chi2(counts: torch.Tensor, trials: int, k: int) -> float:
    """Chi-square statistic of how often each of S items lands in a uniform k-subset over
    `trials` draws. Each count is Binomial(trials, k/S) and the counts are negatively
    correlated (they sum to k*trials), so sum((O-E)^2) / (trials p (1-p)) * (S-1)/S is
    chi-square with S-1 degrees of freedom."""
    s = counts.numel()
    p = k / s
    e = trials * p
    return float(((counts.double() - e) ** 2).sum() / (trials * p * (1 - p)) * (s - 1) / s)


def test_chi2_statistic_detects_bias():
    """The uniformity tests below can fail: a sampler that favours early seeds is rejected."""
    g = torch.Generator().manual_seed(0)
    s, k, trials = 40, 19, 2000
    fair = torch.zeros(s)
    biased = torch.zeros(s)
    weights = torch.linspace(1.0, 1.3, s)
    for _ in range(trials):
        fair[torch.randperm(s, generator=g)[:k]] += 1
        biased[torch.multinomial(weights, k, replacement=False, generator=g)] += 1
    crit = chi2_critical(s - 1, 1e-4)
    assert subset_chi2(fair, trials, k) < crit
    assert subset_chi2(biased, trials, k) > crit


@pytest.mark.parametrize("device", devices())
def test_uniform_over_seeds(device):
    """Which seeds depth 1 picks, over many sampler seeds: chi-square against uniform."""
    g = torch.Generator().manual_seed(1234)
    doc, lm = random_documents(120, g, max_doc_len=30, p_loss=0.6)
    seeds = seed_positions(doc, lm)
    s = len(seeds)
    assert s >= 30
    k = expected_size(s, 1, 0.5, 0.2)
    index = torch.full((120,), -1, dtype=torch.long)
    index[seeds] = torch.arange(s)
    counts = torch.zeros(s)
    trials = 3000
    for seed in range(trials):
        layout = sample(doc, lm, device, num_depths=2, down_sample_ratio=0.5, seed=seed * 7919 + 1)
        picked = index[layout.anchor[layout.depth_offsets[1] :].cpu().long() + 1]
        assert picked.numel() == k and bool((picked >= 0).all())
        counts[picked] += 1
    assert subset_chi2(counts, trials, k) < chi2_critical(s - 1, 1e-4)


def test_uniform_anchor_subsampling():
    """max_anchors keeps a uniform subset of the seeds (depth0='anchors' shows it)."""
    n, m, trials = 60, 25, 3000
    doc = torch.zeros(n, dtype=torch.int32)
    lm = torch.ones(n, dtype=torch.bool)  # seeds 1..59
    counts = torch.zeros(n - 1)
    for seed in range(trials):
        layout = cod_sample(doc, lm, num_depths=1, max_anchors=m, depth0="anchors", seed=seed)
        assert layout.depth_counts() == [m]
        counts[layout.anchor.long()] += 1  # anchor a <-> seed a + 1
    assert subset_chi2(counts, trials, m) < chi2_critical(n - 2, 1e-4)


def test_pairs_are_not_correlated():
    """Uniform k-subsets pick two given seeds together with probability k(k-1)/(S(S-1)):
    checks joint (not only marginal) uniformity for a few pairs, adjacent ones included."""
    n, trials = 21, 6000
    doc = torch.zeros(n, dtype=torch.int32)
    lm = torch.ones(n, dtype=torch.bool)  # 20 seeds
    s = n - 1
    k = expected_size(s, 1, 0.5, 0.0)  # 9
    pairs = [(0, 1), (5, 6), (0, 19), (10, 11)]
    together = torch.zeros(len(pairs))
    for seed in range(trials):
        layout = cod_sample(doc, lm, num_depths=2, down_sample_ratio=0.5, down_sample_ratio_min=0.0, seed=seed)
        chosen = set(layout.anchor[layout.depth_offsets[1] :].tolist())
        for i, (x, y) in enumerate(pairs):
            together[i] += (x in chosen) and (y in chosen)
    p = k * (k - 1) / (s * (s - 1))
    z = (together - trials * p) / math.sqrt(trials * p * (1 - p))
    assert bool((z.abs() < 4.5).all()), z


# ---- determinism ------------------------------------------------------------------------------
@pytest.mark.parametrize("device", devices())
def test_deterministic_per_seed_and_differs_across_seeds(device, rng):
    doc, lm = random_documents(3000, rng, max_doc_len=300)
    a = sample(doc, lm, device, seed=11)
    assert_same_layout(a, sample(doc, lm, device, seed=11))
    b = sample(doc, lm, device, seed=12)
    assert a.depth_offsets[:3] == b.depth_offsets[:3]  # depth 0/1 sizes depend only on the data
    assert not torch.equal(a.anchor, b.anchor)
    torch.manual_seed(5)
    c = sample(doc, lm, device)
    torch.manual_seed(5)
    assert_same_layout(c, sample(doc, lm, device))


@pytest.mark.parametrize("device", devices())
def test_depth0_anchors_mode(device, rng):
    doc, lm = random_documents(2000, rng, max_doc_len=100, pad_tail=100)
    for max_anchors in [None, 300]:
        full = sample(doc, lm, device, seed=3, max_anchors=max_anchors)
        cross = sample(doc, lm, device, seed=3, max_anchors=max_anchors, depth0="anchors")
        assert cross.depth0_all is False
        check_layout_rules(cross, doc, lm, max_anchors=max_anchors, depth0="anchors")
        # the depths >= 1 are the same draw; only depth 0 changes
        o, oc = full.depth_offsets, cross.depth_offsets
        assert torch.equal(full.anchor[o[1] :].cpu(), cross.anchor[oc[1] :].cpu())
        seeds = seed_positions(doc, lm)
        expect = len(seeds) if max_anchors is None else min(max_anchors, len(seeds))
        assert cross.depth_counts()[0] == expect
        if max_anchors is None:
            assert cross.anchor[: oc[1]].cpu().tolist() == [p - 1 for p in seeds]


# ---- edge cases -------------------------------------------------------------------------------
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("depth0", ["all", "anchors"])
def test_edge_cases(device, depth0):
    g = torch.Generator().manual_seed(7)
    cases = {
        "all_zero_loss_mask": (torch.zeros(500, dtype=torch.int32), torch.zeros(500, dtype=torch.bool)),
        "n1": (torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.bool)),
        "n2": (torch.zeros(2, dtype=torch.int32), torch.ones(2, dtype=torch.bool)),
        "n_less_than_k": (torch.zeros(5, dtype=torch.int32), torch.ones(5, dtype=torch.bool)),
        "all_padding": (torch.full((300,), -1, dtype=torch.int32), torch.ones(300, dtype=torch.bool)),
        "one_token_documents": (torch.arange(400, dtype=torch.int32), torch.ones(400, dtype=torch.bool)),
        "two_token_documents": (torch.arange(600, dtype=torch.int32) // 2, torch.ones(600, dtype=torch.bool)),
        "repeated_doc_ids": (
            torch.tensor([0, 0, 1, 0, 0, 0, 1, 1, 1, -1, 0, 0], dtype=torch.int32),
            torch.ones(12, dtype=torch.bool),
        ),
        "random": random_documents(777, g, max_doc_len=5),
    }
    for name, (doc, lm) in cases.items():
        for max_anchors in [None, 2]:
            kw = dict(num_depths=8, max_anchors=max_anchors, depth0=depth0, seed=99)
            layout = sample(doc, lm, device, **kw)
            assert_equals_reference(layout, doc, lm, **kw)
            check_layout_rules(layout, doc, lm, **kw)
            n = doc.shape[0]
            if name in ("all_zero_loss_mask", "n1", "all_padding", "one_token_documents"):
                assert layout.depth_counts() == [n if depth0 == "all" else 0] + [0] * 7, name
            if name == "n_less_than_k":
                assert all(c == 0 for c in layout.depth_counts()[4:])  # 4 seeds: depth d keeps <= 4 - d


@pytest.mark.parametrize("device", devices())
def test_empty_sequence(device):
    doc = torch.zeros(0, dtype=torch.int32, device=device)
    lm = torch.zeros(0, dtype=torch.bool, device=device)
    for depth0 in ["all", "anchors"]:
        layout = cod_sample(doc, lm, num_depths=4, depth0=depth0, seed=1)
        assert layout.depth_offsets == [0] * 5 and layout.anchor.numel() == 0
        assert layout.anchor.device == doc.device


@pytest.mark.parametrize("device", devices())
def test_num_depths_one_and_max(device, rng):
    doc, lm = random_documents(3000, rng)
    for kw in [
        dict(num_depths=1),
        dict(num_depths=1, depth0="anchors", max_anchors=100),
        dict(num_depths=64, down_sample_ratio=1.0, down_sample_ratio_min=1.0),
    ]:
        layout = sample(doc, lm, device, seed=5, **kw)
        assert_equals_reference(layout, doc, lm, seed=5, **kw)
        check_layout_rules(layout, doc, lm, **kw)


@pytest.mark.parametrize("device", devices())
def test_n_131072(device):
    g = torch.Generator().manual_seed(131072)
    doc, lm = random_documents(131072, g, max_doc_len=4000, pad_tail=1000)
    kw = dict(num_depths=8, seed=2024)
    layout = sample(doc, lm, device, **kw)
    assert_equals_reference(layout, doc, lm, **kw)
    if device == "cuda":
        assert_same_layout(layout, sample(doc, lm, **kw))
        kw = dict(num_depths=8, seed=7, max_anchors=50000, depth0="anchors")
        assert_same_layout(sample(doc, lm, device, **kw), sample(doc, lm, **kw))


@requires_cuda
def test_cuda_runs_on_the_current_stream():
    """The op runs on the current stream of the inputs' device."""
    g = torch.Generator().manual_seed(3)
    doc, lm = random_documents(9000, g)
    expect = sample(doc, lm, seed=4)
    s = torch.cuda.Stream()
    d, m = doc.cuda(), lm.cuda()
    torch.cuda.current_stream().synchronize()
    with torch.cuda.stream(s):
        got = cod_sample(d, m, seed=4)
        got_anchor = got.anchor.clone()
    s.synchronize()
    assert got.depth_offsets == expect.depth_offsets
    assert torch.equal(got_anchor.cpu(), expect.anchor)


@requires_cuda
def test_cuda_one_host_sync_and_two_launches_per_depth():
    """The CUDA op syncs with the host once (to size T): no per-depth round trips."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(5)
    doc, lm = random_documents(20000, g)
    d, m = doc.cuda(), lm.cuda()
    args = (8, 0.7, 0.2, -1, True, 1)
    ops.cod_sample(d, m, *args)  # warm the allocators
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ops.cod_sample(d, m, *args)
    # only runtime calls inside the op's own time range count: the profiler adds its own
    # cudaDeviceSynchronize when it stops (seen on the H200)
    events = prof.events()
    op = [e for e in events if e.name == "peagle::cod_sample"]
    assert len(op) == 1, [e.name for e in events]
    t0, t1 = op[0].time_range.start, op[0].time_range.end
    names = [e.name for e in events if t0 <= e.time_range.start and e.time_range.end <= t1]
    launches = sum(name.startswith("cudaLaunchKernel") for name in names)
    if launches == 0:
        pytest.skip("the profiler recorded no CUDA runtime calls here")
    syncs = [
        name
        for name in names
        if name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaStreamWaitEvent")
    ]
    assert syncs == ["cudaStreamSynchronize"], names
    assert sum(name.startswith("cudaMemcpy") for name in names) == 1, names
    assert launches <= 2 * args[0] + 2, names


# ---- bad input --------------------------------------------------------------------------------
def _good(n=50, device="cpu"):
    return torch.zeros(n, dtype=torch.int32, device=device), torch.ones(n, dtype=torch.bool, device=device)


@pytest.mark.parametrize("device", devices())
def test_bad_input_wrapper(device):
    doc, lm = _good(device=device)
    with pytest.raises(TypeError, match="document_ids"):
        cod_sample(doc.float(), lm)
    with pytest.raises(TypeError, match="document_ids"):
        cod_sample(doc.tolist(), lm)
    with pytest.raises(ValueError, match="document_ids"):
        cod_sample(doc.view(5, 10), lm)
    with pytest.raises(ValueError, match="document_ids"):
        cod_sample(torch.full_like(doc, -2), lm)
    with pytest.raises(TypeError, match="loss_mask"):
        cod_sample(doc, lm.to(torch.complex64))
    with pytest.raises(ValueError, match="loss_mask"):
        cod_sample(doc, lm[:-1])
    with pytest.raises(ValueError, match="loss_mask"):
        cod_sample(doc, torch.full(lm.shape, 2, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="loss_mask"):
        cod_sample(doc, lm.to("meta"))
    for bad in [0.0, -0.5, 1.5, float("nan")]:
        with pytest.raises(ValueError, match="down_sample_ratio"):
            cod_sample(doc, lm, down_sample_ratio=bad)
    with pytest.raises(ValueError, match="down_sample_ratio_min"):
        cod_sample(doc, lm, down_sample_ratio_min=1.5)
    for bad in [0, -1, 65]:
        with pytest.raises(ValueError, match="num_depths"):
            cod_sample(doc, lm, num_depths=bad)
    with pytest.raises(TypeError, match="num_depths"):
        cod_sample(doc, lm, num_depths=2.0)
    with pytest.raises(ValueError, match="max_anchors"):
        cod_sample(doc, lm, max_anchors=-1)
    with pytest.raises(ValueError, match="depth0"):
        cod_sample(doc, lm, depth0="none")
    if device == "cuda":
        with pytest.raises(ValueError, match="loss_mask"):
            cod_sample(doc, lm.cpu())


@pytest.mark.parametrize("device", devices())
def test_bad_input_op(device):
    """The C++ op checks again (someone may call torch.ops.peagle.cod_sample directly)."""
    doc, lm = _good(device=device)

    def call(d=doc, m=lm, k=8, r=0.7, r_min=0.2, max_anchors=-1):
        return ops.cod_sample(d, m, k, r, r_min, max_anchors, True, 0)

    with pytest.raises(TypeError, match="document_ids"):
        call(d=doc.long())
    with pytest.raises(TypeError, match="loss_mask"):
        call(m=lm.float())
    with pytest.raises(ValueError, match="document_ids"):
        call(d=doc.view(5, 10), m=lm.view(5, 10))
    with pytest.raises(ValueError, match="loss_mask"):
        call(m=lm[:-1])
    with pytest.raises(ValueError, match="contiguous"):
        call(d=torch.zeros(100, dtype=torch.int32, device=device)[::2])
    bad_doc = doc.clone()
    bad_doc[17] = -3
    with pytest.raises(ValueError, match="document_ids must be >= -1"):
        call(d=bad_doc)
    for bad in [0.0, 1.01, -1.0]:
        with pytest.raises(ValueError, match="down_sample_ratio"):
            call(r=bad)
    with pytest.raises(ValueError, match="down_sample_ratio_min"):
        call(r_min=-0.1)
    for bad in [0, -3, 65]:
        with pytest.raises(ValueError, match="num_depths"):
            call(k=bad)
    with pytest.raises(ValueError, match="max_anchors"):
        call(max_anchors=-2)
    if device == "cuda":
        with pytest.raises(ValueError, match="same device"):
            call(m=lm.cpu())
        with pytest.raises(ValueError, match="same device"):
            call(d=doc.cpu())
        # a rejected call leaves the op usable
        a, d, o = call()
        assert o.device.type == "cpu" and a.is_cuda and int(o[-1]) == a.numel()


# ---- torch.compile / fake tensors -----------------------------------------------------------------
def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(shape_env=ShapeEnv()):
        doc = torch.zeros(100, dtype=torch.int32)
        lm = torch.ones(100, dtype=torch.bool)
        anchor, depth, offsets = ops.cod_sample(doc, lm, 8, 0.7, 0.2, -1, True, 0)
        assert isinstance(anchor.shape[0], torch.SymInt) and anchor.dtype == torch.int32
        assert depth.shape == anchor.shape and depth.dtype == torch.int32
        assert offsets.shape == (9,) and offsets.dtype == torch.int64 and offsets.device.type == "cpu"


@pytest.mark.parametrize("device", devices())
def test_opcheck(device, rng):
    doc, lm = random_documents(500, rng)
    for args in [(8, 0.7, 0.2, -1, True, 3), (4, 0.5, 0.1, 40, False, -9)]:
        torch.library.opcheck(ops.cod_sample.default, (doc.to(device), lm.to(device), *args))


def test_torch_compile_fullgraph(rng):
    doc, lm = random_documents(300, rng)

    def f(d, m):
        anchor, depth, offsets = ops.cod_sample(d, m, 4, 0.7, 0.2, -1, True, 5)
        return anchor + depth, offsets

    import torch._dynamo

    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        got = torch.compile(f, backend="aot_eager", fullgraph=True)(doc, lm)
    want = f(doc, lm)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
