"""serving/cache_attention.py: both implementations of the verifier's cache attention and of
batched generation's (one query per row over a batch of caches) against a plain-PyTorch reference
(explicit scores, GQA by repeating KV heads, the position mask), the choice between them, and
StaticVerifier with each."""

from __future__ import annotations

import pytest
import torch

from peagle_ext.serving.cache_attention import (
    ROUND_TOKENS_MAX,
    attend_cache_varlen,
    attend_rows_flash,
    attend_rows_sdpa,
    attend_sdpa,
    choose_impl,
    flash_lengths,
    flash_unsupported,
    rows_offsets,
    rows_varlen_view,
)
from peagle_ext.serving.static_verifier import StaticVerifier
from peagle_ext.testing import make_tiny_verifier
from tests.helpers import flash_varlen_standin, one_request_batch, requires_cuda


def reference(q, k_cache, v_cache, pos, scale):
    """q [H, T, D]; query i sees cache positions <= pos[i]; float64."""
    q, k, v = q.double(), k_cache.double(), v_cache.double()
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    ctx = int(pos.max()) + 1
    k, v = k[:, :ctx], v[:, :ctx]  # positions past the last query are never read
    s = (q @ k.transpose(1, 2)) * scale
    keep = torch.arange(ctx, device=q.device)[None, :] <= pos[:, None].to(q.device)
    s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, -1) @ v


def case(heads, kv_heads, d, t, cap, start, dtype, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(heads, t, d, device=device, generator=g).to(dtype)
    k = torch.randn(kv_heads, cap, d, device=device, generator=g).to(dtype)
    v = torch.randn(kv_heads, cap, d, device=device, generator=g).to(dtype)
    pos = torch.arange(start, start + t, device=device)
    return q, k, v, pos


SHAPES = [(9, 3, 64), (4, 4, 32), (8, 1, 128)]  # SmolLM2's GQA, MHA, MQA


@pytest.mark.parametrize("heads,kv_heads,d", SHAPES)
@pytest.mark.parametrize("t,cap,start", [(1, 16, 0), (1, 40, 39), (4, 40, 0), (4, 64, 17), (9, 33, 24), (16, 16, 0)])
def test_sdpa_matches_reference(heads, kv_heads, d, t, cap, start):
    q, k, v, pos = case(heads, kv_heads, d, t, cap, start, torch.float64, "cpu", seed=t * 100 + start)
    allowed = torch.arange(cap)[None, :] <= pos[:, None]
    got = attend_sdpa(q, k, v, allowed, d**-0.5)
    torch.testing.assert_close(got, reference(q, k, v, pos, d**-0.5), rtol=1e-10, atol=1e-10)


def test_flash_lengths():
    cu_q, cu_k, used = flash_lengths(torch.arange(5, 9))
    assert cu_q.dtype == cu_k.dtype == used.dtype == torch.int32
    assert cu_q.tolist() == [0, 1, 2, 3, 4] and cu_k.tolist() == [0] * 5 and used.tolist() == [6, 7, 8, 9]
    assert [x.tolist() for x in flash_lengths(torch.tensor([0]))] == [[0, 1], [0, 0], [1]]


@pytest.fixture
def kernel_stood_in(monkeypatch):
    """FlashAttention's varlen forward replaced by its plain-PyTorch semantics, and flash allowed
    on the CPU: the layouts, offsets and used lengths around the kernel run here. The calls made
    are recorded (the number of query tokens of each)."""
    from peagle_ext.serving import cache_attention as ca

    calls = []

    def stand_in(q, *args, **kwargs):
        calls.append(q.shape[0])
        return flash_varlen_standin(q, *args, **kwargs)

    monkeypatch.setattr(ca, "_flash_varlen", stand_in)
    monkeypatch.setattr(ca, "flash_unsupported", lambda *a: None)
    ca._probe.cache_clear()
    ca._probe_rows.cache_clear()
    yield calls
    ca._probe.cache_clear()
    ca._probe_rows.cache_clear()


@pytest.mark.parametrize("heads,kv_heads,d", SHAPES)
@pytest.mark.parametrize("t,cap,start", [(1, 16, 0), (1, 40, 39), (2, 40, 0), (4, 64, 17), (9, 33, 24), (16, 16, 0)])
def test_flash_layout_matches_reference(kernel_stood_in, heads, kv_heads, d, t, cap, start):
    """One sequence per query token over the one cache: query i reads positions 0..pos[i] of the
    [C, kv heads, D] view and nothing past them (NaN there)."""
    q, k, v, pos = case(heads, kv_heads, d, t, cap, start, torch.float64, "cpu", seed=t * 10 + start)
    k[:, start + t :] = float("nan")
    v[:, start + t :] = float("nan")
    got = attend_cache_varlen(q, k, v, flash_lengths(pos), d**-0.5)
    assert got.shape == q.shape and kernel_stood_in == [t]
    torch.testing.assert_close(got, reference(q, k, v, pos, d**-0.5), rtol=1e-10, atol=1e-10)


def test_choice_on_the_cpu():
    assert choose_impl("auto", torch.device("cpu"), torch.bfloat16, 9, 3, 64) == "sdpa"
    assert choose_impl("sdpa", torch.device("cpu"), torch.float32, 9, 3, 64) == "sdpa"
    with pytest.raises(ValueError, match="attention='flash'.*CUDA device"):
        choose_impl("flash", torch.device("cpu"), torch.bfloat16, 9, 3, 64)
    with pytest.raises(ValueError, match="attention must be one of auto, sdpa, flash, peagle, got 'fast'"):
        choose_impl("fast", torch.device("cpu"), torch.bfloat16, 9, 3, 64)
    # peagle's op has a CPU path: chosen where asked for (after its probe), never by auto
    assert choose_impl("peagle", torch.device("cpu"), torch.float32, 9, 3, 64) == "peagle"
    with pytest.raises(ValueError, match="attention='peagle' cannot run this batched generation"):
        choose_impl("peagle", torch.device("cpu"), torch.float32, 9, 3, 64, rows=True)
    with pytest.raises(ValueError, match="attention='peagle' cannot run this verifier: .*multiple of its kv heads"):
        choose_impl("peagle", torch.device("cpu"), torch.float32, 9, 2, 64)
    assert "float16 or bfloat16" in flash_unsupported(torch.device("cuda"), torch.float32, 64)
    assert "head dim" in flash_unsupported(torch.device("cuda"), torch.bfloat16, 72 + 4)
    assert "head dim" in flash_unsupported(torch.device("cuda"), torch.bfloat16, 512)


def test_static_verifier_attention_argument(tmp_path):
    from transformers import AutoModelForCausalLM

    vm = AutoModelForCausalLM.from_pretrained(make_tiny_verifier(tmp_path / "v"), dtype=torch.float32).eval()
    assert StaticVerifier(vm).attention == "sdpa"
    with pytest.raises(ValueError, match="attention='flash' cannot run this verifier"):
        StaticVerifier(vm, attention="flash")
    with pytest.raises(ValueError, match="attention must be one of"):
        StaticVerifier(vm, attention="xformers")


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,d", SHAPES)
@pytest.mark.parametrize(
    "t,cap,start",
    [
        (1, 16, 0),
        (1, 2048, 2047),
        (1, 2048, 100),
        (4, 512, 0),
        (4, 512, 300),
        (4, 200, 196),
        (9, 1024, 500),
        (16, 48, 32),
        (128, 128, 0),
    ],
)
def test_flash_matches_reference(dtype, heads, kv_heads, d, t, cap, start):
    q, k, v, pos = case(heads, kv_heads, d, t, cap, start, dtype, "cuda", seed=cap + start + t)
    # the positions past the last query hold garbage: flash must not read them
    k[:, start + t :] = float("nan")
    v[:, start + t :] = float("nan")
    got = attend_cache_varlen(q, k, v, flash_lengths(pos), d**-0.5)
    assert got.shape == q.shape and got.dtype == dtype
    want = reference(q, k, v, pos, d**-0.5)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@requires_cuda
@pytest.mark.parametrize("t", [1, 4])
def test_flash_replays_from_a_cuda_graph_as_the_sequence_grows(t):
    heads, kv_heads, d, cap = 9, 3, 64, 1024
    q, k, v, pos = case(heads, kv_heads, d, t, cap, 0, torch.bfloat16, "cuda", seed=1)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        attend_cache_varlen(q, k, v, flash_lengths(pos), d**-0.5)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend_cache_varlen(q, k, v, flash_lengths(pos), d**-0.5)
    for start in (0, 5, 100, 700, cap - t):
        pos.copy_(torch.arange(start, start + t))
        q.normal_()
        graph.replay()
        want = attend_cache_varlen(q, k, v, flash_lengths(pos), d**-0.5)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        torch.testing.assert_close(out.double(), reference(q, k, v, pos, d**-0.5), rtol=2e-2, atol=2e-2)


@requires_cuda
@pytest.mark.parametrize("impl", ["flash", "peagle"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_static_verifier_flash_equals_sdpa(tmp_path, model_type, impl):
    """A varlen implementation and sdpa in a bf16 verifier (head dim 64): the same logits within
    bf16 rounding through forward() (a prefill), and the same logits and aux states through
    forward_static() (a round). auto takes peagle here."""
    from transformers import AutoModelForCausalLM

    vdir = make_tiny_verifier(tmp_path / "v", model_type=model_type, hidden=128)
    vm = AutoModelForCausalLM.from_pretrained(vdir, dtype=torch.bfloat16).cuda().eval().requires_grad_(False)
    aux = [0, 1, 2]
    fa, sd = StaticVerifier(vm, aux, attention=impl), StaticVerifier(vm, aux, attention="sdpa")
    assert fa.attention == impl and sd.attention == "sdpa"
    assert StaticVerifier(vm, aux).attention == "peagle"
    ids = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.inference_mode():
        ca, cs = fa.new_cache(96), sd.new_cache(96)
        la, _ = fa.forward(ids[:33], ca, 0)  # a prefill (sdpa in both; aux only when capturing)
        ls, _ = sd.forward(ids[:33], cs, 0)
        torch.testing.assert_close(la.float(), ls.float(), rtol=3e-2, atol=3e-2)
        empty, _ = fa.forward(ids[:0], ca, 33)  # no tokens: an empty result, as with sdpa
        assert empty.shape == (0, la.shape[-1])
        pos = torch.arange(33, 38, device="cuda")
        la, aa = fa.forward_static(ids[33:38], pos, ca)
        ls, as_ = sd.forward_static(ids[33:38], pos, cs)
        torch.testing.assert_close(la.float(), ls.float(), rtol=3e-2, atol=3e-2)
        torch.testing.assert_close(aa.float(), as_.float(), rtol=3e-2, atol=3e-2)


def test_static_verifier_flash_attends_rounds_only(tmp_path, kernel_stood_in):
    """StaticVerifier(attention="flash") with the kernel stood in: a round's tokens go through
    flash and give sdpa's logits and aux states; a greedy step's one token and a prefill take
    sdpa (no kernel call)."""
    from transformers import AutoModelForCausalLM

    vm = AutoModelForCausalLM.from_pretrained(make_tiny_verifier(tmp_path / "v"), dtype=torch.float64).eval()
    aux = [0, 1, 2]
    fa, sd = StaticVerifier(vm, aux, attention="flash"), StaticVerifier(vm, aux, attention="sdpa")
    assert fa.attention == "flash" and sd.attention == "sdpa"
    ids = torch.randint(3, 300, (60,), generator=torch.Generator().manual_seed(0))
    ca, cs = fa.new_cache(96), sd.new_cache(96)
    kernel_stood_in.clear()
    assert ROUND_TOKENS_MAX == 16  # a prefill of 17 tokens (sdpa) and a forward of 16 (flash) straddle it
    steps = ((0, 17, False), (17, 21, True), (21, 22, True), (22, 38, False), (38, 47, False), (47, 48, False))
    for a, b, static in steps:
        if static:
            pos = torch.arange(a, b)
            got, want = fa.forward_static(ids[a:b], pos, ca), sd.forward_static(ids[a:b], pos, cs)
        else:
            got, want = fa.forward(ids[a:b], ca, a), sd.forward(ids[a:b], cs, a)
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-9)
    layers = fa.num_layers
    assert kernel_stood_in == [4] * layers + [16] * layers + [9] * layers  # the rounds of 2..16 tokens only


def _tiny_pair(tmp_path, model_type, dtype, device="cpu", num_layers=2, k=4, hidden=64):
    """A tiny verifier (two query heads, one kv head, head dim hidden / 2) and a random P-EAGLE
    drafter for it (MASK hidden drawn too)."""
    from transformers import AutoModelForCausalLM

    from peagle_ext.model import PEagleDraftModel

    vdir = make_tiny_verifier(tmp_path / "v", model_type=model_type, hidden=hidden)
    vm = AutoModelForCausalLM.from_pretrained(vdir, dtype=dtype).to(device).eval().requires_grad_(False)
    torch.manual_seed(0)
    dm = PEagleDraftModel.from_verifier(vm.config, num_depths=k, mask_token_id=300, num_layers=num_layers)
    with torch.no_grad():
        dm.mask_hidden.normal_()
    return vm, dm


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_drafter_flash_equals_sdpa(tmp_path, kernel_stood_in, model_type):
    """PEagleDrafter(attention="flash") with the kernel stood in (float32 drafter, float64
    verifier): each row, one
    sequence over the cache slots 0..its position, gives sdpa's final hidden states in the
    general forward and in the fixed-shape one, where rejected rows write to the scratch slot and
    may sit past the cache; speculative decoding through a RoundEngine gives sdpa's tokens and
    acceptances round for round, with every drafter forward through the kernel."""
    import copy

    from peagle_ext.serving import PEagleDrafter, speculative_generate
    from peagle_ext.serving.graphs import RoundEngine

    vm, dm = _tiny_pair(tmp_path, model_type, torch.float64)
    k, cap = 4, 48
    fl = PEagleDrafter(copy.deepcopy(dm), dtype=torch.float32, attention="flash")
    sd = PEagleDrafter(copy.deepcopy(dm), dtype=torch.float32, attention="sdpa")
    assert fl.attention == "flash" and sd.attention == "sdpa"
    g = torch.Generator().manual_seed(3)
    w = dm.config.num_aux * vm.config.hidden_size

    def batch(ids, pos0, nrej, aux):
        return one_request_batch(fl, ids, pos0, nrej, aux, k=k, capacity=cap, mask_token_id=300)

    with torch.no_grad():
        b1 = batch(torch.randint(0, 300, (9,), generator=g), 0, 0, torch.randn(9, w, generator=g))
        for d in (fl, sd):
            d.reset(cap)
        kernel_stood_in.clear()
        want, got = (d.forward_rows(b1, 9 + k - 1, 9 + k - 1) for d in (sd, fl))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert kernel_stood_in == [9 + k - 1] * 2  # every row, in both layers
        # the last round before the cache ends: rows past it are rejected
        b2 = batch(torch.randint(0, 300, (k + 1,), generator=g), cap - k - 1, 2, torch.randn(k + 1, w, generator=g))
        rows = b2.token_indices_to_sample[:k].long()
        kernel_stood_in.clear()
        want, got = (d.forward_static(b2, rows) for d in (sd, fl))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert kernel_stood_in == [2 * k, k]  # all 2K rows, then the last layer's sampled rows
        assert int(b2.positions.max()) >= cap  # a rejected row past the cache took part
        for a, b in zip(fl._k_cache + fl._v_cache, sd._k_cache + sd._v_cache):
            torch.testing.assert_close(a[:cap], b[:cap], rtol=1e-5, atol=1e-6)

    st = StaticVerifier(vm, fl.aux_layer_ids, attention="sdpa")
    for p in (torch.randint(3, 300, (n,), generator=g) for n in (1, 6, 13)):
        kernel_stood_in.clear()
        a = speculative_generate(st, fl, p, k, 20, engine=RoundEngine(st, fl, k, cap, cuda_graph=False))
        assert kernel_stood_in  # the drafter's attention went through the kernel
        b = speculative_generate(st, sd, p, k, 20, engine=RoundEngine(st, sd, k, cap, cuda_graph=False))
        assert a.tokens == b.tokens and a.accepted == b.accepted


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_peagle_attention_equals_sdpa_in_decoding(tmp_path, model_type):
    """attention="peagle" (ops.decode_attention, its real CPU path) in the verifier and the
    drafter: a round's logits and aux states equal sdpa's (float64 verifier), and speculative
    decoding through a RoundEngine gives sdpa's tokens and acceptances round for round."""
    import copy

    from peagle_ext.serving import PEagleDrafter, speculative_generate
    from peagle_ext.serving.graphs import RoundEngine

    vm, dm = _tiny_pair(tmp_path, model_type, torch.float64)
    aux = dm.config.eagle_aux_hidden_state_layer_ids
    pv, sv = StaticVerifier(vm, aux, attention="peagle"), StaticVerifier(vm, aux, attention="sdpa")
    assert pv.attention == "peagle"
    ids = torch.randint(3, 300, (30,), generator=torch.Generator().manual_seed(0))
    cp, cs = pv.new_cache(64), sv.new_cache(64)
    pv.forward(ids[:20], cp, 0)
    sv.forward(ids[:20], cs, 0)
    pos = torch.arange(20, 25)
    for x, y in zip(pv.forward_static(ids[20:25], pos, cp), sv.forward_static(ids[20:25], pos, cs)):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-9)
    pd = PEagleDrafter(copy.deepcopy(dm), dtype=torch.float32, attention="peagle")
    sd = PEagleDrafter(copy.deepcopy(dm), dtype=torch.float32, attention="sdpa")
    assert pd.attention == "peagle"
    k, cap = 4, 48
    g = torch.Generator().manual_seed(5)
    for p in (torch.randint(3, 300, (n,), generator=g) for n in (1, 9)):
        a = speculative_generate(pv, pd, p, k, 20, engine=RoundEngine(pv, pd, k, cap, cuda_graph=False))
        b = speculative_generate(sv, sd, p, k, 20, engine=RoundEngine(sv, sd, k, cap, cuda_graph=False))
        assert a.tokens == b.tokens and a.accepted == b.accepted


def test_drafter_attention_argument(tmp_path):
    from peagle_ext.serving import PEagleDrafter

    _, dm = _tiny_pair(tmp_path, "llama", torch.float32, num_layers=1)
    assert PEagleDrafter(dm).attention == "sdpa"  # auto on the CPU
    with pytest.raises(ValueError, match="'flash' cannot run this drafter: it needs a CUDA device \\(the drafter"):
        PEagleDrafter(dm, attention="flash")
    dr = PEagleDrafter(dm, attention="sdpa")
    dr.set_attention("peagle")  # its CPU path
    assert dr.attention == "peagle"
    with pytest.raises(ValueError, match="attention must be one of"):
        PEagleDrafter(dm, attention="math")


@requires_cuda
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_drafter_flash_equals_sdpa_on_cuda(tmp_path, model_type):
    """The real kernels (flash, peagle) in a bf16 drafter: forward_static's hidden states equal
    sdpa's within bf16 rounding after rounds replayed from a CUDA graph as the positions moved on.
    Head dim 64: the smallest the CUDA decode-attention kernel serves."""
    import copy

    from peagle_ext.serving import PEagleDrafter
    from peagle_ext.serving.graphs import RoundEngine

    vm, dm = _tiny_pair(tmp_path, model_type, torch.bfloat16, device="cuda", hidden=128)
    k, cap = 3, 256
    st = StaticVerifier(vm, dm.config.eagle_aux_hidden_state_layer_ids, attention="sdpa")
    outs = []
    for att in ("flash", "peagle", "sdpa"):
        dr = PEagleDrafter(copy.deepcopy(dm), device="cuda", dtype=torch.bfloat16, attention=att)
        assert dr.attention == att
        eng = RoundEngine(st, dr, k, cap, cuda_graph=True)
        prompt = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(0)).cuda()
        eng.first_round(prompt)
        for _ in range(20):  # rounds replayed from the graph, the positions moving on
            eng.step()
        rows = eng.batch.token_indices_to_sample[:k].long()
        with torch.no_grad():
            outs.append(dr.forward_static(eng.batch, rows).float())
    for out in outs[:-1]:
        torch.testing.assert_close(out, outs[-1], rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("rows", [False, True], ids=["verifier", "batched"])
@pytest.mark.parametrize("broken", ["raises", "wrong", "right"])
def test_auto_probes_flash_before_choosing_it(kernel_stood_in, monkeypatch, broken, rows):
    """auto takes flash only where its probe runs and agrees with sdpa (the verifier's: rounds of
    2 and 9 tokens; batched generation's: rows of one position, of the whole capacity, a cache
    with more rows than the batch); an explicit "flash" that fails the probe is an error naming
    why. The kernel is stood in for here, so this runs on the CPU."""
    from peagle_ext.serving import cache_attention as ca

    def flash(q, *args, **kwargs):
        if broken == "raises":
            raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.\nmore")
        out = flash_varlen_standin(q.float(), *(a.float() for a in args[:2]), *args[2:], **kwargs)
        return (out * 2 if broken == "wrong" else out).to(q.dtype)

    monkeypatch.setattr(ca, "_flash_varlen", flash)
    dev = torch.device("cpu")
    assert choose_impl("auto", dev, torch.bfloat16, 9, 3, 64, rows=rows) == ("flash" if broken == "right" else "sdpa")
    assert choose_impl("sdpa", dev, torch.bfloat16, 9, 3, 64, rows=rows) == "sdpa"
    if broken == "right":
        assert choose_impl("flash", dev, torch.bfloat16, 9, 3, 64, rows=rows) == "flash"
    else:
        what = "this batched generation" if rows else "this verifier"
        why = "failed: FlashAttention only supports Ampere" if broken == "raises" else "disagrees with sdpa"
        with pytest.raises(ValueError, match=f"cannot run {what}: .*{why}"):
            choose_impl("flash", dev, torch.bfloat16, 9, 3, 64, rows=rows)


def test_auto_tries_peagle_first_for_rounds_on_cuda():
    from peagle_ext.serving.cache_attention import auto_candidates

    assert auto_candidates(torch.device("cuda")) == ("peagle", "flash")
    assert auto_candidates("cuda:1") == ("peagle", "flash")
    assert auto_candidates(torch.device("cuda"), rows=True) == ("flash",)  # peagle has no rows shape
    assert auto_candidates(torch.device("cpu")) == ("flash",)


@pytest.mark.parametrize("peagle", ["right", "wrong"])
def test_auto_takes_peagle_where_its_probe_agrees(kernel_stood_in, monkeypatch, peagle):
    """With peagle first in auto's order (as on CUDA), auto takes it where its probe agrees with
    sdpa and moves on to flash where it does not; an explicit "peagle" that disagrees is an
    error. Runs on the CPU with the op's CPU path (flash stood in)."""
    from peagle_ext.serving import cache_attention as ca

    monkeypatch.setattr(ca, "auto_candidates", lambda device, rows=False: ("flash",) if rows else ("peagle", "flash"))
    if peagle == "wrong":
        real = ca._peagle_varlen
        monkeypatch.setattr(ca, "_peagle_varlen", lambda *a: real(*a) * 2)
    dev = torch.device("cpu")
    assert choose_impl("auto", dev, torch.float32, 9, 3, 64) == ("peagle" if peagle == "right" else "flash")
    assert choose_impl("auto", dev, torch.float32, 9, 3, 64, rows=True) == "flash"
    if peagle == "wrong":
        with pytest.raises(ValueError, match="attention='peagle' cannot run this verifier: .*disagrees with sdpa"):
            choose_impl("peagle", dev, torch.float32, 9, 3, 64)


# ---- one query per row over a batch of caches (batched generation) ---------------------------


def rows_reference(q, k_cache, v_cache, used, scale):
    """q [B, H, D] over the first B rows of k/v_cache [B', KV, C, D], row r seeing positions
    < used[r]; float64, from the cache tensors themselves (no view arithmetic)."""
    out = []
    for r in range(q.shape[0]):
        n = int(used[r])
        rep = q.shape[1] // k_cache.shape[1]
        k = k_cache[r, :, :n].double().repeat_interleave(rep, 0)
        v = v_cache[r, :, :n].double().repeat_interleave(rep, 0)
        p = torch.softmax(torch.einsum("hd,hnd->hn", q[r].double(), k) * scale, -1)
        out.append(torch.einsum("hn,hnd->hd", p, v))
    return torch.stack(out)


def rows_case(rows, extra, heads, kv_heads, d, cap, dtype, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    k = torch.randn(rows + extra, kv_heads, cap, d, device=device, generator=g).to(dtype)
    v = torch.randn(rows + extra, kv_heads, cap, d, device=device, generator=g).to(dtype)
    q = torch.randn(rows, heads, d, device=device, generator=g).to(dtype)
    used = torch.randint(1, cap + 1, (rows,), device=device, generator=g).to(torch.int32)
    used[0] = 1  # one position
    used[-1] = cap  # the whole capacity
    return q, k, v, used


@pytest.mark.parametrize("rows,extra,cap", [(1, 0, 1), (1, 3, 17), (6, 0, 40), (5, 2, 64)])
def test_rows_varlen_view_addresses_each_rows_positions(rows, extra, cap):
    cache = torch.randn(rows + extra, 3, cap, 8)
    view = rows_varlen_view(cache, rows)
    cu_q, cu_k = rows_offsets(rows, 3, cap, "cpu")
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.tolist() == list(range(rows + 1))
    assert view.data_ptr() == cache.data_ptr() and view.stride(-1) == 1
    for r in range(rows):
        got = view[int(cu_k[r]) : int(cu_k[r]) + cap]  # [cap, kv, D]
        assert torch.equal(got, cache[r].transpose(0, 1))
    with pytest.raises(ValueError, match="contiguous"):
        rows_varlen_view(torch.randn(2, 4, 3, 8).transpose(1, 2), 1)


@pytest.mark.parametrize("heads,kv_heads,d", SHAPES)
@pytest.mark.parametrize("rows,extra,cap", [(1, 0, 1), (3, 0, 16), (7, 2, 33)])
def test_rows_sdpa_and_flash_layout_match_the_reference(kernel_stood_in, heads, kv_heads, d, rows, extra, cap):
    q, k, v, used = rows_case(rows, extra, heads, kv_heads, d, cap, torch.float64, "cpu", seed=rows + cap)
    want = rows_reference(q, k, v, used, d**-0.5)
    allowed = torch.arange(cap)[None, :] < used[:, None]
    got = attend_rows_sdpa(q, k[:rows], v[:rows], allowed, d**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    offsets = rows_offsets(rows, kv_heads, cap, "cpu")
    got = attend_rows_flash(q, k, v, offsets, used, d**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,d", SHAPES)
@pytest.mark.parametrize("rows,extra,cap", [(1, 0, 1), (1, 2, 300), (9, 0, 64), (64, 5, 1000)])
def test_rows_flash_matches_reference(dtype, heads, kv_heads, d, rows, extra, cap):
    q, k, v, used = rows_case(rows, extra, heads, kv_heads, d, cap, dtype, "cuda", seed=rows * 7 + cap)
    got = attend_rows_flash(q, k, v, rows_offsets(rows, kv_heads, cap, "cuda"), used, d**-0.5)
    assert got.shape == q.shape and got.dtype == dtype
    torch.testing.assert_close(got.double(), rows_reference(q, k, v, used, d**-0.5), rtol=2e-2, atol=2e-2)


@requires_cuda
def test_rows_flash_replays_from_a_cuda_graph_as_rows_grow():
    rows, cap, d = 12, 256, 64
    q, k, v, used = rows_case(rows, 0, 9, 3, d, cap, torch.bfloat16, "cuda", seed=3)
    used.clamp_(max=cap - 50)
    offsets = rows_offsets(rows, 3, cap, "cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        attend_rows_flash(q, k, v, offsets, used, d**-0.5)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend_rows_flash(q, k, v, offsets, used, d**-0.5)
    used.add_(50)
    graph.replay()
    torch.testing.assert_close(out.double(), rows_reference(q, k, v, used, d**-0.5), rtol=2e-2, atol=2e-2)
