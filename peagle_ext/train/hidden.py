"""Verifier hidden states of the training rows: kept in memory, recomputed on use, or read from an
on-disk cache; on CPU optionally computed on a background thread while training starts."""

from __future__ import annotations

import dataclasses
import time

import torch

from .. import data as D
from .dataset import cat_fields, cat_rows, split_rows
from .run_log import progress_bar


class HiddenStates:
    """Verifier hidden states per packed row -> TrainingExample: kept in memory as far as they fit
    (--hidden-cache-gb), the rest recomputed on use; or, with a `disk` HiddenStateCache, generated
    once into it (resumable, reusable by later runs on the same data) and read back from it.
    Row by row, all three give the same bits (the verifier forward is deterministic); batched
    passes (get_many's recomputed steps, warming the cache on a GPU) agree to float rounding.

    `cache`: True keeps every row's states in memory, False none, an int n the first n rows'.
    With some rows kept and some not, every row comes back in `store_dtype`, so a step's rows
    look alike whichever way they came: kept rows on the host, rows recomputed by get_many where
    the verifier runs (train.dataset.examples_to puts a step's rows together on its device)."""

    ROWS_PER_SHARD = 16

    def __init__(self, verifier, aux_layer_ids, rows, *, cache: bool | int, store_dtype, device, disk=None, fp8=False):
        self.verifier = verifier
        self.aux = list(aux_layer_ids)
        self.rows = rows
        if isinstance(cache, bool):
            self.cached_rows = len(rows) if cache else 0
        else:
            if int(cache) < 0:
                raise ValueError(f"HiddenStates: cache must be a bool or a row count >= 0, got {cache}")
            self.cached_rows = min(int(cache), len(rows))
        # every row kept (what dropping the verifier and the background thread need)
        self.cache = cache is True or (not isinstance(cache, bool) and self.cached_rows == len(rows))
        self.partial = not self.cache and self.cached_rows > 0
        self.store_dtype = store_dtype
        self.device = device
        # rows kept in memory as fp8 with a scale per position (see _pack); they come back dequantized
        # to store_dtype, on the GPU when the training runs there
        self.fp8 = bool(fp8)
        self.disk = disk
        self._mem: dict[int, object] = {}
        self._shard: tuple[int, list] | None = None
        # seconds of the batched warm-up (GPU) in the verifier's passes and in the shift plus the
        # copies into host memory
        self.warm_seconds = {"verifier": 0.0, "to_host": 0.0}

    def compute(self, i: int):
        if self.disk is not None:
            k, j = divmod(i, self.ROWS_PER_SHARD)
            if self._shard is None or self._shard[0] != k:
                self._shard = (k, self.disk.read_shard(k))
            return self._shard[1][j].to("cpu", self.store_dtype)  # a cache may store bf16 / fp8
        aux, last = D.verifier_hidden_states(self.verifier, self.rows[i], self.aux)
        ex = D.eagle_shift(self.rows[i], aux, last)
        return ex.to("cpu", self.store_dtype) if self.cache or self.partial else ex

    def kept(self, i: int) -> bool:
        """Whether row i's states stay in memory once computed."""
        return i < self.cached_rows

    def get_many(self, indices: list[int]) -> list:
        """get() of several rows. States to compute (rows not kept, and kept rows not computed
        yet, without a disk cache) come from one batched verifier pass over all their documents
        (data.verifier_hidden_states_many): a training step's rows cost about one eager verifier
        forward on a GPU, not one or more per row. They agree with row-by-row states to float
        rounding; the kept ones stay in memory from then on."""
        if self.disk is not None or (self.cache and not self.fp8):
            return [self.get(i) for i in indices]
        todo = [] if self.cache else list(dict.fromkeys(i for i in indices if i not in self._mem))
        if len(todo) == 1:
            return [self.get(i) for i in indices]
        got = {}
        if todo:
            rows = [self.rows[i] for i in todo]
            budget = max(sum(len(r) for r in rows), 4096)
            states = D.verifier_hidden_states_many(self.verifier, rows, self.aux, token_budget=budget)
            got = {i: D.eagle_shift(r, aux, last) for i, r, (aux, last) in zip(todo, rows, states)}
        if self.partial:
            # kept rows go to host memory and come back from there as every kept row does; the
            # others stay where the verifier ran (a GPU: the step reads them there, examples_to),
            # in the store dtype all rows share
            keep = [i for i in todo if self.kept(i)]
            self._mem.update(zip(keep, self._pack_many([got.pop(i) for i in keep])))
            got.update((i, got[i].to(dtype=self.store_dtype)) for i in todo if not self.kept(i))
        kept = list(dict.fromkeys(i for i in indices if i not in got))
        got.update(zip(kept, self._unpack_many([self._packed(i) for i in kept])))
        return [got[i] for i in indices]

    def _pack_many(self, examples: list) -> list:
        """Rows (on any device) -> how the cache keeps them in host memory: in store_dtype, or with
        fp8 a (row with float8_e4m3fn hidden and last_hidden, their float32 scales per position)
        tuple, quantized where the rows are (a GPU quantizes before the copy, which then moves
        half the bytes). Each field of all the rows crosses in one copy (examples_to_host)."""
        if not self.fp8:
            return D.examples_to_host(examples, self.store_dtype)
        quantized, scales = [], []
        for ex in examples:
            qh, sh = D.quantize_fp8(ex.hidden)
            ql, sl = D.quantize_fp8(ex.last_hidden)
            quantized.append(D.TrainingExample(ex.input_ids, ex.document_ids, ex.loss_mask, qh, ql))
            scales.append(torch.stack([sh, sl], dim=1))
        on_host = D.examples_to_host(quantized)
        per_row = torch.cat(scales).cpu().split([len(ex) for ex in examples]) if examples else []
        return list(zip(on_host, per_row))

    def _unpack_many(self, kept: list) -> list:
        """Kept rows as training reads them: in store_dtype. fp8 rows cross to the device the
        training runs on together, one copy per field (from pinned memory, asynchronously, to a
        GPU: a pageable copy per tensor per row holds up the step's kernel launches on the other
        thread), and are dequantized there, so the fp8 bytes cross, not the wider ones."""
        if not self.fp8 or not kept:
            return list(kept)
        dev = torch.device(self.device)
        pin = dev.type == "cuda"
        rows = [ex for ex, _ in kept]
        block = cat_fields(rows, [ex.document_ids for ex in rows], pin).to(dev, non_blocking=pin)
        scales = cat_rows([s for _, s in kept], pin).to(dev, non_blocking=pin)
        block = dataclasses.replace(
            block,
            hidden=D.dequantize_fp8(block.hidden, scales[:, 0]).to(self.store_dtype),
            last_hidden=D.dequantize_fp8(block.last_hidden, scales[:, 1]).to(self.store_dtype),
        )
        return split_rows(block, [len(ex) for ex in rows])

    def _packed(self, i: int):
        """Kept row i as the cache holds it, computed first if it is not there yet."""
        if self._producer is not None:
            return self._wait_for(i)
        if i not in self._mem:
            self._mem[i] = self._pack_many([self.compute(i)])[0]
        return self._mem[i]

    def get(self, i: int):
        if self.kept(i):
            return self._unpack_many([self._packed(i)])[0]
        return self.compute(i)

    # -- background extraction: the verifier runs on a second thread while training starts --
    _producer = None

    def start_background(self, order: list[int], then: HiddenStates | None = None, then_after: int = 0):
        """Compute every row's states on a background thread, in `order` (the order training
        will ask for them), with `then`'s rows (validation) inserted after the first `then_after`
        of them (when the first validation needs them). torch ops release the GIL and, with one
        intra-op thread each, two Python threads use two cores without OpenMP barriers. get()
        waits for a row that is not done yet. Same bits as computing in the foreground."""
        import threading

        cond = threading.Condition()
        cut = max(0, min(then_after, len(order)))
        jobs = (
            [(self, i) for i in order[:cut]]
            + ([(then, i) for i in range(len(then.rows))] if then else [])
            + [(self, i) for i in order[cut:]]
        )
        for hs in (self, then) if then else (self,):
            hs._cond, hs._error, hs._producer = cond, [None], True

        stop = threading.Event()

        def run():
            try:
                with torch.inference_mode(False), torch.no_grad():
                    for hs, i in jobs:
                        if stop.is_set():
                            return
                        if i in hs._mem:
                            continue
                        ex = hs._pack_many([hs.compute(i)])[0]
                        with cond:
                            hs._mem[i] = ex
                            cond.notify_all()
            except BaseException as e:  # surfaced by the next get()
                with cond:
                    for hs in (self, then) if then else (self,):
                        hs._error[0] = e
                    cond.notify_all()
            finally:
                with cond:
                    for hs in (self, then) if then else (self,):
                        hs._done = True
                    cond.notify_all()

        for hs in (self, then) if then else (self,):
            hs._done = False
        t = threading.Thread(target=run, name="peagle-hidden-states", daemon=True)
        t.start()
        self._thread, self._stop = t, stop
        return t

    def stop_background(self):
        """Stop the background thread and wait for it (after its current row). Every exit of the
        trainer calls this: a daemon thread still inside a torch op when the interpreter exits
        aborts the process (`terminate called without an active exception`, SIGABRT)."""
        t = getattr(self, "_thread", None)
        if t is None:
            return
        self._stop.set()
        t.join()
        self._thread = None

    def _wait_for(self, i: int):
        with self._cond:
            while i not in self._mem:
                if self._error[0] is not None:
                    raise self._error[0]
                if self._done:
                    raise RuntimeError(f"hidden states of row {i} were never computed")
                self._cond.wait(timeout=1.0)
            return self._mem[i]

    def warm(self, desc: str, progress: bool):
        if self.disk is not None and self.rows:
            self.disk.generate(
                self.verifier,
                self.rows,
                self.aux,
                rows_per_shard=self.ROWS_PER_SHARD,
                dtype=self.store_dtype,
                progress=progress,
            )
        if not self.cached_rows:
            return
        if self.disk is None and self.verifier is not None and torch.device(self.device).type == "cuda":
            self._warm_batched(desc, progress)
            return
        it = range(self.cached_rows)
        bar = progress_bar(it, desc=desc, unit="row", disable=not progress)
        t0 = time.time()
        ntok = 0
        for i in bar:
            self.get(i)
            ntok += int(self.rows[i].input_ids.shape[0])
            bar.set_postfix(tok_s=f"{ntok / max(time.time() - t0, 1e-9):.0f}")
        bar.close()
        self._shard = None

    # Warming the cache on a GPU (data.hidden_states.PASS_STATE_BYTES says why): rows per batched
    # verifier pass (None: as many as WARM_STATE_BYTES of their states hold), and padded tokens per
    # verifier forward inside a pass
    WARM_ROWS: int | None = None
    WARM_STATE_BYTES = D.hidden_states.PASS_STATE_BYTES
    WARM_TOKENS = D.hidden_states.PASS_TOKENS

    def warm_rows_per_pass(self) -> int:
        if self.WARM_ROWS:
            return int(self.WARM_ROWS)
        return D.rows_per_pass(self.verifier, self.rows, len(self.aux), self.WARM_STATE_BYTES)

    def _warm_batched(self, desc: str, progress: bool):
        """Fill the in-memory cache with one batched verifier pass per warm_rows_per_pass() rows,
        their documents grouped by length into forwards of at most WARM_TOKENS padded tokens. On a
        GPU an eager forward of a small verifier costs host time for its launches whatever its
        size, so row by row the cache cost minutes that batched it does not. The states agree
        with row-by-row ones to float rounding, and every run batches the same rows together, so
        a resumed run caches the same bits."""
        todo = [i for i in range(self.cached_rows) if i not in self._mem]
        bar = progress_bar(None, total=len(todo), desc=desc, unit="row", disable=not progress)
        t0 = time.time()
        ntok = 0
        split = self.warm_seconds
        vdev = next(self.verifier.parameters()).device
        step = self.warm_rows_per_pass()
        for k in range(0, len(todo), step):
            idx = todo[k : k + step]
            rows = [self.rows[i] for i in idx]
            a = time.perf_counter()
            states = D.verifier_hidden_states_many(self.verifier, rows, self.aux, token_budget=self.WARM_TOKENS)
            if vdev.type == "cuda":
                torch.cuda.synchronize(vdev)  # the pass's own time, apart from the copies
            b = time.perf_counter()
            shifted = [D.eagle_shift(r, aux, last) for r, (aux, last) in zip(rows, states)]
            del states
            for i, ex in zip(idx, self._pack_many(shifted)):
                self._mem[i] = ex
            ntok += sum(len(r) for r in rows)
            split["verifier"] += b - a
            split["to_host"] += time.perf_counter() - b
            bar.update(len(idx))
            bar.set_postfix(tok_s=f"{ntok / max(time.time() - t0, 1e-9):.0f}")
        bar.close()
