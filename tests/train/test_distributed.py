"""Distributed training (peagle_ext.distributed) on CPU with the gloo backend: torchrun with 2
processes against 1 process on the same global batch (parameters, reported metrics), gradient
accumulation and sequence partition under DDP / FSDP2, resume of 2-rank checkpoints on 1 rank, the
balanced unit assignment, and the bench's --tiny dry run."""

import json
import shutil
from pathlib import Path

import pytest
import torch.distributed as dist

from peagle_ext.train.checkpoint import read_trainer_state
from tests.helpers import ROOT, assert_same_weights, torchrun

requires_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available",
)


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------
# the trainer: 2 ranks vs 1 process
# ---------------------------------------------------------------------------------------------
COMMON = dict(
    seq_len=64,
    num_depths=3,
    num_layers=1,
    draft_vocab_size=None,
    dtype="float32",
    device="cpu",
    checkpoint_every=2,
    keep_checkpoints=3,
    val_every=2,
    val_fraction=0.15,
    warmup_steps=1,
    lr=3e-3,
    schedule="constant",
    num_conversations=None,
    log_every=1,
)


def settings(tiny, out, **kw):
    from peagle_ext.train import TrainSettings

    v, data = tiny
    return TrainSettings(
        **{**COMMON, "verifier": str(v), "data": str(data), "output": str(out), "progress": False, **kw}
    )


def cli_flags(tiny, out, **kw) -> list[str]:
    v, data = tiny
    opts = {**COMMON, "verifier": str(v), "data": str(data), "output": str(out), **kw}
    flags = ["-m", "peagle_ext.cli", "train", "--no-progress"]
    for k, val in opts.items():
        if val is True:
            flags.append("--" + k.replace("_", "-"))
            continue
        flags += ["--" + k.replace("_", "-"), "none" if val is None else str(val)]
    return flags


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    """1 process, 2 micro-batches per step, 6 steps (checkpoints at 2, 4, 6): the global batch
    that 2 ranks x 1 micro-batch take."""
    from peagle_ext.train import train

    out = tmp_path_factory.mktemp("ref") / "run"
    r = train(settings(tiny, out, max_steps=6, grad_accum=2))
    assert r.final_dir is not None
    return out


def _records(out, split):
    recs = [json.loads(x) for x in (Path(out) / "log.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in recs if r.get("split") == split}


def assert_same_metrics(a_out, b_out, steps):
    for split in ("train", "val"):
        a, b = _records(a_out, split), _records(b_out, split)
        for st in steps:
            if split == "val" and st not in a:
                continue
            ra, rb = a[st], b[st]
            assert ra["counted"] == rb["counted"] and ra["acc"] == rb["acc"], (split, st)
            assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-9, abs=1e-12), (split, st)
            if split == "train":
                assert rb["tokens"] == ra["tokens"], st
                assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-5), st


@requires_gloo
def test_ddp_two_ranks_equal_one_process_and_resume_on_one(tiny, reference, tmp_path):
    from peagle_ext.train import TrainError, train

    out = tmp_path / "ddp"
    # the on-disk hidden-state cache: rank 0 fills it, rank 1 waits and reads (same bits as in memory)
    r = torchrun(
        2, cli_flags(tiny, out, max_steps=4, grad_accum=1, dist="ddp", hidden_cache_dir=str(tmp_path / "hcache"))
    )
    assert r.returncode == 0, r.stderr[-5000:]
    assert r.stdout.count("per-depth accuracy") == 1  # rank 0 reports
    assert "2 ranks (DDP, gloo)" in r.stderr
    assert_same_weights(reference / "checkpoint-4", out / "checkpoint-4")
    assert_same_weights(reference / "checkpoint-4", out / "final")
    assert_same_metrics(reference, out, range(1, 5))
    ck = read_trainer_state(out / "checkpoint-4")
    assert ck["world_size"] == 2 and ck["optimizer"] is not None and not (out / "checkpoint-4" / "optimizer").exists()

    # 1 process continues the 2-rank run; it must keep the global batch (2 micro-batches per step)
    with pytest.raises(TrainError, match=r"2 micro-batches per step .*--grad-accum 2"):
        train(settings(tiny, out, max_steps=6, grad_accum=1, resume=True))
    res = train(settings(tiny, out, max_steps=6, grad_accum=2, resume=True))
    assert res.steps == 6
    assert_same_weights(reference / "final", res.final_dir)
    assert_same_metrics(reference, out, range(1, 7))


@requires_gloo
def test_validation_groups_of_batch_size_rows_split_over_ranks_as_one_process_sums_them(tiny, tmp_path):
    """Validation forwards of --batch-size rows: 2 DDP ranks take alternate groups (an odd count,
    so rank 0 has one more) and report what 1 process does."""
    from peagle_ext.train import train

    kw = dict(max_steps=2, batch_size=2, val_every=2, val_fraction=0.4)
    one = tmp_path / "one"
    assert train(settings(tiny, one, grad_accum=2, **kw)).final_dir is not None
    val_rows = next(json.loads(x) for x in (one / "log.jsonl").read_text().splitlines() if '"event": "data"' in x)[
        "message"
    ]
    assert " / 6 val rows" in val_rows  # 3 groups of 2 rows
    two = tmp_path / "two"
    r = torchrun(2, cli_flags(tiny, two, grad_accum=1, dist="ddp", **kw))
    assert r.returncode == 0, r.stderr[-5000:]
    assert_same_weights(one / "final", two / "final")
    assert_same_metrics(one, two, [2])
    assert _records(two, "val")[2]["counted"] == _records(one, "val")[2]["counted"]


@requires_gloo
def test_fsdp_two_ranks_equal_one_process_and_dcp_resume_on_one(tiny, reference, tmp_path):
    from peagle_ext.train import train

    out = tmp_path / "fsdp"
    # start from the 1-process run's checkpoint-2 (a full, index-keyed optimizer state that FSDP2
    # shards on load), train steps 3-4 on 2 ranks
    shutil.copytree(
        reference,
        out,
        ignore=lambda d, names: [
            n for n in names if n in ("checkpoint-4", "checkpoint-6", "final", "loss.png", "accuracy.png")
        ],
    )
    r = torchrun(2, cli_flags(tiny, out, max_steps=4, grad_accum=1, dist="fsdp", resume=True))
    assert r.returncode == 0, r.stderr[-5000:]
    assert "2 ranks (FSDP, gloo)" in r.stderr
    assert_same_weights(reference / "checkpoint-4", out / "checkpoint-4")
    assert_same_metrics(reference, out, range(1, 5))
    ck = read_trainer_state(out / "checkpoint-4")
    assert ck["optimizer"] is None and ck["optimizer_dcp"] == "optimizer" and ck["dist"] == "fsdp"
    assert (out / "checkpoint-4" / "optimizer" / ".metadata").is_file()
    cfg = json.loads((out / "checkpoint-4" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "peagle"

    # the sharded (DCP) optimizer state resumes on 1 process (resharded to one)
    shutil.rmtree(out / "final")
    res = train(settings(tiny, out, max_steps=6, grad_accum=2, resume=True))
    assert_same_weights(reference / "final", res.final_dir)
    assert_same_metrics(reference, out, range(1, 7))


# ---------------------------------------------------------------------------------------------
# gradient accumulation and sequence partition: one step's gradient, N ranks vs 1 process
# ---------------------------------------------------------------------------------------------
@requires_gloo
def test_grad_accum_and_seq_partition_compose(tmp_path):
    configs = [
        {"mode": "ddp", "grad_accum": 2, "segments": 2},  # no_sync + a partitioned last micro-step
        {"mode": "ddp", "grad_accum": 2, "attention": "cross", "num_layers": 2},
        {"mode": "ddp", "grad_accum": 3, "segments": 3, "attention": "cross", "num_layers": 2},
        {"mode": "fsdp", "grad_accum": 2, "num_layers": 2},  # set_requires_gradient_sync(False)
        {"mode": "fsdp", "grad_accum": 2, "attention": "cross", "num_layers": 2},  # each layer called twice
        {"mode": "fsdp", "grad_accum": 2, "segments": 2},  # partition: root gathered across backward passes
        {"mode": "fsdp", "grad_accum": 1, "segments": 3, "attention": "cross", "num_layers": 2},
    ]
    out = tmp_path / "grads.json"
    r = torchrun(2, [str(Path(__file__).resolve().parent / "dist_grad_worker.py"), str(out), json.dumps(configs)])
    assert r.returncode == 0, r.stderr[-5000:]
    results = json.loads(out.read_text())
    for cfg, res in zip(configs, results):
        assert not res["missing"], (cfg, res["missing"])
        ga = cfg["grad_accum"]
        assert sorted(res["units"][0] + res["units"][1]) == list(range(2 * ga)) and len(res["units"][0]) == ga
        assert len(res["grads"]) >= 10
        for name, g in res["grads"].items():
            # fp32: the same sums in another order
            assert g["max_abs_diff"] <= 1e-6 * g["max_abs_ref"] + 1e-12, (cfg, name, g)


# ---------------------------------------------------------------------------------------------
# pieces
# ---------------------------------------------------------------------------------------------
def test_lpt_partition_balances_deterministically():
    from peagle_ext.train.distributed import lpt_partition

    costs = [512, 100, 480, 300, 64, 512, 200, 250]
    bins = lpt_partition(costs, 2, 4)
    assert sorted(sum(bins, [])) == list(range(8)) and [len(b) for b in bins] == [4, 4]
    # 512 512 480 300 250 200 100 64 in turn to the lighter bin with room (ties: lower bin)
    assert bins == [[0, 2, 4, 6], [1, 3, 5, 7]]
    loads = [sum(costs[i] for i in b) for b in bins]
    assert abs(loads[0] - loads[1]) <= max(costs)
    assert lpt_partition(costs, 2, 4) == bins  # deterministic
    assert lpt_partition([7, 7, 7, 7], 2, 2) == [[0, 2], [1, 3]]  # equal costs: by index
    # no cap; ties go to the lower index / lower bin
    assert lpt_partition([5, 5, 4, 4, 3, 3], 3) == [[0, 4], [1, 5], [2, 3]]
    assert lpt_partition([1, 1, 1, 1], 2, 2) == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="do not fit"):
        lpt_partition([1, 2, 3], 1, 2)


def test_dist_option_and_single_process_context():
    from peagle_ext.cli import build_parser
    from peagle_ext.train import TrainSettings
    from peagle_ext.train.distributed import DistContext

    with pytest.raises(ValueError, match="--dist must be ddp or fsdp"):
        TrainSettings(dist="zero3").validate()
    args = build_parser().parse_args(["train", "--dist", "fsdp"])
    assert args.dist == "fsdp"
    # one process (no WORLD_SIZE): a trivial context, the single-process trainer path
    ctx = DistContext.from_env("fsdp", "cpu")
    assert ctx.world == 1 and ctx.is_main and ctx.my_units([5, 9, 1]) == [0, 1, 2] and ctx.sum_scalar(2.5) == 2.5
    with pytest.raises(ValueError, match="--dist"):
        DistContext("zero3")


@requires_gloo
def test_bench_distributed_tiny_dry_run(tmp_path):
    """bench/bench_distributed.py --tiny on CPU with gloo: the path the lead runs on 2 GPUs."""
    env_out = tmp_path / "bench_out"
    cmd_args = [str(ROOT / "bench" / "bench_distributed.py"), "--tiny", "--steps", "1", "--out", str(env_out)]
    r = torchrun(2, cmd_args)
    assert r.returncode == 0, r.stderr[-5000:]
    res = json.loads((env_out / "bench_distributed.json").read_text())
    assert res["world_size"] == 2
    assert {(x["mode"], x["gpus"]) for x in res["runs"]} >= {("single", 1), ("ddp", 2), ("fsdp", 2)}
    for x in res["runs"]:
        assert x["step_s"] > 0 and x["tokens_per_s_per_rank"] > 0
    for c in res["correctness"]:
        assert c["passed"], c
    assert "scaling" in (env_out / "bench_distributed.md").read_text()
