"""Repetition loops in generated answers.

A small verifier decoding greedily often falls into a loop: it repeats a phrase or a line until
the token cap. Such a tail is trivial to draft once it has gone round once, so answers that loop
inflate a drafter's validation accuracy and spend its training steps on easy positions. These
checks find them in text (datagen's answers, a dataset's assistant turns) so that the caller can
count them or pick another answer.
"""

from __future__ import annotations

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
