"""Duplicate conversations and the prompt-disjoint held-out split (peagle_ext/data/dedup.py),
and the trainer's use of them (`--dedup`)."""

import json
import random

import pytest

from peagle_ext.data import Conversation, disjoint_held_out, drop_duplicates, prompt_key
from peagle_ext.testing import sentence
from tests.helpers import train_settings


def conv(user, answer="ok", system=None, later=()):
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user},
        {"role": "assistant", "content": answer},
    ]
    for u, a in later:
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    return msgs


def test_drop_duplicates_keeps_the_first_of_exact_copies_in_order():
    a, b, c = conv("hi", "one"), conv("hi", "two"), conv("what is 2+2?", "4")
    kept, n = drop_duplicates([a, b, json.loads(json.dumps(a)), c, b, a])
    assert n == 3 and kept == [a, b, c]


@pytest.mark.parametrize(
    "other",
    [
        conv("hi ", "one"),  # whitespace in a message: renders differently
        conv("hi", "one", system="be brief"),
        conv("hi", "one", later=[("more", "sure")]),
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "one", "reasoning_content": "r"}],
    ],
)
def test_drop_duplicates_keeps_conversations_that_render_differently(other):
    kept, n = drop_duplicates([conv("hi", "one"), other])
    assert n == 0 and len(kept) == 2


def test_drop_duplicates_tells_tool_definitions_apart():
    a = Conversation(conv("weather?", "sunny"))
    b = Conversation(conv("weather?", "sunny"))
    a.tools = [{"type": "function", "function": {"name": "get_weather"}}]
    kept, n = drop_duplicates([a, b, a])
    assert n == 1 and kept == [a, b] and kept[0].tools == a.tools


def test_prompt_key_is_the_opening_up_to_the_first_user_turn():
    assert prompt_key(conv("Explain  Quantum\ncomputing", "x")) == prompt_key(conv("explain quantum computing ", "y"))
    assert prompt_key(conv("hi", later=[("a", "b")])) == prompt_key(conv("hi", later=[("c", "d")]))
    assert prompt_key(conv("hi", system="be brief")) != prompt_key(conv("hi"))
    assert prompt_key(conv("hi")) != prompt_key(conv("hello"))


def _random_convs(rng, n, n_prompts):
    prompts = [sentence(rng, rng.randint(1, 6)) for _ in range(n_prompts)]
    return [conv(rng.choice(prompts), sentence(rng, 5)) for _ in range(n)]


@pytest.mark.parametrize("seed", range(6))
def test_disjoint_held_out_shares_no_prompt_and_fills_what_fits(seed):
    rng = random.Random(seed)
    convs = _random_convs(rng, rng.randint(1, 120), rng.randint(1, 40))
    n_held = rng.randint(0, len(convs))
    held = disjoint_held_out(convs, n_held, seed)
    assert held == disjoint_held_out(convs, n_held, seed)  # deterministic
    assert held <= set(range(len(convs))) and len(held) <= n_held
    held_keys = {prompt_key(convs[i]) for i in held}
    rest_keys = {prompt_key(c) for i, c in enumerate(convs) if i not in held}
    assert not held_keys & rest_keys
    # short only when no group left in training would still fit
    sizes = {}
    for c in convs:
        sizes[prompt_key(c)] = sizes.get(prompt_key(c), 0) + 1
    room = n_held - len(held)
    assert all(sizes[k] > room for k in rest_keys)


def test_disjoint_held_out_edges():
    convs = [conv("same")] * 5 + [conv("other")]
    assert disjoint_held_out(convs, 0, 0) == set()
    assert disjoint_held_out(convs, 1, 0) == {5}  # the group of five never straddles the split
    assert disjoint_held_out(convs, 3, 0) == {5}
    assert disjoint_held_out(convs, 6, 0) == set(range(6))
    assert disjoint_held_out([], 3, 0) == set()


@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_disjoint_held_out_without_shared_prompts_is_the_plain_random_split(seed):
    """Data without repeated prompts splits exactly as a seeded shuffle of the conversations did
    before prompts were kept apart, so such runs keep their split."""
    rng = random.Random(seed)
    convs = [conv(f"question {i} " + sentence(rng, 3)) for i in range(50)]
    order = list(range(50))
    random.Random(seed).shuffle(order)
    for n in (0, 1, 7, 50):
        assert disjoint_held_out(convs, n, seed) == set(order[:n])


def _write(path, convs):
    with open(path, "w") as f:
        for c in convs:
            f.write(json.dumps({"messages": c}) + "\n")
    return path


@pytest.fixture
def dup_data(tmp_path):
    rng = random.Random(3)
    base = [conv(sentence(rng, 6), sentence(rng, 10), later=[(sentence(rng, 4), sentence(rng, 8))]) for _ in range(30)]
    # 6 exact copies and 8 conversations that open like another one but go on differently
    shared = [conv(base[i][0]["content"], sentence(rng, 9)) for i in range(8)]
    convs = base + [base[i] for i in (0, 3, 3, 7, 11, 29)] + shared
    random.Random(4).shuffle(convs)
    return _write(tmp_path / "dups.jsonl", convs), len(convs)


@pytest.mark.parametrize("dedup", [True, False])
def test_prepare_data_drops_copies_and_keeps_validation_prompts_out_of_training(tiny, tmp_path, dup_data, dedup):
    from transformers import AutoTokenizer

    from peagle_ext.train import RunLog, prepare_data

    v, _ = tiny
    path, n = dup_data
    tok = AutoTokenizer.from_pretrained(str(v))
    log = RunLog(tmp_path / "log.jsonl", echo=False)
    s = train_settings(tiny, tmp_path / "o", data=str(path), val_fraction=0.3, seq_len=512, dedup=dedup)
    try:
        ds = prepare_data(s.validate(), tok, len(tok), log)
    finally:
        log.close()
    events = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    dropped = [e for e in events if e.get("event") == "duplicates"]
    total = ds.num_train_conversations + ds.num_val_conversations
    if not dedup:
        assert total == n and not dropped
        return
    assert total == n - 6 and dropped[0]["count"] == 6
    assert ds.num_val_conversations == round((n - 6) * 0.3)

    def first_prompts(rows):  # the tokens of each document's first user turn
        out = set()
        for r in rows:
            for d in r.document_ids.unique().tolist():
                if d < 0:
                    continue
                ids, mask = r.input_ids[r.document_ids == d], r.loss_mask[r.document_ids == d]
                first_answer = int(mask.nonzero()[0])
                out.add(tuple(ids[:first_answer].tolist()))
        return out

    assert not first_prompts(ds.train_rows) & first_prompts(ds.val_rows)


def test_resume_of_a_checkpoint_from_before_dedup_runs_without_it(tiny, tmp_path, dup_data):
    """A checkpoint whose settings predate --dedup split the data plainly: resuming it with the
    default is refused by name, with --dedup false it continues."""
    from peagle_ext.train import TrainError, train

    path, _ = dup_data
    out = tmp_path / "run"
    kw = dict(data=str(path), max_steps=2, val_fraction=0.2, seq_len=128)
    train(train_settings(tiny, out, dedup=False, **kw), stop_after=1)
    state = out / "checkpoint-1" / "trainer_state.json"
    st = json.loads(state.read_text())
    del st["settings"]["dedup"]
    state.write_text(json.dumps(st))
    with pytest.raises(TrainError, match=r"dedup=True \(checkpoint: False\)"):
        train(train_settings(tiny, out, resume=True, **kw))
    assert train(train_settings(tiny, out, resume=True, dedup=False, **kw)).steps == 2


def test_cli_dedup_flag(tmp_path):
    from tests.helpers import run_cli

    r = run_cli(["train", "--dedup", "maybe", "--output", str(tmp_path / "o")])
    assert r.returncode == 2 and "--dedup" in r.stderr
