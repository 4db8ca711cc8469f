"""The next step's examples, prepared while the device runs this step.

A step of cached hidden states starts with host work: the rows' states are concatenated (torch.cat
of ~150 MB for 16 SmolLM2 rows of 2048) and copied to the device from pageable memory, which the
device then waits for. Here one worker thread does both for step s+1 while step s runs: it
concatenates into pinned memory and, on CUDA, copies on a side stream; the training stream waits
on that copy's event, not on the host. The examples are the same tensors, value for value, as
dataset.examples_to's without prefetch: only when they are made changes.

Used when every row's states are cached (in memory or on disk), and on CUDA when some are (a partial
cache): the worker then also runs the verifier pass for the rows not kept, on its side stream, beside
the step. States recomputed for every row and CPU's background extraction keep the synchronous path."""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .dataset import examples_to


def _fields(ex):
    return (ex.input_ids, ex.document_ids, ex.loss_mask, ex.hidden, ex.last_hidden)


class BatchPrefetcher:
    """get(micro_batches) returns one example per micro-batch (row indices each), on `device`.
    schedule(micro_batches) starts preparing a later get()'s examples; a get() for other rows than
    the scheduled ones (after validation, at an epoch's reshuffle) loads them synchronously."""

    def __init__(self, source, device: torch.device):
        self.source, self.device = source, torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="peagle-prefetch")
        self._pending: tuple[tuple, Future] | None = None
        self.hits = self.misses = 0

    @staticmethod
    def _key(micro_batches) -> tuple:
        return tuple(tuple(int(i) for i in mb) for mb in micro_batches)

    def schedule(self, micro_batches) -> None:
        key = self._key(micro_batches)
        if self._pending is not None and self._pending[0] == key:
            return
        self._drop()
        self._pending = (key, self._pool.submit(self._load, key))

    def get(self, micro_batches) -> list:
        key = self._key(micro_batches)
        if self._pending is not None and self._pending[0] == key:
            fut = self._pending[1]
            self._pending = None
            self.hits += 1
            examples, event = fut.result()
        else:
            self._drop()
            self.misses += 1
            examples, event = self._load(key)
        if event is not None:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(event)
            for ex in examples:
                for t in _fields(ex):
                    # allocated on the side stream, read on this one: the allocator must not hand the
                    # block back to the side stream before this stream's work on it is done
                    t.record_stream(cur)
        return examples

    def _load(self, key):
        with torch.cuda.stream(self._stream) if self._cuda else contextlib.nullcontext():
            # a partial cache's verifier pass, if any, is queued on the side stream here; its
            # states stay on the device beside the kept rows' copy
            out = [examples_to(self.source.get_many(list(mb)), self.device, pin=self._cuda) for mb in key]
            if not self._cuda:
                return out, None
            event = torch.cuda.Event()
            event.record(self._stream)
        return out, event

    def _drop(self) -> None:
        """Wait for a scheduled load nobody will take (its tensors then free normally); its error,
        if any, is nobody's: the rows it read are read again when asked for."""
        if self._pending is not None:
            self._pending[1].exception()
            self._pending = None

    def close(self) -> None:
        """Never raises: it runs while the loop ends, perhaps on an error of its own."""
        self._drop()
        self._pool.shutdown(wait=True)
