"""BatchGenerator (peagle_ext.serving.batch_generation): greedy answers equal one-at-a-time
greedy decoding through transformers (float64, Llama and Qwen3, right-padded prompts of 1..30
tokens, rows stopping at different steps and leaving the batch) with either attention (flash's
kernel stood in for on the CPU), sampling that stays inside the nucleus and follows the softmax,
seeded determinism, and bad arguments."""

import math
import random

import pytest
import torch

from peagle_ext.serving import Verifier, greedy_generate
from peagle_ext.serving import batch_generation as bg
from peagle_ext.serving.batch_generation import BatchGenerator
from peagle_ext.testing import make_tiny_verifier
from tests.helpers import flash_varlen_standin

pytestmark = pytest.mark.usefixtures("one_thread")


# (family, query heads, K/V heads): groups of 2 and 4 query heads per K/V head
@pytest.fixture(scope="module", params=[("llama", 4, 2), ("qwen3", 4, 1)], ids=["llama-gqa2", "qwen3-gqa4"])
def model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    family, heads, kv_heads = request.param
    d = make_tiny_verifier(tmp_path_factory.mktemp(family), model_type=family, heads=heads, kv_heads=kv_heads)
    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64).eval().requires_grad_(False)


def _prompts(model, n, seed, max_len=30):
    rng = random.Random(seed)
    v = model.config.vocab_size
    return [[rng.randrange(3, v) for _ in range(rng.randrange(1, max_len + 1))] for _ in range(n)]


def _one_at_a_time(model, prompts, max_new, eos):
    res = []
    for p in prompts:
        toks = greedy_generate(Verifier(model), p, max_new, eos_token_id=sorted(eos) or None).tokens
        stop = next((i for i, t in enumerate(toks) if t in eos), None)
        res.append((toks, True) if stop is None else (toks[:stop], False))
    return res


def _eos_that_stops_rows_at_different_steps(free_runs, steps=(2, 9, 17, 26)):
    """Tokens the unstopped runs produce at those steps: rows stop across several stop checks."""
    return {row[s] for (row, _), s in zip(free_runs, steps) if s < len(row)}


@pytest.mark.parametrize("mode", ["eager", "fixed"])
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_equals_one_at_a_time_decoding(model, seed, mode, monkeypatch):
    """Both step forms (eager: attention over the filled positions; fixed: over the capacity, the
    step a CUDA graph captures); stop tokens that end most rows early, so rows leave the batch."""
    prompts = _prompts(model, 11, seed) + [[5]]  # a one-token prompt
    gen = BatchGenerator(model, mode=mode)
    assert gen.mode == mode
    free = gen.generate(prompts, max_new_tokens=40, eos=set())
    assert all(hit and len(toks) == 40 for toks, hit in free)
    assert free == _one_at_a_time(model, prompts, 40, set())
    eos = _eos_that_stops_rows_at_different_steps(free, steps=(2, 3, 5, 6, 9, 10, 17, 26))
    sizes = []
    decode = gen._decode

    def counted(tok, *a):
        sizes.append(tok.shape[0])
        return decode(tok, *a)

    monkeypatch.setattr(gen, "_decode", counted)
    got = gen.generate(prompts, max_new_tokens=40, eos=eos)
    assert got == _one_at_a_time(model, prompts, 40, eos)
    assert any(not hit for _, hit in got) and any(hit for _, hit in got)
    assert sizes[0] == len(prompts) and sizes[-1] < sizes[0]  # stopped rows left the batch
    assert sizes == sorted(sizes, reverse=True)
    if mode == "fixed":  # a compaction costs a capture there: only when half the rows stopped
        assert all(2 * b <= a for a, b in zip(sizes, sizes[1:]) if b < a)


@pytest.mark.parametrize("mode", ["eager", "fixed"])
def test_flash_attention_reads_each_rows_own_positions(model, mode, monkeypatch):
    """attention="flash" with FlashAttention's variable-length kernel stood in for by its plain
    PyTorch semantics (tests/helpers.flash_varlen_standin): the offsets, the used lengths and the
    cache view the decode step passes give the same greedy answers as one-at-a-time decoding,
    also as rows stop and leave the batch."""
    from peagle_ext.serving import cache_attention as ca

    calls = []

    def stand_in(q, *args, **kwargs):
        calls.append(q.shape[0])
        return flash_varlen_standin(q, *args, **kwargs)

    monkeypatch.setattr(ca, "flash_unsupported", lambda *a: None)
    monkeypatch.setattr(ca, "_flash_varlen", stand_in)
    ca._probe_rows.cache_clear()
    try:
        gen = BatchGenerator(model, mode=mode, attention="flash")
    finally:
        ca._probe_rows.cache_clear()
    assert gen.attention == "flash"
    prompts = _prompts(model, 9, 3) + [[5]]
    free = gen.generate(prompts, max_new_tokens=30, eos=set())
    assert free == _one_at_a_time(model, prompts, 30, set())
    eos = _eos_that_stops_rows_at_different_steps(free, steps=(2, 3, 5, 9, 17, 26))
    calls.clear()
    assert gen.generate(prompts, max_new_tokens=30, eos=eos) == _one_at_a_time(model, prompts, 30, eos)
    assert calls[0] == len(prompts) and calls[-1] < calls[0]  # the batch shrank under flash too


@pytest.mark.parametrize("mode", ["eager", "fixed"])
def test_stop_checks_every_step_and_short_limits(model, mode, monkeypatch):
    prompts = _prompts(model, 6, 3)
    gen = BatchGenerator(model, mode=mode)
    free = gen.generate(prompts, max_new_tokens=12, eos=set())
    eos = _eos_that_stops_rows_at_different_steps(free, steps=(1, 4, 7))
    ref = _one_at_a_time(model, prompts, 12, eos)
    monkeypatch.setattr(bg, "STOP_CHECK_EVERY", 1)
    monkeypatch.setattr(bg, "MIN_STEPS_AFTER_COMPACTION", 1)
    assert gen.generate(prompts, max_new_tokens=12, eos=eos) == ref
    first = [(toks[:1], True) if toks[:1] and toks[0] not in eos else ([], False) for toks, _ in free]
    assert gen.generate(prompts, max_new_tokens=1, eos=eos) == first
    assert gen.generate([], max_new_tokens=4, eos=eos) == []


class _ReplayedStep:
    """A stand-in for a CUDA graph on the CPU: replay() runs the captured step again."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        self.fn()


def test_graph_mode_control_flow_with_a_stand_in_capture(model, monkeypatch):
    """mode 'graphs' on the CPU with capture replaced by a stand-in: the warm-up run is the step's
    result, replays follow, every compaction recaptures, and a failed capture leaves the rest of
    that call on eager fixed steps (the same answers) and the next call capturing again."""
    import peagle_ext.serving.graphs as G

    prompts = _prompts(model, 12, 21) + [[7]]
    free = BatchGenerator(model, mode="fixed").generate(prompts, max_new_tokens=40, eos=set())
    eos = _eos_that_stops_rows_at_different_steps(free, steps=(2, 3, 5, 6, 9, 10, 11, 17, 26))
    ref = _one_at_a_time(model, prompts, 40, eos)
    captures = []

    def stand_in(fn, device, pool=None, warmups=2):
        assert pool is None  # a pool of its own per capture
        for _ in range(warmups):
            fn()
        captures.append(warmups)
        return _ReplayedStep(fn)

    monkeypatch.setattr(G, "_capture", stand_in)
    gen = BatchGenerator(model, mode="fixed")
    gen.mode = "graphs"  # refused on a CPU at construction; the control flow is device-free
    assert gen.generate(prompts, max_new_tokens=40, eos=eos) == ref
    assert len(captures) >= 2 and captures[0] == 2 and set(captures[1:]) == {1}  # recaptured per batch size
    assert gen.graphs_captured == len(captures) and gen.failed_captures == 0

    def failing(fn, device, pool=None, warmups=2):
        raise RuntimeError("capture refused (test)")

    monkeypatch.setattr(G, "_capture", failing)
    with pytest.warns(RuntimeWarning, match="capture refused"):
        assert gen.generate(prompts, max_new_tokens=40, eos=eos) == ref
    assert gen.failed_captures == 1  # once for the call, not once per compaction
    monkeypatch.setattr(G, "_capture", stand_in)
    before = len(captures)
    assert gen.generate(prompts, max_new_tokens=40, eos=eos) == ref
    assert len(captures) > before  # the next call captures again


def _first_token_probs(model, prompt):
    logits = model(torch.tensor([prompt])).logits[0, -1]
    return torch.softmax(logits.double(), -1)


def test_sampling_follows_the_softmax_inside_the_nucleus(model):
    gen = BatchGenerator(model)
    prompt = _prompts(model, 1, 7)[0]
    probs = _first_token_probs(model, prompt)
    n = 4000
    g = torch.Generator().manual_seed(0)
    draws = gen.generate([prompt] * n, max_new_tokens=1, eos=set(), temperature=1.0, generator=g)
    counts = torch.bincount(torch.tensor([t[0] for t, _ in draws]), minlength=probs.numel()).double()
    top = probs.argsort(descending=True)[:5]
    for t in top.tolist():  # the likeliest tokens within 5 standard errors
        p = float(probs[t])
        assert abs(counts[t] / n - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-9, (t, counts[t] / n, p)
    # top_p: only the smallest set of likeliest tokens whose mass reaches top_p is ever drawn
    sp, si = probs.sort(descending=True)
    top_p = float(sp[:3].sum()) - 1e-6  # the first three tokens reach it, two do not
    g = torch.Generator().manual_seed(1)
    draws = gen.generate([prompt] * 600, max_new_tokens=1, eos=set(), temperature=1.0, top_p=top_p, generator=g)
    assert {t[0] for t, _ in draws} == set(si[:3].tolist())
    # a nucleus of one token is greedy
    greedy = gen.generate([prompt], max_new_tokens=6, eos=set())
    assert gen.generate([prompt], max_new_tokens=6, eos=set(), temperature=0.7, top_p=1e-12) == greedy


def test_sampling_is_seeded_and_the_same_in_both_step_forms(model):
    prompts = _prompts(model, 5, 11)

    def run(seed, mode="eager"):
        g = torch.Generator().manual_seed(seed)
        gen = BatchGenerator(model, mode=mode)
        return gen.generate(prompts, max_new_tokens=10, eos=set(), temperature=1.5, top_p=0.95, generator=g)

    assert run(3) == run(3) == run(3, "fixed")
    assert run(3) != run(4)


def test_bad_arguments(model):
    gen = BatchGenerator(model)
    for kw, match in (
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=True), "max_new_tokens"),
        (dict(max_new_tokens=3, temperature=-1.0), "temperature"),
        (dict(max_new_tokens=3, temperature=float("nan")), "temperature"),
        (dict(max_new_tokens=3, top_p=0.0), "top_p"),
        (dict(max_new_tokens=3, top_p=1.5), "top_p"),
    ):
        with pytest.raises(ValueError, match=match):
            gen.generate([[4, 5]], eos=set(), **kw)
    with pytest.raises(ValueError, match="at least one token"):
        gen.generate([[4, 5], []], max_new_tokens=3, eos=set())
    limit = model.config.max_position_embeddings
    with pytest.raises(ValueError, match="positions"):
        gen.generate([[4] * limit], max_new_tokens=3, eos=set())
    # exactly the model's positions: the prompt's and all new tokens but the last
    got = gen.generate([[4] * (limit - 2)], max_new_tokens=3, eos=set())
    assert got[0][1] and len(got[0][0]) == 3


def test_modes_and_attention(model):
    assert BatchGenerator(model).mode == "eager"  # auto, on a CPU
    with pytest.raises(ValueError, match="mode must be one of"):
        BatchGenerator(model, mode="fast")
    with pytest.raises(ValueError, match="needs the model on a CUDA device"):
        BatchGenerator(model, mode="graphs")
    assert BatchGenerator(model).attention == "sdpa"  # auto, on a CPU
    with pytest.raises(ValueError, match="attention must be one of"):
        BatchGenerator(model, attention="fast")
    with pytest.raises(ValueError, match="cannot run this batched generation: it needs a CUDA device"):
        BatchGenerator(model, attention="flash")


def test_unsupported_model_is_named(model, monkeypatch):
    monkeypatch.setattr(model.config, "model_type", "gpt2")
    with pytest.raises(ValueError, match="gpt2"):
        BatchGenerator(model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_greedy_and_sampling_match_the_cpu(model):
    """float64 on the GPU: the same greedy answers as one-at-a-time decoding on the CPU, rows
    leaving the batch included; a CUDA generator samples reproducibly."""
    import copy

    prompts = _prompts(model, 9, 5)
    cuda_model = copy.deepcopy(model).cuda()
    gpu = BatchGenerator(cuda_model)
    assert gpu.mode == "graphs"
    free = gpu.generate(prompts, max_new_tokens=40, eos=set())
    assert free == _one_at_a_time(model, prompts, 40, set())
    eos = _eos_that_stops_rows_at_different_steps(free, steps=(2, 3, 5, 6, 9, 26))
    ref = _one_at_a_time(model, prompts, 40, eos)
    captured = gpu.graphs_captured
    assert gpu.generate(prompts, max_new_tokens=40, eos=eos) == ref
    assert gpu.graphs_captured >= captured + 2 and gpu.failed_captures == 0  # a graph per batch size
    assert BatchGenerator(cuda_model, mode="eager").generate(prompts, max_new_tokens=40, eos=eos) == ref

    def sample(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        return gpu.generate(prompts, max_new_tokens=12, eos=eos, temperature=1.0, top_p=0.9, generator=g)

    assert sample(0) == sample(0) and sample(0) != sample(1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_graphs_replay_the_fixed_step(model):
    """bf16, the datagen setting: the graphs replay exactly the fixed step's kernels (the same
    tokens), rows leave the batch, and greedy answers agree with transformers' generate where no
    near-tie of bf16 intervenes (most rows)."""
    import copy

    from peagle_ext.data.datagen import _generate

    m = copy.deepcopy(model).to("cuda", torch.bfloat16)
    prompts = _prompts(model, 24, 9)
    fixed = BatchGenerator(m, mode="fixed")
    free = fixed.generate(prompts, max_new_tokens=40, eos=set())
    eos = _eos_that_stops_rows_at_different_steps(free, steps=(2, 3, 5, 6, 9, 10, 11, 13, 17, 26))
    want = fixed.generate(prompts, max_new_tokens=40, eos=eos)
    gen = BatchGenerator(m)
    assert gen.mode == "graphs"
    assert gen.generate(prompts, max_new_tokens=40, eos=eos) == want
    assert gen.graphs_captured >= 2 and gen.failed_captures == 0
    hf = _generate(m, None, prompts, max_new_tokens=40, temperature=0, top_p=1, eos=eos, pad=0, seed=0, engine=None)
    assert sum(a == b for a, b in zip(hf, want)) >= len(prompts) // 2
    assert gen.attention == "flash"  # auto on a GPU with FlashAttention: bf16 qualifies
    sdpa = BatchGenerator(m, attention="sdpa").generate(prompts, max_new_tokens=40, eos=eos)
    assert sum(a == b for a, b in zip(sdpa, want)) >= len(prompts) * 3 // 4  # bf16 near-ties aside
    g = torch.Generator(device="cuda").manual_seed(0)
    sampled = gen.generate(prompts, max_new_tokens=20, eos=eos, temperature=0.8, top_p=0.9, generator=g)
    assert all(all(0 <= t < m.config.vocab_size for t in toks) for toks, _ in sampled)
