"""`peagle datagen` on the tiny random verifier: the answers are the verifier's own greedy
continuations (batched, left-padded generation checked against one-at-a-time decoding), the
output format and its loading as training data, resume after SIGKILL and after a torn line,
determinism of greedy and sampled runs, and bad input."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from peagle_ext.data import DataError, load_conversations
from peagle_ext.data.datagen import make_groups, read_done_indices, regenerate
from peagle_ext.data.loops import ends_in_loop
from peagle_ext.serving import Verifier, greedy_generate
from peagle_ext.serving.batch_generation import BatchGenerator
from peagle_ext.testing import make_chat_jsonl, make_tiny_verifier
from tests.helpers import ROOT, run_cli

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = tmp_path_factory.mktemp("datagen")
    v = make_tiny_verifier(d / "verifier")
    data = make_chat_jsonl(d / "chat.jsonl", n=7, turns=2, words=(3, 10))
    tok = AutoTokenizer.from_pretrained(v)
    # float64: batched (left-padded) and one-at-a-time greedy decoding agree exactly
    model = AutoModelForCausalLM.from_pretrained(v, dtype=torch.float64).eval().requires_grad_(False)
    return v, data, tok, model


def _records(path: Path) -> dict[int, dict]:
    recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    by = {r["index"]: r for r in recs}
    assert len(by) == len(recs), "an index was written twice"
    return by


def _greedy_answer(model, tok, messages, max_new):
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    toks = greedy_generate(Verifier(model), ids, max_new, eos_token_id=tok.eos_token_id).tokens
    if toks and toks[-1] == tok.eos_token_id:
        toks = toks[:-1]
    return tok.decode(toks, skip_special_tokens=True)


@pytest.mark.parametrize("engine", ["static", "hf"])
@pytest.mark.parametrize("turns", ["first", "all"])
def test_answers_are_the_verifiers_greedy_continuations(setup, tmp_path, turns, engine):
    _, data, tok, model = setup
    convs = load_conversations(str(data))
    out = tmp_path / "out.jsonl"
    kw = dict(max_new_tokens=9, max_length=400, batch_size=3, turns=turns, progress=False)
    st = regenerate(model, tok, convs, out, engine=engine, **kw)
    assert st.engine == engine
    recs = _records(out)
    assert sorted(recs) == list(range(len(convs))) and st.written == len(convs) and st.remaining == 0
    for i, conv in enumerate(convs):
        msgs = recs[i]["messages"]
        users = [m["content"] for m in conv if m["role"] == "user"]
        assert [m["role"] for m in msgs] == ["user", "assistant"] * (1 if turns == "first" else 2)
        assert [m["content"] for m in msgs if m["role"] == "user"] == users[: len(msgs) // 2]
        for j in range(1, len(msgs), 2):  # every answer from the regenerated history before it
            assert msgs[j]["content"] == _greedy_answer(model, tok, msgs[:j], 9), (i, j)
            assert msgs[j]["content"] != conv[j]["content"]
    assert st.turns == sum(len(r["messages"]) // 2 for r in recs.values())
    assert st.truncated_turns == sum(len(r.get("truncated", [])) for r in recs.values())
    answers = [m["content"] for r in recs.values() for m in r["messages"] if m["role"] == "assistant"]
    assert st.looping_turns == sum(ends_in_loop(a) for a in answers)
    # the file is training data as it stands
    loaded = load_conversations(str(out))
    assert len(loaded) == len(convs)
    if engine == "static":  # float64: both engines write the same file
        regenerate(model, tok, convs, tmp_path / "hf.jsonl", engine="hf", **kw)
        assert (tmp_path / "hf.jsonl").read_text() == out.read_text()


def test_auto_engine_falls_back_to_transformers(setup, tmp_path, monkeypatch):
    _, data, tok, model = setup
    convs = load_conversations(str(data))[:2]
    kw = dict(max_new_tokens=3, max_length=400, progress=False)
    assert regenerate(model, tok, convs, tmp_path / "a.jsonl", **kw).engine == "static"
    monkeypatch.setattr(model.config, "model_type", "gpt2")
    assert regenerate(model, tok, convs, tmp_path / "b.jsonl", engine="auto", **kw).engine == "hf"
    with pytest.raises(ValueError, match="engine 'static' does not run this verifier.*gpt2"):
        regenerate(model, tok, convs, tmp_path / "c.jsonl", engine="static", **kw)
    with pytest.raises(ValueError, match="engine must be one of"):
        regenerate(model, tok, convs, tmp_path / "d.jsonl", engine="vllm", **kw)


def _groups_by_hand(order, tokens, batch_size, batch_tokens):
    """Every group of the same cut, grown one index at a time from a fresh start."""
    groups, start = [], 0
    while start < len(order):
        end = start + 1  # a row over the bound still gets a group of its own
        while end < len(order) and end - start < batch_size:
            size, widest = end + 1 - start, max(tokens[i] for i in order[start : end + 1])
            if batch_tokens is not None and size * widest > batch_tokens:
                break
            end += 1
        groups.append(order[start:end])
        start = end
    return groups


@pytest.mark.parametrize("seed", range(6))
def test_groups_hold_at_most_batch_size_rows_and_batch_tokens(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(0, 60, (1,), generator=g))
    tokens = torch.randint(1, 50, (n,), generator=g).tolist()
    order = sorted(range(n), key=lambda i: (tokens[i], i))
    batch_size = int(torch.randint(1, 9, (1,), generator=g))
    for batch_tokens in (None, 1, 49, 120, 10_000):
        groups = make_groups(order, tokens.__getitem__, batch_size, batch_tokens)
        assert groups == _groups_by_hand(order, tokens, batch_size, batch_tokens), (batch_size, batch_tokens)
        assert [i for grp in groups for i in grp] == order
        for grp in groups:
            assert 1 <= len(grp) <= batch_size
            if batch_tokens is not None and len(grp) > 1:
                assert len(grp) * max(tokens[i] for i in grp) <= batch_tokens
    assert make_groups(list(range(10)), lambda i: 5, 4, None) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert make_groups(list(range(5)), lambda i: 5, 4, 10) == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("engine", ["static", "hf"])
@pytest.mark.parametrize("turns", ["first", "all"])
def test_batch_tokens_cuts_groups_and_keeps_the_answers(setup, tmp_path, turns, engine, monkeypatch):
    _, data, tok, model = setup
    convs = load_conversations(str(data))
    kw = dict(max_new_tokens=7, max_length=400, turns=turns, engine=engine, progress=False)
    ref = tmp_path / "ref.jsonl"
    regenerate(model, tok, convs, ref, batch_size=1, **kw)
    lens = sorted(
        len(tok(tok.apply_chat_template(c[:1], tokenize=False, add_generation_prompt=True))["input_ids"]) for c in convs
    )
    per_row = 400 if turns == "all" else lens[-1] + 7
    bounded = tmp_path / "bounded.jsonl"
    calls = []
    if engine == "hf":
        real = model.generate

        def counted(**a):
            calls.append(a["input_ids"].shape[0])
            return real(**a)

        monkeypatch.setattr(model, "generate", counted)
    else:
        real = BatchGenerator.generate

        def counted(self, prompts, **a):
            calls.append(len(prompts))
            return real(self, prompts, **a)

        monkeypatch.setattr(BatchGenerator, "generate", counted)
    regenerate(model, tok, convs, bounded, batch_size=len(convs), batch_tokens=3 * per_row, **kw)
    assert _records(bounded) == _records(ref)  # float64: the grouping changes no answer
    assert max(calls) <= 3 and sum(calls[:3]) >= len(convs) // 2  # the bound, not batch_size, cut the groups
    with pytest.raises(ValueError, match="batch_tokens"):
        regenerate(model, tok, convs, tmp_path / "x.jsonl", batch_tokens=0, **kw)


def test_too_long_prompts_are_skipped_and_recorded(setup, tmp_path):
    _, data, tok, model = setup
    convs = load_conversations(str(data))
    lens = [
        len(tok(tok.apply_chat_template(c[:1], tokenize=False, add_generation_prompt=True))["input_ids"]) for c in convs
    ]
    limit = sorted(lens)[len(lens) // 2] + 4  # about half of the first prompts fit
    out = tmp_path / "out.jsonl"
    st = regenerate(model, tok, convs, out, max_new_tokens=4, max_length=limit, batch_size=4, progress=False)
    recs = _records(out)
    skipped = [i for i, r in recs.items() if r.get("skipped")]
    assert sorted(recs) == list(range(len(convs))) and 0 < st.skipped == len(skipped) < len(convs)
    assert all(recs[i]["messages"] == [] for i in skipped)
    assert len(load_conversations(str(out))) == len(convs) - len(skipped)
    # a resumed run finds everything done, skipped ones included
    st2 = regenerate(model, tok, convs, out, max_new_tokens=4, max_length=limit, batch_size=4, progress=False)
    assert st2.written == 0 and st2.already_done == len(convs)


def test_sampling_is_seeded_and_greedy_is_deterministic(setup, tmp_path):
    _, data, tok, model = setup
    convs = load_conversations(str(data))

    def run(name, **kw):
        p = tmp_path / name
        regenerate(model, tok, convs, p, max_new_tokens=8, max_length=400, batch_size=4, progress=False, **kw)
        return p.read_text()

    assert run("g1") == run("g2")
    s0, s0b, s1 = run("s0", temperature=1.0, seed=0), run("s0b", temperature=1.0, seed=0), run("s1", temperature=1.0)
    assert s0 == s0b and s0 != run("g3")
    assert s1 == s0  # seed defaults to 0
    assert run("s7", temperature=1.0, seed=7) != s0


def test_resume_after_sigkill_and_torn_line_equals_one_run(setup, tmp_path):
    v, data, _, _ = setup
    args = ["--verifier", str(v), "--data", str(data), "--max-new-tokens", "6", "--max-length", "400"]
    args += ["--batch-size", "1", "--turns", "all", "--temperature", "0.8", "--no-progress", "--dtype", "float32"]
    whole = tmp_path / "whole.jsonl"
    r = run_cli(["datagen", *args, "--output", str(whole)], timeout=300)
    assert r.returncode == 0, r.stderr
    assert "complete" in r.stdout

    part = tmp_path / "part.jsonl"
    env_cmd = [sys.executable, "-m", "peagle_ext.cli", "datagen", *args, "--output", str(part)]
    p = subprocess.Popen(env_cmd, cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        t0 = time.time()
        while time.time() - t0 < 240:
            if part.exists() and part.read_text().count("\n") >= 2:
                break
            time.sleep(0.05)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    n_before = part.read_text().count("\n")
    assert 2 <= n_before < 7, "the kill must land mid-run"
    with open(part, "a") as f:  # a line torn by a kill during its write
        f.write('{"index": 99, "messages": [{"role": "us')
    assert len(read_done_indices(part)) == n_before and part.read_text().endswith("\n")
    r = run_cli(["datagen", *args, "--output", str(part)], timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"({n_before} were already in" in r.stdout
    assert _records(part) == _records(whole)


def test_bad_input(setup, tmp_path):
    v, data, tok, model = setup
    convs = load_conversations(str(data))
    with pytest.raises(ValueError, match="temperature"):
        regenerate(model, tok, convs, tmp_path / "a.jsonl", temperature=-1, progress=False)
    with pytest.raises(ValueError, match="max_length"):
        regenerate(model, tok, convs, tmp_path / "a.jsonl", max_new_tokens=64, max_length=64, progress=False)
    with pytest.raises(ValueError, match="turns"):
        regenerate(model, tok, convs, tmp_path / "a.jsonl", turns="some", progress=False)
    with pytest.raises(ValueError, match="loops must be one of"):
        regenerate(model, tok, convs, tmp_path / "a.jsonl", loops="drop", progress=False)
    limit = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"max_length {limit + 2}: .* the verifier has {limit}"):
        regenerate(model, tok, convs, tmp_path / "a.jsonl", max_length=limit + 2, engine="static", progress=False)
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"messages": []}\n')
    with pytest.raises(DataError, match="not a line of `peagle datagen`"):
        regenerate(model, tok, convs, foreign, max_new_tokens=8, max_length=400, progress=False)
    base = ["datagen", "--verifier", str(v), "--no-progress"]
    r = run_cli([*base, "--data", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "o.jsonl")])
    assert r.returncode == 2 and "not found" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "o.jsonl").exists()
    r = run_cli([*base, "--data", str(data), "--output", str(tmp_path)])
    assert r.returncode == 2 and "is a directory" in r.stderr
    for flag in ("--batch-tokens", "--batch-size"):
        r = run_cli([*base, "--data", str(data), "--output", str(tmp_path / "o.jsonl"), flag, "0"])
        assert r.returncode == 2 and f"{flag} must be >= 1" in r.stderr and "Traceback" not in r.stderr
        assert not (tmp_path / "o.jsonl").exists()
    for flag, bad in (("--engine", "vllm"), ("--loops", "drop")):
        r = run_cli([*base, "--data", str(data), "--output", str(tmp_path / "o.jsonl"), flag, bad])
        assert r.returncode == 2 and flag in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("loops", ["keep", "cut"])
def test_answers_that_loop_are_counted_and_cut(setup, tmp_path, monkeypatch, loops):
    """DatagenStats.looping_turns counts the answers that end in a repetition loop (the CLI
    prints it): here every second answer the engine returns is a phrase repeated to the cap.
    loops="cut" writes them cut to the phrase once, records their turns, and generates the next
    turn on the cut answer."""
    import peagle_ext.data.datagen as dg
    from peagle_ext.data.loops import cut_loop

    _, data, tok, model = setup
    convs = load_conversations(str(data))
    loop_text = "the same words once more " * 4
    loop = tok(loop_text, add_special_tokens=False)["input_ids"]
    plain = tok("A plain answer.", add_special_tokens=False)["input_ids"]
    calls = [0]
    prompts_seen = []

    def fake_generate(model, tokenizer, prompts, **gen):
        out = []
        for p in prompts:
            prompts_seen.append(tokenizer.decode(p))
            out.append((loop if calls[0] % 2 == 0 else plain, False))
            calls[0] += 1
        return out

    monkeypatch.setattr(dg, "_generate", fake_generate)
    st = regenerate(
        model,
        tok,
        convs,
        tmp_path / "out.jsonl",
        max_new_tokens=40,
        max_length=400,
        batch_size=3,
        turns="all",
        loops=loops,
        progress=False,
    )
    recs = _records(tmp_path / "out.jsonl")
    answers = [m["content"] for r in recs.values() for m in r["messages"] if m["role"] == "assistant"]
    assert st.turns == len(answers) == calls[0] and st.looping_turns == (calls[0] + 1) // 2 > 0
    generated_loop = tok.decode(loop, skip_special_tokens=True)
    if loops == "keep":
        assert st.looping_turns == sum(ends_in_loop(a) for a in answers) and st.cut_turns == 0
        assert not any("loops_cut" in r for r in recs.values())
        assert any(generated_loop.strip() in p for p in prompts_seen)  # later turns saw the loop
    else:
        assert st.cut_turns == st.looping_turns and not any(ends_in_loop(a) for a in answers)
        assert sum(a == cut_loop(generated_loop) for a in answers) == st.cut_turns
        assert sum(len(r.get("loops_cut", [])) for r in recs.values()) == st.cut_turns
        assert not any(generated_loop.strip() in p for p in prompts_seen)  # later turns saw the cut answer
        assert any(cut_loop(generated_loop) in p for p in prompts_seen)
