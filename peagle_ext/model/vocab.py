"""The draft vocabulary (d2t / t2d from token frequencies) and the choice of the MASK token id."""

from __future__ import annotations

import torch


def build_vocab_mapping(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) from token frequencies (speculators' rule): the draft vocab is the
    `draft_vocab_size` most frequent ids (ties to the lower id), topped up with the lowest unseen
    ids, sorted; d2t[i] = target_id(i) - i; t2d[target] = True for the kept ids."""
    counts = torch.as_tensor(token_counts).long().cpu()
    v = counts.shape[0]
    if not 1 <= draft_vocab_size <= v:
        raise ValueError(f"draft_vocab_size must be in [1, {v}], got {draft_vocab_size}")
    seen = (counts > 0).nonzero().flatten()
    order = sorted(seen.tolist(), key=lambda t: (-int(counts[t]), t))[:draft_vocab_size]
    chosen = set(order)
    t = 0
    while len(order) < draft_vocab_size:
        if t not in chosen:
            order.append(t)
            chosen.add(t)
        t += 1
    ids = torch.tensor(sorted(order), dtype=torch.long)
    d2t = ids - torch.arange(draft_vocab_size)
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def resolve_mask_token_id(tokenizer, vocab_size: int, requested: int | None = None) -> tuple[int, str]:
    """(mask_token_id, how). An explicit id must be in [0, vocab_size]; else the tokenizer's own
    mask token; else an id no tokenizer string maps to: len(tokenizer) when the embedding has an
    unused row there, else vocab_size (the drafter's embedding grows by one)."""
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or not 0 <= requested <= vocab_size:
            raise ValueError(f"mask_token_id must be an int in [0, {vocab_size}], got {requested!r}")
        return requested, "given"
    mid = getattr(tokenizer, "mask_token_id", None)
    if mid is not None and 0 <= int(mid) < vocab_size:
        return int(mid), "the tokenizer's mask token"
    n = len(tokenizer)
    if n < vocab_size:
        return n, f"an unused embedding row: the tokenizer has {n} tokens"
    return vocab_size, f"a new id past the vocab of {vocab_size}: the drafter's embedding grows by one"
