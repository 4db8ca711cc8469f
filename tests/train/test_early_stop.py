"""Stopping before --max-steps: on a validation-loss plateau (--early-stop-patience) and on the
time budget (--max-minutes); both save a checkpoint and final/ like a finished run."""

import functools
import json

import pytest

from peagle_ext.train import train
from peagle_ext.train.checkpoint import check_trainer_state, read_trainer_state
from peagle_ext.train.early_stop import StopRule
from peagle_ext.train.settings import TrainError
from tests.helpers import train_settings

pytestmark = pytest.mark.usefixtures("one_thread")


_settings = functools.partial(
    train_settings,
    max_steps=20,
    checkpoint_every=100,
    val_every=1,
    val_fraction=0.2,
    background_hidden=False,
)


def test_stop_rule():
    r = StopRule(2, 0.1, None, 0.0)
    assert r.after_val(1.0) is None and r.after_val(0.8) is None  # improvements
    assert r.after_val(0.75) is None  # < 10% better: one bad evaluation
    assert r.after_val(0.5) is None  # better again: the count restarts
    assert r.after_val(0.49) is None and "2 evaluations" in r.after_val(0.6)
    assert StopRule(None, 0.1, None, 0.0).after_val(5.0) is None
    assert not StopRule(None, 0.0, None, 0.0).over_time() and StopRule(None, 0.0, 1e-9, 0.0).over_time()


def test_early_stop_on_plateau_saves_final(tiny, tmp_path):
    # an improvement must halve the loss: after the first evaluation none does
    r = train(_settings(tiny, tmp_path / "run", early_stop_patience=2, early_stop_min_delta=0.5))
    assert r.steps == 3 and r.stop_reason and "--early-stop-patience 2" in r.stop_reason
    assert (r.final_dir / "model.safetensors").is_file() and (tmp_path / "run" / "checkpoint-3").is_dir()
    events = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert any(e.get("event") == "stop" for e in events) and events[-1]["event"] == "done"


def test_time_budget_saves_final(tiny, tmp_path):
    r = train(_settings(tiny, tmp_path / "run", max_minutes=1e-6, val_every=100))
    assert r.steps == 1 and "--max-minutes" in r.stop_reason and r.final_dir.is_dir()


def test_bad_stop_settings(tiny, tmp_path):
    for kw, flag in (
        ({"early_stop_patience": 0}, "--early-stop-patience"),
        ({"early_stop_min_delta": 1.0}, "--early-stop-min-delta"),
        ({"max_minutes": 0}, "--max-minutes"),
    ):
        with pytest.raises(TrainError, match=flag):
            _settings(tiny, tmp_path / "x", **kw).validate()


def test_time_schedule_ends_decayed_when_the_clock_stops_the_run(tiny, tmp_path):
    # 10**6 steps would keep the rate near its peak; the clock's share of the budget decays it
    # (12 s: the start-up counts against it, and the last step must begin past 90% of what is left)
    kw = dict(max_steps=10**6, max_minutes=0.2, time_schedule=True, val_every=10**6, checkpoint_every=10**6)
    r = train(_settings(tiny, tmp_path / "run", log_every=1, **kw))
    assert "--max-minutes" in r.stop_reason and r.steps >= 3
    lrs = [e["lr"] for e in map(json.loads, (tmp_path / "run" / "log.jsonl").read_text().splitlines()) if "lr" in e]
    s = _settings(tiny, tmp_path / "run")
    assert all(a >= b for a, b in zip(lrs, lrs[1:])) and lrs[-1] < 0.25 * s.lr
    ck = read_trainer_state(tmp_path / "run" / f"checkpoint-{r.steps}")
    assert ck["schedule_progress"] > 0.9
    with pytest.raises(ValueError, match="schedule_progress must be a number in"):
        check_trainer_state({**ck, "schedule_progress": 1.5}, tmp_path / "run")
    # a resume goes on from that progress (its own clock starts at 0): the rate stays decayed
    train(_settings(tiny, tmp_path / "run", resume=True, log_every=1, **kw), stop_after=2)
    recs = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    after = [e["lr"] for e in recs if "lr" in e and e["step"] > r.steps]
    assert len(after) == 2 and max(after) <= lrs[-1]


def test_time_schedule_does_not_count_the_start_up(tiny, tmp_path, monkeypatch):
    # a slow start-up (here 3 s of the 12 s budget) leaves the first steps after warmup near the peak
    import time

    import peagle_ext.train.loop as loop

    real = loop.build_hidden_states
    monkeypatch.setattr(loop, "build_hidden_states", lambda *a, **k: time.sleep(3.0) or real(*a, **k))
    kw = dict(max_steps=10**6, max_minutes=0.2, time_schedule=True, val_every=10**6, checkpoint_every=10**6)
    train(_settings(tiny, tmp_path / "run", log_every=1, **kw), stop_after=3)
    lrs = [e["lr"] for e in map(json.loads, (tmp_path / "run" / "log.jsonl").read_text().splitlines()) if "lr" in e]
    s = _settings(tiny, tmp_path / "run")
    assert len(lrs) == 3 and lrs[1] > 0.9 * s.lr
