"""Train/serve consistency: decoding's position-k acceptance and the trainer's validation accuracy
at depth k-1 are one quantity measured two ways.

A drafter is trained briefly by `peagle train` on chat data for a tiny verifier. On held-out
conversations of the same distribution, the validation accuracy of the training forward (every
scored chain, peagle_ext.serving.teacher_forced.scored_chains_layout) must equal decoding's
per-position correctness of teacher-forced drafting rounds on the same texts (one round per
anchor, through prepare_parallel_draft_inputs and PEagleDrafter, scored against the verifier's
own greedy choices). On the verifier's own greedy continuations, teacher-forced rounds must give
the acceptance that speculative decoding measures on the same prompts."""

import json

import pytest
import torch

from peagle_ext.data import PackedSequence, eagle_shift, load_conversations, tokenize_conversation
from peagle_ext.data import verifier_hidden_states as hidden_states
from peagle_ext.model import PEagleDraftModel
from peagle_ext.serving import PEagleDrafter, Verifier, acceptance_stats, greedy_generate, speculative_generate
from peagle_ext.serving.teacher_forced import decoding_rounds, scored_chains_layout, teacher_forced_rounds
from peagle_ext.testing import make_chat_jsonl, make_tiny_verifier

pytestmark = pytest.mark.usefixtures("one_thread")
K = 3


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(verifier dir, drafter dir, held-out data): a peaked tiny verifier (a random one is nearly
    uniform) and a drafter trained on 60 chats by the trainer, in float32."""
    from transformers import AutoModelForCausalLM

    from peagle_ext.train import TrainSettings, train

    d = tmp_path_factory.mktemp("consistency")
    vdir = make_tiny_verifier(d / "verifier")
    vm = AutoModelForCausalLM.from_pretrained(vdir)
    with torch.no_grad():
        vm.lm_head.weight.mul_(30.0)
    vm.save_pretrained(vdir)
    data = make_chat_jsonl(d / "train.jsonl", n=60, turns=1, words=(6, 16))
    held = make_chat_jsonl(d / "heldout.jsonl", n=8, turns=1, words=(10, 16), seed=99)
    s = TrainSettings(
        verifier=str(vdir),
        data=str(data),
        output=str(d / "run"),
        seq_len=128,
        num_depths=K,
        max_steps=150,
        draft_vocab_size=None,
        dtype="float32",
        val_fraction=0.05,
        val_every=1000,
        checkpoint_every=1000,
        warmup_steps=5,
        lr=3e-3,
        loss="ce",
        down_sample_ratio=0.9,
        down_sample_ratio_min=0.5,
        progress=False,
        num_conversations=None,
        background_hidden=False,
    )
    r = train(s)
    return vdir, r.final_dir, held


def _models(vdir, ddir, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from peagle_ext.data import decoder_parts

    vm = AutoModelForCausalLM.from_pretrained(vdir, dtype=dtype).eval().requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(vdir)
    dm = PEagleDraftModel.from_pretrained(ddir)
    _, _, norm = decoder_parts(vm)
    dm.attach_verifier(norm_weight=norm.weight, lm_head_weight=vm.lm_head.weight, init_from_verifier=False)
    dm = dm.eval().requires_grad_(False)  # float32: the parallel-drafting op takes no float64
    return vm, tok, dm


def _validation_counts(vm, dm, ids, mask):
    """The training forward's per-depth (correct, total) over every scored chain of one text."""
    n = ids.numel()
    row = PackedSequence(ids, torch.zeros(n, dtype=torch.int32), mask, 0)
    aux, last = hidden_states(vm, row, dm.config.eagle_aux_hidden_state_layer_ids)
    ex = eagle_shift(row, aux, last)
    with torch.no_grad():
        _, met = dm(ex, scored_chains_layout(ex, dm.num_depths))
    return met["correct"].tolist(), met["total"].tolist()


def test_validation_accuracy_equals_teacher_forced_acceptance(trained):
    vdir, ddir, held = trained
    # a float64 verifier: its greedy choices do not depend on scoring one or many tokens per forward
    vm, tok, dm = _models(vdir, ddir, torch.float64)
    v = Verifier(vm, dm.config.eagle_aux_hidden_state_layer_ids)
    dr = PEagleDrafter(dm)
    val_c, val_t = [0] * K, [0] * K
    tf = None
    for conv in load_conversations(str(held)):
        ids, mask = tokenize_conversation(tok, conv, max_len=128)
        c, t = _validation_counts(vm, dm, ids, mask)
        val_c = [a + b for a, b in zip(val_c, c)]
        val_t = [a + b for a, b in zip(val_t, t)]
        r = teacher_forced_rounds(v, dr, ids, K, scored=mask)
        tf = r if tf is None else tf.merge(r)
    msg = f"validation {val_c}/{val_t} vs teacher-forced decoding {tf.correct}/{tf.total}"
    assert val_t == tf.total and min(val_t) > 50, msg
    # the drafter's two forwards (COD attention op, SDPA over the draft KV cache) differ by float32
    # rounding, which may flip an argmax at a near-tie, rarely
    assert all(abs(a - b) <= max(1, t // 200) for a, b, t in zip(val_c, tf.correct, val_t)), msg
    acc = tf.accuracy
    print(msg)
    assert acc[0] > 0.2 and acc[0] > acc[-1], msg  # a trained drafter, so the check has teeth


def test_teacher_forced_rounds_on_greedy_text_are_decoding(trained):
    """On the verifier's own greedy continuation, the conditional acceptance of teacher-forced
    rounds is speculative decoding's, and the rounds decoding runs are among them."""
    vdir, ddir, held = trained
    vm, tok, dm = _models(vdir, ddir, torch.float64)
    v = Verifier(vm, dm.config.eagle_aux_hidden_state_layer_ids)
    dr = PEagleDrafter(dm)
    n_new = 40
    tf_acc, dec_acc = [], []
    for conv in load_conversations(str(held)):
        text = tok.apply_chat_template(conv[:1], tokenize=False, add_generation_prompt=True)
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        gen = greedy_generate(v, prompt, n_new).tokens
        full = torch.tensor(prompt + gen)
        scored = torch.arange(full.numel()) >= len(prompt)
        r = teacher_forced_rounds(v, dr, full, K, scored=scored)
        s = speculative_generate(v, dr, prompt, K, n_new)
        assert s.tokens == gen
        # decoding's rounds: anchor n-1 first, then after each round the last accepted position
        anchors, a = [], len(prompt) - 1
        for acc in s.accepted:
            anchors.append(a)
            a += acc + 1
        # the round at anchor a is teacher-forced round a - (n - 1); a decoding round that drafts
        # past the generated text sees fewer scored drafts there
        for a, acc in zip(anchors, s.accepted):
            i = a - len(prompt) + 1
            assert r.accepted[i] == min(acc, n_new - 1 - i), (i, r.accepted[i], acc)
        # the same rounds, walked from the teacher-forced ones alone
        walked = decoding_rounds(r.accepted)
        assert walked == [min(acc, n_new - 1 - (a - len(prompt) + 1)) for a, acc in zip(anchors, s.accepted)]
        tf_acc += r.accepted
        dec_acc += s.accepted
    st_tf = acceptance_stats(tf_acc, K)
    st_dec = acceptance_stats(dec_acc, K)
    print(st_tf["per_position_acceptance"], st_dec["per_position_acceptance"])
    assert abs(st_tf["per_position_acceptance"][0] - st_dec["per_position_acceptance"][0]) < 0.15, (st_tf, st_dec)


def test_decoding_rounds_walk_past_each_accepted_run():
    assert decoding_rounds([]) == [] and decoding_rounds([1]) == []  # one token: the prefill's
    assert decoding_rounds([0, 0, 0]) == [0, 0]  # the last anchor drafts past the text
    assert decoding_rounds([2, 9, 9, 1, 9, 0, 0]) == [2, 1, 0]  # anchors 0, 3, 5
    assert decoding_rounds([2, 0, 0]) == [2]  # the first round reaches the text's end


def test_teacher_forced_bad_input(trained):
    vdir, ddir, _ = trained
    vm, _, dm = _models(vdir, ddir, torch.float32)
    v = Verifier(vm, dm.config.eagle_aux_hidden_state_layer_ids)
    dr = PEagleDrafter(dm)
    with pytest.raises(ValueError, match="num_spec_tokens"):
        teacher_forced_rounds(v, dr, torch.arange(5, 20), K + 1)
    with pytest.raises(ValueError, match="at least 2"):
        teacher_forced_rounds(v, dr, [5], 1)
    with pytest.raises(ValueError, match="scored has"):
        teacher_forced_rounds(v, dr, torch.arange(5, 20), 1, scored=torch.ones(3, dtype=torch.bool))
    # no scored position: nothing to score, no round
    r = teacher_forced_rounds(v, dr, torch.arange(5, 20), 2, scored=torch.zeros(15, dtype=torch.bool))
    assert r.total == [0, 0] and r.accepted == [] and r.accuracy == [None, None]
    json.dumps(r.__dict__)


@pytest.mark.parametrize(
    "args,named",
    [
        (["--num-conversations", "0"], "--num-conversations"),
        (["--gen-tokens", "-1"], "--gen-tokens"),
        (["--skip", "-3"], "--skip"),
        (["--max-len", "1"], "--max-len"),
        (["--verifier-impl", "fast"], "--verifier-impl"),
    ],
)
def test_consistency_tool_bad_arguments_exit_2(args, named):
    """tools/consistency.py names a bad argument and exits 2 before it loads any model."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    p = subprocess.run(
        [sys.executable, str(root / "tools" / "consistency.py"), "--draft", "no/such/dir", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and named in p.stderr, p.stderr[-500:]


def test_consistency_tool_runs_end_to_end(trained, tmp_path):
    """tools/consistency.py on a trained drafter: every measure in its report, the validation and
    teacher-forced accuracies equal (the tool's own check of this module's first test)."""
    import subprocess
    import sys
    from pathlib import Path

    vdir, ddir, held = trained
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "consistency.json"
    args = ["--draft", str(ddir), "--verifier", str(vdir), "--data", str(held), "--skip", "0"]
    args += ["--num-conversations", "3", "--max-len", "64", "--gen-prompts", "2", "--gen-tokens", "12"]
    p = subprocess.run(
        [sys.executable, str(root / "tools" / "consistency.py"), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["num_spec_tokens"] == K and len(rep["decode"]) == K
    assert rep["scored"][0] > 0
    for a, b in zip(rep["val_fp32"], rep["tf_full"]):
        assert a is None and b is None or abs(a - b) < 1e-6
    assert rep["decode_acceptance_length"] >= 1.0
