"""The training data of a run: conversations -> tokenized, split, packed rows and token counts; the
epoch order; the rows of one micro-batch side by side; the COD seed of each micro-batch."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, fields

import torch

from .. import data as D
from .run_log import RunLog
from .settings import TrainError, TrainSettings


@dataclass
class Dataset:
    train_rows: list  # PackedSequence
    val_rows: list
    token_counts: torch.Tensor
    truncated: int
    dropped: int
    num_train_conversations: int
    num_val_conversations: int


def prepare_data(s: TrainSettings, tokenizer, vocab_size: int, log: RunLog) -> Dataset:
    convs = D.load_conversations(s.data, limit=s.num_conversations, split=s.data_split)
    if not convs:
        raise TrainError(f"--data {s.data}: empty dataset (no conversations)")
    if s.dedup:
        convs, n_dup = D.drop_duplicates(convs)
        if n_dup:
            log.event(
                "duplicates",
                f"{n_dup} conversation(s) identical to an earlier one were skipped (--dedup false keeps them)",
                count=n_dup,
            )
    n_val = int(round(len(convs) * s.val_fraction)) if len(convs) > 1 else 0
    if s.dedup:  # no validation conversation opens with a prompt that training also has
        val_idx = D.disjoint_held_out(convs, n_val, s.seed)
    else:
        order = list(range(len(convs)))
        random.Random(s.seed).shuffle(order)
        val_idx = set(order[:n_val])
    tok_train, tok_val = [], []
    truncated = dropped = unrenderable = 0
    counts = torch.zeros(vocab_size, dtype=torch.long)
    t0 = time.time()
    tokenized = D.tokenize_many(tokenizer, convs, max_len=s.seq_len + 1, template_kwargs=s.chat_template_kwargs)
    dt = time.time() - t0
    log.event(
        "tokenized",
        f"{len(convs)} conversations rendered with the chat template and tokenized in {dt:.1f}s "
        f"({D.tokenize_workers(len(convs))} process(es))",
        seconds=dt,
    )
    for i, res in enumerate(tokenized):
        if isinstance(res, str):
            unrenderable += 1
            continue
        ids, mask = res
        if ids.shape[0] > s.seq_len:
            truncated += 1
            ids, mask = ids[: s.seq_len], mask[: s.seq_len]
        if ids.shape[0] < 2 or not bool(mask[1:].any()):
            dropped += 1
            continue
        if int(ids.max()) >= vocab_size or int(ids.min()) < 0:
            raise TrainError(
                f"conversation {i}: token id {int(ids.max())} is outside the verifier vocab "
                f"({vocab_size}): tokenizer and verifier do not match"
            )
        (tok_val if i in val_idx else tok_train).append((ids, mask))
        if i not in val_idx:
            counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    if truncated:
        log.event(
            "truncated",
            f"{truncated} conversation(s) longer than --seq-len {s.seq_len} were truncated to {s.seq_len} tokens",
            count=truncated,
        )
    if unrenderable:
        log.event(
            "unrenderable",
            f"{unrenderable} conversation(s) the verifier's chat template cannot render were skipped",
            count=unrenderable,
        )
    if dropped:
        log.event("dropped", f"{dropped} conversation(s) without assistant tokens were skipped", count=dropped)
    if not tok_train:
        raise TrainError(f"--data {s.data}: empty dataset after tokenization (no conversation with assistant tokens)")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    train_rows = D.pack_conversations(tok_train, s.seq_len, pad_token_id=pad)
    val_rows = D.pack_conversations(tok_val, s.seq_len, pad_token_id=pad) if tok_val else []
    return Dataset(train_rows, val_rows, counts, truncated, dropped, len(tok_train), len(tok_val))


def concat_examples(examples, pin: bool = False):
    """Packed rows side by side as one sequence; document ids offset so rows never mix.
    The rows are on one device; pin: the result's tensors in pinned host memory (for
    asynchronous copies to a GPU)."""
    if len(examples) == 1 and not pin:
        return examples[0]
    return cat_fields(examples, _offset_documents([ex.document_ids for ex in examples]), pin)


def examples_to(examples, device, pin: bool = False):
    """concat_examples(examples).to(device), value for value, for rows on the host, on `device`,
    or some on each (a partial cache's rows: kept ones on the host, recomputed ones where the
    verifier ran). Host rows cross in one copy per field (pin: from pinned memory, asynchronously:
    the caller orders the streams); rows already on the device stay there instead of a round trip
    through the host."""
    device = torch.device(device)
    on_host = [ex.hidden.device.type == "cpu" for ex in examples]
    if device.type == "cpu" or all(on_host):
        pin = pin and device.type != "cpu"
        return concat_examples(examples, pin=pin).to(device, non_blocking=pin)
    host = [ex for ex, h in zip(examples, on_host) if h]
    if host:
        block = cat_fields(host, [ex.document_ids.to(torch.int32) for ex in host], pin)
        moved = iter(split_rows(block.to(device, non_blocking=pin), [len(ex) for ex in host]))
        examples = [next(moved) if h else ex for ex, h in zip(examples, on_host)]
    return concat_examples(examples)


def _offset_documents(docs: list) -> list:
    """Each row's document ids (>= 0; -1 padding) shifted past the rows before it. The running
    offset is a tensor, so rows on a GPU need no synchronization with the host."""
    out, off = [], None
    for d in docs:
        d = d.to(torch.int32)
        out.append(d if off is None else torch.where(d >= 0, d + off, d))
        if d.numel():
            # a row of padding only (max -1) adds nothing
            step = d.amax().add(1).clamp_(min=0)
            off = step if off is None else off + step
    return out


def cat_rows(parts: list, pin: bool = False) -> torch.Tensor:
    """torch.cat(parts) along dim 0; pin: into pinned host memory, so that the copy to a GPU after
    it is one asynchronous transfer."""
    if not pin:
        return torch.cat(parts)
    shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
    return torch.cat(parts, out=torch.empty(shape, dtype=parts[0].dtype, pin_memory=True))


def cat_fields(examples, docs: list, pin: bool = False):
    """The rows' fields end to end (cat_rows each), with `docs` as their document ids."""
    return D.TrainingExample(
        input_ids=cat_rows([e.input_ids for e in examples], pin),
        document_ids=cat_rows(docs, pin),
        loss_mask=cat_rows([e.loss_mask for e in examples], pin),
        hidden=cat_rows([e.hidden for e in examples], pin),
        last_hidden=cat_rows([e.last_hidden for e in examples], pin),
    )


def split_rows(ex, sizes: list[int]) -> list:
    parts = [getattr(ex, f.name).split(sizes) for f in fields(ex)]
    return [D.TrainingExample(*row) for row in zip(*parts)]


def epoch_order(seed: int, epoch: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def take_rows(order: list[int], cursor: int, epoch: int, n: int, n_rows: int, seed: int):
    """The next n row indices of the data order, crossing into the next epoch's order when this
    one runs out. Returns (rows, order, cursor, epoch) after them; the arguments are unchanged, so
    a caller can also look one step ahead."""
    rows = []
    for _ in range(n):
        if cursor >= n_rows:
            epoch, cursor = epoch + 1, 0
            order = epoch_order(seed, epoch, n_rows)
        rows.append(order[cursor])
        cursor += 1
    return rows, order, cursor, epoch


def cod_seed(seed: int, step: int, micro: int) -> int:
    return (seed * 0x9E3779B1 + step * 7919 + micro * 104729 + 12345) % (2**62)
