"""Chat-template tokenization with assistant-only loss masks."""

from __future__ import annotations

import bisect
import logging
import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import torch

from .records import DataError

log = logging.getLogger("peagle_ext.data")


def _common_prefix_len(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    # Strings: compare in big blocks first (long conversations make this loop the hot spot).
    step = 256
    while i + step <= n and a[i : i + step] == b[i : i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _render(tokenizer, messages, *, add_generation_prompt: bool, tools=None, template_kwargs=None) -> str:
    try:
        return tokenizer.apply_chat_template(
            list(messages),
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **(template_kwargs or {}),
        )
    except Exception as e:  # jinja raises TemplateError, TypeError, ... for what a template refuses
        raise DataError(f"the chat template cannot render this conversation: {type(e).__name__}: {e}") from None


def _assistant_footer(tokenizer, tools, template_kwargs) -> str:
    """What the template writes after an assistant turn's text (e.g. "<|im_end|>\n"): the common
    tail of two renders that differ only in the assistant's last character."""
    a, b = (
        _render(
            tokenizer,
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "footer probe " + c}],
            add_generation_prompt=False,
            tools=tools,
            template_kwargs=template_kwargs,
        )
        for c in "AB"
    )
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return a[len(a) - n :] if n else ""


def assistant_char_spans(tokenizer, messages, *, tools=None, template_kwargs=None) -> tuple[str, list[tuple[int, int]]]:
    """Render `messages` with the tokenizer's chat template and find each assistant turn's
    character span [start, end) in the rendered text, by incremental prefix rendering:

      start = end of render(messages[:j], add_generation_prompt=True)   (the "<assistant>\n" header
              is context, like at inference where the server writes it)
      end   = end of render(messages[:j+1])                             (reasoning, tool calls,
              content and end-of-turn tokens such as "<|im_end|>\n", which the model must learn
              to emit)

    Everything between is what the assistant generates: its reasoning when the template renders
    it, its tool calls and its text. Tool results, user and system text are never inside a span.
    When the template is not prefix-stable, the longest common prefix with the full render is
    used, which keeps every span inside the turn (speculators' boundary rule); a template that
    renders the last assistant turn differently from the same turn in the history (Qwen3 shows
    the reasoning, or an empty think block, only after the last user query) starts the span
    after the turn's header (the generation prompt) and ends it at its end-of-turn text (the
    template's assistant footer), found in the full render after the previous turn.
    """
    kw = dict(tools=tools, template_kwargs=template_kwargs)
    full = _render(tokenizer, messages, add_generation_prompt=False, **kw)
    spans = []
    footer = None
    prev_end = 0
    for j, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if j == 0:
            start = 0
        else:
            prompt = _render(tokenizer, messages[:j], add_generation_prompt=True, **kw)
            start = _common_prefix_len(prompt, full)
            if start < len(prompt):
                # the history renders differently once this turn follows it: find this turn's
                # header (the generation prompt, or its longest prefix) after the previous turn
                history = _render(tokenizer, messages[:j], add_generation_prompt=False, **kw)
                header = prompt[_common_prefix_len(history, prompt) :]
                for n in range(len(header), 0, -1):
                    k = full.find(header[:n], max(prev_end, 0))
                    if k >= 0:
                        start = k + n
                        break
        upto = _render(tokenizer, messages[: j + 1], add_generation_prompt=False, **kw)
        end = _common_prefix_len(upto, full)
        if end < len(upto) and j + 1 < len(messages):
            footer = _assistant_footer(tokenizer, tools, template_kwargs) if footer is None else footer
            k = full.find(footer, start) if footer.strip() else -1
            if k >= 0:
                end = k + len(footer)
        if end > start:
            spans.append((start, end))
            prev_end = end
    return full, spans


_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _check_tokenizer(tokenizer):
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
            "set tokenizer.chat_template (conversations are rendered with it)"
        )


def tokenize_conversation(
    tokenizer, messages, *, max_len: int, template_kwargs: dict | None = None, _use_offsets: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Render a conversation with the tokenizer's chat template and tokenize it.

    Returns (input_ids int64 [n], loss_mask bool [n]), n <= max_len. loss_mask is True exactly on
    the tokens of assistant turns: the content plus the end-of-turn tokens the template appends
    (e.g. "<|im_end|>" and its newline), NOT the role header (see assistant_char_spans). A token
    straddling a span edge (BPE merges across it) counts as assistant. Longer conversations are
    truncated to their first max_len tokens (tokenize_conversations counts them).

    The ids equal tokenizer.apply_chat_template(messages, tokenize=True) (the rendered text
    tokenized without extra special tokens). Fast tokenizers map spans via offsets; others by
    tokenizing each prefix (same result for prefix-stable tokenizations). A template that marks
    what the assistant generates with {% generation %} blocks gives the mask itself
    (transformers' return_assistant_tokens_mask). `messages.tools` (a Conversation's tool
    definitions) and `template_kwargs` (e.g. {"enable_thinking": False}) go to the template. A
    conversation the template refuses raises DataError (tokenize_conversations counts them).
    """
    _check_tokenizer(tokenizer)
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 2:
        raise ValueError(f"max_len must be an int >= 2, got {max_len!r}")
    if not isinstance(messages, list) or not messages:
        raise DataError("messages must be a non-empty list of {role, content} dicts")
    tools = getattr(messages, "tools", None)
    if _GENERATION_BLOCK.search(tokenizer.chat_template) and getattr(tokenizer, "is_fast", False):
        try:
            enc = tokenizer.apply_chat_template(
                list(messages),
                tools=tools,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
                **(template_kwargs or {}),
            )
        except Exception as e:
            raise DataError(f"the chat template cannot render this conversation: {type(e).__name__}: {e}") from None
        ids, mask = list(enc["input_ids"])[:max_len], [bool(x) for x in enc["assistant_masks"]][:max_len]
        return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)
    text, spans = assistant_char_spans(tokenizer, messages, tools=tools, template_kwargs=template_kwargs)
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


# below this many conversations a process pool costs more than it saves
PARALLEL_MIN_CONVERSATIONS = 1024
_worker_args: tuple = ()


def _init_worker(tokenizer, max_len, template_kwargs):
    global _worker_args
    # the Rust tokenizer's own thread pool would oversubscribe the cores the processes share
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_args = (tokenizer, max_len, template_kwargs)


def _tokenize_one(msgs):
    tokenizer, max_len, template_kwargs = _worker_args
    try:
        ids, mask = tokenize_conversation(tokenizer, msgs, max_len=max_len, template_kwargs=template_kwargs)
    except DataError as e:
        return str(e)
    return ids.numpy(), mask.numpy()


def tokenize_workers(n: int, workers: int | None = None) -> int:
    """How many processes tokenize_many uses for n conversations (1 = in this process)."""
    if workers is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        # under torchrun every rank on this host tokenizes at once: share the cores among them
        ranks = os.environ.get("LOCAL_WORLD_SIZE", "1")
        workers = min(32, cores // (int(ranks) if ranks.isdigit() and int(ranks) > 0 else 1))
    per_worker = max(1, PARALLEL_MIN_CONVERSATIONS // 4)  # conversations a process is worth starting for
    workers = max(1, min(int(workers), n // per_worker))
    if n < PARALLEL_MIN_CONVERSATIONS or "fork" not in multiprocessing.get_all_start_methods():
        return 1
    return workers


def tokenize_many(tokenizer, conversations, *, max_len: int, template_kwargs: dict | None = None, workers=None):
    """tokenize_conversation of every conversation, in order: (ids, mask) each, or the DataError
    message of a conversation the template refuses. Chat-template rendering is single-threaded
    Python (a few ms a conversation), so large lists are split over `workers` forked processes
    (default: the cores this process may use, shared among the ranks of a torchrun host, at most
    32; 1 = in this process)."""
    _check_tokenizer(tokenizer)
    n = len(conversations)
    workers = tokenize_workers(n, workers)
    if workers == 1:
        out = []
        for msgs in conversations:
            try:
                out.append(tokenize_conversation(tokenizer, msgs, max_len=max_len, template_kwargs=template_kwargs))
            except DataError as e:
                out.append(str(e))
        return out
    ctx = multiprocessing.get_context("fork")  # the tokenizer is inherited, not pickled
    with ProcessPoolExecutor(
        workers, mp_context=ctx, initializer=_init_worker, initargs=(tokenizer, max_len, template_kwargs)
    ) as pool:
        res = list(pool.map(_tokenize_one, conversations, chunksize=64))
    return [r if isinstance(r, str) else (torch.from_numpy(r[0]), torch.from_numpy(r[1])) for r in res]


@dataclass
class TokenizeStats:
    conversations: int = 0
    truncated: int = 0  # longer than max_len: cut to max_len
    dropped_no_loss: int = 0  # no assistant token left (e.g. truncated before the answer)
    unrenderable: int = 0  # the chat template refused the conversation (e.g. roles it cannot alternate)
    tokens: int = 0
    loss_tokens: int = 0
    lengths: list[int] = field(default_factory=list, repr=False)


def tokenize_conversations(
    tokenizer, conversations, *, max_len: int, template_kwargs: dict | None = None
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], TokenizeStats]:
    """tokenize_conversation over a list, dropping results without any loss token and the
    conversations the chat template cannot render, with counts (the caller logs
    `stats.truncated`, `stats.unrenderable` etc.)."""
    out = []
    st = TokenizeStats()
    # Truncation check needs the untruncated length: ask for one more token than allowed.
    for res in tokenize_many(tokenizer, conversations, max_len=max_len + 1, template_kwargs=template_kwargs):
        st.conversations += 1
        if isinstance(res, str):
            st.unrenderable += 1
            log.debug("skipping a conversation: %s", res)
            continue
        ids, mask = res
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
    if st.unrenderable:
        log.warning(
            "%d of %d conversations cannot be rendered by the chat template and were skipped",
            st.unrenderable,
            st.conversations,
        )
    if st.truncated:
        log.warning(
            "%d of %d conversations were longer than %d tokens and were truncated",
            st.truncated,
            st.conversations,
            max_len,
        )
    return out, st
