"""`peagle export` names the verifier by what resolves it (the bundled one by its hub id, a hub id
as given, a local directory by its absolute path) and prints the exact `vllm serve` line."""

import json
import shlex

import pytest
import torch

from peagle_ext import data as D
from peagle_ext.cli import main
from tests.helpers import make_model


def _checkpoint(tmp_path, verifier_name):
    m = make_model(torch.Generator().manual_seed(0), k=3)
    m.config.speculators_config["verifier"]["name_or_path"] = verifier_name
    d = tmp_path / "ckpt"
    m.save_pretrained(d)
    return d


@pytest.mark.parametrize(
    "recorded, flag, want",
    [
        ("smollm2", None, "HuggingFaceTB/SmolLM2-135M-Instruct"),  # a name only peagle resolves
        ("Qwen/Qwen3-8B", None, "Qwen/Qwen3-8B"),
        ("smollm2", "my-org/my-verifier", "my-org/my-verifier"),
    ],
)
def test_export_names_the_verifier_and_prints_the_serve_line(tmp_path, capsys, recorded, flag, want):
    src = _checkpoint(tmp_path, recorded)
    dst = tmp_path / "out"
    assert main(["export", str(src), str(dst)] + (["--verifier", flag] if flag else [])) == 0
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == want
    line = capsys.readouterr().out.strip().splitlines()[-1]
    argv = shlex.split(line)
    assert argv[:3] == ["vllm", "serve", want] and argv[3] == "--speculative-config"
    assert json.loads(argv[4]) == {
        "model": str(dst.resolve()),
        "method": "eagle3",
        "num_speculative_tokens": 3,
        "parallel_drafting": True,
    }


def test_recorded_revision_pins_the_serve_line(tmp_path, capsys):
    src = _checkpoint(tmp_path, "Qwen/Qwen3-8B")
    cfg = json.loads((src / "config.json").read_text())
    cfg["speculators_config"]["verifier"]["revision"] = "0123abc"
    (src / "config.json").write_text(json.dumps(cfg))
    assert main(["export", str(src), str(tmp_path / "out")]) == 0
    argv = shlex.split(capsys.readouterr().out.strip().splitlines()[-1])
    assert argv[:5] == ["vllm", "serve", "Qwen/Qwen3-8B", "--revision", "0123abc"]
    # another verifier named at export time drops the trained one's revision
    assert main(["export", str(src), str(tmp_path / "out2"), "--verifier", "my-org/v"]) == 0
    assert (
        "revision" not in json.loads((tmp_path / "out2" / "config.json").read_text())["speculators_config"]["verifier"]
    )
    assert "--revision" not in capsys.readouterr().out.strip().splitlines()[-1]


def test_local_verifier_is_named_by_its_absolute_path(tmp_path, monkeypatch):
    (tmp_path / "v").mkdir()
    monkeypatch.chdir(tmp_path)
    assert D.verifier_name("v") == str((tmp_path / "v").resolve())
    assert D.verifier_name("./v") == str((tmp_path / "v").resolve())
