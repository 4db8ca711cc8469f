"""Tests of peagle_ext.data: loaders, loss masks, packing, verifier hidden states, EAGLE shift, cache.

Most tests use a tiny random Llama / Qwen3 and a tiny byte-level BPE tokenizer built here, offline.
Real-data tests: the ShareGPT dump and SmolLM2's tokenizer (read straight from the GGUF, ~4 s);
`-m slow` selects the one test that converts the real SmolLM2 GGUF (~20 s) and runs it.
"""

from __future__ import annotations

import json

import pytest
import torch

from peagle_ext import data as D
from tests.helpers import requires_cuda

CHATML = (
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}"
)

CONV = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello world, how are you?"},
    {"role": "assistant", "content": "the quick brown fox"},
    {"role": "user", "content": "ünïcode 🙂 and\n\nnewlines"},
    {"role": "assistant", "content": "\n\njumps over\n the lazy dog 🙂"},
]


def _build_tiny_tokenizer(chat_template=CHATML):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(
        ["hello world how are you", "the quick brown fox jumps over the lazy dog", "assistant user system\n\n"] * 10,
        trainer=trainer,
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", eos_token="<|im_end|>", bos_token="<|im_start|>"
    )
    tok.chat_template = chat_template
    return tok


@pytest.fixture(scope="module")
def tiny_tok():
    return _build_tiny_tokenizer()


def _tiny_model(kind: str, vocab: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        head_dim=8,
        tie_word_embeddings=False,
    )
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    with torch.no_grad():  # random norm weights so "pre-norm vs post-norm" is a visible difference
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tiny_tok):
    d = tmp_path_factory.mktemp("tiny_llama")
    _tiny_model("llama", len(tiny_tok)).save_pretrained(d)
    tiny_tok.save_pretrained(d)
    return d


def _rand_tokenized(g, n, lo, hi, vocab=300):
    out = []
    for _ in range(n):
        ln = int(torch.randint(lo, hi + 1, (1,), generator=g))
        ids = torch.randint(3, vocab, (ln,), generator=g)
        mask = torch.rand(ln, generator=g) < 0.6
        out.append((ids, mask))
    return out


def _masked_runs(tok, ids, mask):
    """Decoded text of each maximal run of loss-mask tokens."""
    runs, cur = [], []
    for i, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


# ----------------------------------------------------------------------------------------------
# Loaders


def test_sharegpt_loader_handles_truncated_tail():
    convs = D.load_conversations("sharegpt")
    assert len(convs) > 17000
    for c in convs[::97]:
        assert c[0]["role"] in ("system", "user")
        assert c[-1]["role"] == "assistant"
        assert all(m["role"] in ("system", "user", "assistant") and isinstance(m["content"], str) for m in c)
        assert all(m["role"] != "system" for m in c[1:])
    assert D.load_conversations("sharegpt", limit=5) == convs[:5]


def test_iter_records_stops_at_truncated_tail(tmp_path):
    recs = [
        {"id": i, "conversations": [{"from": "human", "value": f"q{i} ]"}, {"from": "gpt", "value": "a, {"}]}
        for i in range(3)
    ]
    text = json.dumps(recs, indent=2)
    cut = text[: text.rindex('"a, {"') + 3]  # inside the last record's string
    p = tmp_path / "cut.json"
    p.write_text(cut)
    got = list(D.iter_sharegpt_records(p))
    assert got == recs[:2]
    p.write_text(text)
    assert list(D.iter_sharegpt_records(p)) == recs


def test_normalize_messages():
    raw = [
        {"from": "gpt", "value": "orphan answer"},
        {"from": "system", "value": "sys"},
        {"from": "human", "value": "q"},
        {"from": "bing", "value": "a"},
        {"from": "human", "value": "q2"},
    ]
    # A system turn after an orphan assistant turn is not at the start: dropped with the orphan.
    assert D.normalize_messages(raw) == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert D.normalize_messages([{"role": "user", "content": "q"}]) is None
    assert D.normalize_messages([{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]) is None
    with pytest.raises(D.DataError, match="unknown role"):
        D.normalize_messages([{"role": "robot", "content": "x"}])
    with pytest.raises(D.DataError, match="content must be a string"):
        D.normalize_messages([{"role": "user", "content": 3}])


def test_jsonl_loader_and_errors(tmp_path):
    p = tmp_path / "d.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
        {"messages": [{"role": "user", "content": "only a question"}]},  # unusable: skipped
        {"conversations": [{"from": "human", "value": "c"}, {"from": "gpt", "value": "d"}]},
    ]
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    convs = D.load_conversations(str(p))
    assert convs == [
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
        [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}],
    ]
    assert D.load_conversations(p, limit=1) == convs[:1]

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(lines[0]) + "\n" + "{not json\n")
    with pytest.raises(D.DataError, match=r"bad.jsonl:2: invalid JSON"):
        D.load_conversations(str(bad))
    nomsg = tmp_path / "nomsg.jsonl"
    nomsg.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(D.DataError, match=r"nomsg.jsonl:1: missing 'messages'"):
        D.load_conversations(str(nomsg))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(D.DataError, match="no usable conversation"):
        D.load_conversations(str(empty))
    useless = tmp_path / "useless.jsonl"
    useless.write_text(json.dumps(lines[1]) + "\n")
    with pytest.raises(D.DataError, match="no usable conversation"):
        D.load_conversations(str(useless))
    with pytest.raises(D.DataError, match="not found"):
        D.load_conversations(str(tmp_path / "missing.jsonl"))
    with pytest.raises(D.DataError, match="directory"):
        D.load_conversations(str(tmp_path))
    with pytest.raises(ValueError, match="limit"):
        D.load_conversations(str(p), limit=0)


def test_eval_prompts(tmp_path):
    mt = D.load_eval_prompts("mtbench")
    assert len(mt) == 80 and all(len(m) == 1 and m[0]["role"] == "user" for m in mt)
    he = D.load_eval_prompts("humaneval", limit=3)
    assert len(he) == 3 and "def has_close_elements" in he[0][0]["content"]
    p = tmp_path / "p.jsonl"
    p.write_text(
        "\n".join(
            [
                json.dumps({"prompt": "p1"}),
                json.dumps({"turns": ["t1", "t2"]}),
                json.dumps(
                    {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "drop me"}]}
                ),
            ]
        )
    )
    assert D.load_eval_prompts(str(p)) == [
        [{"role": "user", "content": "p1"}],
        [{"role": "user", "content": "t1"}],
        [{"role": "user", "content": "u"}],
    ]
    p.write_text('{"prompt": "ok"}\n[1, 2]\n')
    with pytest.raises(D.DataError, match=r"p.jsonl:2"):
        D.load_eval_prompts(str(p))


# ----------------------------------------------------------------------------------------------
# Tokenization and loss masks


def _check_assistant_mask(tok, conv, ids, mask, end_of_turn):
    """The masked runs decode exactly to each assistant turn's content + its end-of-turn text.
    Exception by design: a token that BPE merged across the header/content edge ("\n" + "\n\n"
    -> "\n\n\n") is assistant, so a run may start with that one extra header newline."""
    want = [m["content"] + end_of_turn for m in conv if m["role"] == "assistant"]
    runs = _masked_runs(tok, ids, mask)
    assert len(runs) == len(want)
    for run, w in zip(runs, want):
        assert run.endswith(w) and run[: len(run) - len(w)] in ("", "\n"), (run, w)
    ref = tok.apply_chat_template(conv, tokenize=True)
    ref = ref["input_ids"] if hasattr(ref, "keys") else ref
    assert ids.tolist() == list(ref)


def test_loss_mask_tiny_tokenizer(tiny_tok):
    ids, mask = D.tokenize_conversation(tiny_tok, CONV, max_len=10_000)
    assert ids.dtype == torch.long and mask.dtype == torch.bool and ids.shape == mask.shape
    _check_assistant_mask(tiny_tok, CONV, ids, mask, "<|im_end|>\n")
    # The offset-free path (slow tokenizers) gives the same mask.
    ids2, mask2 = D.tokenize_conversation(tiny_tok, CONV, max_len=10_000, _use_offsets=False)
    assert torch.equal(ids, ids2) and torch.equal(mask, mask2)
    # Truncation keeps the head.
    ids3, mask3 = D.tokenize_conversation(tiny_tok, CONV, max_len=7)
    assert torch.equal(ids3, ids[:7]) and torch.equal(mask3, mask[:7])


def test_loss_mask_smollm2_tokenizer():
    from transformers import AutoTokenizer

    gguf = D.smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    # No system message: SmolLM2's template inserts its default system prompt (never trained on).
    conv = CONV[1:]
    ids, mask = D.tokenize_conversation(tok, conv, max_len=10_000)
    _check_assistant_mask(tok, conv, ids, mask, "<|im_end|>\n")
    assert "You are a helpful AI assistant" in tok.decode(ids[~mask])
    ids2, mask2 = D.tokenize_conversation(tok, conv, max_len=10_000, _use_offsets=False)
    assert torch.equal(ids, ids2) and torch.equal(mask, mask2)


def test_loss_mask_template_not_prefix_stable():
    # Generation prompt opens a think block that the rendered history never contains (Qwen3-like):
    # the mask must start where the full render and the prompt render part, inside the turn.
    tmpl = (
        "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}"
        "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n<think>\n'}}{% endif %}"
    )
    tok = _build_tiny_tokenizer(tmpl)
    conv = CONV[1:3]
    ids, mask = D.tokenize_conversation(tok, conv, max_len=10_000)
    assert _masked_runs(tok, ids, mask) == [conv[1]["content"] + "<|im_end|>\n"]


def test_tokenize_errors(tiny_tok):
    tok = _build_tiny_tokenizer(None)
    with pytest.raises(D.DataError, match="no chat template"):
        D.tokenize_conversation(tok, CONV, max_len=64)
    with pytest.raises(D.DataError, match="no chat template"):
        D.tokenize_conversations(tok, [CONV], max_len=64)
    with pytest.raises(ValueError, match="max_len"):
        D.tokenize_conversation(tiny_tok, CONV, max_len=1)
    with pytest.raises(D.DataError, match="non-empty list"):
        D.tokenize_conversation(tiny_tok, [], max_len=64)


def test_tokenize_conversations_counts(tiny_tok):
    full, _ = D.tokenize_conversation(tiny_tok, CONV, max_len=10_000)
    n = len(full)
    short = CONV[1:3]
    out, st = D.tokenize_conversations(tiny_tok, [CONV, short, CONV], max_len=n)
    assert st.truncated == 0 and len(out) == 3
    out, st = D.tokenize_conversations(tiny_tok, [CONV, short], max_len=n - 1)
    assert st.truncated == 1 and len(out[0][0]) == n - 1
    # Cut before the first answer: no loss token left, dropped.
    out, st = D.tokenize_conversations(tiny_tok, [CONV], max_len=6)
    assert st.dropped_no_loss == 1 and out == []


def test_tokenize_many_processes_equal_one_process(tiny_tok, monkeypatch):
    """The forked pool gives, in order, what one process gives, refusals included."""
    import peagle_ext.data.chat as chat

    monkeypatch.setattr(chat, "PARALLEL_MIN_CONVERSATIONS", 8)
    refused = [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]
    convs = [CONV, CONV[1:3], CONV[:2], *[CONV[: 2 + i % 3] for i in range(21)]]
    convs[7] = refused  # ChatML renders it; a template that refuses it is checked below
    one = D.tokenize_many(tiny_tok, convs, max_len=40, workers=1)
    many = D.tokenize_many(tiny_tok, convs, max_len=40, workers=2)
    assert len(one) == len(many) == len(convs)
    for a, b in zip(one, many):
        assert type(a) is type(b)
        if isinstance(a, str):
            assert a == b
        else:
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    strict = _build_tiny_tokenizer(
        "{% for m in messages %}{% if loop.index0 % 2 == 0 and m['role'] == 'assistant' %}"
        "{{ raise_exception('roles must alternate') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    res = D.tokenize_many(strict, [CONV[1:3], refused] * 6, max_len=40, workers=2)
    assert [isinstance(r, str) for r in res] == [False, True] * 6
    assert "roles must alternate" in res[1]


# ----------------------------------------------------------------------------------------------
# Packing


def test_pack_invariants(rng):
    tokenized = _rand_tokenized(rng, 60, 1, 70)
    tokenized.append((torch.arange(3, 203), torch.ones(200, dtype=torch.bool)))  # longer than a row
    seq_len = 100
    rows = D.pack_conversations(tokenized, seq_len, pad_token_id=0)
    again = D.pack_conversations(tokenized, seq_len, pad_token_id=0)
    assert len(rows) == len(again)
    seen = []
    for r, r2 in zip(rows, again):
        assert torch.equal(r.input_ids, r2.input_ids) and torch.equal(r.document_ids, r2.document_ids)
        assert torch.equal(r.loss_mask, r2.loss_mask)
        assert r.input_ids.shape == (seq_len,) and r.input_ids.dtype == torch.long
        assert r.document_ids.dtype == torch.int32 and r.loss_mask.dtype == torch.bool
        doc = r.document_ids
        used = int((doc >= 0).sum())
        assert bool((doc[:used] >= 0).all()) and bool((doc[used:] == -1).all())  # padding is a tail
        assert bool((r.input_ids[used:] == 0).all()) and not bool(r.loss_mask[used:].any())
        spans = r.document_spans()
        assert [int(doc[s]) for s, _ in spans] == list(range(len(spans)))  # 0, 1, 2, ...
        for s, e in spans:
            seen.append((r.input_ids[s:e].tolist(), r.loss_mask[s:e].tolist()))
    want = [(ids[:seq_len].tolist(), m[:seq_len].tolist()) for ids, m in tokenized]
    assert sorted(seen) == sorted(want)  # every conversation exactly once (the long one truncated)
    # Any-fit packing: no two rows are both at most half full, so rows <= 2 * tokens / seq_len + 1.
    used = sorted(int((r.document_ids >= 0).sum()) for r in rows)
    assert len(used) < 2 or used[0] + used[1] > seq_len
    assert len(rows) <= 2 * sum(used) / seq_len + 1


def test_pack_errors():
    with pytest.raises(ValueError, match="seq_len"):
        D.pack_conversations([(torch.arange(3), torch.ones(3, dtype=torch.bool))], 1, pad_token_id=0)
    with pytest.raises(D.DataError, match="nothing to pack"):
        D.pack_conversations([], 16, pad_token_id=0)
    with pytest.raises(ValueError, match="lengths differ"):
        D.pack_conversations([(torch.arange(3), torch.ones(2, dtype=torch.bool))], 16, pad_token_id=0)
    with pytest.raises(ValueError, match="pad_token_id"):
        D.pack_conversations([(torch.arange(3), torch.ones(3, dtype=torch.bool))], 16, pad_token_id=-1)


# ----------------------------------------------------------------------------------------------
# Verifier hidden states


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_verifier_hidden_states_per_document(kind, rng):
    model = _tiny_model(kind, 300)
    tokenized = _rand_tokenized(rng, 7, 1, 40)
    row = D.pack_conversations(tokenized, 160, pad_token_id=0)[0]
    assert len(row.document_spans()) >= 3 and int((row.document_ids < 0).sum()) > 0
    L, H = model.config.num_hidden_layers, model.config.hidden_size
    ids = [0, 2, L]  # embeddings, a middle layer input, and the final pre-norm state
    aux, last = D.verifier_hidden_states(model, row, ids, token_budget=64)  # forces several batches
    assert aux.shape == (160, 3 * H) and last.shape == (160, H)
    pad = row.document_ids < 0
    assert bool((aux[pad] == 0).all()) and bool((last[pad] == 0).all())
    for s, e in row.document_spans():
        out = model(input_ids=row.input_ids[s:e][None], output_hidden_states=True)
        hs = out.hidden_states
        for j, k in enumerate(ids[:2]):  # aux id k == HF hidden_states[k] (input of layer k)
            torch.testing.assert_close(aux[s:e, j * H : (j + 1) * H], hs[k][0], rtol=1e-5, atol=1e-5)
        # id L == the state entering the final norm == `last`
        torch.testing.assert_close(aux[s:e, 2 * H :], last[s:e], rtol=0, atol=0)
        # last is PRE final norm: lm_head(norm(last)) reproduces the logits ...
        logits = model.lm_head(model.model.norm(last[s:e]))
        torch.testing.assert_close(logits, out.logits[0], rtol=1e-5, atol=1e-5)
        # ... and HF's hidden_states[-1] is the POST-norm state (so it is not what `last` holds).
        torch.testing.assert_close(hs[-1][0], model.model.norm(last[s:e]), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(hs[-1][0], last[s:e], atol=1e-3)


def test_verifier_hidden_states_edge_cases():
    model = _tiny_model("llama", 300)
    empty = D.PackedSequence(
        torch.zeros(8, dtype=torch.long), torch.full((8,), -1, dtype=torch.int32), torch.zeros(8, dtype=torch.bool)
    )
    aux, last = D.verifier_hidden_states(model, empty, [1, 2])
    assert aux.shape == (8, 64) and not aux.any() and not last.any()
    one = D.PackedSequence(torch.tensor([5, 7]), torch.tensor([0, 1], dtype=torch.int32), torch.tensor([True, True]))
    aux, last = D.verifier_hidden_states(model, one, [3])
    alone = model(input_ids=torch.tensor([[7]]), output_hidden_states=True).hidden_states[3][0, 0]
    torch.testing.assert_close(aux[1], alone, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="aux_layer_ids"):
        D.verifier_hidden_states(model, one, [6])
    with pytest.raises(ValueError, match="aux_layer_ids"):
        D.verifier_hidden_states(model, one, [])
    with pytest.raises(TypeError, match="PackedSequence"):
        D.verifier_hidden_states(model, (one.input_ids,), [1])


def test_verifier_hidden_states_of_many_rows_equal_each_row_alone(rng):
    """Documents of several rows batched together (one forward for a training step's rows) give
    each row's states as computing it alone, to float rounding (float64 here), including an
    empty row and a row whose documents end up in batches with other rows' documents."""
    model = _tiny_model("llama", 300).double()
    rows = [D.pack_conversations(_rand_tokenized(rng, 5, 1, 40), 120, pad_token_id=0)[0] for _ in range(3)]
    empty = D.PackedSequence(
        torch.zeros(50, dtype=torch.long), torch.full((50,), -1, dtype=torch.int32), torch.zeros(50, dtype=torch.bool)
    )
    rows.insert(1, empty)
    ids = [0, 2, model.config.num_hidden_layers]
    for budget in (None, 200, 4096):
        many = D.verifier_hidden_states_many(model, rows, ids, token_budget=budget)
        assert len(many) == len(rows)
        for r, (aux, last) in zip(rows, many):
            a1, l1 = D.verifier_hidden_states(model, r, ids)
            torch.testing.assert_close(aux, a1, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(last, l1, rtol=1e-12, atol=1e-12)
    assert D.verifier_hidden_states_many(model, [empty], ids)[0][0].shape == (50, 3 * model.config.hidden_size)
    with pytest.raises(TypeError, match="PackedSequence"):
        D.verifier_hidden_states_many(model, [rows[0], "row"], ids)


@requires_cuda
def test_verifier_passes_on_cuda_leave_cudnn_attention_out(rng):
    """A batched pass's forwards have shapes that rarely repeat, and cuDNN's SDPA plans each new
    one for tens of ms: on CUDA the pass runs no cuDNN attention, gives the states that torch's own
    choice gives (to bf16 rounding), and leaves the process's SDPA backends as it found them."""
    from torch.profiler import ProfilerActivity, profile

    from peagle_ext.data import hidden_states as HS

    model = _tiny_model("llama", 300).to("cuda", torch.bfloat16)
    rows = [D.pack_conversations(_rand_tokenized(rng, 5, 1, 40), 120, pad_token_id=0)[0] for _ in range(3)]
    ids = [0, 2, model.config.num_hidden_layers]
    before = torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        ours = D.verifier_hidden_states_many(model, rows, ids)
    assert (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()) == before
    ran = {e.name for e in prof.events()}
    assert "aten::scaled_dot_product_attention" in ran
    assert not any("cudnn_attention" in n for n in ran)
    HS.PASS_WITHOUT_CUDNN_ATTENTION = False
    try:
        theirs = D.verifier_hidden_states_many(model, rows, ids)
    finally:
        HS.PASS_WITHOUT_CUDNN_ATTENTION = True
    for mine, torchs in zip(ours, theirs):
        for x, y in zip(mine, torchs):  # aux, last
            torch.testing.assert_close(x.float(), y.float(), rtol=2e-2, atol=2e-2)


def test_recomputed_hidden_states_of_a_step_come_from_one_batched_pass(rng, monkeypatch):
    """HiddenStates.get_many without a cache: one batched verifier pass for all the rows, and the
    same examples as get() row by row (to float rounding)."""
    from peagle_ext.train.hidden import HiddenStates

    model = _tiny_model("llama", 300).double()
    rows = [D.pack_conversations(_rand_tokenized(rng, 4, 1, 30), 96, pad_token_id=0)[0] for _ in range(4)]
    ids = [1, 2, 3]
    hs = HiddenStates(model, ids, rows, cache=False, store_dtype=torch.float64, device=torch.device("cpu"))
    calls = []
    real = D.verifier_hidden_states_many
    monkeypatch.setattr(D, "verifier_hidden_states_many", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = hs.get_many([2, 0, 3])
    assert len(calls) == 1
    for i, ex in zip([2, 0, 3], got):
        want = hs.get(i)
        assert torch.equal(ex.input_ids, want.input_ids) and torch.equal(ex.document_ids, want.document_ids)
        torch.testing.assert_close(ex.hidden, want.hidden, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ex.last_hidden, want.last_hidden, rtol=1e-12, atol=1e-12)


def test_a_partial_cache_keeps_its_rows_and_recomputes_the_rest_in_one_pass(rng, monkeypatch):
    """HiddenStates(cache=n) keeps the first n rows' states once computed and recomputes the others
    at every use: a step's rows still take one batched verifier pass (for the rows not in memory),
    every row comes back in store_dtype whichever way it came (on the CPU, on the host), the values are the
    row-by-row ones (to float rounding), and a warm-up computes the kept rows only."""
    from peagle_ext.train.hidden import HiddenStates

    model = _tiny_model("llama", 300).double()
    rows = [D.pack_conversations(_rand_tokenized(rng, 4, 1, 30), 96, pad_token_id=0)[0] for _ in range(5)]
    ids = [1, 2, 3]
    alone = HiddenStates(model, ids, rows, cache=False, store_dtype=torch.float64, device=torch.device("cpu"))
    want = [alone.get(i) for i in range(len(rows))]
    hs = HiddenStates(model, ids, rows, cache=2, store_dtype=torch.float32, device=torch.device("cpu"))
    assert hs.partial and not hs.cache and [hs.kept(i) for i in range(5)] == [True, True, False, False, False]
    calls = []
    real = D.verifier_hidden_states_many
    monkeypatch.setattr(D, "verifier_hidden_states_many", lambda *a, **k: calls.append(len(a[1])) or real(*a, **k))

    def check(got, idx):
        for i, ex in zip(idx, got):
            assert ex.hidden.dtype == ex.last_hidden.dtype == torch.float32 and ex.hidden.device.type == "cpu"
            assert torch.equal(ex.input_ids, want[i].input_ids) and torch.equal(ex.loss_mask, want[i].loss_mask)
            torch.testing.assert_close(ex.hidden, want[i].hidden.float(), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(ex.last_hidden, want[i].last_hidden.float(), rtol=1e-6, atol=1e-6)

    check(hs.get_many([4, 0, 3, 1, 4]), [4, 0, 3, 1, 4])
    assert calls == [4] and sorted(hs._mem) == [0, 1]  # one pass for the four distinct rows; 0 and 1 kept
    kept0 = hs._mem[0]
    check(hs.get_many([1, 4, 0, 3]), [1, 4, 0, 3])
    assert calls == [4, 2] and hs._mem[0] is kept0  # only the rows not kept are computed again
    check(hs.get_many([0, 2]), [0, 2])
    assert calls == [4, 2]  # one row to compute: row by row
    assert sorted(hs._mem) == [0, 1]

    warm = HiddenStates(model, ids, rows, cache=3, store_dtype=torch.float64, device=torch.device("cpu"))
    calls.clear()
    warm.device = torch.device("cuda")  # warm() batches for a GPU verifier (none is touched here)
    warm.warm("test", progress=False)
    assert sum(calls) == 3 and sorted(warm._mem) == [0, 1, 2]

    assert HiddenStates(model, ids, rows, cache=9, store_dtype=torch.float64, device="cpu").cache
    none = HiddenStates(model, ids, rows, cache=0, store_dtype=torch.float64, device="cpu")
    assert not none.cache and not none.partial and none.get(0).hidden.dtype == torch.float64
    with pytest.raises(ValueError, match="row count >= 0"):
        HiddenStates(model, ids, rows, cache=-1, store_dtype=torch.float64, device="cpu")


def _fp8_round_trip(ex, dtype):
    """An independent restatement of the fp8 cache's rounding: per position, scale = amax / 448,
    float8 e4m3 of x / scale, times the scale again."""

    def rt(x):
        x = x.double()
        amax = x.abs().amax(dim=-1, keepdim=True)
        scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax)).float()
        q = (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        return (q.float() * scale).to(dtype)

    return rt(ex.hidden), rt(ex.last_hidden)


@pytest.mark.parametrize("cache", [True, 2])
def test_an_fp8_cache_keeps_rows_in_a_byte_a_feature_and_gives_them_back_dequantized(rng, cache, monkeypatch):
    """HiddenStates(fp8=True) keeps each row as float8 e4m3 with a float32 scale per position and
    tensor, and gives it back in store_dtype: the reference's fp8 rounding of the row, the same
    rows every time, whether asked for together (get_many, which dequantizes a step's kept rows
    in one pass per tensor) or one by one (get); rows it does not keep (a partial cache) come back
    unrounded."""
    from peagle_ext.train.hidden import HiddenStates

    model = _tiny_model("llama", 300)
    rows = [D.pack_conversations(_rand_tokenized(rng, 4, 1, 30), 96, pad_token_id=0)[0] for _ in range(4)]
    ids = [1, 2, 3]
    exact = HiddenStates(model, ids, rows, cache=False, store_dtype=torch.float32, device="cpu")
    want = [exact.get(i) for i in range(len(rows))]
    hs = HiddenStates(model, ids, rows, cache=cache, store_dtype=torch.float32, device="cpu", fp8=True)
    for idx in ([3, 0, 2, 1], [1, 3]):
        for i, ex in zip(idx, hs.get_many(idx)):
            assert ex.hidden.dtype == ex.last_hidden.dtype == torch.float32
            assert torch.equal(ex.input_ids, want[i].input_ids) and torch.equal(ex.loss_mask, want[i].loss_mask)
            if hs.kept(i):
                h, last = _fp8_round_trip(want[i], torch.float32)
                torch.testing.assert_close(ex.hidden, h, rtol=0, atol=0)
                torch.testing.assert_close(ex.last_hidden, last, rtol=0, atol=0)
                # e4m3 keeps 3 mantissa bits: within 1/16 of each position's largest value
                amax = want[i].hidden.abs().amax(dim=-1, keepdim=True)
                assert bool(((ex.hidden - want[i].hidden).abs() <= amax / 16 + 1e-12).all())
            else:
                torch.testing.assert_close(ex.hidden, want[i].hidden, rtol=1e-6, atol=1e-6)
    kept = [i for i in range(len(rows)) if hs.kept(i)]
    assert sorted(hs._mem) == kept
    passes = []
    real = D.dequantize_fp8
    monkeypatch.setattr(D, "dequantize_fp8", lambda *a: passes.append(a[0].shape[0]) or real(*a))
    together = hs.get_many(kept + kept[:1])
    assert passes == [sum(len(rows[i]) for i in kept)] * 2  # a row asked for twice crosses once
    for i, ex in zip(kept + kept[:1], together):
        alone = hs.get(i)
        for f in ("input_ids", "document_ids", "loss_mask", "hidden", "last_hidden"):
            assert torch.equal(getattr(ex, f), getattr(alone, f)), f
    for i in kept:
        ex, scales = hs._mem[i]
        assert ex.hidden.dtype == ex.last_hidden.dtype == torch.float8_e4m3fn
        assert scales.dtype == torch.float32 and scales.shape == (len(rows[i]), 2)


def test_an_fp8_cache_fills_the_same_from_batched_passes_and_a_background_thread(rng):
    """The GPU warm-up's batched passes (run here on the CPU through the same method) and CPU's
    background thread keep the same fp8 rows as row-by-row use, to the float rounding of the
    passes, and give them back dequantized."""
    from peagle_ext.train.hidden import HiddenStates

    model = _tiny_model("llama", 300).double()
    rows = [D.pack_conversations(_rand_tokenized(rng, 4, 1, 30), 96, pad_token_id=0)[0] for _ in range(3)]
    ids = [1, 2, 3]
    one = HiddenStates(model, ids, rows, cache=True, store_dtype=torch.float64, device="cpu", fp8=True)
    want = [one.get(i) for i in range(3)]
    warm = HiddenStates(model, ids, rows, cache=True, store_dtype=torch.float64, device="cpu", fp8=True)
    warm.device = torch.device("cuda")  # warm() batches for a GPU verifier (none is touched here)
    warm.warm("test", progress=False)
    warm.device = torch.device("cpu")
    bg = HiddenStates(model, ids, rows, cache=True, store_dtype=torch.float64, device="cpu", fp8=True)
    bg.start_background([2, 0, 1])
    try:
        got_bg = [bg.get(i) for i in range(3)]
    finally:
        bg.stop_background()
    for hs_rows in ([warm.get(i) for i in range(3)], got_bg):
        for ex, w in zip(hs_rows, want):
            assert ex.hidden.dtype == torch.float64
            # one fp8 step apart at most where the passes' rounding crosses a rounding boundary
            amax = w.hidden.abs().amax(dim=-1, keepdim=True)
            assert bool(((ex.hidden - w.hidden).abs() <= amax / 16 + 1e-9).all())
    assert all(isinstance(v, tuple) for v in warm._mem.values())


@requires_cuda
def test_an_fp8_caches_rows_are_dequantized_on_the_gpu(rng):
    """On a GPU the fp8 rows cross in fp8 and are dequantized there: the values the host would give."""
    from peagle_ext.train.hidden import HiddenStates

    model = _tiny_model("llama", 300).cuda()
    rows = [D.pack_conversations(_rand_tokenized(rng, 4, 1, 30), 96, pad_token_id=0)[0] for _ in range(3)]
    hs = HiddenStates(model, [1, 2, 3], rows, cache=True, store_dtype=torch.bfloat16, device="cuda", fp8=True)
    hs.warm("test", progress=False)
    got = hs.get_many([2, 0])
    hs.device = "cpu"
    on_host = hs.get_many([2, 0])
    for ex, h in zip(got, on_host):
        assert ex.hidden.device.type == "cuda" and ex.hidden.dtype == torch.bfloat16
        for f in ("input_ids", "document_ids", "loss_mask", "hidden", "last_hidden"):
            assert torch.equal(getattr(ex, f).cpu(), getattr(h, f)), f


@requires_cuda
def test_a_partial_caches_recomputed_rows_stay_on_the_gpu(rng):
    """On a GPU, get_many keeps the rows it recomputes (not kept) on the device, in store_dtype,
    and the kept ones in host memory; side by side on the device they equal the rows brought to
    the host and put together there."""
    from peagle_ext.train.dataset import concat_examples, examples_to
    from peagle_ext.train.hidden import HiddenStates

    model = _tiny_model("llama", 300).cuda()
    rows = [D.pack_conversations(_rand_tokenized(rng, 4, 1, 30), 96, pad_token_id=0)[0] for _ in range(5)]
    hs = HiddenStates(model, [1, 2, 3], rows, cache=2, store_dtype=torch.bfloat16, device=torch.device("cuda"))
    idx = [4, 0, 3, 1]
    got = hs.get_many(idx)
    for i, ex in zip(idx, got):
        assert ex.hidden.dtype == ex.last_hidden.dtype == torch.bfloat16
        assert ex.hidden.device.type == ("cpu" if hs.kept(i) else "cuda")
    on_host = [ex.to("cpu") for ex in got]
    want, mine = concat_examples(on_host).to("cuda"), examples_to(got, "cuda")
    for f in ("input_ids", "document_ids", "loss_mask", "hidden", "last_hidden"):
        assert torch.equal(getattr(mine, f), getattr(want, f)), f


def test_cache_warmed_in_batched_passes_equals_row_by_row(rng, monkeypatch):
    """On a GPU, HiddenStates.warm fills the cache with one batched verifier pass per WARM_ROWS
    rows: the same examples as computing each row alone (to float rounding), every row cached
    once, the passes as many as the chunks. Run here on the CPU through the same method."""
    from peagle_ext.train.hidden import HiddenStates

    model = _tiny_model("llama", 300).double()
    rows = [D.pack_conversations(_rand_tokenized(rng, 4, 1, 30), 96, pad_token_id=0)[0] for _ in range(5)]
    ids = [1, 2, 3]
    cached = HiddenStates(model, ids, rows, cache=True, store_dtype=torch.float64, device=torch.device("cpu"))
    cached.WARM_ROWS = 2
    calls = []
    real = D.verifier_hidden_states_many
    monkeypatch.setattr(D, "verifier_hidden_states_many", lambda *a, **k: calls.append(len(a[1])) or real(*a, **k))
    cached.get(3)  # a row already cached is not computed again
    calls.clear()
    cached.device = torch.device("cuda")  # warm() batches for a GPU verifier (none is touched here)
    cached.warm("test", progress=False)
    assert calls == [2, 2] and sorted(cached._mem) == [0, 1, 2, 3, 4]
    assert cached.warm_seconds["verifier"] > 0 and cached.warm_seconds["to_host"] > 0  # the log's split
    alone = HiddenStates(model, ids, rows, cache=False, store_dtype=torch.float64, device=torch.device("cpu"))
    for i in range(len(rows)):
        ex, want = cached.get(i), alone.get(i)
        assert torch.equal(ex.input_ids, want.input_ids) and torch.equal(ex.loss_mask, want.loss_mask)
        torch.testing.assert_close(ex.hidden, want.hidden, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ex.last_hidden, want.last_hidden, rtol=1e-12, atol=1e-12)


def test_warm_passes_are_sized_by_the_bytes_of_their_states(rng, monkeypatch):
    """Without WARM_ROWS a warm-up pass takes the rows whose states fill WARM_STATE_BYTES (the
    longest row x (aux layers + last) x hidden x the verifier's element size), at least one, and
    caches the same states as row by row."""
    from peagle_ext.train.hidden import HiddenStates

    model = _tiny_model("llama", 300).double()
    rows = [D.pack_conversations(_rand_tokenized(rng, 4, 1, 30), 96, pad_token_id=0)[0] for _ in range(7)]
    ids = [1, 2, 3]
    per_row = 96 * (len(ids) + 1) * model.config.hidden_size * 8
    cached = HiddenStates(model, ids, rows, cache=True, store_dtype=torch.float64, device=torch.device("cpu"))
    cached.WARM_STATE_BYTES = 3 * per_row + per_row // 2
    assert cached.warm_rows_per_pass() == 3
    cached.WARM_STATE_BYTES = per_row // 2
    assert cached.warm_rows_per_pass() == 1
    cached.WARM_ROWS = 5
    assert cached.warm_rows_per_pass() == 5
    cached.WARM_ROWS, cached.WARM_STATE_BYTES, cached.WARM_TOKENS = None, 3 * per_row, 40
    calls = []
    real = D.verifier_hidden_states_many
    monkeypatch.setattr(D, "verifier_hidden_states_many", lambda *a, **k: calls.append((len(a[1]), k)) or real(*a, **k))
    cached.device = torch.device("cuda")  # warm() batches for a GPU verifier (none is touched here)
    cached.warm("test", progress=False)
    assert calls == [(3, {"token_budget": 40})] * 2 + [(1, {"token_budget": 40})]
    alone = HiddenStates(model, ids, rows, cache=False, store_dtype=torch.float64, device=torch.device("cpu"))
    for i in range(len(rows)):
        torch.testing.assert_close(cached.get(i).hidden, alone.get(i).hidden, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(cached.get(i).last_hidden, alone.get(i).last_hidden, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_examples_to_host_equals_row_by_row(rng, device):
    """examples_to_host (the cache warm-up's one copy per field for a pass's rows) gives every
    row what TrainingExample.to("cpu", dtype) gives it alone: the same values and dtypes, rows of
    different lengths split at the right places, each a contiguous host tensor of its own length
    (from a GPU through pinned memory, the result itself pageable)."""
    from peagle_ext.data import examples_to_host

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    exs = []
    for n in (7, 1, 12):
        exs.append(
            D.TrainingExample(
                input_ids=torch.randint(0, 100, (n,), generator=rng),
                document_ids=torch.randint(-1, 3, (n,), generator=rng).to(torch.int32),
                loss_mask=torch.rand(n, generator=rng) > 0.5,
                hidden=torch.randn(n, 6, generator=rng, dtype=torch.float64),
                last_hidden=torch.randn(n, 2, generator=rng, dtype=torch.float64),
            ).to(device)
        )
    for dtype in (torch.float64, torch.bfloat16):
        got = examples_to_host(exs, dtype)
        assert len(got) == len(exs)
        for ex, g in zip(exs, got):
            want = ex.to("cpu", dtype)
            for f in ("input_ids", "document_ids", "loss_mask", "hidden", "last_hidden"):
                a, b = getattr(g, f), getattr(want, f)
                assert a.device.type == "cpu" and not a.is_pinned(), f
                assert a.dtype == b.dtype and a.is_contiguous() and torch.equal(a, b), f
    assert examples_to_host([], torch.bfloat16) == []


def test_default_aux_layer_ids():
    assert D.default_aux_layer_ids(30) == [2, 15, 27]
    assert D.default_aux_layer_ids(5) == [2, 2, 2]
    assert D.default_aux_layer_ids(2) == [1, 1, 0]
    with pytest.raises(ValueError):
        D.default_aux_layer_ids(0)


# ----------------------------------------------------------------------------------------------
# EAGLE shift


def test_eagle_shift_worked_example():
    a, b, c, d_, e, PAD = 11, 12, 13, 14, 15, 99
    packed = D.PackedSequence(
        torch.tensor([a, b, c, d_, e, PAD]),
        torch.tensor([0, 0, 0, 1, 1, -1], dtype=torch.int32),
        torch.tensor([0, 1, 1, 0, 1, 0], dtype=torch.bool),
        pad_token_id=PAD,
    )
    g = torch.arange(1, 7, dtype=torch.float32)[:, None].repeat(1, 4)  # g_p = p + 1
    y = 10 * torch.arange(1, 7, dtype=torch.float32)[:, None].repeat(1, 2)  # y_p = 10 (p + 1)
    ex = D.eagle_shift(packed, g, y)
    assert ex.input_ids.tolist() == [b, c, PAD, e, PAD, PAD]
    assert ex.document_ids.tolist() == [0, 0, -1, 1, -1, -1] and ex.document_ids.dtype == torch.int32
    assert ex.hidden[:, 0].tolist() == [1, 2, 0, 4, 0, 0]  # g0 g1 0 g3 0 0
    assert ex.last_hidden[:, 0].tolist() == [20, 30, 0, 50, 0, 0]  # y1 y2 0 y4 0 0
    assert ex.loss_mask.tolist() == [True, True, False, True, False, False]
    assert ex.num_loss_tokens == 3


def test_eagle_shift_random_vs_loop(rng):
    tokenized = _rand_tokenized(rng, 9, 1, 30)
    row = D.pack_conversations(tokenized, 128, pad_token_id=1)[0]
    N = len(row)
    aux = torch.randn(N, 6, generator=rng)
    last = torch.randn(N, 2, generator=rng)
    ex = D.eagle_shift(row, aux, last)
    doc = row.document_ids.tolist()
    for p in range(N):
        ok = p + 1 < N and doc[p] >= 0 and doc[p + 1] == doc[p]
        if ok:
            assert ex.input_ids[p] == row.input_ids[p + 1] and ex.document_ids[p] == doc[p]
            assert bool(ex.loss_mask[p]) == bool(row.loss_mask[p + 1])
            assert torch.equal(ex.hidden[p], aux[p]) and torch.equal(ex.last_hidden[p], last[p + 1])
        else:
            assert ex.input_ids[p] == 1 and ex.document_ids[p] == -1 and not ex.loss_mask[p]
            assert not ex.hidden[p].any() and not ex.last_hidden[p].any()
    with pytest.raises(ValueError, match="aux"):
        D.eagle_shift(row, aux[1:], last)


# ----------------------------------------------------------------------------------------------
# Offline cache


def test_hidden_state_cache_roundtrip_resume_corruption(tmp_path, rng, monkeypatch):
    model = _tiny_model("llama", 300)
    rows = D.pack_conversations(_rand_tokenized(rng, 20, 5, 40), 64, pad_token_id=0)
    assert len(rows) >= 5
    ids = [1, 3]
    cache = D.HiddenStateCache(tmp_path / "c", meta={"verifier": "tiny", "aux": ids})
    assert cache.generate(model, rows, ids, rows_per_shard=2) == (len(rows) + 1) // 2
    cache = D.HiddenStateCache(tmp_path / "c", meta={"verifier": "tiny", "aux": ids})  # reopen
    got = list(cache)
    assert len(got) == len(rows) == len(cache)
    for p, ex in zip(rows, got):
        want = D.eagle_shift(p, *D.verifier_hidden_states(model, p, ids))
        for f in ("input_ids", "document_ids", "loss_mask", "hidden", "last_hidden"):
            assert torch.equal(getattr(ex, f), getattr(want, f)), f

    # Resume: a shard whose file vanished (crash before/after) is regenerated, the others skipped.
    cache.shard_path(1).unlink()
    calls = []
    real = D.verifier_hidden_states
    monkeypatch.setattr(
        "peagle_ext.data.hidden_states.verifier_hidden_states", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    cache.generate(model, rows, ids, rows_per_shard=2)
    assert len(calls) == 2  # exactly the two rows of shard 1
    assert len(list(cache)) == len(rows)

    # Corruption: one flipped byte is detected on read.
    path = cache.shard_path(0)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(D.DataError, match="corrupted"):
        cache.read_shard(0)
    # Other settings / other data in the same directory are refused.
    with pytest.raises(D.DataError, match="different settings"):
        D.HiddenStateCache(tmp_path / "c", meta={"verifier": "other", "aux": ids})
    with pytest.raises(D.DataError, match="other data"):
        cache.generate(model, rows[:-1], ids, rows_per_shard=2)
    index = json.loads((tmp_path / "c" / "index.json").read_text())
    assert set(index["shards"]) == {str(i) for i in range(cache.num_shards)}
    assert not [p for p in (tmp_path / "c").iterdir() if p.name.endswith(".tmp")]


def test_hidden_state_cache_batched_generation_equals_row_by_row(tmp_path, rng, monkeypatch):
    """generate(batched=True) (the default on a GPU): several shards' rows in one verifier pass,
    one copy per field to the host; the same shards, rows and storage dtype as row by row, the
    states equal to float rounding, after_shard called for every shard in order, and a resume
    recomputes only the missing shard's rows."""
    model = _tiny_model("llama", 300).double()
    rows = D.pack_conversations(_rand_tokenized(rng, 20, 5, 40), 64, pad_token_id=0)
    ids = [1, 3]
    per_row = 64 * (len(ids) + 1) * model.config.hidden_size * 8
    monkeypatch.setattr(D.hidden_states, "PASS_STATE_BYTES", 5 * per_row)  # 2 shards of 2 rows a pass
    monkeypatch.setattr(D.hidden_states, "PASS_TOKENS", 80)
    alone = D.HiddenStateCache(tmp_path / "alone", meta={"aux": ids})
    n = alone.generate(model, rows, ids, rows_per_shard=2, batched=False)
    passes, done = [], []
    real = D.hidden_states.verifier_hidden_states_many
    monkeypatch.setattr(
        D.hidden_states, "verifier_hidden_states_many", lambda *a, **k: passes.append(len(a[1])) or real(*a, **k)
    )
    batched = D.HiddenStateCache(tmp_path / "batched", meta={"aux": ids})
    assert batched.generate(model, rows, ids, rows_per_shard=2, batched=True, after_shard=done.append) == n
    assert done == list(range(n)) and passes[0] == 4 and sum(passes) == len(rows)
    assert batched.index["storage"] == alone.index["storage"]
    for i in range(n):
        a, b = alone.read_shard(i), batched.read_shard(i)
        assert len(a) == len(b)
        for x, y in zip(a, b):
            for f in ("input_ids", "document_ids", "loss_mask"):
                assert torch.equal(getattr(x, f), getattr(y, f)), f
            for f in ("hidden", "last_hidden"):
                assert getattr(x, f).dtype == getattr(y, f).dtype
                torch.testing.assert_close(getattr(y, f), getattr(x, f), rtol=1e-12, atol=1e-12)
    batched.shard_path(1).unlink()
    batched = D.HiddenStateCache(tmp_path / "batched", meta={"aux": ids})
    passes.clear()
    batched.generate(model, rows, ids, rows_per_shard=2, batched=True)
    assert passes == [2] and len(list(batched)) == len(rows)


# ----------------------------------------------------------------------------------------------
# Verifier paths and loading


def test_resolve_and_load_verifier(tiny_dir, tmp_path):
    assert D.resolve_verifier_path(str(tiny_dir)) == tiny_dir
    model, tok = D.load_verifier(str(tiny_dir))
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert tok.chat_template == CHATML
    m16, _ = D.load_verifier(str(tiny_dir), dtype=torch.bfloat16)
    row = D.PackedSequence(
        torch.tensor([5, 6, 7, 0]),
        torch.tensor([0, 0, 0, -1], dtype=torch.int32),
        torch.tensor([0, 1, 1, 0], dtype=torch.bool),
    )
    aux, last = D.verifier_hidden_states(m16, row, [1, 2])
    assert aux.dtype == last.dtype == torch.bfloat16
    aux32, last32 = D.verifier_hidden_states(model, row, [1, 2])
    torch.testing.assert_close(last.float(), last32, rtol=0.05, atol=0.05)

    with pytest.raises(D.DataError, match="not found"):
        D.resolve_verifier_path(str(tmp_path / "nope"))
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(D.DataError, match="not a directory"):
        D.resolve_verifier_path(str(f))
    for missing, pattern in [
        ("config.json", "config.json"),
        ("model.safetensors", "weights"),
        ("tokenizer.json", "tokenizer"),
    ]:
        d = tmp_path / f"no-{missing}"
        d.mkdir()
        for p in tiny_dir.iterdir():
            if p.name != missing and not (missing == "tokenizer.json" and p.name.startswith("tokenizer")):
                (d / p.name).write_bytes(p.read_bytes())
        with pytest.raises(D.DataError, match=pattern):
            D.resolve_verifier_path(str(d))
    with pytest.raises(D.DataError, match="empty"):
        D.resolve_verifier_path("")

    no_tmpl = tmp_path / "no-template"
    no_tmpl.mkdir()
    for p in tiny_dir.iterdir():
        (no_tmpl / p.name).write_bytes(p.read_bytes())
    for p in no_tmpl.glob("chat_template*"):
        p.unlink()
    cfg = no_tmpl / "tokenizer_config.json"
    c = json.loads(cfg.read_text())
    c.pop("chat_template", None)
    cfg.write_text(json.dumps(c))
    with pytest.raises(D.DataError, match="no chat template"):
        D.load_verifier(str(no_tmpl))


def test_gguf_conversion_failure_leaves_nothing(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"GGUF but not really")
    out = tmp_path / "cache" / "conv"
    with pytest.raises(D.DataError, match="cannot convert GGUF"):
        D.resolve_verifier_path(str(bogus), cache_dir=str(out))
    assert not out.exists()
    assert list((tmp_path / "cache").iterdir()) == []  # no temporary directory left behind
    with pytest.raises(D.DataError, match="GGUF file not found"):
        D.resolve_verifier_path(str(tmp_path / "missing.gguf"))


@pytest.mark.slow
def test_smollm2_real_verifier(tmp_path):
    """Converts the packaged SmolLM2 GGUF (timed), reloads from the cache, and checks the model."""
    import time

    out = tmp_path / "smollm2"
    t0 = time.perf_counter()
    path = D.resolve_verifier_path("smollm2", cache_dir=str(out))
    convert_s = time.perf_counter() - t0
    written = (path / "model.safetensors").stat().st_mtime_ns
    assert D.resolve_verifier_path("smollm2", cache_dir=str(out)) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == written  # cached: no second conversion
    assert (path / "model.safetensors").is_file() and (path / "chat_template.jinja").is_file()
    model, tok = D.load_verifier("smollm2", cache_dir=str(out))
    print(f"\nSmolLM2 GGUF -> safetensors conversion: {convert_s:.1f} s")
    cfg = model.config
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == ("llama", 576, 30, 49152)
    assert "<|im_start|>assistant" in tok.chat_template
    # The dequantized weights are the real model: it answers a trivial question correctly.
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    gen = model.generate(**enc, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(gen[0, enc["input_ids"].shape[1] :])
    # Hidden states of a real conversation: last is pre-norm, documents independent.
    conv = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there!"}]
    tokd, _ = D.tokenize_conversations(tok, [conv, CONV], max_len=256)
    row = D.pack_conversations(tokd, 256, pad_token_id=tok.pad_token_id)[0]
    aux, last = D.verifier_hidden_states(model, row, D.default_aux_layer_ids(30))
    s, e = row.document_spans()[1]
    logits = model(input_ids=row.input_ids[s:e][None]).logits[0]
    torch.testing.assert_close(model.lm_head(model.model.norm(last[s:e])), logits, rtol=1e-4, atol=1e-3)
