"""--report-to (TensorBoard event files read back, W&B offline), --epochs, --eval-every with the
validation printed, and --init-from warm starts."""

import functools
import math

import pytest
import torch

from tests.helpers import train_settings

pytestmark = pytest.mark.usefixtures("one_thread")


settings = functools.partial(
    train_settings, max_steps=3, val_every=2, checkpoint_every=100, val_fraction=0.05, log_every=1
)


def test_tensorboard_and_wandb_offline_with_epochs_and_printed_validation(tiny, tmp_path, monkeypatch, capfd):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from peagle_ext.train import train

    monkeypatch.delenv("WANDB_MODE", raising=False)
    out = tmp_path / "run"
    r = train(settings(tiny, out, epochs=2, report_to=["tensorboard", "wandb"]))
    n_rows = sum(1 for _ in (out / "log.jsonl").read_text().splitlines() if '"split": "train"' in _)
    assert r.steps == n_rows  # log_every 1: one train record per step
    ev = EventAccumulator(str(out / "tensorboard"))
    ev.Reload()
    tags = set(ev.Tags()["scalars"])
    for t in ("loss", "acc_d0", "acc_d1", "accept_len", "lr", "tokens_per_s", "grad_norm", "memory_gib"):
        assert f"train/{t}" in tags, t
    assert {"val/loss", "val/acc_d0", "val/accept_len"} <= tags
    assert [e.step for e in ev.Scalars("train/loss")] == list(range(1, r.steps + 1))
    assert ev.Scalars("val/loss")[-1].value == pytest.approx(r.val["loss"], rel=1e-6)
    assert any((out / "wandb").glob("offline-run-*"))
    err = capfd.readouterr().err
    assert "validation loss" in err and "--epochs 2" in err


def test_epochs_sets_the_step_count(tiny, tmp_path):
    from peagle_ext.train import train

    r1 = train(settings(tiny, tmp_path / "a", epochs=1, val_every=1000))
    r3 = train(settings(tiny, tmp_path / "b", epochs=3, val_every=1000, batch_size=2))
    assert r3.steps == math.ceil(3 * r1.steps / 2)


def test_init_from_warm_starts(tiny, tmp_path):
    from safetensors.torch import load_file

    from peagle_ext.train import TrainError, export, train

    a = train(settings(tiny, tmp_path / "a", max_steps=4))
    export(str(a.final_dir), str(tmp_path / "exported"))  # bf16, as users would pass it
    b = train(settings(tiny, tmp_path / "b", max_steps=1, lr=1e-12, init_from=str(a.final_dir)))
    wa, wb = load_file(str(a.final_dir / "model.safetensors")), load_file(str(b.final_dir / "model.safetensors"))
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-6, atol=1e-6)
    c = train(settings(tiny, tmp_path / "c", max_steps=1, init_from=str(tmp_path / "exported")))
    assert c.final_dir is not None
    with pytest.raises(TrainError, match="--init-from"):
        train(settings(tiny, tmp_path / "d", max_steps=1, init_from=str(tmp_path / "nothing")))
    with pytest.raises(TrainError, match="not a drafter of this shape"):
        train(settings(tiny, tmp_path / "e", max_steps=1, num_layers=2, init_from=str(a.final_dir)))


def test_report_to_is_checked():
    from peagle_ext.train import TrainError, TrainSettings

    with pytest.raises(TrainError, match="--report-to"):
        TrainSettings(report_to="mlflow").validate()
    with pytest.raises(TrainError, match="none cannot be combined"):
        TrainSettings(report_to=["none", "wandb"]).validate()
    assert TrainSettings(report_to="tensorboard,wandb").validate()


def test_cli_flags():
    from peagle_ext.cli import build_parser

    a = build_parser().parse_args(
        ["train", "--report-to", "tensorboard", "--report-to", "wandb", "--eval-every", "7", "--epochs", "1.5"]
        + ["--init-from", "x", "--data", "a.jsonl", "--data", "b.parquet", "--chat-template-kwargs", '{"k": 1}']
    )
    assert a.report_to == ["tensorboard", "wandb"] and a.val_every == 7 and a.epochs == 1.5
    assert a.init_from == "x" and a.data == ["a.jsonl", "b.parquet"] and a.chat_template_kwargs == {"k": 1}
