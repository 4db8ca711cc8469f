"""The train-step benchmark's parent side (scheduling and tables), without running a step."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
bts = pytest.importorskip("bench_train_step")


def test_share_deadline_splits_the_time_left_by_estimate():
    # 220 s left, this implementation's cases 60 s, the later ones' 190 s: 60/250 of it
    assert bts.share_deadline(0.0, 220.0, 60.0, 190.0) == pytest.approx(220.0 * 60 / 250)
    assert bts.share_deadline(100.0, 320.0, 60.0, 0.0) == pytest.approx(320.0)  # the last takes all
    assert bts.share_deadline(100.0, 101.0, 60.0, 190.0) == pytest.approx(110.0)  # never under 10 s


def test_a_short_budget_leaves_the_first_implementation_its_child_start():
    """With a 200 s budget for peagle-1L-8K then spec-1L-8K (whose estimate includes its
    compiles), peagle's share covers its child's start and its case: the child skips a case that
    does not have min(est_s, 20) s left after starting."""
    cases = {c["name"]: c for c in bts.default_cases()}
    mine, later = bts.impl_seconds([cases["peagle-1L-8K"]], [cases["spec-1L-8K"]], 1)
    assert mine == cases["peagle-1L-8K"]["est_s"] + bts.CHILD_START_S
    assert later == cases["spec-1L-8K"]["est_s"] + bts.CHILD_START_S
    deadline = bts.share_deadline(0.0, 200.0 - 5.0, mine, later)
    assert deadline >= bts.CHILD_START_S + min(cases["peagle-1L-8K"]["est_s"], 20)


def test_tables_print_a_skipped_case_that_asked_for_a_profile(capsys):
    ran = bts.case("peagle-1L-8K", "peagle", 512, profile=True)
    ran.update(
        status="ok",
        median_s=0.1,
        T=1400,
        floor_ms=10.0,
        x_floor=10.0,
        bound_ms=12.5,
        x_bound=8.0,
        copy_gbps=3000.0,
        peak_gb=None,
        rest_gb=None,
        profile={"classes_ms": {k: 1.0 for k in bts.KERNEL_CLASSES}, "kernel_ms": 7.0, "wall_ms": 9.0},
    )
    skipped = {**bts.case("peagle-4L-8K", "peagle", 512, layers=4, profile=True), "status": "skipped: 4s left"}
    bts.print_tables({"device": "cpu", "tiny": True, "elapsed_s": 1.0}, [ran, skipped])
    out = capsys.readouterr().out
    assert "| peagle-4L-8K | 512 | - |" in out and "skipped: 4s left" in out
    assert "| 100.0 | 10.0 | 10.0 | 12.5 | 8.0 |" in out  # step, floor, x floor, bound, x bound
    assert "memory speed in this run (a plain copy): 3000 GB/s" in out
    assert "| peagle-1L-8K | 1.0 |" in out  # the profiled case's class row
    assert out.count("| peagle-4L-8K |") == 1  # no class row for the case that never ran


def test_a_profiled_case_leaves_its_step_trace_beside_its_result(tmp_path):
    """--tiny on the CPU, one profiled case: the logs archive holds the case's result and its
    profiled step as a gzipped chrome trace that names the step's ops."""
    import gzip
    import json
    import subprocess
    import tarfile

    script = Path(bts.__file__)
    r = subprocess.run(
        [sys.executable, str(script), "--device", "cpu", "--tiny", "--cases", "peagle-1L-8K", "--budget-s", "120"]
        + ["--steps", "2", "--out", str(tmp_path / "out"), "--logdir", str(tmp_path / "logs")],
        cwd=str(script.parents[1]),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((tmp_path / "logs" / "peagle-1L-8K.json").read_text())
    assert res["status"] == "ok" and res["profile"]["kernel_ms"] > 0
    # the bound: the matmul floor plus AdamW's 28 bytes per trainable parameter and the loss's
    # logit bytes at the copy speed measured in the run
    fl, nb = res["floor"], res["floor_bytes"]
    assert nb["optimizer"] == 28 * res["trainable_params"]
    # the tiny verifier's 1,024-token vocab, fp32 logits on the CPU
    assert nb["loss"] == (2 * fl["weighted_rows"] + fl["distinct_targets"]) * 1024 * 4
    want = res["floor_ms"] + (nb["optimizer"] + nb["loss"]) / (res["copy_gbps"] * 1e9) * 1e3
    assert res["bound_ms"] == pytest.approx(want, rel=1e-2) and res["bound_ms"] > res["floor_ms"]
    assert res["x_bound"] == pytest.approx(res["median_s"] * 1e3 / res["bound_ms"], rel=1e-2)
    with tarfile.open(tmp_path / "out" / "bench_train_step_logs.tgz") as t:
        names = t.getnames()
        trace = json.loads(gzip.decompress(t.extractfile("logs/peagle-1L-8K.trace.json.gz").read()))
    assert "logs/peagle-1L-8K.json" in names
    assert any(e.get("name") == "peagle.step" for e in trace["traceEvents"])
    assert not list((tmp_path / "logs").glob("*.tmp"))
