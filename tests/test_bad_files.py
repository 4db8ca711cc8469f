"""Bad files and run-directory hazards: the trainer state is never unpickled, symlinks and index
entries cannot reach outside the run or the cache, export and a second trainer never destroy
data, --resume notices changed inputs, and every bad value read from a file (config.json,
--config, data lines, cache index, bench lines) is an error naming it (docs/bad_inputs.md)."""

from __future__ import annotations

import errno
import json
import pickle
import shutil
import threading
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_run_inputs, train_settings

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_run_inputs(tmp_path_factory.mktemp("tiny"), n=8, words=(4, 10))


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory):
    """A finished 2-step run (checkpoint-1, checkpoint-2, final/) to copy from."""
    from peagle_ext.train import train

    out = tmp_path_factory.mktemp("run") / "run"
    train(train_settings(tiny, out))
    return out


class _Exploit:
    flag: Path

    def __reduce__(self):
        return (Path.touch, (self.flag,))


# -- code execution and files outside the run ---------------------------------------------------
def test_trainer_state_is_json_and_safetensors_and_a_pickle_never_runs(trained, tmp_path):
    from peagle_ext.train.checkpoint import LEGACY_TRAINER_STATE, TRAINER_STATE, TRAINER_TENSORS, read_trainer_state

    ck = trained / "checkpoint-2"
    assert (ck / TRAINER_STATE).is_file() and (ck / TRAINER_TENSORS).is_file()
    assert not (ck / LEGACY_TRAINER_STATE).exists()
    st = read_trainer_state(ck)
    assert st["step"] == 2 and isinstance(st["rng"]["python"], tuple) and st["optimizer"]["state"]
    # a checkpoint in the old pickle format whose pickle would run code: refused, nothing runs
    old = tmp_path / "checkpoint-2"
    shutil.copytree(ck, old)
    (old / TRAINER_STATE).unlink()
    flag = tmp_path / "pwned"
    bomb = _Exploit()
    bomb.flag = flag
    (old / LEGACY_TRAINER_STATE).write_bytes(pickle.dumps({"step": bomb}))
    with pytest.raises(pickle.UnpicklingError):
        read_trainer_state(old)
    assert not flag.exists()


def test_symlinked_checkpoint_is_ignored_and_never_pruned_through(trained, tmp_path):
    import peagle_ext.train as T
    from tests.helpers import make_model

    outside = tmp_path / "outside"
    shutil.copytree(trained / "checkpoint-2", outside)
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint-999").symlink_to(outside)  # would shadow every newer checkpoint
    assert T.list_checkpoints(out) == []
    m = make_model(torch.Generator().manual_seed(1), num_layers=1, k=2)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad])
    sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    (out / "checkpoint-3.tmp").symlink_to(outside)  # a stale "tmp" that is a link: unlinked, not emptied
    for step in (1, 2, 3):
        T.save_checkpoint(out, step, m, opt, sch, {"step": step}, keep=1)
    assert [s for s, _ in T.list_checkpoints(out)] == [3]
    assert (outside / "COMPLETE").is_file() and (outside / "model.safetensors").is_file()


# -- data loss ------------------------------------------------------------------------------------
def test_export_replaces_only_an_earlier_export(trained, tiny, tmp_path):
    from peagle_ext.train import TrainError, export

    src = trained / "final"
    verifier, _ = tiny
    with pytest.raises(TrainError, match="not a P-EAGLE export"):
        export(str(src), str(verifier))  # a verifier's directory holds a config.json too
    with pytest.raises(TrainError, match="source or contains it"):
        export(str(src), str(trained))  # an ancestor of SRC
    assert (trained / "checkpoint-2" / "COMPLETE").is_file()
    link = tmp_path / "link"
    link.symlink_to(trained)
    with pytest.raises(TrainError, match="symlink"):
        export(str(src), str(link))
    # the user's DST.tmp / DST.old are never touched; an earlier export is replaced
    dst = tmp_path / "exp"
    for side in ("exp.tmp", "exp.old"):
        (tmp_path / side).mkdir()
        (tmp_path / side / "keep.txt").write_text("mine")
    export(str(src), str(dst))
    export(str(src), str(dst), dtype="float32")
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors"]
    assert all((tmp_path / s / "keep.txt").read_text() == "mine" for s in ("exp.tmp", "exp.old"))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".exp.")]  # no leftovers
    (dst / "notes.txt").write_text("added by hand")  # no longer only an export
    with pytest.raises(TrainError, match="not a P-EAGLE export"):
        export(str(src), str(dst))


def test_second_trainer_on_the_same_output_is_refused(tiny, tmp_path):
    from peagle_ext.train import TrainError, train
    from peagle_ext.train.run_guard import OutputLock

    out = tmp_path / "run"
    out.mkdir()
    held = OutputLock(out).acquire()  # another process's run, as far as flock is concerned
    try:
        for resume in (False, True):
            with pytest.raises(TrainError, match="in use by another peagle train"):
                train(train_settings(tiny, out, resume=resume))
    finally:
        held.release()
    assert train(train_settings(tiny, out, max_steps=1)).steps == 1


def test_resume_refuses_changed_inputs_unless_accepted(tiny, tmp_path):
    from peagle_ext.train import TrainError, train

    v, data = tiny
    mine = tmp_path / "chat.jsonl"
    shutil.copy(data, mine)
    out = tmp_path / "run"
    train(train_settings(tiny, out, data=str(mine), max_steps=2))
    lines = mine.read_text().splitlines(keepends=True)
    mine.write_text("".join(lines[1:] + lines[:1]))  # same size, edited in place
    with pytest.raises(
        TrainError, match=r"inputs changed since checkpoint-2 was written: data file .*chat.jsonl \(changed\)"
    ):
        train(train_settings(tiny, out, data=str(mine), max_steps=3, resume=True))
    r = train(train_settings(tiny, out, data=str(mine), max_steps=3, resume=True, accept_changed_inputs=True))
    assert r.steps == 3
    log = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    assert any(x.get("event") == "inputs_changed" for x in log)


def test_resume_refuses_another_revision_of_a_hub_verifier(tiny, tmp_path, monkeypatch):
    """A hub verifier is fingerprinted by its cached snapshot: a resume after the cache's main
    branch moved to another commit is refused, naming the verifier's files; a hub verifier not in
    the cache has nothing to compare yet."""
    from peagle_ext.testing import make_fake_hub_cache
    from peagle_ext.train import TrainError, train
    from peagle_ext.train.run_guard import check_inputs_unchanged, input_fingerprints

    v, _ = tiny
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"
    hub = "tiny-org/tiny-llama"
    make_fake_hub_cache(tmp_path / "hf", hub, v, commit="a" * 40)
    train(train_settings(tiny, out, verifier=hub, max_steps=2))
    ck = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["inputs"]["verifier"]
    assert ck and all(f"snapshots/{'a' * 40}/" in name for name in ck)
    assert train(train_settings(tiny, out, verifier=hub, max_steps=3, resume=True)).steps == 3
    make_fake_hub_cache(tmp_path / "hf", hub, v, commit="b" * 40)  # refs/main now names another commit
    with pytest.raises(TrainError, match=r"inputs changed since checkpoint-3 was written: verifier file .*aaaa"):
        train(train_settings(tiny, out, verifier=hub, max_steps=4, resume=True))
    absent = train_settings(tiny, out, verifier="tiny-org/not-cached")
    fp = input_fingerprints(absent)
    assert fp["verifier"] is None
    assert check_inputs_unchanged({"verifier": ck}, fp, out / "checkpoint-3", False) is None


def test_background_thread_is_stopped_on_every_exit(tiny, tmp_path, monkeypatch):
    from peagle_ext.train import TrainError, train
    from peagle_ext.train.distributed import DistContext

    def refuse(*a, **k):
        raise TrainError("refusing to write checkpoint 1 (test)")

    monkeypatch.setattr(DistContext, "save_checkpoint", refuse)
    with pytest.raises(TrainError, match="test"):
        train(train_settings(tiny, tmp_path / "run", background_hidden=True))
    assert not [t for t in threading.enumerate() if t.name == "peagle-hidden-states"]


def test_disk_full_during_a_checkpoint_names_it(tiny, tmp_path, monkeypatch):
    import peagle_ext.train.checkpoint as C
    from peagle_ext.train import TrainError, train

    def full(d, state):
        raise OSError(errno.ENOSPC, "No space left on device", str(d / C.TRAINER_TENSORS))

    monkeypatch.setattr(C, "save_trainer_state", full)
    out = tmp_path / "run"
    with pytest.raises(TrainError, match=r"cannot write checkpoint 1 to .*checkpoint-1.tmp: No space left"):
        train(train_settings(tiny, out))
    assert not (out / "checkpoint-1.tmp").exists()


# -- one error style --------------------------------------------------------------------------------
CONFIG_CASES = [
    ("seq_len: sixty", "--seq-len must be an int, got 'sixty'"),
    ("lr: '3e-3'", "--lr must be a float"),
    ("lr: 3e-3", "YAML also reads 3e-3"),
    ("device: 0", "--device must be a str"),
    ("norm_before_residual: 'false'", "--norm-before-residual must be a bool"),
    ("mask_token_id: true", "--mask-token-id must be an int or none"),
    ("num_depths: 3.9", "--num-depths must be an int, got 3.9"),
    ("aux_layer_ids: []", "--aux-layer-ids must list at least one"),
    ("grad_clip: -1", "--grad-clip must be a finite number > 0, or 0"),
    ("grad_clip: .nan", "--grad-clip must be a number, got NaN"),
    ("lr: .inf", "--lr must be finite"),
    ("hidden_cache_gb: -1", "--hidden-cache-gb must be a finite number >= 0"),
    ("hidden_cache_dtype: fp16", "--hidden-cache-dtype must be auto or fp8"),
    ("{hidden_cache_dtype: fp8, hidden_cache_dir: c}", "--hidden-cache-dtype fp8 is for states kept in memory"),
    ("output: ''", "--output must name a directory"),
    ("rms_eps: 1", "unknown option 'rms_eps'"),
    ("[1, 2]", "must hold a mapping"),
    ("a: [" * 2000, "not valid YAML|nested too deeply"),
]


@pytest.mark.parametrize("text,match", CONFIG_CASES, ids=[c[0][:24] for c in CONFIG_CASES])
def test_config_file_values_are_typed_and_named(tmp_path, text, match):
    from peagle_ext.train import TrainError, settings_from

    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(TrainError, match=match):
        settings_from({}, str(f))


def test_binary_config_file_is_named(tmp_path):
    from peagle_ext.train import TrainError, settings_from

    f = tmp_path / "c.yaml"
    f.write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(TrainError, match=f"--config file {f} is not UTF-8"):
        settings_from({}, str(f))


def _layer(key, value):
    return lambda c: c["transformer_layer_config"].__setitem__(key, value)


CHECKPOINT_CONFIG_CASES = [
    ("heads_0", _layer("num_attention_heads", 0), "num_attention_heads must be an int >= 1"),
    ("act", _layer("hidden_act", "nope"), "hidden_act 'nope' is not an activation"),
    ("rope_type", _layer("rope_parameters", {"rope_type": "bogus", "rope_theta": 1e4}), "rope_type 'bogus'"),
    ("str_size", _layer("hidden_size", "64"), "hidden_size must be an int"),
    ("nan_eps", _layer("rms_norm_eps", float("nan")), "rms_norm_eps must be a number in"),
    ("kv_heads", _layer("num_key_value_heads", 3), "multiple of num_key_value_heads"),
    ("nbr_str", lambda c: c.update(norm_before_residual="false"), "norm_before_residual must be true or false"),
    ("mask_bool", lambda c: c.update(mask_token_id=True), "mask_token_id must be an int"),
    ("aux_empty", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[]), "non-empty list of layer ids"),
    (
        "k_float",
        lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=3.9),
        r"speculative_tokens \(K\) must be in \[1, 64\] \(an int\), got 3.9",
    ),
]


@pytest.mark.parametrize("case,mutate,match", CHECKPOINT_CONFIG_CASES, ids=[c[0] for c in CHECKPOINT_CONFIG_CASES])
def test_checkpoint_config_values_are_checked(tiny_drafter_dir, tmp_path, case, mutate, match):
    from peagle_ext.model import PEagleDraftModel

    d = tmp_path / "m"
    shutil.copytree(tiny_drafter_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    mutate(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match) as e:
        PEagleDraftModel.from_pretrained(d)
    assert "config.json" in str(e.value)


def test_deeply_nested_checkpoint_config(tiny_drafter_dir, tmp_path):
    from peagle_ext.model import PEagleDraftModel

    d = tmp_path / "m"
    shutil.copytree(tiny_drafter_dir, d)
    (d / "config.json").write_text("[" * 100000)
    with pytest.raises(ValueError, match="config.json"):
        PEagleDraftModel.from_pretrained(d)


DATA_LINES = [
    ("[" * 50000, "nested too deeply"),
    ('{"messages": [{"role": "user", "content": "hi \\ud800"}, {"role": "assistant", "content": "yo"}]}', "surrogate"),
    ('{"messages": [{"role": "user", "content": "hi"}], "n": ' + "9" * 5000 + "}", "unreadable JSON value"),
]


@pytest.mark.parametrize("line,match", DATA_LINES, ids=["deep", "surrogate", "digits"])
def test_data_lines_name_file_and_line(tiny, tmp_path, line, match):
    from peagle_ext.data import DataError, load_conversations

    f = tmp_path / "d.jsonl"
    f.write_text(Path(tiny[1]).read_text().splitlines()[0] + "\n" + line + "\n")
    with pytest.raises(DataError, match=f"{f}:2: .*{match}"):
        load_conversations(str(f))


INDEX_CASES = [
    ({"version": 1, "meta": {}, "shards": []}, "shards must be an object"),
    ({"version": 1, "meta": [], "shards": {}}, "meta must be an object"),
    (
        {"version": 1, "meta": {}, "shards": {"0": {"file": "../../x", "sha256": "0" * 64, "bytes": 1, "rows": 1}}},
        "names file '../../x'",
    ),
    ({"version": 1, "meta": {}, "shards": {"0": "x"}}, "shard 0 must be an object"),
    ({"version": 1, "meta": {}, "shards": {"a": {}}}, "not a shard number"),
    (
        {
            "version": 1,
            "meta": {},
            "shards": {"0": {"file": "shard-000000.safetensors", "sha256": "0" * 64, "bytes": "1", "rows": 1}},
        },
        "bytes must be an int",
    ),
]


@pytest.mark.parametrize("index,match", INDEX_CASES, ids=range(len(INDEX_CASES)))
def test_cache_index_of_the_wrong_shape_is_named(tmp_path, index, match):
    from peagle_ext.data import DataError, HiddenStateCache

    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(DataError, match=f"cache index {tmp_path / 'index.json'} is corrupted: .*{match}"):
        HiddenStateCache(tmp_path)


def test_cli_exits_2_with_one_line(tiny, trained, tmp_path, capsys):
    from peagle_ext.cli import main

    v, data = tiny
    bench = tmp_path / "b.jsonl"
    bench.write_text('{"messages": "hi"}\n')
    base = ["--draft", str(trained / "final"), "--verifier", str(v), "--num-prompts", "1", "--max-new-tokens", "2"]
    runs = [
        (["eval", *base, "--device", "tpu"], "--device must be cpu or cuda"),
        (["eval", *base, "--json", str(tmp_path)], "is a directory"),
        (["eval", *base, "--bench", str(bench)], "b.jsonl:1: 'messages' must be a list of objects"),
        (["train", "--verifier", str(v), "--data", str(data), "--output", str(tmp_path / "o"), "--lr", "inf"], "--lr"),
        (["train", "--verifier", str(v), "--output", ""], "--output must name a directory"),
        (["train", "--verifier", str(v), "--grad-clip", "nan"], "--grad-clip must be a number"),
    ]
    for argv, match in runs:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert match in err and "Traceback" not in err, (argv, err)


def test_prepare_parallel_draft_inputs_overflow_and_aliased_outputs():
    from peagle_ext.vllm import DraftBatch, prepare_parallel_draft_inputs

    def call(pos0=0, block_size=16, out=None):
        return prepare_parallel_draft_inputs(
            torch.tensor([5, 6, 7], dtype=torch.int32),
            torch.tensor([pos0, pos0 + 1, pos0 + 2], dtype=torch.int64),
            torch.tensor([9], dtype=torch.int32),
            torch.tensor([0, 3], dtype=torch.int32),
            None,
            torch.randn(3, 4),
            torch.zeros(4),
            torch.full((1, 4), 3, dtype=torch.int32),
            num_spec_tokens=2,
            mask_token_id=1,
            block_size=block_size,
            max_model_len=64,
            out=out,
        )

    with pytest.raises(ValueError, match="block_size must be <= 2147483647"):
        call(block_size=2**62)
    with pytest.raises(ValueError, match="overflow int64"):
        call(pos0=2**63 - 3)
    assert int(call(pos0=2**63 - 7).positions.max()) == 2**63 - 4  # start + len + K - 2 fits: accepted
    for a, b in (("slot_mapping", "positions"), ("is_masked", "is_rejected")):
        out = DraftBatch.empty(3, 1, 2, 4, dtype=torch.float32)
        setattr(out, a, getattr(out, b))
        with pytest.raises(ValueError, match="overlap: every output needs its own memory"):
            call(out=out)
    ops = torch.ops.peagle  # the raw op checks the same
    with pytest.raises(ValueError, match=r"block_size must be in \[1, 2\^31 - 1\]"):
        ops.prepare_parallel_draft_inputs(
            torch.tensor([5], dtype=torch.int32),
            torch.tensor([0]),
            torch.tensor([9], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32),
            None,
            torch.randn(1, 4),
            torch.zeros(4),
            torch.full((1, 1), 3, dtype=torch.int32),
            2,
            1,
            2**62,
            64,
        )
