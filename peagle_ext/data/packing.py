"""Packing of tokenized conversations into fixed-length rows with document ids."""

from __future__ import annotations

import bisect
import logging

import torch

from .records import DataError, PackedSequence

log = logging.getLogger("peagle_ext.data")


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
            raise ValueError(
                f"tokenized[{k}]: input_ids and loss_mask lengths differ ({ids.numel()} vs {mask.numel()})"
            )
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
            input_ids[p : p + n] = ids
            document_ids[p : p + n] = d
            loss_mask[p : p + n] = mask
            p += n
        out.append(PackedSequence(input_ids, document_ids, loss_mask, pad_token_id))
    return out
