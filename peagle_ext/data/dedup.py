"""Duplicate conversations and a held-out split that shares no prompt with the rest.

Chat dumps repeat themselves: 1,815 of ShareGPT's 17,392 usable conversations open with a prompt
(system message and first user turn) that an earlier one already has ("continue" opens 247), and
a dataset whose answers were regenerated greedily by the verifier turns every repeated prompt into
an identical conversation. An identical conversation teaches nothing new, and one that lands on
both sides of a random split makes validation accuracy measure recall, not drafting: in the first
turns of ShareGPT with a 2% split, 19% of the validation conversations open with a prompt that the
training side also has.

    kept, n_dropped = drop_duplicates(convs)               # exact copies, first one kept
    held = disjoint_held_out(kept, n_held, seed)           # index set; no prompt on both sides
"""

from __future__ import annotations

import hashlib
import json
import random
import re

_SPACE = re.compile(r"\s+")


def _message_key(m: dict) -> str:
    return json.dumps(m, sort_keys=True, ensure_ascii=False, default=str)


def conversation_key(conv) -> str:
    """Equal for conversations that render identically: every message field and the tool
    definitions (a Conversation's `tools`)."""
    tools = getattr(conv, "tools", None)
    return json.dumps([_message_key(m) for m in conv] + [_message_key({"tools": tools})], ensure_ascii=False)


def prompt_key(conv) -> str:
    """The messages up to and including the first user turn, text case-folded and whitespace
    collapsed: conversations that open with the same question share it."""
    parts = []
    for m in conv:
        text = m.get("content")
        text = _SPACE.sub(" ", text).strip().casefold() if isinstance(text, str) else ""
        parts.append(m.get("role", "") + ":" + text)
        if m.get("role") == "user":
            break
    return "\n".join(parts)


def _digest(key: str) -> bytes:  # 16 bytes per conversation held, not its whole text
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def drop_duplicates(convs: list) -> tuple[list, int]:
    """The conversations without exact copies of an earlier one (order kept), and how many were
    dropped."""
    seen: set[bytes] = set()
    kept = []
    for c in convs:
        k = _digest(conversation_key(c))
        if k not in seen:
            seen.add(k)
            kept.append(c)
    return kept, len(convs) - len(kept)


def disjoint_held_out(convs: list, n_held: int, seed: int) -> set[int]:
    """Indices of up to n_held conversations such that no other conversation shares a prompt_key
    with one of them. Prompt groups are visited in a seeded random order and taken whole while
    they fit, so the result has exactly n_held indices unless the groups that remain cannot make
    up the rest (then fewer: a group never straddles the split)."""
    if n_held <= 0:
        return set()
    groups: dict[bytes, list[int]] = {}
    for i, c in enumerate(convs):
        groups.setdefault(_digest(prompt_key(c)), []).append(i)
    order = list(groups.values())  # first-appearance order: deterministic before the shuffle
    random.Random(seed).shuffle(order)
    held: set[int] = set()
    for g in order:
        if len(held) + len(g) <= n_held:
            held.update(g)
            if len(held) == n_held:
                break
    return held
