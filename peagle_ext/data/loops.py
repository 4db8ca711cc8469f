"""Repetition loops in generated answers.

A small verifier decoding greedily often falls into a loop: it repeats a phrase or a line until
the token cap. Such a tail is trivial to draft once it has gone round once, so answers that loop
inflate a drafter's validation accuracy and spend its training steps on easy positions. These
checks find them in text (datagen's answers, a dataset's assistant turns) so that the caller can
count them, pick another answer, or cut the loop off (`cut_loop`: the text up to the end of the
repeated unit's first occurrence, so that the answer keeps the verifier's words and the history a
later turn is generated on does not loop).
"""

from __future__ import annotations

import re
from collections import Counter

MIN_REPEATS = 3  # a period that occurs this many times back to back at the end is a loop
MAX_PERIOD_WORDS = 24  # the longest repeated run of words looked for
MIN_PERIOD_WORDS = 2  # shorter periods ("no, no, no") are too often real text
LINE_SHARE = 0.3  # or: this share of the non-empty lines are lines that occur MIN_REPEATS+ times
MIN_LINE_CHARS = 11  # lines shorter than this ("---", "}") repeat in real text


def loop_period(words: list[str]) -> int:
    """The shortest period p (MIN_PERIOD_WORDS <= p <= MAX_PERIOD_WORDS) whose last p words occur
    at least MIN_REPEATS times back to back at the end of `words`; 0 when there is none."""
    n = len(words)
    for p in range(MIN_PERIOD_WORDS, MAX_PERIOD_WORDS + 1):
        if n < MIN_REPEATS * p:
            break
        tail = words[n - p :]
        if all(words[n - (k + 1) * p : n - k * p] == tail for k in range(1, MIN_REPEATS)):
            return p
    return 0


def repeated_line_share(text: str) -> float:
    """The share of the non-empty lines of `text` that are lines (of MIN_LINE_CHARS or more)
    occurring at least MIN_REPEATS times."""
    lines = [ln.strip() for ln in text.split("\n") if ln.strip()]
    if not lines:
        return 0.0
    counts = Counter(lines)
    repeated = sum(c for ln, c in counts.items() if c >= MIN_REPEATS and len(ln) >= MIN_LINE_CHARS)
    return repeated / len(lines)


def ends_in_loop(text: str) -> bool:
    """Whether an answer ends in a repetition loop: its last words repeat a period of
    MIN_PERIOD_WORDS..MAX_PERIOD_WORDS words MIN_REPEATS times, or LINE_SHARE of its lines are
    one line repeated MIN_REPEATS or more times (a list whose items repeat)."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return loop_period(text.split()) > 0 or repeated_line_share(text) >= LINE_SHARE


def conversation_loops(messages: list[dict]) -> bool:
    """Whether any assistant turn of a conversation ({"role", "content"} messages) ends in a loop."""
    return any(m.get("role") == "assistant" and ends_in_loop(m.get("content") or "") for m in messages)


def _cut_word_loop(text: str) -> str:
    """`text` up to the end of the first occurrence of the period its words end repeating; `text`
    when they end in none."""
    spans = [m.span() for m in re.finditer(r"\S+", text)]
    words = [text[a:b] for a, b in spans]
    p = loop_period(words)
    if p == 0:
        return text
    start = len(words) - p  # walk back to where the periodic tail begins
    while start > 0 and words[start - 1] == words[start - 1 + p]:
        start -= 1
    return text[: spans[start + p - 1][1]]


def _cut_line_loop(text: str) -> str:
    """`text` before the second occurrence of its first line (of MIN_LINE_CHARS or more) that
    occurs MIN_REPEATS or more times; `text` when it holds no such line."""
    lines = text.split("\n")
    counts = Counter(ln.strip() for ln in lines)
    seen: set[str] = set()
    offset = 0
    for ln in lines:
        key = ln.strip()
        if counts[key] >= MIN_REPEATS and len(key) >= MIN_LINE_CHARS:
            if key in seen:
                return text[:offset].rstrip()
            seen.add(key)
        offset += len(ln) + 1
    return text


def cut_loop(text: str) -> str:
    """An answer with its repetition loop cut off: while it ends in a loop (`ends_in_loop`), the
    text up to the end of the repeated unit's first occurrence (a run of words) or before a
    repeated line's second occurrence (a list whose items repeat). A prefix of `text`; `text`
    itself when it does not loop."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    while ends_in_loop(text):
        cut = _cut_word_loop(text) if loop_period(text.split()) else _cut_line_loop(text)
        if len(cut) >= len(text):  # each cut shortens a looping text; this keeps the loop finite regardless
            break
        text = cut
    return text
