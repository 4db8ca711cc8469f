"""scripts/smollm2_gpu.sh rehearsed on the CPU with a tiny verifier in a bundle laid out as
tools/device_bundle.py writes it: every phase runs, a second run finds every phase done, the
results come back as results.md + results.tgz; and device_bundle's conversation cut keeps the
first max_tokens tokens and their loss mask."""

import importlib.util
import json
import lzma
import os
import shutil
import subprocess
import tarfile

import pytest

from peagle_ext.data.loops import conversation_loops
from peagle_ext.testing import make_chat_jsonl, make_tiny_verifier
from tests.helpers import ROOT


def _device_bundle():
    """tools/device_bundle.py as a module, loaded from its file (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location("device_bundle", ROOT / "tools" / "device_bundle.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    b = tmp_path_factory.mktemp("bundle")
    make_tiny_verifier(b / "verifier")
    chats = make_chat_jsonl(b / "chats.jsonl", n=24, turns=2, words=(4, 10))
    with lzma.open(b / "sharegpt.jsonl.xz", "wt") as f:
        f.write(chats.read_text())
    for name in ("mtbench", "humaneval"):
        (b / f"{name}.jsonl").write_text('{"prompt": "the water is hot"}\n{"prompt": "how many people know"}\n')
    return b


def _run(bundle, work, *phases, **env_extra):
    env = {
        **os.environ,
        "DEVICE": "cpu",
        "OMP_NUM_THREADS": "1",
        "K": "2",
        "SEQ": "96",
        "SETTINGS": "1:orig 1:regen",
        "DATAGEN_TURNS": "first",
        "EVAL_FULL": "1:regen",
        "EVAL_K": "2",
        "DRAFT_VOCAB": "none",
        "BATCH": "1",
        "MAX_STEPS": "4",
        "WARMUP": "1",
        "VAL_EVERY": "2",
        "CHECKPOINT_EVERY": "2",
        "HOLDOUT": "3",
        "VAL_FRACTION": "0.2",
        "DATAGEN_TOKENS": "6",
        "DATAGEN_BATCH": "8",
        "EVAL_TOKENS": "6",
        "OUT": str(work / "out"),
        **env_extra,
    }
    return subprocess.run(
        ["bash", "scripts/smollm2_gpu.sh", "--bundle", str(bundle), "--work", str(work), *phases],
        cwd=str(ROOT),
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )


def test_recipe_rehearsal_on_cpu(bundle, tmp_path):
    work = tmp_path / "work"
    r = _run(bundle, work, "all")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sum(1 for _ in open(work / "data" / "heldout.jsonl")) == 3
    regen = [json.loads(x) for x in open(work / "data" / "regen.jsonl")]
    assert len(regen) == 21 and all(len(x["messages"]) in (0, 2) for x in regen)
    for s in ("L1-orig", "L1-regen"):
        assert (work / "train" / s / "final" / "config.json").is_file()
    ev = work / "eval"
    assert {p.name for p in ev.glob("*.json")} >= {
        "L1-regen_mtbench.json",
        "L1-regen_humaneval.json",
        "L1-orig_mtbench.json",
        "consistency_L1-regen.json",
    }
    full = json.loads((ev / "L1-regen_mtbench.json").read_text())
    assert [s["num_spec_tokens"] for s in full["k_sweep"]] == [1, 2] and full["lossless"] and full["profile"]
    assert (ev / "L1-regen_mtbench_k_sweep.png").is_file()
    # the round profile runs once, with the K sweep
    for f in ("L1-orig_mtbench.json", "L1-regen_humaneval.json"):
        assert "profile" not in json.loads((ev / f).read_text()), f
    md = (work / "out" / "results.md").read_text()
    assert "| L1-regen | mtbench | 2 |" in md and "L1-orig: step 4 (max steps), val loss" in md
    with tarfile.open(work / "out" / "results.tgz") as t:
        assert "eval/L1-regen_humaneval.json" in t.getnames()
    # every phase resumes as done
    r = _run(bundle, work, "data", "datagen", "train", "eval")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "train 1:orig: done" in r.stdout and "eval L1-orig_mtbench: done" in r.stdout
    assert "0 conversations written this run (21 were already" in r.stdout
    # DATAGEN_SECONDS=0: the study trains and evaluates on what an earlier datagen wrote, and
    # does not start datagen (nor keep) itself
    r = _run(bundle, work, "study", DATAGEN_SECONDS="0")
    assert r.returncode == 0 and "phase study" in r.stdout, r.stderr[-3000:]
    assert "conversations written this run" not in r.stdout and "save-regen" not in r.stdout
    assert "eval L1-regen_mtbench: done" in r.stdout
    r = _run(bundle, tmp_path / "work3", "data", "study", DATAGEN_SECONDS="0", SETTINGS="1:regen")
    assert "DATAGEN_SECONDS=0 and no" in r.stdout and "run datagen first" in r.stdout, r.stdout[-3000:]
    assert not (tmp_path / "work3" / "data" / "regen.jsonl").exists()
    # keep: the regenerated data back as files; carried into a bundle, a fresh work dir's data phase
    # puts them back and datagen has nothing left to do
    r = _run(bundle, work, "keep", OUT=str(tmp_path / "kept"))
    assert r.returncode == 0 and "save-regen: 21 regenerated conversations" in r.stdout, r.stderr[-3000:]
    b2 = tmp_path / "bundle2"
    shutil.copytree(bundle, b2)
    for f in (tmp_path / "kept").glob("regen*"):
        shutil.copy(f, b2 / f.name)
    r = _run(b2, tmp_path / "work2", "data", "datagen")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "seed-regen: 21 regenerated conversations put back" in r.stdout
    assert "0 conversations written this run (21 were already" in r.stdout
    assert (tmp_path / "work2" / "data" / "regen.jsonl").read_text() == (work / "data" / "regen.jsonl").read_text()
    # the same files committed to the repository (REGEN_KEPT) instead of carried in the bundle
    r = _run(bundle, tmp_path / "work4", "data", REGEN_KEPT=str(tmp_path / "kept"))
    assert r.returncode == 0 and "seed-regen: 21 regenerated conversations put back" in r.stdout, r.stderr[-3000:]
    assert (tmp_path / "work4" / "data" / "regen.jsonl").read_text() == (work / "data" / "regen.jsonl").read_text()
    # mix: every training conversation, the regenerated one where datagen wrote one, else the original
    mixed = tmp_path / "work_mix"
    shutil.copytree(work / "data", mixed / "data")
    # (the first kept conversation's answer made a loop: MIX_LOOPS=original, the default, leaves every
    # conversation with a looping answer original; this tiny random verifier's answers loop too)
    recs = [json.loads(x) for x in open(work / "data" / "regen.jsonl").readlines()[:12]]
    looped = next(r for r in recs if r["messages"])
    looped["messages"][-1]["content"] = "over and over " * 4
    (mixed / "data" / "regen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    r = _run(bundle, mixed, "train", SETTINGS="1:mix", EVAL_FULL="1:mix")
    assert r.returncode == 0, r.stderr[-3000:]
    src = [json.loads(x)["messages"] for x in open(mixed / "data" / "train.jsonl")]
    done = {x["index"]: x["messages"] for x in recs if x["messages"]}
    clean = {i: m for i, m in done.items() if not conversation_loops(m)}
    n, k, left = len(src), len(clean), len(done) - len(clean)
    assert looped["index"] not in clean and 0 < k < len(done)
    assert f"mix: {n} conversations, {k} of them regenerated, {n - k} original ({left} regenerated" in r.stdout
    mix = [json.loads(x)["messages"] for x in open(mixed / "data" / "mix.jsonl")]
    assert mix == [clean.get(i, m) for i, m in enumerate(src)]
    assert (mixed / "train" / "L1-mix" / "final" / "config.json").is_file()
    # MIX_LOOPS=keep rewrites the mix (the rule changed) with every regenerated conversation
    r = _run(bundle, mixed, "train", SETTINGS="1:mix", EVAL_FULL="1:mix", MIX_LOOPS="keep")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"mix: {n} conversations, {len(done)} of them regenerated, {n - len(done)} original\n" in r.stdout
    mix = [json.loads(x)["messages"] for x in open(mixed / "data" / "mix.jsonl")]
    assert mix == [done.get(i, m) for i, m in enumerate(src)]
    # both: every original conversation, then every regenerated one without a loop besides it
    r = _run(bundle, mixed, "train", SETTINGS="1:both", EVAL_FULL="")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"both: {n + k} conversations, {n} original and {k} regenerated ({left} regenerated" in r.stdout
    both = [json.loads(x)["messages"] for x in open(mixed / "data" / "both.jsonl")]
    assert both == src + [clean[i] for i in sorted(clean)]
    assert (mixed / "train" / "L1-both" / "final" / "config.json").is_file()
    # LAYERS:DATA:K trains K depths in its own directory, beside the setting at the default K (and
    # OPTIMIZER and CHECKPOINT_EVERY reach the trainer)
    r = _run(
        bundle,
        mixed,
        "train",
        SETTINGS="1:mix 1:mix:3",
        EVAL_FULL="1:mix",
        MIX_LOOPS="keep",
        OPTIMIZER="adamw",
        CHECKPOINT_EVERY="3",
    )
    assert r.returncode == 0 and "train 1:mix: done" in r.stdout, r.stderr[-3000:]
    start = json.loads((mixed / "train" / "L1-mix-k3" / "log.jsonl").read_text().splitlines()[0])
    assert start["settings"]["num_depths"] == 3 and (mixed / "train" / "L1-mix-k3" / "final" / "config.json").is_file()
    assert start["settings"]["optimizer"] == "adamw"
    # the trainings' checkpoints follow CHECKPOINT_EVERY, their validations VAL_EVERY
    assert start["settings"]["checkpoint_every"] == 3 and start["settings"]["val_every"] == 2
    r = _run(bundle, mixed, "train", SETTINGS="1:mix", OPTIMIZER="sgd")
    assert r.returncode == 2 and "OPTIMIZER must be adamw or muon, got sgd" in r.stderr and not r.stdout
    r = _run(bundle, mixed, "train", SETTINGS="1:mix", CHECKPOINT_EVERY="0")
    assert r.returncode == 2 and "CHECKPOINT_EVERY must be a whole number of steps >= 1, got 0" in r.stderr
    # a setting trained for fewer depths than the K it is evaluated at: exit 2 before any phase runs
    r = _run(bundle, mixed, "train", SETTINGS="1:mix:1", EVAL_FULL="")
    assert r.returncode == 2 and "setting 1:mix:1 trains 1 depths and is evaluated at K=2" in r.stderr and not r.stdout
    r = _run(bundle, mixed, "train", SETTINGS="1:mix", MIX_LOOPS="sometimes")
    assert r.returncode == 2 and "MIX_LOOPS must be original or keep, got sometimes" in r.stderr and not r.stdout
    r = _run(bundle, mixed, "consistency", CONSISTENCY_CONVERSATIONS="-1")
    assert r.returncode == 2 and "CONSISTENCY_CONVERSATIONS must be a whole number >= 0" in r.stderr and not r.stdout
    r = _run(bundle, mixed, "consistency", CONSISTENCY_PROMPTS="0")
    assert r.returncode == 2 and "CONSISTENCY_PROMPTS must be a whole number >= 1, got 0" in r.stderr and not r.stdout
    # CONSISTENCY_CONVERSATIONS=0: no consistency phase, though a trained EVAL_FULL setting awaits one
    r = _run(bundle, mixed, "consistency", SETTINGS="1:mix", EVAL_FULL="1:mix", CONSISTENCY_CONVERSATIONS="0")
    assert r.returncode == 0 and "consistency: off" in r.stdout, r.stderr[-3000:]
    assert not (mixed / "eval" / "consistency_L1-mix.json").exists()
    # an EVAL_FULL setting that was never trained is named, not passed over in silence
    r = _run(bundle, mixed, "consistency", SETTINGS="1:mix", EVAL_FULL="2:mix", CONSISTENCY_CONVERSATIONS="2")
    assert r.returncode == 0 and "consistency L2-mix: no trained drafter" in r.stdout, r.stderr[-3000:]
    assert not (mixed / "eval" / "consistency_L2-mix.json").exists()
    # a bundle without its eval prompts: exit 2 before the training that the evaluation would follow
    partial = tmp_path / "partial-bundle"
    shutil.copytree(bundle, partial)
    (partial / "humaneval.jsonl").unlink()
    r = _run(partial, work, "--detach", "study", DATAGEN_SECONDS="0")
    assert r.returncode == 2 and "humaneval.jsonl is missing" in r.stderr and "study phase" in r.stderr and not r.stdout
    assert _run(partial, work, "eval", EVAL_FULL="").returncode == 0  # MT-Bench alone needs no HumanEval
    # bad phase: exit 2 and one line
    r = _run(bundle, work, "nope")
    assert r.returncode == 2 and "unknown argument nope" in r.stderr
    # a setting with an unknown data kind: exit 2 before any phase runs
    r = _run(bundle, work, "train", SETTINGS="1:regn")
    assert r.returncode == 2 and "setting 1:regn" in r.stderr and "mix or both" in r.stderr and not r.stdout


def test_detached_study_outlasts_its_command_and_wait_brings_the_results(bundle, tmp_path):
    """`--detach study` returns at once and goes on in its own session (as training must outlast a
    device call); a second --detach while it runs is refused; `wait` follows it to the end and
    copies its results into the calling command's $OUT."""
    work = tmp_path / "work"
    assert _run(bundle, work, "setup", "data").returncode == 0
    settings = "1:orig 1:origfirst 1:regen"
    r = _run(
        bundle,
        work,
        "--detach",
        "study",
        DATAGEN_SECONDS="60",
        DATAGEN_TURNS="all",
        TRAIN_MINUTES="5",
        SETTINGS=settings,
        TRAIN_PARALLEL="1",
        EVAL_SWEEP="1",
    )
    assert r.returncode == 0 and "detached: study" in r.stdout, r.stderr[-2000:]
    # it runs from its own copy of the code, which a later device call's copy of the tree leaves alone
    assert (work / "code" / "scripts" / "smollm2_gpu.sh").is_file() and (work / "code" / "peagle_ext").is_dir()
    again = _run(bundle, work, "--detach", "study")
    assert again.returncode == 2 and "still going" in again.stderr
    out = tmp_path / "call_out"
    out.mkdir()
    r = _run(bundle, work, "wait", OUT=str(out), WAIT_SECONDS="900", SETTINGS=settings)
    assert r.returncode == 0 and "the detached run has ended" in r.stdout, r.stdout[-3000:]
    md = (out / "results.md").read_text()
    assert "| L1-regen | mtbench | 1 |" in md and "| L1-orig | mtbench | 2 |" in md
    assert "| L1-regen | mtbench | 2 |" not in md  # EVAL_SWEEP=1: the sweep of EVAL_FULL is K=1 alone
    assert "| L1-origfirst | mtbench | 2 |" in md
    # the regenerated data kept for a later session, brought back with the results
    kept = json.loads((out / "regen.json").read_text())
    assert all((out / p["name"]).is_file() for p in kept["parts"])
    n_regen = sum(1 for _ in open(work / "data" / "regen.jsonl"))
    assert kept["settings"]["turns"] == "all" and kept["conversations"] == n_regen
    # origfirst: the regenerated conversations' first prompts, each with its original first answer
    src = [json.loads(x)["messages"] for x in open(work / "data" / "train.jsonl")]
    regen = [json.loads(x) for x in open(work / "data" / "regen.jsonl")]
    regen = [r for r in regen if r["messages"]]
    first = [json.loads(x)["messages"] for x in open(work / "data" / "origfirst.jsonl")]
    assert len(first) == len(regen) > 10
    for r, f in zip(regen, first):
        want = next(m["content"] for m in src[r["index"]] if m["role"] == "assistant")
        answer = next(i for i, m in enumerate(r["messages"]) if m["role"] == "assistant")
        assert f[:-1] == r["messages"][:answer] and f[-1] == {"role": "assistant", "content": want}
    # DATAGEN_TURNS=all: conversations of several turns, every answer regenerated
    assert any(sum(m["role"] == "assistant" for m in r["messages"]) > 1 for r in regen)
    assert (work / "eval" / "consistency_L1-regen.json").is_file()
    # HumanEval before consistency: a hold that ends first loses the figure least likely to move
    log = (work / "detached.log").read_text()
    assert log.index("L1-regen_humaneval") < log.index("tools/consistency.py"), log[-3000:]
    start = json.loads((work / "train" / "L1-regen" / "log.jsonl").read_text().splitlines()[0])
    assert start["settings"]["time_schedule"] and start["settings"]["max_minutes"] == 5
    # HIDDEN_CACHE_GB=auto: 75% of the available memory, shared by the three settings
    total_gib = next(int(x.split()[1]) for x in open("/proc/meminfo") if x.startswith("MemTotal:")) / 2**20
    assert 0 < start["settings"]["hidden_cache_gb"] <= total_gib * 0.75 / 3
    # side by side, each training starts once the one before has prepared its data
    summary = (work / "out" / "summary.txt").read_text()
    assert all(f"train/L1-{d} prepared after" in summary for d in ("orig", "origfirst", "regen"))
    assert summary.index("train/L1-origfirst prepared after") < summary.index("train 1:regen: starting")
    with tarfile.open(out / "results_so_far.tgz") as t:
        assert "detached.log" in t.getnames()


def test_a_stuck_training_is_stopped_with_its_stacks_logged_and_its_checkpoint_evaluated(bundle, tmp_path):
    """A training still running TRAIN_GRACE s past its minutes (here: held by the trainer's test
    hook after step 2) gets SIGUSR1, which puts its Python stacks into its log, and is killed
    KILL_AFTER s later; eval then takes its newest checkpoint."""
    work = tmp_path / "work"
    assert _run(bundle, work, "setup", "data").returncode == 0
    stuck = dict(SETTINGS="1:orig", EVAL_FULL="1:orig", EVAL_HE_SWEEP="", TRAIN_MINUTES="1", TRAIN_GRACE="-40")
    r = _run(bundle, work, "train", KILL_AFTER="3", PEAGLE_TEST_PAUSE=f"step:2:{tmp_path / 'held'}", **stuck)
    assert r.returncode != 0 and (tmp_path / "held").is_file()
    log = (work / "logs" / "train_L1-orig.log").read_text()
    assert "in test_pause" in log and "Thread 0x" in log, log[-3000:]
    assert not (work / "train" / "L1-orig" / "final").exists()
    r = _run(bundle, work, "eval", **stuck)
    assert r.returncode == 0 and "evaluating " in r.stdout and "checkpoint-2" in r.stdout, r.stdout[-3000:]
    assert json.loads((work / "eval" / "L1-orig_humaneval.json").read_text())["num_spec_tokens"] == 2


def test_bundle_cut_keeps_the_first_tokens(tmp_path):

    from transformers import AutoTokenizer

    from peagle_ext.data import load_conversations, tokenize_conversation

    truncate_conversation = _device_bundle().truncate_conversation

    v = make_tiny_verifier(tmp_path / "v")
    tok = AutoTokenizer.from_pretrained(v)
    convs = load_conversations(str(make_chat_jsonl(tmp_path / "c.jsonl", n=30, turns=4, words=(5, 40), seed=3)))
    cut = 0
    for c in convs:
        t = truncate_conversation(tok, c, 48, margin=8)
        cut += t != c
        assert t[-1]["role"] == "assistant"
        a, ma = tokenize_conversation(tok, c, max_len=48)
        b, mb = tokenize_conversation(tok, t, max_len=48)
        assert a.tolist() == b.tolist() and ma.tolist() == mb.tolist()
    assert cut > 10


def test_bundle_join_checks_parts(tmp_path):
    import hashlib

    join = _device_bundle().join

    blob = bytes(range(256)) * 40
    (tmp_path / "gguf.part00").write_bytes(blob[:6000])
    sha = hashlib.sha256(blob).hexdigest()
    man = {"gguf": {"size": len(blob), "sha256": sha, "parts": ["gguf.part00", "gguf.part01"]}}
    (tmp_path / "MANIFEST.json").write_text(json.dumps(man))
    join(tmp_path, if_complete=True)  # a part is still on its way: nothing happens
    assert not (tmp_path / "verifier.gguf").exists()
    with pytest.raises(SystemExit, match="missing gguf.part01"):
        join(tmp_path)
    (tmp_path / "gguf.part01").write_bytes(blob[6000:-1] + b"x")  # a damaged part
    with pytest.raises(SystemExit, match="sha256"):
        join(tmp_path)
    assert not (tmp_path / "verifier.gguf").exists() and not (tmp_path / "verifier.tmp").exists()


def test_bundle_runs_carry_every_file_once_within_a_call():
    """The manifest's runs, on the bundle's real sizes: every top-level entry carried once, at most
    8 paths a run, and each run under 64 MiB with room for the repository beside it."""
    mib = 2**20
    sizes = {
        "gguf/__init__.py": 4096,
        "gguf/gguf_reader.py": 60_000,
        "gguf-0.19.0.dist-info/METADATA": 2_000,
        "gguf.part00": 52 * mib,
        "gguf.part01": int(41.8 * mib),
        "sharegpt.jsonl.xz": int(15.6 * mib),
        "mtbench.jsonl": 28_000,
        "humaneval.jsonl": 95_000,
        "verifier/config.json": 900,
        "verifier/tokenizer.json": int(3.4 * mib),
    }
    runs = _device_bundle().plan_runs(sizes, ["gguf.part00", "gguf.part01"])
    carried = [t for r in runs for t in r["carry"]]
    tops = {k.split("/")[0] for k in sizes} | {"MANIFEST.json"}
    assert sorted(carried) == sorted(tops)  # each once, MANIFEST.json with the first part
    assert {"gguf", "verifier", "gguf-0.19.0.dist-info", "gguf.part00"} <= set(runs[0]["carry"])
    assert runs[-1]["carry"] == ["sharegpt.jsonl.xz", "mtbench.jsonl", "humaneval.jsonl"]
    assert all(len(r["carry"]) <= 8 and r["mib"] <= 64 - 7 for r in runs)
    assert runs[1] == {"carry": ["gguf.part01"], "mib": pytest.approx(41.8, abs=0.01)}


def test_gguf_parts_fill_what_each_run_leaves_beside_the_repository():
    """pack's default part sizes: the first part with setup's files and each later part alone fit
    a run's limit beside the repository with headroom; a repository too large to leave room is an
    error that names the sizes; the repository's size is what git would carry."""
    db = _device_bundle()
    mib = 2**20
    gguf, repo, setup = int(93.8 * mib), int(10.5 * mib), int(4.2 * mib)
    first, later = db.part_sizes(gguf, repo, setup)
    assert first + setup + repo + db.GROWTH_HEADROOM == db.CARRY_LIMIT
    assert later + repo + db.GROWTH_HEADROOM == db.CARRY_LIMIT
    assert first + 2 * later >= gguf  # three parts: one run each
    assert db.part_sizes(10 * mib, repo, setup) == (10 * mib, later)
    with pytest.raises(SystemExit, match="leave no room for a GGUF part"):
        db.part_sizes(gguf, 58 * mib, setup)
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, check=True)
    some = [f for f in tracked.stdout.split("\n") if f][:50]
    assert db.repository_bytes(ROOT) >= sum((ROOT / f).stat().st_size for f in some if (ROOT / f).is_file()) > 0


def test_check_says_which_runs_no_longer_fit_beside_the_repository(tmp_path, capsys):
    """check: a pack's runs against the repository's size now; over the limit is exit 1 naming the
    run and the re-pack command, a directory without a manifest exit 2 naming the file."""
    db = _device_bundle()
    mib = 2**20
    runs = [{"carry": ["verifier", "gguf.part00"], "mib": 40.0}, {"carry": ["gguf.part01"], "mib": 50.0}]
    (tmp_path / "MANIFEST.json").write_text(json.dumps({"runs": runs}))
    (tmp_path / "verifier").mkdir()
    for name, size in (("verifier/config.json", mib), ("gguf.part00", 39 * mib), ("gguf.part01", 50 * mib)):
        with open(tmp_path / name, "wb") as f:
            f.truncate(size)
    assert db.check(tmp_path, repo_bytes=10 * mib) == 0
    assert db.check(tmp_path, repo_bytes=15 * mib) == 1
    out = capsys.readouterr()
    assert "run 2:  65.0 MiB" in out.out
    assert "run(s) [2]" in out.err and "pack" in out.err and "--keep-data" in out.err
    # what a local `join` leaves in verifier/ counts: the run no longer fits, and check names the file
    with open(tmp_path / "verifier" / "model.safetensors", "wb") as f:
        f.truncate(257 * mib)
    assert db.check(tmp_path, repo_bytes=10 * mib) == 1
    out = capsys.readouterr()
    assert "run 1: 307.0 MiB" in out.out
    assert "model.safetensors (257.0 MiB)" in out.err and "--keep-data" not in out.err
    (tmp_path / "verifier" / "model.safetensors").unlink()
    # a carried entry gone from the bundle
    (tmp_path / "gguf.part01").unlink()
    assert db.check(tmp_path, repo_bytes=10 * mib) == 1
    err = capsys.readouterr().err
    assert "not in" in err and "run 2: gguf.part01" in err
    with pytest.raises(SystemExit) as e:
        db.check(tmp_path / "missing")
    assert e.value.code == 2
    assert "MANIFEST.json" in capsys.readouterr().err


def test_kept_regenerated_data_goes_back_only_where_it_belongs(tmp_path, capsys):
    """save-regen / seed-regen: parts checked one by one, used only for the same train.jsonl and
    datagen settings, never over a file that holds as many conversations."""
    db = _device_bundle()
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    prompts = [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(50)]
    (data / "train.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    (data / "heldout.jsonl").write_text('{"messages": []}\n')
    answers = [{"index": i, "messages": [{"role": "assistant", "content": os.urandom(300).hex()}]} for i in range(40)]
    body = "".join(json.dumps(a) + "\n" for a in answers)
    (data / "regen.jsonl").write_text(body)
    (data / "heldout_regen.jsonl").write_text('{"index": 0, "messages": []}\n')
    st = {"turns": "all", "max_new_tokens": 256, "max_length": 2048}
    meta = db.save_regen(data, out, st, part_mib=0.01)
    assert len(meta["parts"]) >= 2 and meta["conversations"] == 40
    assert sorted(p.name for p in out.iterdir()) == ["regen.json"] + [p["name"] for p in meta["parts"]]

    def fresh(name, regen_lines=0):
        d = tmp_path / name
        d.mkdir()
        for n in ("train.jsonl", "heldout.jsonl"):
            shutil.copy(data / n, d / n)
        if regen_lines:
            (d / "regen.jsonl").write_text("".join(body.splitlines(True)[:regen_lines]))
        return d

    def said():
        return capsys.readouterr().out

    d = fresh("ok", regen_lines=7)  # fewer conversations than carried: replaced
    assert db.seed_regen(out, d, st) and "40 regenerated conversations put back" in said()
    assert (d / "regen.jsonl").read_text() == body and (d / "heldout_regen.jsonl").is_file()
    assert not db.seed_regen(out, d, st) and "already holds 40 conversations" in said()
    assert not db.seed_regen(out, fresh("turns"), {**st, "turns": "first"}) and "this run asks for" in said()
    other = fresh("other")
    (other / "train.jsonl").write_text('{"messages": []}\n')
    assert not db.seed_regen(out, other, st) and "answers another train.jsonl" in said()
    bad = tmp_path / "bad_bundle"
    shutil.copytree(out, bad)
    last = meta["parts"][-1]["name"]
    (bad / last).write_bytes((bad / last).read_bytes()[:-1] + b"x")
    d = fresh("damaged")
    assert not db.seed_regen(bad, d, st) and f"{last} does not match its sha256" in said()
    assert not (d / "regen.jsonl").exists()
    (bad / last).unlink()
    assert not db.seed_regen(bad, d, st) and f"{last} not carried" in said()
    assert not db.seed_regen(tmp_path / "nothing", d, st) and "datagen starts from nothing" in said()
    # a later, smaller save into the same folder leaves no part of the earlier one behind
    (data / "regen.jsonl").write_text("".join(body.splitlines(True)[:2]))
    small = db.save_regen(data, out, st, part_mib=0.01)
    assert sorted(p.name for p in out.iterdir()) == ["regen.json"] + [p["name"] for p in small["parts"]]
    assert len(small["parts"]) < len(meta["parts"])
