"""Long-run stability, short version: 200 steps of the tiny config without memory growth after
warm-up (tools/long_run.py; the full check is `python tools/long_run.py --steps 2000`, and
`--device cuda` on a GPU). Marked `slow` (~15 s): deselect with `pytest -m "not slow"`, run
alone with `pytest -m slow tests/train/test_long_run.py`."""

import runpy
from pathlib import Path
from types import SimpleNamespace

import pytest

# the tool is a script, not a module of the package: load its functions from its file
long_run = SimpleNamespace(**runpy.run_path(str(Path(__file__).resolve().parents[2] / "tools" / "long_run.py")))


def test_growth_detector_sees_a_leak_and_ignores_warmup():
    mib = long_run.MiB
    flat = [{"step": s, "rss": 400 * mib + (50 * mib if s < 50 else 0)} for s in range(0, 201, 10)]
    assert abs(long_run.growth(flat, "rss", 50)["growth_mib"]) < 1e-9  # the warm-up jump is not growth
    leaky = [{"step": s, "rss": 400 * mib + s * 200 * 1024} for s in range(0, 2001, 10)]  # 200 KiB a step
    g = long_run.growth(leaky, "rss", 500)
    assert g["growth_mib"] > 24 and abs(g["slope_mib_per_1000_steps"] - 1000 * 200 / 1024) < 1e-6


@pytest.mark.slow
def test_200_steps_without_memory_growth(tmp_path):
    r = long_run.run(200, out_dir=tmp_path, log_every=5, checkpoint_every=50, plot=False, quiet=True)
    assert r["skipped_steps"] == 0 and r["rss"]["samples"] >= 20
    assert r["ok"], r["failures"]
    assert (tmp_path / "long_run_cpu.json").is_file()
