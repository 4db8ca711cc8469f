"""A micro-batch's rows side by side (peagle_ext/train/dataset.py: concat_examples, examples_to)."""

import pytest
import torch

from peagle_ext.data import TrainingExample
from peagle_ext.train.dataset import concat_examples, examples_to
from tests.helpers import requires_cuda


def _rows(lengths, seed=0, width=4):
    """Random rows; document ids non-decreasing runs with -1 padding, one row of padding only."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for j, n in enumerate(lengths):
        doc = torch.sort(torch.randint(0, 3, (n,), generator=g)).values.to(torch.int32)
        doc[torch.rand(n, generator=g) < 0.2] = -1
        if j == 1:
            doc[:] = -1
        rows.append(
            TrainingExample(
                input_ids=torch.randint(0, 100, (n,), generator=g),
                document_ids=doc,
                loss_mask=torch.rand(n, generator=g) > 0.5,
                hidden=torch.randn(n, 3 * width, generator=g).to(torch.bfloat16),
                last_hidden=torch.randn(n, width, generator=g).to(torch.bfloat16),
            )
        )
    return rows


def _reference(rows):
    """Document ids of rows side by side, offset in plain Python: each row's ids past every id
    before it, padding kept at -1."""
    out, off = [], 0
    for r in rows:
        ids = r.document_ids.tolist()
        out += [d + off if d >= 0 else -1 for d in ids]
        if any(d >= 0 for d in ids):
            off += max(ids) + 1
    return out


@pytest.mark.parametrize("lengths", [[7, 5, 9, 1], [3], [1, 1], [6, 4, 0, 5]])
def test_concat_examples_puts_each_rows_documents_past_the_earlier_ones(lengths):
    rows = _rows(lengths)
    got = concat_examples(rows)
    assert got.document_ids.dtype == torch.int32 or len(rows) == 1
    assert got.document_ids.tolist() == _reference(rows)
    for f in ("input_ids", "loss_mask", "hidden", "last_hidden"):
        assert torch.equal(getattr(got, f), torch.cat([getattr(r, f) for r in rows]))


def test_examples_to_the_cpu_is_concat_examples():
    rows = _rows([5, 3, 8])
    got, want = examples_to(rows, "cpu", pin=True), concat_examples(rows)
    for f in ("input_ids", "document_ids", "loss_mask", "hidden", "last_hidden"):
        assert torch.equal(getattr(got, f), getattr(want, f))
    assert not got.hidden.is_pinned()  # nothing crosses to a GPU: nothing to pin for


@requires_cuda
@pytest.mark.parametrize("pin", [False, True])
@pytest.mark.parametrize("on_device", [[1, 3], [0], [0, 1, 2, 3], []])
def test_examples_to_a_gpu_leaves_rows_already_there_and_equals_the_host_concat_moved(pin, on_device):
    """A partial cache's step: kept rows on the host, recomputed ones on the GPU."""
    rows = _rows([6, 4, 9, 2], seed=1)
    want = concat_examples(rows).to("cuda")
    mixed = [r.to("cuda") if j in on_device else r for j, r in enumerate(rows)]
    got = examples_to(mixed, "cuda", pin=pin)
    torch.cuda.synchronize()
    for f in ("input_ids", "document_ids", "loss_mask", "hidden", "last_hidden"):
        a, b = getattr(got, f), getattr(want, f)
        assert a.device.type == "cuda" and a.dtype == b.dtype and torch.equal(a, b), f
