"""The hidden-state warm-up benchmark's own accounting, on a tiny CPU model."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
bhs = pytest.importorskip("bench_hidden_states")


def test_rows_are_full_packed_rows_of_the_asked_length():
    rows = bhs.make_rows(5, 128, (20, 90), 300)
    assert len(rows) == 5 and all(len(r) == 128 for r in rows)


def test_cases_parse_and_name_themselves():
    assert bhs.parse_case("16:32768") == (16, 32768) and bhs.parse_case("auto:512") == (None, 512)
    assert bhs.case_name((None, 512)) == "auto:512" and bhs.case_name((16, 32768)) == "16:32768"
    for bad in ("0:10", "4:0", "x:10", "4", "4:5:6", "4:5:pinned"):
        with pytest.raises(ValueError):
            bhs.parse_case(bad)


def test_measure_counts_every_row_token_forward_and_pad():
    model = bhs.make_model(
        torch.device("cpu"),
        torch.float32,
        num_hidden_layers=28,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=300,
    )
    rows = bhs.make_rows(3, 64, (10, 40), 300)
    r = bhs.measure(model, rows, (2, 512))
    assert r["rows"] == 3 and r["tokens"] == 3 * 64 and r["tok_s"] > 0 and r["case"] == "2:512"
    # on the CPU the warm-up goes row by row: one verifier forward per length group of a row
    groups = [
        bhs.D.hidden_states._batches_by_length([(s, e, 0) for s, e in row.document_spans()], max(len(row), 4096))
        for row in rows
    ]
    assert r["forwards"] == sum(len(g) for g in groups)
    padded = sum(len(b) * max(e - s for s, e, _ in b) for g in groups for b in g)
    real = sum(e - s for row in rows for s, e in row.document_spans())
    assert r["padding"] == pytest.approx(padded / real - 1)
