"""Speculative decoding (peagle_ext.decode) and `peagle eval` on a tiny random verifier:
losslessness vs the verifier's own greedy decoding for K = 1..8, the draft forward vs the
training forward of the model, exact acceptance accounting with an oracle drafter, the report
schema, the CLI end to end and bad-input messages."""

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from peagle_ext.model import PEagleDraftModel
from peagle_ext.serving import (
    Drafter,
    PEagleDrafter,
    Verifier,
    acceptance_stats,
    first_mismatch,
    greedy_generate,
    speculative_generate,
)
from peagle_ext.testing import make_tiny_verifier
from tests.helpers import run_cli

VOCAB = 300


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_verifier(tmp_path_factory.mktemp("tiny") / "verifier")


def _load(tiny_dir, dtype):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=dtype).eval()
    m.requires_grad_(False)
    return m


@pytest.fixture(scope="module")
def vm64(tiny_dir):
    """float64 verifier: exactness tests must not hinge on fp32 near-ties between scoring K+1
    tokens in one forward and one token per forward."""
    return _load(tiny_dir, torch.float64)


@pytest.fixture(scope="module")
def vm32(tiny_dir):
    return _load(tiny_dir, torch.float32)


def _drafter_model(vm, *, num_depths=8, seed=0, **kw):
    torch.manual_seed(seed)
    return PEagleDraftModel.from_verifier(
        vm.config, num_depths=num_depths, mask_token_id=kw.pop("mask_token_id", VOCAB), **kw
    )


def _prompts(seed, n=3, lo=3, hi=12):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g) for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# Baseline greedy and losslessness
# ---------------------------------------------------------------------------------------------
def test_greedy_generate_equals_hf_generate(vm32):
    v = Verifier(vm32)
    eos = vm32.config.eos_token_id
    for p in _prompts(1, n=3):
        ours = greedy_generate(v, p, 24, eos_token_id=eos).tokens
        ref = vm32.generate(
            p[None], do_sample=False, max_new_tokens=24, eos_token_id=eos, pad_token_id=vm32.config.pad_token_id
        )[0, p.numel() :].tolist()
        assert ours == ref[: len(ours)] and len(ours) == len(ref)


@pytest.mark.parametrize("k", range(1, 9))
def test_lossless_random_drafter_all_k(vm64, k):
    dm = _drafter_model(vm64, num_depths=8, seed=k)
    dr = PEagleDrafter(dm, dtype=torch.float32)
    v = Verifier(vm64, dm.config.eagle_aux_hidden_state_layer_ids)
    for p in _prompts(100 + k, n=3):
        base = greedy_generate(v, p, 30).tokens
        s = speculative_generate(v, dr, p, k, 30)
        assert s.tokens == base
        assert len(s.tokens) == 30
        # every round emits accepted + 1 tokens; the first token comes from the prefill
        assert 1 + sum(a + 1 for a in s.accepted) >= 30 > 1 + sum(a + 1 for a in s.accepted[:-1])


def test_lossless_fp32_qwen3_drafter_and_eos(vm32):
    """Realistic dtype, qwen3 layer type, two layers, reduced draft vocab, stopping at EOS."""
    from peagle_ext.model import build_vocab_mapping

    d2t, _ = build_vocab_mapping(torch.arange(VOCAB).flip(0) + 1, 200)
    dm = _drafter_model(
        vm32, num_depths=4, num_layers=2, layer_type="qwen3", draft_vocab_size=200, d2t=d2t, mask_token_id=7, seed=3
    )
    dr = PEagleDrafter(dm)
    v = Verifier(vm32, dm.config.eagle_aux_hidden_state_layer_ids)
    eos = vm32.config.eos_token_id
    for k in (1, 4):
        for p in _prompts(7, n=2):
            base = greedy_generate(v, p, 25, eos_token_id=eos).tokens
            assert speculative_generate(v, dr, p, k, 25, eos_token_id=eos).tokens == base
    prof = speculative_generate(v, dr, p, 4, 25, eos_token_id=eos, profile=True)
    assert prof.tokens == base and prof.draft_s > 0 and prof.verify_s > 0
    assert prof.draft_s + prof.verify_s <= prof.wall_s
    assert speculative_generate(v, dr, p, 4, 25).draft_s is None


class CopyDrafter(Drafter):
    """Proposes the bonus token K times: the tiny random verifier repeats tokens a lot, so some
    drafts are accepted and the cache rollback paths (partial acceptance) are exercised."""

    def __init__(self, aux, num_depths=8):
        self.aux_layer_ids, self.num_depths, self.mask_token_id = aux, num_depths, VOCAB

    def combine_hidden(self, aux):
        return aux[:, :4].float()

    @property
    def mask_hidden(self):
        return torch.zeros(4)

    def propose(self, batch, k, num_rows, context_len):
        bonus = batch.input_ids[batch.token_indices_to_sample[0].long()].long()
        return bonus.repeat(k)


def test_lossless_with_partial_acceptance(vm64):
    v = Verifier(vm64, [1, 3, 4])
    total = []
    for k in (1, 3, 8):
        for p in _prompts(11, n=4):
            base = greedy_generate(v, p, 40).tokens
            s = speculative_generate(v, CopyDrafter([1, 3, 4]), p, k, 40)
            assert s.tokens == base
            total += s.accepted
    assert sum(total) > 0 and min(total) == 0  # both paths were exercised


# ---------------------------------------------------------------------------------------------
# Oracle drafter: exact acceptance accounting
# ---------------------------------------------------------------------------------------------
class OracleDrafter(Drafter):
    """Knows the verifier's greedy continuation `full` (prompt + generated): proposes it for the
    first j drafts of every round and a wrong token after. Draft k of a round is sampled from the
    row at position m + k - 1 (m = last accepted position) and predicts sequence index m + 1 + k,
    i.e. row position + 2."""

    def __init__(self, full, j, aux, num_depths=8):
        self.full, self.j = full, j
        self.aux_layer_ids, self.num_depths, self.mask_token_id = aux, num_depths, VOCAB
        self.calls = []

    def combine_hidden(self, aux):
        return aux.float()

    @property
    def mask_hidden(self):
        return torch.full((self._w,), 0.5)

    def reset(self, capacity):
        self.calls.clear()

    def propose(self, batch, k, num_rows, context_len):
        rows = batch.token_indices_to_sample[:k].long()
        idx = (batch.positions[rows] + 2).tolist()
        self.calls.append((batch, num_rows, context_len))
        out = [self.full[i] if n < self.j else (self.full[i] + 1) % VOCAB for n, i in enumerate(idx)]
        return torch.tensor(out)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_oracle_drafter_acceptance_is_exactly_j_plus_one(vm64, k):
    aux = [1, 3, 4]
    v = Verifier(vm64, aux)
    m = 29
    for j in range(0, k + 1):
        p = _prompts(50 + j, n=1)[0]
        full = p.tolist() + greedy_generate(v, p, m + k + 2).tokens
        dr = OracleDrafter(full, j, aux)
        dr._w = 64 * len(aux)
        s = speculative_generate(v, dr, p, k, m)
        assert s.tokens == full[p.numel() : p.numel() + m]
        assert s.accepted == [j] * s.rounds
        assert s.acceptance_length == j + 1
        assert s.rounds == -(-(m - 1) // (j + 1))  # the prefill gives the first token
        st = acceptance_stats(s.accepted, k)
        assert st["acceptance_length"] == j + 1
        assert st["per_position_acceptance"] == [1.0] * j + ([0.0] if j < k else []) + [None] * (k - j - 1)
        assert st["per_position_acceptance_unconditional"] == [1.0] * j + [0.0] * (k - j)
        # the draft batches are vLLM's: bonus row at the last accepted position, K-1 MASK rows
        n = p.numel()
        b0, rows0, ctx0 = dr.calls[0]
        assert rows0 == n + k - 1 and ctx0 == n + k - 1
        assert b0.input_ids[:n].tolist() == full[1 : n + 1]
        assert b0.is_masked[:rows0].tolist() == [False] * n + [True] * (k - 1)
        if len(dr.calls) > 1:
            b1, rows1, ctx1 = dr.calls[1]
            assert rows1 == (j + 1) + k - 1  # j accepted + bonus depth-0 rows, then the MASK rows
            assert b1.positions[:rows1].tolist() == list(range(n, n + j + k))
            assert b1.input_ids[: j + 1].tolist() == full[n + 1 : n + j + 2]
            assert bool(b1.is_rejected[rows1:].all()) and int(b1.is_rejected.sum()) == k - j


def test_acceptance_stats_hand_example():
    st = acceptance_stats([0, 2, 3, 1], 3)
    assert st["rounds"] == 4
    assert st["acceptance_length"] == (6 + 4) / 4
    assert st["per_position_reached"] == [4, 3, 2]
    assert st["per_position_accepted"] == [3, 2, 1]
    assert st["per_position_acceptance"] == [3 / 4, 2 / 3, 1 / 2]
    assert st["per_position_acceptance_unconditional"] == [3 / 4, 2 / 4, 1 / 4]
    empty = acceptance_stats([], 2)
    assert empty["acceptance_length"] is None and empty["per_position_acceptance"] == [None, None]
    with pytest.raises(ValueError):
        acceptance_stats([4], 3)
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert first_mismatch([1, 2], [1, 2, 3]) == 2


# ---------------------------------------------------------------------------------------------
# The draft forward equals the model's training forward (symmetric P-EAGLE rule)
# ---------------------------------------------------------------------------------------------
def _training_hidden(dm, tokens_next, hidden, k):
    """Final hidden states of the training path: depth 0 at positions 0..N-1 (token p+1, hidden
    p), one chain of depths 1..k-1 anchored at N-1. Rows in layout order."""
    from peagle_ext.cod import CodLayout

    n = tokens_next.numel()
    anchor = torch.cat([torch.arange(n), torch.full((k - 1,), n - 1)]).int()
    depth = torch.cat([torch.zeros(n), torch.arange(1, k)]).int()
    lay = CodLayout(anchor, depth, [0, n, *range(n + 1, n + k)], torch.zeros(n, dtype=torch.int32), True)
    ex = SimpleNamespace(input_ids=tokens_next, hidden=hidden)
    tok = dm.pass_tokens(lay, dm.layout_rows(lay))
    h, _ = dm.run_layers(tok, dm.layer0_rows(ex))
    return h


@pytest.mark.parametrize(
    "layer_type,num_layers,k,embeddings",
    [("llama", 1, 5, "all"), ("llama", 2, 1, "all"), ("qwen3", 2, 4, "all"), ("llama", 1, 3, "mask")],
)
def test_draft_forward_matches_training_forward(vm32, layer_type, num_layers, k, embeddings):
    from peagle_ext.model import PEagleOptions
    from peagle_ext.serving import BLOCK_SIZE
    from peagle_ext.vllm import prepare_parallel_draft_inputs

    g = torch.Generator().manual_seed(num_layers * 10 + k)
    dm = _drafter_model(
        vm32,
        num_depths=6,
        num_layers=num_layers,
        layer_type=layer_type,
        seed=k,
        options=PEagleOptions(train_embeddings=embeddings),
    )
    with torch.no_grad():  # non-trivial learned vectors
        dm.mask_hidden.normal_(generator=g)
        if dm.mask_embed is not None:  # the live MASK row differs from the embedding table's
            dm.mask_embed.normal_(generator=g)
    dr = PEagleDrafter(dm)
    w = dm.config.num_aux * 64
    n = 9
    seq = torch.randint(0, VOCAB, (n + 1 + k + 1,), generator=g)  # prompt, bonus, round-2 tokens
    aux1 = torch.randn(n, w, generator=g)
    cap = 64
    bt = torch.arange(cap // BLOCK_SIZE, dtype=torch.int32)[None]

    def batch(tgt_ids, pos0, bonus, nrej, aux):
        t = tgt_ids.numel()
        return prepare_parallel_draft_inputs(
            tgt_ids.int(),
            torch.arange(pos0, pos0 + t),
            torch.tensor([bonus], dtype=torch.int32),
            torch.tensor([0, t], dtype=torch.int32),
            torch.tensor([nrej], dtype=torch.int32),
            dr.combine_hidden(aux).contiguous(),
            dr.mask_hidden,
            bt,
            num_spec_tokens=k,
            mask_token_id=dm.config.mask_token_id,
            block_size=BLOCK_SIZE,
            max_model_len=cap,
        )

    with torch.no_grad():
        dr.reset(cap)
        # round 1: the prompt seq[:n], bonus seq[n]
        b1 = batch(seq[:n], 0, int(seq[n]), 0, aux1)
        rows1 = n + k - 1
        got1 = dr.forward_rows(b1, rows1, n + k - 1)
        want1 = _training_hidden(dm, seq[1 : n + 1], aux1, k)
        torch.testing.assert_close(got1, want1, rtol=1e-4, atol=1e-5)
        # round 2: verified [seq[n], d_1..d_k], a accepted, new bonus; stale MASK K/V in the cache
        a = min(2, k)
        ver = torch.cat([seq[n : n + 1 + a], torch.randint(0, VOCAB, (k - a,), generator=g)])
        aux2 = torch.randn(k + 1, w, generator=g)
        bonus2 = int(seq[n + 1 + a])
        b2 = batch(ver, n, bonus2, k - a, aux2)
        rows2 = a + 1 + k - 1
        got2 = dr.forward_rows(b2, rows2, n + a + k)
        n2 = n + a + 1
        want2 = _training_hidden(
            dm, torch.cat([seq[1 : n + 1 + a], torch.tensor([bonus2])]), torch.cat([aux1, aux2[: a + 1]]), k
        )
        torch.testing.assert_close(got2, want2[n:], rtol=1e-4, atol=1e-5)
        assert want2.shape[0] == n2 + k - 1
        # and the logits path used by propose
        lg = dr.draft_logits(b2, k, rows2, n + a + k)
        ref = dm.lm_head(dm.norm(want2[n2 - 1 :]))
        torch.testing.assert_close(lg, ref, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Report, CLI, bad input
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_drafter(tiny_dir, vm32, tmp_path_factory):
    d = tmp_path_factory.mktemp("draft") / "final"
    _drafter_model(vm32, num_depths=4, seed=5).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "the water is hot"}]},
        {"prompt": "one day we can find"},
        {"turns": ["how many people know", "ignored second turn"]},
    ]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def _eval_cli(args, timeout=240):
    return run_cli(["eval", *args], timeout=timeout)


def test_evaluate_report_schema_and_plot(vm32, tiny_dir, saved_drafter, prompt_file, tmp_path):
    from transformers import AutoTokenizer

    from peagle_ext.eval import evaluate, load_drafter, plot_k_sweep, render_prompts

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    prompts = render_prompts(tok, str(prompt_file), None)
    assert [p for p, _ in prompts] == ["prompts-0", "prompts-1", "prompts-2"]
    text = tok.apply_chat_template(
        [{"role": "user", "content": "the water is hot"}], tokenize=False, add_generation_prompt=True
    )
    assert prompts[0][1] == tok(text, add_special_tokens=False)["input_ids"]
    text0 = tok.decode(prompts[0][1])
    assert text0.startswith("<|im_start|>user\nthe water is hot<|im_end|>") and text0.endswith("assistant\n")
    dr = load_drafter(saved_drafter, Verifier(vm32))
    v = Verifier(vm32, dr.aux_layer_ids)
    r = evaluate(v, dr, prompts, num_spec_tokens=3, max_new_tokens=12, k_sweep=[1, 2, 3], eos_token_id=None)
    for key, typ in [
        ("acceptance_length", float),
        ("per_position_acceptance", list),
        ("tokens_per_s", float),
        ("baseline_tokens_per_s", float),
        ("speedup", float),
        ("lossless", bool),
        ("prompts", list),
        ("k_sweep", list),
        ("per_position_acceptance_unconditional", list),
        ("rounds", int),
    ]:
        assert isinstance(r[key], typ), key
    assert len(r["per_position_acceptance"]) == 3
    assert r["lossless"] and r["num_lossless"] == 3
    for p in r["prompts"]:
        assert set(p) >= {"id", "lossless", "tokens_generated", "rounds", "prompt_tokens", "acceptance_length"}
        assert p["tokens_generated"] == 12 and p["lossless"] is True and p["first_mismatch"] is None
        assert len(p["accepted_per_round"]) == p["rounds"]
    assert r["rounds"] == sum(p["rounds"] for p in r["prompts"])
    assert [s["num_spec_tokens"] for s in r["k_sweep"]] == [1, 2, 3]
    assert r["k_sweep"][2]["acceptance_length"] == r["acceptance_length"]
    json.dumps(r)  # serialisable
    png = plot_k_sweep(r["k_sweep"], tmp_path / "k.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_eval_end_to_end(tiny_dir, saved_drafter, prompt_file, tmp_path):
    out = tmp_path / "eval.json"
    r = _eval_cli(
        [
            "--verifier",
            str(tiny_dir),
            "--draft",
            str(saved_drafter.parent),
            "--bench",
            str(prompt_file),
            "--num-prompts",
            "2",
            "--max-new-tokens",
            "10",
            "--num-spec-tokens",
            "2",
            "--json",
            str(out),
            "--k-sweep",
            "1..2",
            "--device",
            "cpu",
            "--quiet",
        ]
    )
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    assert rep["num_prompts"] == 2 and rep["num_spec_tokens"] == 2 and rep["drafter_num_depths"] == 4
    assert rep["draft"] == str(saved_drafter)  # a training output dir resolves to its final/
    assert rep["lossless"] is True and len(rep["prompts"]) == 2
    assert Path(rep["plot"]).is_file() and Path(rep["plot"]).name == "eval_k_sweep.png"
    assert "acceptance length" in r.stdout and "lossless (== verifier greedy): 2/2" in r.stdout


def test_cli_eval_bad_input(tiny_dir, saved_drafter, prompt_file, tmp_path, capsys):
    from peagle_ext.cli import main

    def run(*args):
        rc = main(["eval", *args])
        return rc, capsys.readouterr().err

    base = ["--verifier", str(tiny_dir), "--bench", str(prompt_file), "--max-new-tokens", "4", "--quiet"]
    rc, err = run(*base, "--draft", str(tmp_path / "nope"))
    assert rc == 2 and "--draft" in err and "no such directory" in err
    (tmp_path / "empty_dir").mkdir()
    rc, err = run(*base, "--draft", str(tmp_path / "empty_dir"))
    assert rc == 2 and "not a P-EAGLE checkpoint" in err
    rc, err = run(*base, "--draft", str(saved_drafter), "--num-spec-tokens", "5")
    assert rc == 2 and "larger than the drafter's num_depths 4" in err
    rc, err = run(*base, "--draft", str(saved_drafter), "--k-sweep", "1..6")
    assert rc == 2 and "num_depths is 4" in err
    rc, err = run(*base, "--draft", str(saved_drafter), "--k-sweep", "a..b")
    assert rc == 2 and "--k-sweep" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    rc, err = run("--verifier", str(tiny_dir), "--bench", str(empty), "--draft", str(saved_drafter))
    assert rc == 2 and "no prompts" in err
    rc, err = run(*base, "--draft", str(saved_drafter), "--max-new-tokens", "0")
    assert rc == 2 and "--max-new-tokens" in err
    rc, err = (
        run(*base, "--draft", str(saved_drafter), "--device", "cuda") if not torch.cuda.is_available() else (2, "cuda")
    )
    assert rc == 2 and "cuda" in err


def test_bad_arguments_to_decoding(vm32, tmp_path):
    dm = _drafter_model(vm32, num_depths=3)
    dr = PEagleDrafter(dm)
    v = Verifier(vm32, dm.config.eagle_aux_hidden_state_layer_ids)
    p = torch.tensor([5, 6, 7])
    with pytest.raises(ValueError, match="num_depths 3"):
        speculative_generate(v, dr, p, 4, 5)
    with pytest.raises(ValueError, match="num_spec_tokens"):
        speculative_generate(v, dr, p, 0, 5)
    with pytest.raises(ValueError, match="empty"):
        speculative_generate(v, dr, [], 2, 5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        greedy_generate(v, p, 0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        speculative_generate(v, dr, p, 3, 1022)
    with pytest.raises(ValueError, match="aux layers"):
        speculative_generate(Verifier(vm32), dr, p, 2, 5)
    # a drafter built for another verifier
    from transformers import LlamaConfig

    from peagle_ext.eval import load_drafter

    other = PEagleDraftModel.from_verifier(
        LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=2),
        num_depths=2,
        mask_token_id=VOCAB,
    )
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="hidden_size 32, the verifier 64"):
        load_drafter(tmp_path / "other", Verifier(vm32))


# ---------------------------------------------------------------------------------------------
# A drafter trained through the model's training path accepts at inference, losslessly
# ---------------------------------------------------------------------------------------------
def test_trained_tiny_drafter_accepts_and_stays_lossless(tiny_dir):
    """Self-distillation on the verifier's own greedy continuations of 16 prompts (training
    path: verifier_hidden_states + eagle_shift + forward_backward), then speculative decoding of
    the same prompts. A convention mismatch between the training and the inference layouts (token
    / hidden / position pairing, MASK rows, RoPE) would keep the acceptance near 1."""
    from peagle_ext.data import PackedSequence, eagle_shift, verifier_hidden_states
    from peagle_ext.model import PEagleOptions

    vm = _load(tiny_dir, torch.float32)
    with torch.no_grad():
        vm.lm_head.weight.mul_(30.0)  # a peaked verifier: random-init logits are near-uniform
    torch.manual_seed(0)
    k = 3
    dm = PEagleDraftModel.from_verifier(
        vm.config,
        num_depths=k,
        mask_token_id=VOCAB,
        options=PEagleOptions(down_sample_ratio=0.9, down_sample_ratio_min=0.5, loss_kind="ce"),
    )
    dm.attach_verifier(
        norm_weight=vm.model.norm.weight, lm_head_weight=vm.lm_head.weight, embed_weight=vm.model.embed_tokens.weight
    )
    v = Verifier(vm, dm.config.eagle_aux_hidden_state_layer_ids)
    prompts = _prompts(21, n=16, lo=6, hi=7)
    examples = []
    for p in prompts:
        seq = torch.tensor(p.tolist() + greedy_generate(v, p, 50).tokens)
        n = seq.numel()
        row = PackedSequence(seq, torch.zeros(n, dtype=torch.int32), torch.arange(n) >= p.numel(), 0)
        aux, last = verifier_hidden_states(vm, row, dm.config.eagle_aux_hidden_state_layer_ids)
        examples.append(eagle_shift(row, aux, last))
    untrained = PEagleDrafter(copy.deepcopy(dm))
    opt = torch.optim.AdamW([q for q in dm.parameters() if q.requires_grad], lr=3e-3)
    for step in range(400):
        opt.zero_grad()
        dm.forward_backward(examples[step % len(examples)])
        opt.step()
    dr = PEagleDrafter(dm.eval())
    acc, acc0 = [], []
    for kk in range(1, k + 1):
        for p in prompts[:6]:
            base = greedy_generate(v, p, 30).tokens
            s = speculative_generate(v, dr, p, kk, 30)
            assert s.tokens == base
            if kk == k:
                acc += s.accepted
                acc0 += speculative_generate(v, untrained, p, kk, 30).accepted
    trained_al = acceptance_stats(acc, k)["acceptance_length"]
    untrained_al = acceptance_stats(acc0, k)["acceptance_length"]
    assert untrained_al < 1.3 and trained_al > 2.0, (untrained_al, trained_al)


# ---------------------------------------------------------------------------------------------
# CUDA: the same checks on the device, bf16 drafter
# ---------------------------------------------------------------------------------------------
from tests.helpers import requires_cuda  # noqa: E402


@requires_cuda
def test_cuda_lossless_bf16_drafter(tiny_dir):
    """fp64 verifier on the GPU (exact greedy), bf16 drafter (the CUDA batch op on bf16 hidden,
    SDPA in bf16): lossless for K = 1..8, with no acceptance and with partial acceptance."""
    vm = _load(tiny_dir, torch.float64).cuda()
    dm = _drafter_model(vm, num_depths=8, seed=1)
    dr = PEagleDrafter(dm, device="cuda", dtype=torch.bfloat16)
    v = Verifier(vm, dm.config.eagle_aux_hidden_state_layer_ids)
    for k in range(1, 9):
        for p in _prompts(300 + k, n=2):
            base = greedy_generate(v, p, 30).tokens
            assert speculative_generate(v, dr, p, k, 30).tokens == base
            s = speculative_generate(v, CopyDrafter(dm.config.eagle_aux_hidden_state_layer_ids), p, k, 30)
            assert s.tokens == base


@requires_cuda
def test_cuda_draft_forward_matches_cpu(vm32):
    """The bf16 CUDA draft forward vs the fp32 CPU one on the same batch (two rounds, cache reuse)."""
    from peagle_ext.serving import BLOCK_SIZE
    from peagle_ext.vllm import prepare_parallel_draft_inputs

    g = torch.Generator().manual_seed(5)
    k = 4
    dm = _drafter_model(vm32, num_depths=k, num_layers=2, seed=2)
    cpu = PEagleDrafter(copy.deepcopy(dm))
    gpu = PEagleDrafter(copy.deepcopy(dm), device="cuda", dtype=torch.bfloat16)
    w = dm.config.num_aux * 64
    cap = 64
    rounds = [
        (torch.randint(0, VOCAB, (11,), generator=g), 0, 0, torch.randn(11, w, generator=g)),
        (torch.randint(0, VOCAB, (k + 1,), generator=g), 11, 2, torch.randn(k + 1, w, generator=g)),
    ]
    for dr in (cpu, gpu):
        dr.reset(cap)
    outs = {}
    for dr, dev in ((cpu, "cpu"), (gpu, "cuda")):
        res = []
        for ids, pos0, nrej, aux in rounds:
            t = ids.numel()
            b = prepare_parallel_draft_inputs(
                ids.int().to(dev),
                torch.arange(pos0, pos0 + t, device=dev),
                torch.tensor([7], dtype=torch.int32, device=dev),
                torch.tensor([0, t], dtype=torch.int32, device=dev),
                torch.tensor([nrej], dtype=torch.int32, device=dev),
                dr.combine_hidden(aux.to(dev)).contiguous(),
                dr.mask_hidden,
                torch.arange(cap // BLOCK_SIZE, dtype=torch.int32, device=dev)[None],
                num_spec_tokens=k,
                mask_token_id=dm.config.mask_token_id,
                block_size=BLOCK_SIZE,
                max_model_len=cap,
            )
            rows = t + k - 1 - nrej
            ctx = pos0 + (t - nrej) + k - 1
            with torch.no_grad():
                res.append(dr.forward_rows(b, rows, ctx).float().cpu())
        outs[dev] = res
    for a, b in zip(outs["cpu"], outs["cuda"]):
        torch.testing.assert_close(b, a, rtol=5e-2, atol=5e-2)


@requires_cuda
def test_cuda_cli_eval(tiny_dir, saved_drafter, prompt_file, tmp_path):
    out = tmp_path / "eval.json"
    r = _eval_cli(
        [
            "--verifier",
            str(tiny_dir),
            "--draft",
            str(saved_drafter),
            "--bench",
            str(prompt_file),
            "--num-prompts",
            "2",
            "--max-new-tokens",
            "10",
            "--num-spec-tokens",
            "3",
            "--json",
            str(out),
            "--k-sweep",
            "1..3",
            "--device",
            "cuda",
            "--quiet",
        ]
    )
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    assert rep["device"].startswith("cuda") and rep["dtype"] == "bfloat16"
    assert len(rep["k_sweep"]) == 3 and rep["tokens_per_s"] > 0 and rep["baseline_tokens_per_s"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_drafter_rope_tables_equal_the_rope_of_each_position(vm32, dtype):
    """The drafter looks cos/sin up in tables reset() fills: the values of computing them per
    position, bit for bit; the tables grow with the cache and reach K past its capacity; a
    position past them takes the last entry."""
    dr = PEagleDrafter(_drafter_model(vm32, num_depths=4, seed=1), dtype=dtype)
    dr.reset(40)
    assert dr._cos_table.shape[0] == 40 + 4 + 1
    pos = torch.tensor([0, 1, 17, 39, 40, 44])
    for got, want in zip(dr._rope(pos), dr._rope_of(pos)):
        assert got.dtype == dtype and torch.equal(got, want)
    far = dr._rope(torch.tensor([45, 1000]))
    for t, tab in zip(far, (dr._cos_table, dr._sin_table)):
        assert torch.equal(t, tab[-1:].expand(2, *tab.shape[1:]))
    dr.reset(20)  # the cache only grows: so do the tables
    assert dr._cos_table.shape[0] == 45
    dr.reset(100)
    assert dr._cos_table.shape[0] == 105
    for got, want in zip(dr._rope(torch.arange(105)), dr._rope_of(torch.arange(105))):
        assert torch.equal(got, want)


@requires_cuda
def test_cuda_rms_norm_in_the_weights_dtype_without_gradients():
    """A bf16 drafter's norm on the GPU under no_grad takes torch's one-kernel RMSNorm: fp32
    statistics and one rounding, within a bf16 step of the float64 norm; with gradients on it
    stays the eager norm."""
    from peagle_ext.model.layers import RMSNorm, rms_norm

    g = torch.Generator().manual_seed(3)
    norm = RMSNorm(576, 1e-5).to("cuda", torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_((torch.rand(576, generator=g) + 0.5).to(torch.bfloat16))
    x = (3 * torch.randn(9, 576, generator=g)).to("cuda", torch.bfloat16)
    x64, w64 = x.double(), norm.weight.double()
    want = w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
    with torch.no_grad():
        got = norm(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=8e-3, atol=1e-2)
    assert torch.equal(norm(x).detach(), rms_norm(x, norm.weight, norm.eps).detach())
