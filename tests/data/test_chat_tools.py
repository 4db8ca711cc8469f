"""Loss masks of tool calls, tool results and reasoning, rendered by a tiny tokenizer whose chat
template behaves like Qwen3's (reasoning shown only after the last user query, tool results as
user turns, an empty think block for enable_thinking=False), template options, templates that
refuse a conversation, and templates with {% generation %} blocks."""

import pytest

from peagle_ext import data as D
from peagle_ext.testing import make_tokenizer

# one line, no whitespace control: a newline right after a block tag is written as {{ nl }}
# (transformers renders with trim_blocks, which drops it)
TOOL_TEMPLATE = (
    "{% set nl = '\\n' %}"
    "{% if messages[0].role == 'system' or tools %}<|im_start|>system{{ nl }}"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}"
    "{% if tools %}{{ nl }}# Tools{% for t in tools %}{{ nl }}{{ t | tojson }}{% endfor %}{% endif %}"
    "<|im_end|>{{ nl }}{% endif %}"
    "{% set ns = namespace(last_query=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<|im_start|>user{{ nl }}{{ m.content }}<|im_end|>{{ nl }}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant{{ nl }}"
    "{% if loop.index0 > ns.last_query %}<think>{{ nl }}{{ m.reasoning_content or '' }}{{ nl }}</think>{{ nl }}{{ nl }}"
    "{% endif %}{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ nl }}"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}{{ nl }}</tool_call>'
    "{% endfor %}<|im_end|>{{ nl }}"
    "{% elif m.role == 'tool' %}<|im_start|>user{{ nl }}<tool_response>{{ nl }}{{ m.content }}{{ nl }}"
    "</tool_response><|im_end|>{{ nl }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ nl }}"
    "{% if enable_thinking is defined and not enable_thinking %}<think>{{ nl }}{{ nl }}</think>{{ nl }}{{ nl }}"
    "{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    t = make_tokenizer(tmp_path_factory.mktemp("tok"))
    t.chat_template = TOOL_TEMPLATE
    return t


def masked_runs(tok, ids, mask):
    """The decoded text of each maximal run of loss-masked tokens."""
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


CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
RAW = [
    {"role": "system", "content": "be terse"},
    {"role": "user", "content": "the weather"},
    {"role": "assistant", "content": None, "tool_calls": [CALL], "reasoning_content": "call a tool"},
    {"role": "tool", "tool_call_id": "1", "content": "sunny and hot"},
    {"role": "assistant", "content": "it is sunny", "reasoning": "read the tool"},
    {"role": "user", "content": [{"type": "text", "text": "and "}, {"type": "text", "text": "tomorrow"}]},
    {"role": "assistant", "content": "no idea", "reasoning_content": "no tool for that"},
]


def test_mask_covers_tool_calls_reasoning_and_text_never_tool_output_or_system(tok):
    msgs = D.normalize_messages(RAW)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant", "user", "assistant"]
    assert msgs[5]["content"] == "and tomorrow"  # text parts joined
    assert msgs[4]["reasoning_content"] == "read the tool"  # the `reasoning` alias
    ids, mask = D.tokenize_conversation(tok, msgs, max_len=4096)
    assert ids.tolist() == tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
    runs = masked_runs(tok, ids, mask)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
    # the history turns before the last user query render without their reasoning (the template
    # drops it), the final turn with it: exactly what the assistant generates is trained on
    assert runs == [call, "it is sunny<|im_end|>\n", "<think>\nno tool for that\n</think>\n\nno idea<|im_end|>\n"]
    text = tok.decode(ids[mask])
    for never in ("sunny and hot", "be terse", "the weather", "tomorrow", "<|im_start|>"):
        assert never not in text


def test_reasoning_of_turns_after_the_last_query_is_trained(tok):
    """A tool loop after the last user query: both assistant turns show their reasoning."""
    msgs = D.normalize_messages(RAW[1:5])
    ids, mask = D.tokenize_conversation(tok, msgs, max_len=4096)
    runs = masked_runs(tok, ids, mask)
    assert runs[0].startswith("<think>\ncall a tool\n</think>\n\n<tool_call>")
    assert runs[1] == "<think>\nread the tool\n</think>\n\nit is sunny<|im_end|>\n"
    assert "sunny and hot" not in tok.decode(ids[mask])


def test_template_kwargs_reach_the_template(tok):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    ids, mask = D.tokenize_conversation(tok, msgs, max_len=256)
    assert masked_runs(tok, ids, mask) == ["<think>\n\n</think>\n\nhello<|im_end|>\n"]
    # with thinking off the empty think block is part of the prompt (the server writes it)
    ids, mask = D.tokenize_conversation(tok, msgs, max_len=256, template_kwargs={"enable_thinking": False})
    assert masked_runs(tok, ids, mask) == ["hello<|im_end|>\n"]


def test_tools_of_a_record_are_rendered_as_system_context(tok, tmp_path):
    import json

    p = tmp_path / "t.jsonl"
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    p.write_text(json.dumps({"messages": RAW[1:5], "tools": [tool]}) + "\n")
    (conv,) = D.load_conversations(str(p))
    assert conv.tools == [tool]
    ids, mask = D.tokenize_conversation(tok, conv, max_len=4096)
    full = tok.decode(ids)
    assert "# Tools" in full and "get_weather" in full.split("<|im_end|>")[0]
    assert "# Tools" not in tok.decode(ids[mask])


def test_unrenderable_rows_are_skipped_with_a_count(tok, tmp_path):
    strict = make_tokenizer(tmp_path / "strict")
    strict.chat_template = (
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('tool turns are not supported') }}"
        "{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    ok = [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "c d"}]
    out, st = D.tokenize_conversations(strict, [D.normalize_messages(RAW), ok], max_len=256)
    assert st.unrenderable == 1 and st.conversations == 2 and len(out) == 1
    with pytest.raises(D.DataError, match="cannot render"):
        D.tokenize_conversation(strict, D.normalize_messages(RAW), max_len=256)


def test_generation_blocks_give_the_mask(tmp_path):
    t = make_tokenizer(tmp_path / "gen")
    t.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}\n"
        "{% else %}{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    )
    msgs = [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "c d"}]
    ids, mask = D.tokenize_conversation(t, msgs, max_len=256)
    assert masked_runs(t, ids, mask) == ["c d<|im_end|>"]


def test_non_text_content_parts_are_refused():
    with pytest.raises(D.DataError, match="not text"):
        D.normalize_messages([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])
