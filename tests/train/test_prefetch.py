"""The next step's examples prepared during this step (peagle_ext/train/prefetch.py) and the
data order's look-ahead (dataset.take_rows)."""

import functools

import pytest
import torch

from peagle_ext.data import TrainingExample
from peagle_ext.train import dataset as train_dataset
from peagle_ext.train.dataset import concat_examples, epoch_order, take_rows
from peagle_ext.train.prefetch import BatchPrefetcher
from tests.helpers import hidden_state_bytes, requires_cuda, train_settings

pytestmark = pytest.mark.usefixtures("one_thread")

settings = functools.partial(train_settings, checkpoint_every=100, val_every=100, num_depths=3)


class Rows:
    """A stand-in for HiddenStates: fixed random rows, with the calls it served."""

    def __init__(self, n=9, length=11, width=6, seed=0, fail_on=None):
        g = torch.Generator().manual_seed(seed)
        self.rows = []
        for _ in range(n):
            doc = torch.randint(-1, 3, (length,), generator=g).to(torch.int32)
            self.rows.append(
                TrainingExample(
                    input_ids=torch.randint(0, 100, (length,), generator=g),
                    document_ids=doc,
                    loss_mask=torch.rand(length, generator=g) > 0.5,
                    hidden=torch.randn(length, 3 * width, generator=g).to(torch.bfloat16),
                    last_hidden=torch.randn(length, width, generator=g).to(torch.bfloat16),
                )
            )
        self.calls, self.fail_on = [], fail_on

    def get_many(self, idx):
        self.calls.append(list(idx))
        if self.fail_on is not None and self.fail_on in idx:
            raise OSError(f"row {self.fail_on} unreadable")
        return [self.rows[i] for i in idx]


def _fields(ex):
    return [ex.input_ids, ex.document_ids, ex.loss_mask, ex.hidden, ex.last_hidden]


def _same(a, b):
    return all(x.dtype == y.dtype and torch.equal(x.cpu(), y.cpu()) for x, y in zip(_fields(a), _fields(b)))


def _want(src, units):
    return [concat_examples([src.rows[i] for i in mb]) for mb in units]


def test_take_rows_is_the_plain_loop_and_looks_ahead_without_moving():
    n_rows, seed = 7, 3
    order, cursor, epoch = epoch_order(seed, 0, n_rows), 0, 0
    plain = [order[i] for i in range(n_rows)] + epoch_order(seed, 1, n_rows) + epoch_order(seed, 2, n_rows)[:4]
    got = []
    for _ in range(6):  # 6 x 3 = 18 rows: two epoch boundaries, one inside a step
        ahead = take_rows(order, cursor, epoch, 3, n_rows, seed)
        assert take_rows(order, cursor, epoch, 3, n_rows, seed) == ahead  # the arguments are unchanged
        rows, order, cursor, epoch = ahead
        got += rows
    assert got == plain and (cursor, epoch) == (4, 2)


def test_scheduled_rows_are_the_synchronous_ones():
    src = Rows()
    p = BatchPrefetcher(src, "cpu")
    try:
        units = [[3, 1], [0, 8, 2]]
        p.schedule(units)
        got = p.get(units)
        assert p.hits == 1 and p.misses == 0
        assert all(_same(a, b) for a, b in zip(got, _want(src, units)))
        # rows other than the scheduled ones: loaded now, the stale load is dropped
        p.schedule([[4]])
        other = [[5, 6]]
        assert all(_same(a, b) for a, b in zip(p.get(other), _want(src, other)))
        assert p.misses == 1 and src.calls[-2:] == [[4], [5, 6]]
        # a single row comes back as itself
        assert _same(p.get([[7]])[0], src.rows[7])
    finally:
        p.close()


def test_a_failed_load_raises_in_get_not_in_the_worker():
    src = Rows(fail_on=2)
    p = BatchPrefetcher(src, "cpu")
    try:
        p.schedule([[1, 2]])
        with pytest.raises(OSError, match="row 2 unreadable"):
            p.get([[1, 2]])
        assert _same(p.get([[0, 1]])[0], _want(src, [[0, 1]])[0])  # the prefetcher goes on
    finally:
        p.close()


def test_close_never_raises_so_the_loop_keeps_its_own_error():
    """close() runs in the loop's finally: a failed load nobody took must not replace the error
    that is ending the run; a stale failed load is also dropped quietly by a get() of other rows."""
    src = Rows(fail_on=2)
    p = BatchPrefetcher(src, "cpu")
    p.schedule([[2, 3]])
    assert _same(p.get([[4]])[0], src.rows[4])
    p.schedule([[1, 2]])
    p.close()


def test_examples_move_with_non_blocking_copies():
    """The prefetcher's CUDA path copies with non_blocking=True: TrainingExample.to takes it."""
    ex = concat_examples(Rows().rows[:2])
    moved = ex.to("cpu", dtype=torch.float32, non_blocking=True)
    assert moved.hidden.dtype == torch.float32 and moved.input_ids.dtype == ex.input_ids.dtype
    assert torch.equal(moved.hidden, ex.hidden.float()) and torch.equal(moved.document_ids, ex.document_ids)


def _count_prefetchers(monkeypatch) -> list:
    """The training loop's BatchPrefetcher, recording every one it makes in the returned list."""
    from peagle_ext.train import loop

    made = []

    class Counting(BatchPrefetcher):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(loop, "BatchPrefetcher", Counting)
    return made


def test_training_is_bitwise_the_same_with_and_without_prefetch(tiny, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from peagle_ext.train import train

    made = _count_prefetchers(monkeypatch)
    # 14 short chats pack into few rows: batch 2 crosses epoch boundaries within 6 steps
    kw = dict(max_steps=6, batch_size=2, background_hidden=False)
    a = train(settings(tiny, tmp_path / "a", prefetch=False, **kw))
    assert not made
    b = train(settings(tiny, tmp_path / "b", prefetch=True, **kw))
    (p,) = made
    assert p.hits == 5 and p.misses == 1  # the first step has nothing scheduled; the last schedules nothing
    wa, wb = load_file(str(a.final_dir / "model.safetensors")), load_file(str(b.final_dir / "model.safetensors"))
    assert set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_no_prefetch_while_states_are_still_computed(tiny, tmp_path, monkeypatch):
    """CPU's background extraction runs the verifier on its own thread: the loop reads rows itself."""
    from peagle_ext.train import loop, train

    made = []
    monkeypatch.setattr(loop, "BatchPrefetcher", lambda *a, **k: made.append(1))
    train(settings(tiny, tmp_path / "run", max_steps=2, background_hidden=True))
    assert not made


def test_pinned_concat_equals_the_plain_one(monkeypatch):
    """concat_examples(pin=True) allocates pinned outputs; the values are the plain ones (the pinned
    allocation is replaced by a plain one where no accelerator exists)."""
    src = Rows()
    if not torch.cuda.is_available():
        real_empty = torch.empty

        def empty(*a, pin_memory=False, **k):
            return real_empty(*a, **k)

        monkeypatch.setattr(train_dataset.torch, "empty", empty)
    for units in ([[0, 4, 2]], [[6]]):
        got = concat_examples([src.rows[i] for i in units[0]], pin=True)
        assert _same(got, _want(src, units)[0])
        if torch.cuda.is_available():
            assert all(t.is_pinned() for t in _fields(got))


@requires_cuda
def test_cuda_prefetch_survives_later_loads():
    """Side-stream copies read on the default stream: values intact after the next loads reuse memory."""
    src = Rows(n=12, length=4096, width=64)
    p = BatchPrefetcher(src, "cuda")
    try:
        seq = [[[0, 1, 2]], [[3, 4]], [[5, 6, 7, 8]], [[9, 10, 11]]]
        p.schedule(seq[0])
        for i, units in enumerate(seq):
            got = p.get(units)
            if i + 1 < len(seq):
                p.schedule(seq[i + 1])
            # a long kernel queue on the default stream before the read
            x = torch.randn(4096, 4096, device="cuda")
            for _ in range(20):
                x = x @ x * 1e-3
            assert got[0].hidden.device.type == "cuda"
            assert all(_same(a, b) for a, b in zip(got, _want(src, units)))
        assert p.hits == 4
    finally:
        p.close()


@requires_cuda
def test_cuda_training_matches_without_prefetch(tiny, tmp_path):
    from safetensors.torch import load_file

    from peagle_ext.testing import make_tiny_verifier
    from peagle_ext.train import train

    v = make_tiny_verifier(tmp_path / "v128", hidden=128, heads=2)
    kw = dict(max_steps=5, batch_size=2, device="cuda", dtype="float32")
    a = train(settings((v, tiny[1]), tmp_path / "a", prefetch=False, **kw))
    b = train(settings((v, tiny[1]), tmp_path / "b", prefetch=True, **kw))
    wa, wb = load_file(str(a.final_dir / "model.safetensors")), load_file(str(b.final_dir / "model.safetensors"))
    # the same inputs in the same order; CUDA reductions may round differently run to run
    assert all(torch.allclose(wa[k], wb[k], rtol=1e-5, atol=1e-6) for k in wa)


def _partial_cache_gb(tiny, tmp_path, **kw):
    """A --hidden-cache-gb that keeps validation's rows and one training row."""
    per_row, _, n_val = hidden_state_bytes(settings, tiny, tmp_path / "probe", **kw)
    return per_row * (n_val + 1.5) / 2**30


def test_no_prefetch_for_a_partial_cache_on_cpu(tiny, tmp_path, monkeypatch):
    """On the CPU a partial cache's verifier pass would share the cores with the step: the loop
    reads rows itself."""
    from peagle_ext.train import loop, train

    gb = _partial_cache_gb(tiny, tmp_path, background_hidden=False)
    made = []
    monkeypatch.setattr(loop, "BatchPrefetcher", lambda *a, **k: made.append(1))
    train(settings(tiny, tmp_path / "run", max_steps=2, hidden_cache_gb=gb, background_hidden=False))
    assert not made
    log = (tmp_path / "run" / "log.jsonl").read_text()
    assert '"kept_rows"' in log  # the cache did keep some rows


@requires_cuda
def test_cuda_prefetch_runs_a_partial_caches_verifier_pass_beside_the_step(tiny, tmp_path, monkeypatch):
    """With some rows' states kept, the worker runs the verifier pass for the others on its side
    stream: training matches the same partial cache read by the loop itself. (Against every row
    cached it would not match this closely: the warm-up's passes batch other documents together,
    so the states differ by float rounding, which a few optimizer steps amplify.)"""
    from safetensors.torch import load_file

    from peagle_ext.testing import make_tiny_verifier
    from peagle_ext.train import train

    v = make_tiny_verifier(tmp_path / "v128", hidden=128, heads=2)
    kw = dict(max_steps=5, batch_size=2, device="cuda", dtype="float32")
    gb = _partial_cache_gb((v, tiny[1]), tmp_path, **kw)
    made = _count_prefetchers(monkeypatch)
    a = train(settings((v, tiny[1]), tmp_path / "a", hidden_cache_gb=gb, prefetch=False, **kw))
    assert not made
    b = train(settings((v, tiny[1]), tmp_path / "b", hidden_cache_gb=gb, prefetch=True, **kw))
    (p,) = made
    assert p.hits == 4
    wa, wb = load_file(str(a.final_dir / "model.safetensors")), load_file(str(b.final_dir / "model.safetensors"))
    assert all(torch.allclose(wa[k], wb[k], rtol=1e-5, atol=1e-6) for k in wa)
