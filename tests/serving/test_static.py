"""The fixed-shape decoding path: StaticVerifier (own KV cache) against the transformers model,
PEagleDrafter.forward_static against forward_rows, and the Round/Greedy engines (run eagerly on
the CPU, replayed as CUDA graphs on a GPU) against the general decoding loop, token for token and
round for round, with no, partial and full acceptance."""

import copy

import pytest
import torch

from peagle_ext.model import PEagleDraftModel
from peagle_ext.serving import PEagleDrafter, Verifier, greedy_generate, speculative_generate
from peagle_ext.serving.graphs import GreedyEngine, RoundEngine
from peagle_ext.serving.static_verifier import StaticVerifier, static_verifier_support
from peagle_ext.testing import make_tiny_verifier
from tests.helpers import one_request_batch, requires_cuda

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 300


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def vdir(request, tmp_path_factory):
    return make_tiny_verifier(tmp_path_factory.mktemp(request.param) / "v", model_type=request.param)


def _load(vdir, dtype, device="cpu"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(vdir, dtype=dtype).to(device).eval().requires_grad_(False)


def _drafter(vm, k=4, seed=0, **kw):
    torch.manual_seed(seed)
    dm = PEagleDraftModel.from_verifier(vm.config, num_depths=k, mask_token_id=VOCAB, **kw)
    with torch.no_grad():
        dm.mask_hidden.normal_()
    return dm


def _prompts(seed, n=3, lo=4, hi=14):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g) for _ in range(n)]


def test_static_verifier_matches_transformers(vdir):
    vm = _load(vdir, torch.float64)
    assert static_verifier_support(vm) is None
    aux_ids = [1, 3, 6]
    hf, st = Verifier(vm, aux_ids), StaticVerifier(vm, aux_ids)
    ids = torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(1))
    with hf.capturing(), st.capturing():
        c1, c2 = hf.new_cache(), st.new_cache(64)
        l1, a1 = hf.forward(ids[:12], c1, 0)
        l2, a2 = st.forward(ids[:12], c2, 0)
        torch.testing.assert_close(l2, l1, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(a2, a1, rtol=1e-9, atol=1e-9)
        # 5 tokens, then keep 2 of them (crop) and run 6 from there: stale entries are never read
        hf.forward(ids[12:17], c1, 12)
        st.forward(ids[12:17] + 1, c2, 12)
        hf.crop(c1, 14)
        st.crop(c2, 14)
        st.forward(ids[12:14], c2, 12)  # rewrite what the HF cache kept
        l1, a1 = hf.forward(ids[14:20], c1, 14)
        l2, a2 = st.forward(ids[14:20], c2, 14)
        torch.testing.assert_close(l2, l1, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(a2, a1, rtol=1e-9, atol=1e-9)
        # the fixed-shape form: the whole capacity under the position mask
        l3, a3 = st.forward_static(ids[14:20], torch.arange(14, 20), c2)
        torch.testing.assert_close(l3, l2, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(a3, a2, rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="holds 64 positions"):
        st.forward(ids, c2, 50)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_tables_give_rotate_half_rope_to_the_bit(vdir, dtype):
    """StaticVerifier's RoPE (contiguous per-head tables, sin's first half negated, halves
    swapped) equals the textbook x * cos + rotate_half(x) * sin bit for bit, for q and k, at
    positions of one prompt and of a batch of rows."""
    from transformers.models.llama.modeling_llama import rotate_half

    from peagle_ext.serving.static_verifier import ROPE_EXPAND_MAX, _swap_halves

    st = StaticVerifier(_load(vdir, dtype), [1])
    g = torch.Generator().manual_seed(0)
    for pos in (torch.arange(5, 12), torch.tensor([[3], [40], [0]]), torch.arange(ROPE_EXPAND_MAX + 1)):
        cos_q, sin_q, cos_k, sin_k = st.rope(pos)
        if pos.numel() <= ROPE_EXPAND_MAX:  # per head and contiguous
            assert cos_q.shape == (*pos.shape, st.num_heads, st.head_dim) and cos_q.is_contiguous()
            assert sin_k.shape == (*pos.shape, st.kv_heads, st.head_dim) and sin_k.is_contiguous()
        else:  # a long prefill's: broadcast over the heads
            assert cos_q.shape == sin_k.shape == (*pos.shape, 1, st.head_dim)
        freqs = pos.float()[..., None] * st._inv_freq
        emb = torch.cat([freqs, freqs], -1)[..., None, :]
        cos, sin = (emb.cos() * st._rope_scale).to(dtype), (emb.sin() * st._rope_scale).to(dtype)
        for heads, c, s in ((st.num_heads, cos_q, sin_q), (st.kv_heads, cos_k, sin_k)):
            x = torch.randn(*pos.shape, heads, st.head_dim, generator=g).to(dtype)
            assert torch.equal(x * c + _swap_halves(x) * s, x * cos + rotate_half(x) * sin)


def test_static_greedy_equals_transformers_greedy(vdir):
    vm = _load(vdir, torch.float64)
    hf, st = Verifier(vm), StaticVerifier(vm)
    eng = GreedyEngine(st, 64, cuda_graph=False)
    for p in _prompts(3):
        want = greedy_generate(hf, p, 30).tokens
        assert greedy_generate(st, p, 30).tokens == want
        assert greedy_generate(st, p, 30, engine=eng).tokens == want
    with pytest.raises(ValueError, match="capacity 64"):
        greedy_generate(st, p, 60, engine=eng)


def test_forward_static_matches_forward_rows(vdir):
    vm = _load(vdir, torch.float32)
    k = 4
    dr = PEagleDrafter(_drafter(vm, k=k, num_layers=2))
    g = torch.Generator().manual_seed(2)
    w = dr.model.config.num_aux * 64
    cap = 48

    def batch(ids, pos0, nrej, aux):
        return one_request_batch(dr, ids, pos0, nrej, aux, k=k, capacity=cap, mask_token_id=VOCAB)

    b1 = batch(torch.randint(0, VOCAB, (9,), generator=g), 0, 0, torch.randn(9, w, generator=g))
    for nrej in (0, 2, k):  # a round with rejected rows, after the same first round in two drafters
        b2 = batch(torch.randint(0, VOCAB, (k + 1,), generator=g), 9, nrej, torch.randn(k + 1, w, generator=g))
        rows = b2.token_indices_to_sample[:k].long()
        general, static = PEagleDrafter(copy.deepcopy(dr.model)), PEagleDrafter(copy.deepcopy(dr.model))
        with torch.no_grad():
            for d in (general, static):
                d.reset(cap)
                d.forward_rows(b1, 9 + k - 1, 9 + k - 1)
            want = general.forward_rows(b2, 2 * k - nrej, 9 + (k + 1 - nrej) + k - 1, out_rows=rows)
            got = static.forward_static(b2, rows)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert bool(b2.is_rejected.any()) == (nrej > 0)


class OracleDrafter(PEagleDrafter):
    """A PEagleDrafter (the real batch and forward run) whose proposals are replaced by the
    verifier's greedy continuation for the first j drafts and a wrong token after, in both the
    general and the fixed-shape path: partial acceptance exercises every bookkeeping branch."""

    def setup(self, full, j):
        """In place: a CUDA graph captured before keeps reading the same buffers."""
        if not hasattr(self, "full"):
            self.full = torch.zeros(1024, dtype=torch.long, device=self.device)
            self.j = torch.zeros((), dtype=torch.long, device=self.device)
        self.full.zero_()
        self.full[: len(full)] = torch.tensor(full, dtype=torch.long)
        self.j.fill_(j)

    def _oracle(self, batch, k, drafts):
        rows = batch.token_indices_to_sample[:k].long()
        want = self.full[batch.positions[rows] + 2]
        keep = torch.arange(k, device=drafts.device) < self.j
        return torch.where(keep, want, (want + 1) % VOCAB)

    def propose(self, batch, k, num_rows, context_len):
        return self._oracle(batch, k, super().propose(batch, k, num_rows, context_len))

    def propose_static(self, batch, k):
        return self._oracle(batch, k, super().propose_static(batch, k))


@pytest.mark.parametrize("k", [1, 3, 8])
def test_round_engine_equals_general_loop(vdir, k):
    vm = _load(vdir, torch.float64)
    dm = _drafter(vm, k=8, seed=k)
    aux = dm.config.eagle_aux_hidden_state_layer_ids
    st = StaticVerifier(vm, aux)
    hf = Verifier(vm, aux)
    m = 33
    for j in sorted({0, 1, k // 2, k}):
        dr = OracleDrafter(dm, dtype=torch.float32)
        eng = RoundEngine(st, dr, k, 96, cuda_graph=False)
        padded = RoundEngine(st, dr, k, 96, cuda_graph=False, padded_prefill=True)
        for p in _prompts(40 + j, n=2):
            full = p.tolist() + greedy_generate(hf, p, m + k + 2).tokens
            dr.setup(full, j)
            ref = speculative_generate(hf, dr, p, k, m)
            gen = speculative_generate(st, dr, p, k, m)
            fast = speculative_generate(st, dr, p, k, m, engine=eng, profile=True)
            # unprofiled, the first round's verify half runs on the engine too (first_verify)
            fast2 = speculative_generate(st, dr, p, k, m, engine=eng)
            # the prefill and the whole first round on the prompt padded to its bucket
            fast3 = speculative_generate(st, dr, p, k, m, engine=padded)
            for r in (gen, fast, fast2, fast3):
                assert r.tokens == ref.tokens and r.accepted == ref.accepted
            assert ref.tokens == full[p.numel() : p.numel() + m] and ref.accepted == [j] * ref.rounds
            prof = fast.profile
            assert prof["engine_rounds"] == fast.rounds - 1 and prof["engine_round"] > 0
    # the random drafter itself through the engine: lossless
    dr = PEagleDrafter(dm, dtype=torch.float32)
    eng = RoundEngine(st, dr, k, 96, cuda_graph=False)
    for p in _prompts(7):
        want = greedy_generate(hf, p, m).tokens
        a = speculative_generate(st, dr, p, k, m, engine=eng)
        b = speculative_generate(hf, dr, p, k, m)
        assert a.tokens == want and a.accepted == b.accepted


def test_engine_on_a_cache_allocated_under_inference_mode(vdir):
    """Teacher-forced rounds and decoding reset() the drafter under inference_mode; an engine built
    afterwards on that cache runs its round outside it (a CUDA graph capture runs under no_grad)
    and writes the cache in place, which torch refuses for inference tensors."""
    vm = _load(vdir, torch.float32)
    dm = _drafter(vm, k=3)
    st = StaticVerifier(vm, dm.config.eagle_aux_hidden_state_layer_ids)
    dr = PEagleDrafter(dm, dtype=torch.float32)
    with torch.inference_mode():
        dr.reset(128)
    eng = RoundEngine(st, dr, 3, 96, cuda_graph=False)  # keeps the larger cache
    assert not dr._k_cache[0].is_inference()
    with torch.no_grad():
        eng.round()
    p = _prompts(5, n=1)[0]
    want = greedy_generate(Verifier(vm, st.aux_layer_ids), p, 12).tokens
    assert speculative_generate(st, dr, p, 3, 12, engine=eng).tokens == want


@pytest.mark.parametrize("k", [1, 4])
def test_padded_prefill_at_bucket_edges(vdir, k):
    """Prompts of 1 token, at and just past a bucket's length, and as long as the capacity allows:
    the padded prefill (greedy) and first round (speculative) give the general loop's tokens and
    rounds; the padding rows change nothing that is read (float64)."""
    from peagle_ext.serving.graphs import prefill_buckets

    assert prefill_buckets(96) == [32, 64, 96] and prefill_buckets(32) == [32] and prefill_buckets(20) == [20]
    assert prefill_buckets(200) == [32, 64, 128, 200]
    vm = _load(vdir, torch.float64)
    dm = _drafter(vm, k=4, seed=11)
    aux = dm.config.eagle_aux_hidden_state_layer_ids
    st, hf = StaticVerifier(vm, aux), Verifier(vm, aux)
    dr = PEagleDrafter(dm, dtype=torch.float32)
    cap, m = 96, 12
    eng = RoundEngine(st, dr, k, cap, cuda_graph=False, padded_prefill=True)
    plain = RoundEngine(st, dr, k, cap, cuda_graph=False)
    ge = GreedyEngine(st, cap, cuda_graph=False, padded_prefill=True)
    assert eng.buckets == ge.buckets == [32, 64, 96]
    g = torch.Generator().manual_seed(k)
    for n in (1, 31, 32, 33, 64, cap - m - k):
        p = torch.randint(3, VOCAB, (n,), generator=g)
        # the first round's drafts and the drafter's K/V of the prompt rows, bonus and MASK rows
        # (positions 0..n+K-2), padded against the loop's own first draft
        firsts = []
        for e in (plain, eng):
            speculative_generate(st, dr, p, k, 2, engine=e)
            firsts.append((e.drafts.clone(), [c[: n + k - 1].clone() for c in dr._k_cache + dr._v_cache]))
        assert torch.equal(firsts[0][0], firsts[1][0])
        for a, b in zip(firsts[0][1], firsts[1][1]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        want = greedy_generate(hf, p, m).tokens
        assert greedy_generate(st, p, m, engine=ge).tokens == want
        ref = speculative_generate(hf, dr, p, k, m)
        got = speculative_generate(st, dr, p, k, m, engine=eng)
        assert got.tokens == ref.tokens == want and got.accepted == ref.accepted
        one = speculative_generate(st, dr, p, k, 1, engine=eng)  # the prefill's token alone
        assert one.tokens == want[:1] and one.rounds == 0
    with pytest.raises(ValueError, match="capacity 96"):
        eng.first_round(torch.arange(3, 3 + cap - k))
    with pytest.raises(ValueError, match="padded_prefill=False"):
        RoundEngine(st, dr, k, cap, cuda_graph=False).first_round(torch.arange(3, 9))
    with pytest.raises(ValueError, match="padded_prefill=False"):
        GreedyEngine(st, cap, cuda_graph=False).prefill(torch.arange(3, 9))


def test_failed_prefill_capture_falls_back_to_eager(monkeypatch):
    """A prefill bucket whose graph capture fails runs eagerly, with a warning naming the bucket."""
    from peagle_ext.serving import graphs

    def fail(fn, device, pool=None):
        raise RuntimeError("operation not permitted when stream is capturing")

    def out_of_memory(fn, device, pool=None):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(graphs, "_capture", fail)
    with pytest.warns(RuntimeWarning, match="bucket 64 runs eagerly"):
        assert graphs._capture_prefill(lambda: None, "cpu", 64, None) is None
    # running out of memory is not a capture problem: it stays an error
    monkeypatch.setattr(graphs, "_capture", out_of_memory)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        graphs._capture_prefill(lambda: None, "cpu", 64, None)


def test_engine_bad_input(vdir):
    vm = _load(vdir, torch.float32)
    dm = _drafter(vm, k=3)
    st = StaticVerifier(vm, dm.config.eagle_aux_hidden_state_layer_ids)
    dr = PEagleDrafter(dm)
    with pytest.raises(ValueError, match="num_spec_tokens"):
        RoundEngine(st, dr, 4, 64, cuda_graph=False)
    with pytest.raises(TypeError, match="StaticVerifier"):
        RoundEngine(Verifier(vm, st.aux_layer_ids), dr, 2, 64, cuda_graph=False)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            RoundEngine(st, dr, 2, 64, cuda_graph=True)
    eng = RoundEngine(st, dr, 2, 64, cuda_graph=False)
    with pytest.raises(ValueError, match="another"):
        speculative_generate(st, dr, [5, 6, 7], 3, 5, engine=eng)
    with pytest.raises(ValueError, match="capacity 64"):
        speculative_generate(st, dr, [5, 6, 7], 2, 60, engine=eng)


@requires_cuda
def test_cuda_graph_engines_equal_eager(vdir):
    """bf16 verifier and drafter on the GPU: graph replay gives exactly the eager engine's rounds."""
    vm = _load(vdir, torch.bfloat16, "cuda")
    dm = _drafter(vm, k=8, seed=3)
    st = StaticVerifier(vm, dm.config.eagle_aux_hidden_state_layer_ids)
    # the same padded shapes eagerly and replayed: prompts in each prefill bucket (32, 64, 128)
    ge = GreedyEngine(st, 128, cuda_graph=False, padded_prefill=True)
    gg = GreedyEngine(st, 128, cuda_graph=True)
    assert gg.padded_prefill and gg.buckets == [32, 64, 128] and not gg.eager_prefill_buckets
    for k in (1, 4, 8):
        dr = OracleDrafter(dm, device="cuda", dtype=torch.bfloat16)
        dr.setup([], 0)  # the oracle's buffers exist before the graph engine captures a round
        eager = RoundEngine(st, dr, k, 128, cuda_graph=False, padded_prefill=True)
        graph = RoundEngine(st, dr, k, 128, cuda_graph=True)
        assert not graph.eager_prefill_buckets
        g = torch.Generator().manual_seed(60 + k)
        for n in (5, 33, 70):
            p = torch.randint(3, VOCAB, (n,), generator=g)
            want = greedy_generate(st, p, 50, engine=ge).tokens
            dr.setup(p.tolist() + want, k // 2)
            a = speculative_generate(st, dr, p, k, 40, engine=eager)
            b = speculative_generate(st, dr, p, k, 40, engine=graph)
            assert a.tokens == b.tokens and a.accepted == b.accepted
            assert a.tokens == want[:40]
    g = torch.Generator().manual_seed(9)
    for n in (5, 33, 70):
        p = torch.randint(3, VOCAB, (n,), generator=g)
        assert greedy_generate(st, p, 50, engine=ge).tokens == greedy_generate(st, p, 50, engine=gg).tokens


def test_cli_eval_profile_and_verifier_impl(vdir, tmp_path):
    import json

    from tests.helpers import run_cli

    vm = _load(vdir, torch.float32)
    _drafter(vm, k=3).save_pretrained(tmp_path / "draft")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "the water is hot"}\n{"prompt": "one day we can find"}\n')
    base = ["eval", "--verifier", str(vdir), "--draft", str(tmp_path / "draft"), "--bench", str(prompts)]
    base += ["--max-new-tokens", "12", "--quiet", "--k-sweep", "1..3"]
    r = run_cli([*base, "--profile", "--profile-prompts", "1", "--json", str(tmp_path / "s.json")], timeout=300)
    assert r.returncode == 0, r.stderr
    rep = json.loads((tmp_path / "s.json").read_text())
    assert rep["verifier_impl"] == "StaticVerifier" and rep["cuda_graphs"] is False and rep["lossless"]
    prof = rep["profile"]
    assert set(prof["parts_ms_per_round"]) == {"verify", "hidden", "batch", "draft", "accept", "crop"}
    assert prof["round_ms"] > prof["overhead_ms"] > 0 and prof["engine_round_ms"] > 0 and prof["rounds"] > 0
    assert prof["replay_position"] == rep["prompts"][0]["prompt_tokens"] + 6  # the first prompt's middle
    assert "round profile" in r.stdout and "beyond the verifier forward" in r.stdout
    r = run_cli([*base, "--verifier-impl", "hf", "--json", str(tmp_path / "h.json")], timeout=300)
    assert r.returncode == 0, r.stderr
    hf = json.loads((tmp_path / "h.json").read_text())
    assert hf["verifier_impl"] == "Verifier" and "profile" not in hf
    # the same tokens whichever verifier runs them (float32: equal up to near-ties, none here)
    assert [p["accepted_per_round"] for p in hf["prompts"]] == [p["accepted_per_round"] for p in rep["prompts"]]
    # and whichever attention: peagle's decode-attention op (its CPU path) in verifier and drafter
    r = run_cli([*base, "--attention", "peagle", "--json", str(tmp_path / "p.json")], timeout=300)
    assert r.returncode == 0, r.stderr
    pe = json.loads((tmp_path / "p.json").read_text())
    assert pe["verifier_attention"] == pe["drafter_attention"] == "peagle" and pe["lossless"]
    assert "attention peagle, drafter attention peagle" in r.stdout
    assert [p["accepted_per_round"] for p in pe["prompts"]] == [p["accepted_per_round"] for p in rep["prompts"]]


def test_kernel_class_names():
    from peagle_ext.eval import kernel_class

    assert kernel_class("nvjet_hsh_64x8_64x16_2x1_v_bz_splitK_TNN") == "gemm"
    assert kernel_class("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>") == "gemm"
    assert kernel_class("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(...)") == "attention"
    assert kernel_class("void pytorch_flash::flash_fwd_kernel<...>") == "attention"
    assert kernel_class("void at::native::reduce_kernel<512, 1, ...ArgMaxOps...>") == "reduce"
    assert kernel_class("void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>") == "copy / index"
    assert kernel_class("void at::native::vectorized_elementwise_kernel<4, ...>") == "elementwise"
    assert kernel_class("peagle_parallel_draft_kernel") == "parallel draft"
    assert kernel_class("void peagle::decode_attention::decode_attention_kernel<__nv_bfloat16, 64>") == "attention"
    assert kernel_class("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
    assert kernel_class("Memcpy DtoD (Device -> Device)") == "copy / index"
    assert kernel_class("something_else") == "other"


def test_eval_profile_prints_the_kernel_breakdown(capsys):
    """peagle eval's round profile prints the device time by class and the host wall time per
    replay when the profile has a kernel breakdown (a GPU run), and no such line without it."""
    from peagle_ext.cli.eval import print_profile

    p = {
        "num_spec_tokens": 3,
        "prompts": 2,
        "rounds": 40,
        "acceptance_length": 1.6,
        "parts_ms_per_round": {"verify": 3.0, "draft": 0.5},
        "prefill_ms_per_prompt": 20.0,
        "round_ms": 3.5,
        "overhead_ms": 0.5,
        "greedy_step_ms": 3.2,
        "engine_round_ms": 3.8,
        "engine_cuda_graph": True,
        "greedy_engine_step_ms": 3.1,
    }
    print_profile(p, "cuda")
    assert "device time" not in capsys.readouterr().out
    p["kernels"] = {
        "round_us": 3400.4,
        "greedy_step_us": 2900.2,
        "round_wall_us": 3700.0,
        "greedy_step_wall_us": 3050.0,
        "round_us_by_class": {"gemm": 2000.0, "attention": 1400.4},
        "greedy_step_us_by_class": {"gemm": 1700.0, "attention": 1200.2},
    }
    print_profile(p, "cuda")
    out = capsys.readouterr().out
    assert "device time: engine round 3400 us (gemm 2000, attention 1400), greedy step 2900 us" in out
    assert "host wall per replay: round 3700 us, greedy step 3050 us" in out
    assert "a round costs 1.23 greedy steps" in out and "device ops" not in out  # a report from before counts
    p["kernels"] |= {"round_device_ops": 412.0, "greedy_step_device_ops": 350.0}
    print_profile(p, "cuda")
    assert "device ops: round 412, greedy step 350" in capsys.readouterr().out


@requires_cuda
def test_kernel_breakdown_of_graph_engines(vdir):
    """Device time of a graph-replayed round and greedy step, by class; the engines still decode
    exactly afterwards (begin() replaces the made-up state the profile leaves)."""
    from peagle_ext.eval import kernel_breakdown

    vm = _load(vdir, torch.bfloat16, "cuda")
    dm = _drafter(vm, k=4, seed=5)
    st = StaticVerifier(vm, dm.config.eagle_aux_hidden_state_layer_ids)
    dr = PEagleDrafter(dm, device="cuda", dtype=torch.bfloat16)
    dr.reset(128)
    eng, ge = RoundEngine(st, dr, 4, 128, cuda_graph=True), GreedyEngine(st, 128, cuda_graph=True)
    p = _prompts(3)[0]
    want = greedy_generate(st, p, 40, engine=ge).tokens
    kb = kernel_breakdown(eng, ge, replays=6)
    assert kb["replays"] == {"round": 6, "greedy_step": 6}
    assert kb["round_us"] > kb["greedy_step_us"] > 0 and kb["round_kernels"] > 10
    # the host waits for the device: wall time per replay is at least most of the device time
    assert kb["round_wall_us"] > 0.8 * kb["round_us"] and kb["greedy_step_wall_us"] > 0.8 * kb["greedy_step_us"]
    assert abs(sum(kb["round_us_by_class"].values()) - kb["round_us"]) < 0.1 * kb["round_us"] + 1
    assert "gemm" in kb["round_us_by_class"] and kb["round_minus_greedy_top_us"]
    assert set(kb["round_minus_greedy_top_calls"]) == set(kb["round_minus_greedy_top_us"])
    assert kb["round_device_ops"] > kb["greedy_step_device_ops"] > 0
    assert speculative_generate(st, dr, p, 4, 40, engine=eng).tokens == want
    assert greedy_generate(st, p, 40, engine=ge).tokens == want
