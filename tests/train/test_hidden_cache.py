"""`peagle hidden-states` and training from its cache: the cache equals the one a run would
compute, `peagle train --hidden-cache-dir` then loads no verifier layer (only the final norm,
lm_head and embeddings, read by name) and ends bit-identical to a run that computed the states
itself, bf16 / fp8 storage, device_map placement, and under torchrun (gloo): 2 ranks write the
same cache as 1, a cache whose writer rank was killed resumes, no rank waits forever, and 2
ranks train from a complete cache."""

import functools
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from peagle_ext import data as D
from peagle_ext.cli import main
from peagle_ext.testing import make_chat_jsonl, make_tiny_verifier
from tests.helpers import assert_same_weights, torchrun, train_settings

pytestmark = pytest.mark.usefixtures("one_thread")
requires_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)

DATA_FLAGS = ["--seq-len", "64", "--num-conversations", "none", "--val-fraction", "0.1"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny verifier and enough data for several 16-row shards per split."""
    d = tmp_path_factory.mktemp("hc")
    v = make_tiny_verifier(d / "verifier", layers=4)
    data = make_chat_jsonl(d / "chat.jsonl", n=170, turns=1, words=(4, 12))
    return v, data


def hidden_states_args(setup, out, *extra):
    v, data = setup
    return ["hidden-states", "--verifier", str(v), "--data", str(data), "--output", str(out), "--no-progress"] + [
        *DATA_FLAGS,
        *extra,
    ]


settings = functools.partial(
    train_settings, max_steps=4, val_every=2, checkpoint_every=2, val_fraction=0.1, log_every=1
)


def cache_files(cache: Path) -> dict:
    """Every shard's bytes and the recorded shard table, per split."""
    out = {}
    for split in ("train", "val"):
        idx = json.loads((cache / split / "index.json").read_text())
        out[split] = (idx["shards"], {p.name: p.read_bytes() for p in sorted((cache / split).glob("shard-*"))})
    return out


@pytest.fixture(scope="module")
def one_rank_cache(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "cache"
    assert main(hidden_states_args(setup, out, "--dtype", "float32")) == 0
    return out


def test_train_from_the_cache_loads_no_verifier_layer_and_matches(setup, one_rank_cache, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from peagle_ext.train import train

    assert len(json.loads((one_rank_cache / "train" / "index.json").read_text())["shards"]) >= 4
    ref = train(settings(setup, tmp_path / "ref"))  # computes the verifier states itself

    def no_layers(*a, **k):
        raise AssertionError("the verifier's layers were loaded")

    monkeypatch.setattr(D, "load_verifier", no_layers)
    got = train(settings(setup, tmp_path / "cached", hidden_cache_dir=str(one_rank_cache)))
    a = load_file(str(ref.final_dir / "model.safetensors"))
    b = load_file(str(got.final_dir / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert got.val == ref.val
    log = (tmp_path / "cached" / "log.jsonl").read_text()
    assert "only its final norm, lm_head and embeddings loaded" in log
    # rerunning the command on a complete cache does nothing (and loads no verifier either)
    assert main(hidden_states_args(setup, one_rank_cache, "--dtype", "float32")) == 0


def test_bf16_and_fp8_storage(setup, one_rank_cache, tmp_path):
    from peagle_ext.train import train
    from peagle_ext.train.build import cache_meta

    ref = D.HiddenStateCache(one_rank_cache / "train")
    for storage, tol in (("bfloat16", 2**-8), ("fp8", 2**-4)):
        out = tmp_path / storage
        assert main(hidden_states_args(setup, out, "--dtype", storage)) == 0
        c = D.HiddenStateCache(out / "train")
        assert c.index["storage"] == ("fp8" if storage == "fp8" else "torch.bfloat16")
        for x, y in zip(ref.read_shard(0), c.read_shard(0)):
            assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
            for f in ("hidden", "last_hidden"):
                want, have = getattr(x, f).float(), getattr(y, f).float()
                rowmax = want.abs().amax(-1, keepdim=True).clamp_min(1e-30)
                assert float(((have - want).abs() / rowmax).max()) <= tol, (storage, f)
                assert torch.equal(have[want.abs().amax(-1) == 0], want[want.abs().amax(-1) == 0])
        r = train(settings(setup, tmp_path / f"run-{storage}", hidden_cache_dir=str(out), max_steps=2))
        assert r.final_dir is not None
    # a resume with another storage format is refused instead of mixing them
    part = tmp_path / "mixed"
    assert main(hidden_states_args(setup, part, "--dtype", "fp8")) == 0
    (part / "train" / "shard-000001.safetensors").unlink()
    idx = json.loads((part / "train" / "index.json").read_text())
    del idx["shards"]["1"]
    (part / "train" / "index.json").write_text(json.dumps(idx))
    assert main(hidden_states_args(setup, part, "--dtype", "bfloat16")) == 2
    assert cache_meta  # the meta train and the command share


def test_fp8_quantization_per_position():
    from peagle_ext.data.cache import dequantize_fp8, quantize_fp8

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, 32, generator=g) * torch.logspace(-3, 3, 7)[None, :, None]
    x[2, 3] = 0
    q, s = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 7)
    y = dequantize_fp8(q, s)
    err = (y - x).abs() / x.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    assert float(err.max()) <= 2**-4 and torch.equal(y[2, 3], x[2, 3])


def test_device_map_placement_gives_the_same_states(setup):
    pytest.importorskip("accelerate")
    v, _ = setup
    plain, tok = D.load_verifier(str(v))
    placed, _ = D.load_verifier(str(v), device_map="auto", max_memory={"cpu": "2GiB"})
    assert {p.device.type for p in placed.parameters()} == {"cpu"}
    row = D.pack_conversations(
        D.tokenize_conversations(tok, D.load_conversations(str(setup[1]), limit=3), max_len=64)[0], 64, pad_token_id=0
    )[0]
    for a, b in zip(D.verifier_hidden_states(plain, row, [1, 2]), D.verifier_hidden_states(placed, row, [1, 2])):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# torchrun (gloo / CPU)
# ---------------------------------------------------------------------------------------------
def _torchrun_cli(nproc, args, env_extra=None, retry_teardown_abort=True):
    return torchrun(
        nproc, ["-m", "peagle_ext.cli", *args], env_extra=env_extra, retry_teardown_abort=retry_teardown_abort
    )


@requires_gloo
def test_two_ranks_write_the_one_rank_cache_and_resume_after_a_kill(setup, one_rank_cache, tmp_path):
    out = tmp_path / "cache"
    args = hidden_states_args(setup, out, "--dtype", "float32")
    # rank 1 is killed after its first shard: the run fails, the shards written so far stay
    # no retry: the killed rank is the point
    r = _torchrun_cli(2, args, {"PEAGLE_TEST_KILL_AFTER": "1:1"}, retry_teardown_abort=False)
    assert r.returncode != 0
    have = json.loads((out / "train" / "index.json").read_text())["shards"]
    n = len(json.loads((one_rank_cache / "train" / "index.json").read_text())["shards"])
    assert 1 <= len(have) < n
    r = _torchrun_cli(2, args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert cache_files(out) == cache_files(one_rank_cache)  # bit for bit, index included


def test_a_missing_rank_is_a_timeout_not_a_hang(setup, tmp_path, monkeypatch, capsys):
    """Rank 0 of a world of 2 whose rank 1 never comes: a clear error after the timeout, naming
    the rank whose shards are missing and saying that a rerun resumes."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    rc = main(hidden_states_args(setup, tmp_path / "c", "--dtype", "float32", "--timeout-s", "2"))
    assert rc == 2
    err = capsys.readouterr().err
    assert "did not appear within 2 s" in err and "rank(s) [1]" in err and "Run again to resume" in err


@requires_gloo
def test_a_two_rank_cache_killed_midway_resumes_on_one_rank(setup, one_rank_cache, tmp_path):
    """The cache's shards do not depend on the rank count: one process finishes what a killed
    2-rank run left, and the result is the 1-rank cache bit for bit."""
    out = tmp_path / "cache"
    args = hidden_states_args(setup, out, "--dtype", "float32")
    r = _torchrun_cli(2, args, {"PEAGLE_TEST_KILL_AFTER": "0:1"}, retry_teardown_abort=False)
    assert r.returncode != 0
    assert main(args) == 0
    assert cache_files(out) == cache_files(one_rank_cache)


@requires_gloo
def test_two_ranks_train_from_a_complete_cache(setup, one_rank_cache, tmp_path):
    from peagle_ext.train import train

    ref = train(settings(setup, tmp_path / "ref", hidden_cache_dir=str(one_rank_cache), grad_accum=2))
    v, data = setup
    flags = ["train", "--verifier", str(v), "--data", str(data), "--output", str(tmp_path / "two"), *DATA_FLAGS]
    flags += ["--num-depths", "2", "--draft-vocab-size", "none", "--dtype", "float32", "--max-steps", "4"]
    flags += ["--val-every", "2", "--checkpoint-every", "2", "--log-every", "1", "--warmup-steps", "1"]
    flags += ["--no-progress", "--hidden-cache-dir", str(one_rank_cache)]
    r = _torchrun_cli(2, flags)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "only its final norm, lm_head and embeddings loaded" in (tmp_path / "two" / "log.jsonl").read_text()
    assert_same_weights(ref.final_dir, tmp_path / "two" / "final")


needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)


@pytest.mark.cuda
@needs_two_gpus
def test_device_map_over_two_gpus_equals_one_gpu(tmp_path):
    """A random Qwen3-shaped verifier split over 2 GPUs by device_map + max_memory gives the
    one-GPU hidden states (bit for bit expected; the check allows bf16 rounding)."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM, Qwen3Config

    from peagle_ext.testing import make_tokenizer

    cfg = Qwen3Config(
        vocab_size=300,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    make_tokenizer(tmp_path)
    one, _ = D.load_verifier(str(tmp_path), device="cuda:0", dtype=torch.bfloat16)
    split, _ = D.load_verifier(
        str(tmp_path), dtype=torch.bfloat16, device_map="auto", max_memory={0: "100MiB", 1: "10GiB"}
    )
    assert len({str(d) for d in split.hf_device_map.values()}) >= 2
    ids = torch.randint(3, 300, (512,))
    row = D.PackedSequence(ids, torch.zeros(512, dtype=torch.int32), torch.ones(512, dtype=torch.bool))
    for a, b in zip(D.verifier_hidden_states(one, row, [2, 6, 9]), D.verifier_hidden_states(split, row, [2, 6, 9])):
        torch.testing.assert_close(b.to(a.device).float(), a.float(), rtol=2**-7, atol=2**-7)
