"""Trainer crash safety: `peagle train` SIGKILLed during training and during a checkpoint write,
then `peagle train --resume`.

Guarantees checked (the trainer writes DIR/checkpoint-<step>.tmp, fsyncs it, marks it COMPLETE
and renames it into place; see peagle_ext/train.py):
- no corrupt checkpoint is ever picked: after every kill, each checkpoint `list_checkpoints`
  reports loads completely, and a half-written .tmp directory is ignored (and removed by --resume);
- at most the steps since the last complete checkpoint are lost: the resumed run starts from the
  newest checkpoint at or before the kill;
- the resumed run ends bitwise equal (CPU) to an uninterrupted one: final weights, and the
  per-step training losses in log.jsonl (each step logged exactly once).

The kill lands at a known point through the trainer's test hook PEAGLE_TEST_PAUSE=
"<point>:<step>:<flag file>" (peagle_ext.train.checkpoint.test_pause): at that point the trainer creates
the flag file and sleeps; the test waits for the file and sends SIGKILL. Each test runs two
`peagle train` processes (~10-20 s on 2 cores).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from peagle_ext.testing import make_chat_jsonl, make_tiny_verifier
from tests.helpers import ROOT, subprocess_env

MAX_STEPS = 8
CHECKPOINT_EVERY = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("crash")
    return make_tiny_verifier(d / "verifier"), make_chat_jsonl(d / "chat.jsonl", n=14, turns=1, words=(4, 12))


def _options(tiny):
    v, data = tiny
    return dict(
        verifier=str(v),
        data=str(data),
        max_steps=MAX_STEPS,
        seq_len=64,
        num_depths=3,
        num_layers=1,
        draft_vocab_size=None,
        dtype="float32",
        device="cpu",
        checkpoint_every=CHECKPOINT_EVERY,
        val_every=4,
        val_fraction=0.15,
        warmup_steps=1,
        lr=3e-3,
        log_every=1,
        num_conversations=None,
    )


def _cli_args(opts: dict, out: Path, resume=False) -> list[str]:
    args = ["train", "--output", str(out), "--no-progress"]
    for k, val in opts.items():
        args += ["--" + k.replace("_", "-"), "none" if val is None else str(val)]
    return args + (["--resume"] if resume else [])


@pytest.fixture(scope="module")
def uninterrupted(tiny, tmp_path_factory):
    """The reference: the same run, never killed (in-process: same settings, same bits)."""
    from peagle_ext.train import TrainSettings, train

    out = tmp_path_factory.mktemp("reference") / "run"
    torch.set_num_threads(1)
    r = train(TrainSettings(output=str(out), progress=False, **_options(tiny)))
    return _weights(r.final_dir), _train_losses(out)


def _weights(d):
    from safetensors.torch import load_file

    return load_file(str(Path(d) / "model.safetensors"))


def _train_losses(out: Path) -> dict[int, float]:
    recs = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in recs if r.get("split") == "train"]
    assert len(steps) == len(set(steps)), f"a step was logged twice: {steps}"
    return {r["step"]: r["loss"] for r in recs if r.get("split") == "train"}


def _kill_at(tiny, out: Path, point: str, step: int, timeout=90.0, before_kill=None):
    """Start `peagle train`, wait until it pauses at (point, step), call before_kill(process,
    log path) if given, SIGKILL it."""
    flag = out.parent / f"paused-{point}-{step}"
    log = open(out.parent / f"killed-{point}-{step}.log", "w")
    p = subprocess.Popen(
        [sys.executable, "-m", "peagle_ext.cli", *_cli_args(_options(tiny), out)],
        cwd=str(ROOT),
        env=subprocess_env(PEAGLE_TEST_PAUSE=f"{point}:{step}:{flag}"),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        t0 = time.time()
        while not flag.exists():
            if p.poll() is not None:
                log.close()
                pytest.fail(
                    f"trainer exited (rc {p.returncode}) before pausing at {point}:{step}:\n"
                    + (out.parent / f"killed-{point}-{step}.log").read_text()[-3000:]
                )
            if time.time() - t0 > timeout:
                pytest.fail(f"trainer did not reach {point}:{step} in {timeout}s")
            time.sleep(0.05)
        if before_kill is not None:
            before_kill(p, out.parent / f"killed-{point}-{step}.log")
        os.kill(p.pid, signal.SIGKILL)
        assert p.wait(timeout=30) == -signal.SIGKILL
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
        log.close()


def _assert_every_listed_checkpoint_loads(out: Path) -> list[int]:
    from peagle_ext.model import PEagleDraftModel
    from peagle_ext.train import list_checkpoints
    from peagle_ext.train.checkpoint import read_trainer_state

    steps = []
    for step, d in list_checkpoints(out):
        PEagleDraftModel.from_pretrained(d)  # config + every tensor, validated
        state = read_trainer_state(d)
        assert state["step"] == step and {"optimizer", "scheduler", "rng"} <= set(state)
        steps.append(step)
    return steps


def _resume_and_compare(tiny, out: Path, uninterrupted, *, expect_from: int):
    ref_weights, ref_losses = uninterrupted
    r = subprocess.run(
        [sys.executable, "-m", "peagle_ext.cli", *_cli_args(_options(tiny), out, resume=True)],
        cwd=str(ROOT),
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"at step {expect_from}" in r.stderr, r.stderr[-3000:]
    assert not list(out.glob("*.tmp")) and not list(out.glob("*.old")), "leftovers of the killed write remain"
    got = _weights(out / "final")
    assert set(got) == set(ref_weights)
    for k in got:
        assert torch.equal(got[k], ref_weights[k]), f"{k} differs from the uninterrupted run"
    assert _train_losses(out) == ref_losses


def test_sigkill_during_training_then_resume(tiny, tmp_path, uninterrupted):
    out = tmp_path / "run"
    _kill_at(tiny, out, "step", 5)  # checkpoint-3 written, steps 4 and 5 done, not saved
    assert _assert_every_listed_checkpoint_loads(out) == [3]
    assert max(_train_losses(out)) == 5
    _resume_and_compare(tiny, out, uninterrupted, expect_from=3)  # loses steps 4-5 only


def test_sigkill_while_checkpoint_holds_only_the_weights(tiny, tmp_path, uninterrupted):
    out = tmp_path / "run"
    _kill_at(tiny, out, "weights", 6)
    tmp = out / "checkpoint-6.tmp"
    assert (tmp / "model.safetensors").is_file() and not (tmp / "trainer_state.json").exists()
    assert _assert_every_listed_checkpoint_loads(out) == [3]
    _resume_and_compare(tiny, out, uninterrupted, expect_from=3)


def test_sigkill_before_the_checkpoint_rename(tiny, tmp_path, uninterrupted):
    """Every file of checkpoint-6 written, COMPLETE marker included, but still under its .tmp
    name: not a checkpoint yet (the rename is the commit point)."""
    out = tmp_path / "run"
    _kill_at(tiny, out, "written", 6)
    tmp = out / "checkpoint-6.tmp"
    assert (tmp / "COMPLETE").is_file() and (tmp / "trainer_state.json").is_file()
    assert _assert_every_listed_checkpoint_loads(out) == [3]
    _resume_and_compare(tiny, out, uninterrupted, expect_from=3)


def test_sigusr1_prints_the_stacks_of_a_stuck_run_and_it_goes_on(tiny, tmp_path):
    """A run that seems stuck (here: paused by the test hook) answers SIGUSR1 with every thread's
    Python stack on stderr, and keeps running."""

    def dump(p, log):
        os.kill(p.pid, signal.SIGUSR1)
        t0 = time.time()
        while "in test_pause" not in log.read_text() and time.time() - t0 < 30:
            time.sleep(0.1)
        text = log.read_text()
        assert "SIGUSR1: the Python stacks" in text and "in test_pause" in text
        # every thread is reported, the hidden-state thread too (mid-forward or waiting for work)
        assert text.count("most recent call last") >= 2
        assert p.poll() is None  # still running

    _kill_at(tiny, tmp_path / "run", "step", 1, before_kill=dump)


def test_sigusr1_stacks_name_a_thread_waiting_in_a_call_that_releases_the_gil(capfd):
    """In-process: installing twice keeps one printing thread, and a thread blocked in C (here an
    Event wait) is reported with its Python frames while the main thread keeps running."""
    import threading

    from peagle_ext import cli

    cli._stacks_on_sigusr1()
    first = cli._STACKS_THREAD
    cli._stacks_on_sigusr1()
    assert first is not None and first.is_alive() and cli._STACKS_THREAD is first

    release = threading.Event()

    def waiting_for_release_event():
        release.wait(60)

    t = threading.Thread(target=waiting_for_release_event, name="blocked-in-c")
    t.start()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        err, t0 = "", time.time()
        while "in waiting_for_release_event" not in err and time.time() - t0 < 20:
            time.sleep(0.05)
            err += capfd.readouterr().err
    finally:
        release.set()
        t.join()
    assert f"SIGUSR1: the Python stacks of pid {os.getpid()}" in err
    assert "(blocked-in-c), most recent call last" in err and "in waiting_for_release_event" in err
    assert "peagle-sigusr1-stacks" not in err  # the printing thread leaves itself out
