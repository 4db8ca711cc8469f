"""The trainer and the `peagle` CLI on a tiny random verifier: end-to-end smoke, bitwise resume,
atomic checkpoints, NaN-step skipping, export, config files and bad-input messages."""

import functools
import json
from pathlib import Path

import pytest
import torch

import peagle_ext.train as T
from peagle_ext.testing import make_chat_jsonl, make_tiny_verifier
from tests.helpers import hidden_state_bytes, requires_cuda, run_cli, train_settings

ROOT = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("one_thread")


settings = functools.partial(
    train_settings,
    num_depths=3,
    max_steps=4,
    checkpoint_every=2,
    val_every=2,
    val_fraction=0.15,
    lr=3e-3,
    log_every=1,
)


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))


def test_cli_train_end_to_end_smoke(tiny, tmp_path):
    v, data = tiny
    out = tmp_path / "run"
    r = run_cli(
        [
            "train",
            "--verifier",
            str(v),
            "--data",
            str(data),
            "--output",
            str(out),
            "--max-steps",
            "3",
            "--seq-len",
            "64",
            "--num-depths",
            "3",
            "--num-layers",
            "1",
            "--device",
            "cpu",
            "--draft-vocab-size",
            "64",
            "--dtype",
            "float32",
            "--checkpoint-every",
            "2",
            "--log-every",
            "1",
            "--no-progress",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "per-depth accuracy" in r.stdout and "d0=" in r.stdout and "d2=" in r.stdout
    assert f"checkpoint: {out / 'final'}" in r.stdout and "accuracy.png" in r.stdout
    cfg = json.loads((out / "final" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "peagle" and cfg["draft_vocab_size"] == 64
    w = _weights(out / "final")
    assert w["lm_head.weight"].shape[0] == 64 and int(w["t2d"].sum()) == 64
    assert (out / "loss.png").stat().st_size > 1000 and (out / "accuracy.png").stat().st_size > 1000
    recs = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    steps = [x for x in recs if x.get("split") == "train"]
    assert [x["step"] for x in steps] == [1, 2, 3]
    assert all(len(x["acc"]) == 3 and x["tokens_per_s"] > 0 and "accept_len" in x for x in steps)
    assert any(x.get("split") == "val" for x in recs)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    # where the wall time went, logged and printed: every part, and together no more than the whole
    done = next(x for x in recs if x.get("event") == "done")
    parts = done["time_s"]
    assert set(parts) == {"to_first_step", "steps", "validation", "checkpoints", "final_save"}
    assert all(v >= 0 for v in parts.values()) and parts["steps"] > 0 and parts["validation"] > 0
    assert parts["checkpoints"] > 0 and sum(parts.values()) <= done["wall_s"]
    assert "s to the first step (data, verifier, states, model)" in r.stdout and "s of validation" in r.stdout
    # export for vLLM: bf16 copy with the same keys and config
    r = run_cli(["export", str(out), str(tmp_path / "exported")])
    assert r.returncode == 0, r.stderr
    e = _weights(tmp_path / "exported")
    assert set(e) == set(w) and e["fc.weight"].dtype == torch.bfloat16 and e["d2t"].dtype == torch.int64
    assert json.loads((tmp_path / "exported" / "config.json").read_text()) == cfg


def test_resume_is_bitwise_equal_and_ignores_tmp(tiny, tmp_path):
    from peagle_ext.train import train

    full = train(settings(tiny, tmp_path / "full", max_steps=5, grad_accum=2, seq_partition=2))
    out = tmp_path / "killed"
    r = train(settings(tiny, out, max_steps=5, grad_accum=2, seq_partition=2), stop_after=3)
    assert r.stopped_early and r.final_dir is None
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]  # step 3 not saved: "killed"
    # a half-written checkpoint of a later step must be ignored
    junk = out / "checkpoint-4.tmp"
    junk.mkdir()
    (junk / "model.safetensors").write_bytes(b"garbage")
    nomarker = out / "checkpoint-9"
    nomarker.mkdir()
    res = train(settings(tiny, out, max_steps=5, grad_accum=2, seq_partition=2, resume=True))
    assert res.steps == 5 and not junk.exists()
    a, b = _weights(full.final_dir), _weights(res.final_dir)
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    log = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log if x.get("split") == "train"] == [1, 2, 3, 4, 5]
    full_log = [json.loads(x) for x in (tmp_path / "full" / "log.jsonl").read_text().splitlines()]
    assert [x["loss"] for x in log if x.get("split") == "train"] == [
        x["loss"] for x in full_log if x.get("split") == "train"
    ]


def test_muon_resume_is_bitwise_equal_and_other_optimizer_state_is_refused(tiny, tmp_path):
    from peagle_ext.train import train

    full = train(settings(tiny, tmp_path / "full", max_steps=4, optimizer="muon"))
    start = [json.loads(x) for x in (tmp_path / "full" / "log.jsonl").read_text().splitlines()]
    assert any("Muon on" in x.get("message", "") for x in start if x.get("event") == "model")
    out = tmp_path / "killed"
    train(settings(tiny, out, max_steps=4, optimizer="muon"), stop_after=3)
    res = train(settings(tiny, out, max_steps=4, optimizer="muon", resume=True))
    a, b = _weights(full.final_dir), _weights(res.final_dir)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    adamw = _weights(train(settings(tiny, tmp_path / "adamw", max_steps=4)).final_dir)
    assert not torch.equal(adamw["fc.weight"], a["fc.weight"])
    # an AdamW checkpoint resumed as a Muon run: a named error, not a traceback
    mixed = tmp_path / "mixed"
    train(settings(tiny, mixed, max_steps=4), stop_after=3)
    with pytest.raises(T.TrainError, match="does not fit this run"):
        train(settings(tiny, mixed, max_steps=4, optimizer="muon", resume=True))


def test_muon_under_fsdp_is_refused_before_any_work(tiny, tmp_path, monkeypatch):
    import peagle_ext.train.loop as loop

    closed = []

    class TwoRanks:
        world = 2

        def close(self):
            closed.append(True)

    monkeypatch.setattr(loop.DistContext, "from_env", staticmethod(lambda dist, device: TwoRanks()))
    out = tmp_path / "run"
    with pytest.raises(T.TrainError, match="not --dist fsdp"):
        loop.train(settings(tiny, out, optimizer="muon", dist="fsdp"))
    assert closed and not out.exists()


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    from peagle_ext.train import COMPLETE_MARKER, list_checkpoints, save_checkpoint
    from tests.helpers import make_model

    m = make_model(torch.Generator().manual_seed(0), num_layers=1, k=2)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad])
    sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, m, opt, sch, {"step": step}, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 3]
    assert not list(tmp_path.glob("*.tmp")) and (tmp_path / "checkpoint-3" / COMPLETE_MARKER).is_file()
    (tmp_path / "checkpoint-7.tmp").mkdir()
    (tmp_path / "checkpoint-8").mkdir()  # no marker: incomplete
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 3]
    with torch.no_grad():
        m.fc.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="refusing to write checkpoint 4"):
        save_checkpoint(tmp_path, 4, m, opt, sch, {"step": 4}, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 3]


def test_nan_step_is_skipped(tiny, tmp_path, monkeypatch):
    import dataclasses

    import peagle_ext.train as T
    from peagle_ext.train.dataset import examples_to as orig

    calls = {"n": 0}

    def poisoned(examples, device, **kw):
        ex = orig(examples, device, **kw)
        calls["n"] += 1
        if calls["n"] == 2:  # the 2nd training step's micro-batch gets a NaN hidden state
            hidden = ex.hidden.clone()
            hidden[3] = float("nan")
            ex = dataclasses.replace(ex, hidden=hidden)
        return ex

    monkeypatch.setattr("peagle_ext.train.loop.examples_to", poisoned)
    out = tmp_path / "nan"
    r = T.train(settings(tiny, out, max_steps=3, checkpoint_every=1, keep_checkpoints=3, val_every=100))
    assert r.skipped_steps == 1
    log = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    assert any(x.get("event") == "nan" and x["step"] == 2 for x in log)
    assert [x["skipped"] for x in log if x.get("split") == "train"] == [False, True, False]
    w1, w2, w3 = (_weights(out / f"checkpoint-{i}") for i in (1, 2, 3))
    assert all(torch.equal(w1[k], w2[k]) for k in w1)  # the skipped step changed nothing
    assert not all(torch.equal(w2[k], w3[k]) for k in w2)
    assert all(torch.isfinite(t).all() for w in (w1, w2, w3) for t in w.values() if t.is_floating_point())


def test_bad_inputs_have_clear_messages(tiny, tmp_path):
    from peagle_ext.train import TrainError, settings_from, train

    v, data = tiny
    with pytest.raises(ValueError, match="not found"):
        train(settings(tiny, tmp_path / "a", verifier=str(tmp_path / "nope")))
    empty_dir = tmp_path / "empty_verifier"
    empty_dir.mkdir()
    with pytest.raises(ValueError, match="config.json"):
        train(settings(tiny, tmp_path / "b", verifier=str(empty_dir)))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="(?i)empty"):
        train(settings(tiny, tmp_path / "c", data=str(empty)))
    with pytest.raises(ValueError, match="(?i)does not exist|not found|no such"):
        train(settings(tiny, tmp_path / "d", data=str(tmp_path / "missing.jsonl")))
    with pytest.raises(TrainError, match="--resume: no complete checkpoint"):
        train(settings(tiny, tmp_path / "e", resume=True))
    done = tmp_path / "done"
    train(settings(tiny, done, max_steps=1, val_fraction=0.0))
    with pytest.raises(TrainError, match="already holds checkpoints"):
        train(settings(tiny, done, max_steps=1, val_fraction=0.0))
    assert (done / "checkpoint-1").is_dir()
    with pytest.raises(TrainError, match="--seq-len must be >= 8"):
        settings(tiny, tmp_path / "f", seq_len=4).validate()
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max_stepz: 3\n")
    with pytest.raises(TrainError, match="unknown option 'max_stepz'"):
        settings_from({}, str(cfg))
    # a tokenizer without a chat template
    import shutil

    nochat = tmp_path / "nochat"
    shutil.copytree(v, nochat)
    tc = json.loads((nochat / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (nochat / "tokenizer_config.json").write_text(json.dumps(tc))
    for f in nochat.glob("chat_template.*"):
        f.unlink()
    with pytest.raises(ValueError, match="(?i)chat template"):
        train(settings(tiny, tmp_path / "g", verifier=str(nochat)))
    # CLI: exit code 2 and a one-line message, no traceback
    r = run_cli(
        [
            "train",
            "--verifier",
            str(tmp_path / "nope"),
            "--data",
            str(data),
            "--output",
            str(tmp_path / "h"),
            "--max-steps",
            "1",
        ]
    )
    assert r.returncode == 2 and "peagle train: error:" in r.stderr and "Traceback" not in r.stderr


def test_truncation_is_logged_and_resume_rejects_other_verifier(tiny, tmp_path):
    from peagle_ext.train import TrainError, train

    out = tmp_path / "t"
    longer = make_chat_jsonl(tmp_path / "long.jsonl", n=8, turns=3, words=(8, 16))
    train(settings(tiny, out, data=str(longer), seq_len=64, max_steps=2))
    log = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    ev = [x for x in log if x.get("event") == "truncated"]
    assert ev and ev[0]["count"] > 0 and "--seq-len 64" in ev[0]["message"]
    other = make_tiny_verifier(tmp_path / "wide", hidden=96, heads=2, layers=6)
    with pytest.raises(TrainError, match="differ from the checkpoint"):
        train(settings(tiny, out, data=str(longer), seq_len=64, max_steps=3, resume=True, verifier=str(other)))


def test_hidden_size_mismatch_on_resume(tiny, tmp_path):
    """Same settings but the verifier directory now holds a model of another width."""
    import shutil

    from peagle_ext.train import TrainError, train

    v, data = tiny
    vdir = tmp_path / "v"
    shutil.copytree(v, vdir)
    out = tmp_path / "r"
    train(settings(tiny, out, verifier=str(vdir), max_steps=2, val_fraction=0.0))
    shutil.rmtree(vdir)
    make_tiny_verifier(vdir, hidden=96, heads=2, layers=6)
    with pytest.raises(TrainError, match="verifier/draft hidden size mismatch"):
        train(settings(tiny, out, verifier=str(vdir), max_steps=3, val_fraction=0.0, resume=True))


def test_config_file_and_flag_precedence(tmp_path):
    from peagle_ext.cli import build_parser
    from peagle_ext.train import TrainSettings, settings_from

    cfg = tmp_path / "run.yaml"
    cfg.write_text("max-steps: 7\nlr: 0.01\nschedule: linear\ndraft_vocab_size: 128\n")
    args = build_parser().parse_args(["train", "--config", str(cfg), "--lr", "0.02", "--draft-vocab-size", "none"])
    cli = {k: getattr(args, k) for k in TrainSettings.field_names() if hasattr(args, k)}
    s = settings_from(cli, args.config)
    assert s.max_steps == 7 and s.lr == 0.02 and s.schedule == "linear" and s.draft_vocab_size is None
    j = tmp_path / "run.json"
    j.write_text(json.dumps({"num_depths": 5, "attention": "cross"}))
    s = settings_from({}, str(j))
    assert s.num_depths == 5 and s.attention == "cross" and s.seq_len == TrainSettings().seq_len


def test_lr_schedule_shapes():
    from peagle_ext.train import TrainSettings, lr_lambda

    f = lr_lambda(TrainSettings(max_steps=110, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1))
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0) and f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.55) and f(110) == pytest.approx(0.1)
    g = lr_lambda(TrainSettings(max_steps=110, warmup_steps=10, schedule="linear", min_lr_ratio=0.0))
    assert g(60) == pytest.approx(0.5) and g(110) == pytest.approx(0.0)


@requires_cuda
@pytest.mark.parametrize("hidden_cache_gb", [4.0, 0.0])
def test_train_on_cuda_smoke(tiny, tmp_path, hidden_cache_gb):
    """The same trainer on the GPU (head dim 64, as the CUDA attention needs): bf16 autocast, fp32
    master weights, finite loss, validations, a final dir; with the verifier's states cached and
    recomputed every step (a step's rows, and a validation forward's, in one batched pass)."""
    from peagle_ext.testing import make_tiny_verifier
    from peagle_ext.train import train

    v = make_tiny_verifier(tmp_path / "v128", hidden=128, heads=2)
    r = train(
        settings(
            (v, tiny[1]),
            tmp_path / "gpu",
            device="cuda",
            dtype="auto",
            max_steps=4,
            seq_partition=2,
            attention="cross",
            batch_size=2,
            val_fraction=0.2,
            val_every=2,
            hidden_cache_gb=hidden_cache_gb,
        )
    )
    assert r.final_dir is not None and r.skipped_steps == 0 and r.val is not None
    w = _weights(r.final_dir)
    assert w["fc.weight"].dtype == torch.float32 and all(
        torch.isfinite(t).all() for t in w.values() if t.is_floating_point()
    )


def test_hidden_state_disk_cache_is_reused_and_bitwise_equal(tiny, tmp_path, monkeypatch):
    import peagle_ext.data as D
    from peagle_ext.train import train

    mem = train(settings(tiny, tmp_path / "mem", max_steps=3))
    cache = tmp_path / "hcache"
    a = train(settings(tiny, tmp_path / "a", max_steps=3, hidden_cache_dir=str(cache)))
    assert (cache / "train" / "index.json").is_file() and list((cache / "train").glob("shard-*.safetensors"))

    def no_verifier(*a, **k):
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(D, "verifier_hidden_states", no_verifier)
    b = train(settings(tiny, tmp_path / "b", max_steps=3, hidden_cache_dir=str(cache)))
    wm, wa, wb = (_weights(r.final_dir) for r in (mem, a, b))
    for k in wm:
        assert torch.equal(wm[k], wa[k]) and torch.equal(wa[k], wb[k]), k
    with pytest.raises(ValueError, match="different settings"):
        train(settings(tiny, tmp_path / "c", max_steps=3, seq_len=48, hidden_cache_dir=str(cache)))


def test_recomputed_hidden_states_train_like_cached_ones(tiny, tmp_path, monkeypatch):
    """--hidden-cache-gb 0 (states recomputed every step, one batched verifier pass for the step's
    rows) trains like the in-memory cache (states per row) up to float rounding, which AdamW's
    normalised update can lift to ~1e-5 on weights whose gradients are near 0."""
    import peagle_ext.data as D
    from peagle_ext.train import train

    mem = train(settings(tiny, tmp_path / "mem", max_steps=3, batch_size=3))
    calls = []
    real = D.verifier_hidden_states_many
    monkeypatch.setattr(D, "verifier_hidden_states_many", lambda *a, **k: calls.append(len(a[1])) or real(*a, **k))
    rec = train(settings(tiny, tmp_path / "rec", max_steps=3, batch_size=3, hidden_cache_gb=0))
    assert calls.count(3) >= 3  # every step's 3 rows in one pass
    # the log says what caching them would take and how
    ev = [json.loads(x) for x in (tmp_path / "rec" / "log.jsonl").read_text().splitlines()]
    hidden = next(e for e in ev if e.get("event") == "hidden")
    assert hidden["need_bytes"] > 0 and "more than --hidden-cache-gb 0:" in hidden["message"]
    assert "--hidden-cache-dir" in hidden["message"]
    wm, wr = _weights(mem.final_dir), _weights(rec.final_dir)
    for k in wm:
        torch.testing.assert_close(wr[k], wm[k], rtol=1e-4, atol=2e-5)
    assert rec.train["loss"] == pytest.approx(mem.train["loss"], rel=1e-5)


def test_a_cache_too_small_for_every_row_keeps_what_fits(tiny, tmp_path):
    """--hidden-cache-gb below what every row needs keeps as many rows as fit, validation's first,
    recomputes the rest, and trains like the full cache up to float rounding."""
    from peagle_ext.train import train

    mem = train(settings(tiny, tmp_path / "mem", max_steps=3, batch_size=3))
    per_row, n_train, n_val = hidden_state_bytes(settings, tiny, tmp_path / "rec", batch_size=3)
    need = per_row * (n_train + n_val)
    kept = n_val + 1  # validation's rows and one training row
    part = train(
        settings(tiny, tmp_path / "part", max_steps=3, batch_size=3, hidden_cache_gb=per_row * (kept + 0.5) / 2**30)
    )
    ev = [json.loads(x) for x in (tmp_path / "part" / "log.jsonl").read_text().splitlines()]
    hidden = next(e for e in ev if e.get("event") == "hidden")
    assert hidden["kept_rows"] == kept and hidden["need_bytes"] == need
    assert f"{kept} rows ({n_val} of them validation's) are kept" in hidden["message"]
    assert f"the other {n_train - 1} recomputed at each use" in hidden["message"]
    wm, wp = _weights(mem.final_dir), _weights(part.final_dir)
    for k in wm:
        torch.testing.assert_close(wp[k], wm[k], rtol=1e-4, atol=2e-5)
    assert part.train["loss"] == pytest.approx(mem.train["loss"], rel=1e-5)


def test_an_fp8_cache_keeps_every_row_where_the_training_dtype_would_not_fit(tiny, tmp_path):
    """--hidden-cache-dtype fp8: a row takes a byte a feature plus two float32 scales a position, so
    a --hidden-cache-gb too small for every row in float32 holds them all in fp8; the drafter
    trains on the rounded states, close to the unrounded run."""
    from peagle_ext.train import train

    full = train(settings(tiny, tmp_path / "f32", max_steps=3, batch_size=3))
    per_row, n_train, n_val = hidden_state_bytes(settings, tiny, tmp_path / "rec", batch_size=3)
    n, seq = n_train + n_val, settings(tiny, tmp_path / "x").seq_len
    feat = per_row / 4 / seq  # float32 bytes a row = seq_len x features x 4
    fp8_need = n * seq * (feat + 8)
    gb = (fp8_need + 0.5 * per_row) / 2**30
    assert fp8_need < gb * 2**30 < per_row * n  # fits in fp8, not in float32
    r = train(settings(tiny, tmp_path / "fp8", max_steps=3, batch_size=3, hidden_cache_gb=gb, hidden_cache_dtype="fp8"))
    ev = [json.loads(x) for x in (tmp_path / "fp8" / "log.jsonl").read_text().splitlines()]
    hidden = next(e for e in ev if e.get("event") == "hidden")
    assert "as fp8" in hidden["message"] and "kept_rows" not in hidden and "need_bytes" not in hidden
    wf, w8 = _weights(full.final_dir), _weights(r.final_dir)
    assert any(not torch.equal(wf[k], w8[k]) for k in wf)  # the states were rounded
    assert r.train["loss"] == pytest.approx(full.train["loss"], rel=0.05)


@requires_cuda
def test_an_fp8_cache_trains_on_cuda(tiny, tmp_path):
    """fp8 rows cross to the GPU in fp8, are dequantized there and prefetched like any cached row:
    the same weights with and without prefetch."""
    from peagle_ext.testing import make_tiny_verifier
    from peagle_ext.train import train

    v = make_tiny_verifier(tmp_path / "v128", hidden=128, heads=2)
    kw = dict(device="cuda", dtype="float32", max_steps=4, batch_size=2, hidden_cache_dtype="fp8")
    a = train(settings((v, tiny[1]), tmp_path / "a", prefetch=False, **kw))
    b = train(settings((v, tiny[1]), tmp_path / "b", prefetch=True, **kw))
    wa, wb = _weights(a.final_dir), _weights(b.final_dir)
    assert all(torch.allclose(wa[k], wb[k], rtol=1e-5, atol=1e-6) for k in wa)
    assert "as fp8" in (tmp_path / "a" / "log.jsonl").read_text()


def test_acceptance_length_formula():
    # tokens per round as `peagle eval` counts them: the bonus token + the accepted drafts
    assert T.acceptance_length([1.0, 1.0, 1.0]) == 4.0
    assert abs(T.acceptance_length([0.8, 0.5, 0.5]) - (1 + 0.8 + 0.4 + 0.2)) < 1e-12
    assert T.acceptance_length([0.0, 0.9]) == 1.0
    assert T.acceptance_length([]) == 1.0


@pytest.mark.parametrize("batch_size", [1, 2, 3])
def test_validation_runs_batch_size_rows_per_forward(batch_size):
    """evaluate() runs one forward per --batch-size validation rows side by side, as training
    does. Depth 0 holds every loss position (no sampling), so its counts do not depend on the
    grouping; the deeper depths' COD samples do, and still count only loss positions."""
    import contextlib

    from peagle_ext.testing import synthetic_example
    from peagle_ext.train.loop import evaluate
    from tests.helpers import H, V, make_model

    model = make_model(torch.Generator().manual_seed(0), num_layers=1, k=3).double()
    rows = [
        synthetic_example(48, hidden=H, vocab=V, dtype=torch.float64, doc_len=(8, 20), seed=i, avoid_id=V)
        for i in range(5)
    ]

    class ValRows:
        def __init__(self):
            self.rows, self.asked = rows, []

        def get_many(self, indices):
            self.asked.append(list(indices))
            return [rows[i] for i in indices]

    def run(bs):
        hs, forwards = ValRows(), []
        real = model.forward
        model.forward = lambda ex, lay: forwards.append(ex.input_ids.numel()) or real(ex, lay)
        try:
            s = T.TrainSettings(num_depths=3, batch_size=bs, seed=0)
            summary = evaluate(model, hs, s, contextlib.nullcontext, torch.device("cpu"))
        finally:
            del model.forward
        return summary, hs.asked, forwards

    got, asked, forwards = run(batch_size)
    assert asked == [list(range(i, min(i + batch_size, 5))) for i in range(0, 5, batch_size)]
    assert forwards == [48 * len(a) for a in asked]
    one_by_one = run(1)[0]
    assert got["counted"][0] == one_by_one["counted"][0] == sum(int(r.loss_mask.sum()) for r in rows)
    assert got["acc"][0] == one_by_one["acc"][0]
    assert all(0 < c <= got["counted"][0] for c in got["counted"][1:])
