"""The records of the data pipeline: a packed row before the EAGLE shift, a training example after it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class DataError(ValueError):
    """A data set, verifier directory or cache is unusable; the message says which and why."""


@dataclass
class PackedSequence:
    """One packed training row of length N (before the EAGLE shift).

    input_ids    int64 [N]  token ids; padding positions hold `pad_token_id`
    document_ids int32 [N]  0, 1, 2, ... per conversation in the row, -1 = padding
    loss_mask    bool  [N]  True on assistant tokens (see tokenize_conversation)
    pad_token_id int        the id written at padding positions (eagle_shift reuses it)
    """

    input_ids: torch.Tensor
    document_ids: torch.Tensor
    loss_mask: torch.Tensor
    pad_token_id: int = 0

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def document_spans(self) -> list[tuple[int, int]]:
        """[start, end) of every document in row order (padding excluded)."""
        return _document_spans(self.document_ids)


@dataclass
class TrainingExample:
    """One row after the EAGLE shift (docs/design.md section 1), what the draft model trains on.

    input_ids    int64 [N]         token p+1 at index p
    document_ids int32 [N]         -1 = padding (incl. each document's last position, see eagle_shift)
    loss_mask    bool  [N]         whether the target at index p is trained on
    hidden       [N, n_aux*H]      verifier aux hidden states of position p
    last_hidden  [N, H]            verifier last hidden state (PRE final norm) of position p+1
    """

    input_ids: torch.Tensor
    document_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden: torch.Tensor
    last_hidden: torch.Tensor

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def to(self, device=None, dtype: torch.dtype | None = None, non_blocking: bool = False) -> TrainingExample:
        """Move every tensor to `device`; cast only the two hidden-state tensors to `dtype`.
        non_blocking: asynchronous copies from pinned host memory (the caller orders the streams)."""
        nb = non_blocking
        return TrainingExample(
            input_ids=self.input_ids.to(device, non_blocking=nb),
            document_ids=self.document_ids.to(device, non_blocking=nb),
            loss_mask=self.loss_mask.to(device, non_blocking=nb),
            hidden=self.hidden.to(device=device, dtype=dtype, non_blocking=nb),
            last_hidden=self.last_hidden.to(device=device, dtype=dtype, non_blocking=nb),
        )


_EXAMPLE_FIELDS = ("input_ids", "document_ids", "loss_mask", "hidden", "last_hidden")


def examples_to_host(examples: list[TrainingExample], dtype: torch.dtype | None = None) -> list[TrainingExample]:
    """TrainingExamples (on one device) -> the same on the host, the two hidden-state tensors cast
    to dtype (None: kept). Each field of all of them crosses in one copy, then is split back into
    per-row views of that copy: from a GPU, five copies for all the rows instead of five per row,
    each of which waits for the device (16 rows of 2048 SmolLM2 positions took 89 ms tensor by
    tensor on an H100, 13 ms as one copy). From a GPU each copy goes through a pinned block
    (`_to_host_via_pinned`). The values are the bits TrainingExample.to("cpu", dtype) gives."""
    if not examples:
        return []
    sizes = [len(ex) for ex in examples]
    moved = {}
    for f in _EXAMPLE_FIELDS:
        parts = [getattr(ex, f) for ex in examples]
        one = parts[0] if len(parts) == 1 else torch.cat(parts)
        cast = dtype if f in ("hidden", "last_hidden") else None
        moved[f] = _to_host_via_pinned(one if cast is None else one.to(cast)).split(sizes)
    return [TrainingExample(**{f: moved[f][j] for f in _EXAMPLE_FIELDS}) for j in range(len(examples))]


def _to_host_via_pinned(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t` in pageable memory, from a GPU through a pinned block. A device copy into
    fresh pageable memory goes at the rate the host faults its pages in, inside the driver (about
    2.4 GB/s in the warm-up's profile on an H100); a copy into pinned memory goes at the link's
    rate, and the host-side copy after it faults the pages in on torch's threads: a fifth less
    time for the warm-up's copies on an H100 (bench/bench_hidden_states.py). The pinned block
    returns to torch's caching host allocator and serves the next call. The result is pageable:
    the cache it fills holds tens of GB, more than pinning should take from the host."""
    if t.device.type != "cuda":
        return t.to("cpu")
    staged = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    staged.copy_(t)  # synchronous: the host copy below reads finished data
    return torch.empty(t.shape, dtype=t.dtype).copy_(staged)


def _document_spans(document_ids: torch.Tensor) -> list[tuple[int, int]]:
    """Maximal runs of equal, non-negative document ids, as [start, end) pairs."""
    doc = document_ids.tolist()
    spans: list[tuple[int, int]] = []
    start = None
    for i, d in enumerate(doc):
        if start is not None and d != doc[start]:
            spans.append((start, i))
            start = None
        if start is None and d >= 0:
            start = i
    if start is not None:
        spans.append((start, len(doc)))
    return spans
