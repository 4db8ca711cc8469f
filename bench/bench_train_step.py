"""One training step (forward + backward + AdamW step) of a Qwen3-8B-shaped P-EAGLE drafter,
peagle_ext vs speculators 0.9.0 in the same run, time-boxed, with where the GPU time goes.

Drafter: hidden 4096, 32/8 heads x 128, intermediate 12288, vocab 151,936, 3 aux layers
(fc 12288 -> 4096), K=8, r=0.7, r_min=0.2; fp32 master weights + bf16 autocast (as both trainers
do); the embedding, fc, layers and mask_hidden train, lm_head is frozen (as speculators does).
Draft vocab: the full 151,936, or 32,768 through d2t (the usual EAGLE-3 setting). Random weights
and random verifier states of the right shapes; every step draws a new COD sample inside the
step (ours: cod_sample; speculators: its own sampler) from one synthetic packed row of
documents of 512-2048 tokens (10-40% prompt, then answer).

Implementations (a case's "impl"; one small builder each, STEP_BUILDERS):
  peagle  PEagleDraftModel.forward_backward (COD attention + fused linear-KL ops), fused AdamW
  spec    speculators' PEagleDraftModel.forward with its whole-forward torch.compile wrapper
          removed and its two FlexAttention pieces compiled with dynamic shapes, as PyTorch asks
          eager callers to (flex_attention and create_block_mask; static shapes if that fails);
          its loss is its fused Triton KL; AdamW as its trainer builds it (torch's default)
  specx   speculators' model, sampler, loss config and AdamW with peagle_ext's backend enabled
          (peagle_ext.integrations.speculators.enable_backend: its forward on our COD attention and
          fused linear-KL loss)
  plain   our model with plain-PyTorch attention (dense [T, T] mask) and full logits (--cases)

Per case it reports: step time (median of --steps), peak memory and memory at rest (after a
step: weights, AdamW state, gradients), kernel time per step by class from torch.profiler
(cuBLAS GEMMs, index/gather/scatter incl. their sorts, casts/copies/fills, optimizer, other
elementwise, loss row kernels, attention), the matmul floor of the work the step cannot
avoid (bf16 FLOPs of step_flops_floor at the cuBLAS rates measured in the same run: the head
GEMM shape and the MLP GEMM shape), and the step's bound: that floor plus the bytes AdamW and the
loss must move (step_bytes_floor) at the memory speed of a plain copy measured in the same run.

Time box: the parent (which never imports torch) runs each implementation's cases in one child
process (speculators compiles once for all its cases), each child in its own session with a
deadline, killed with its process group when it overruns; a child writes each case's result
file after every milestone, and a crashed child is restarted on the cases it did not reach.
Outputs in --out: bench_train_step.json, bench_train_step_logs.tgz (each case's result and, for a
profiled case, its step's chrome trace: logs/<case>.trace.json.gz); the tables are printed last.

GPU (one call; speculators and its pure-Python dependencies from wheels in .whl/, installed
with --no-deps; the CUDA build of peagle_ext):
    pip install --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:$PWD python bench/bench_train_step.py --budget-s 480   # every default case
CPU smoke test of the harness (toy shapes; speculators with its sdpa attention and eager loss):
    PYTHONPATH=/path/to/speculators:$PWD python bench/bench_train_step.py --device cpu --tiny
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from train_step_work import copy_rate, gemm_rates, profile_step, step_bytes_floor, step_flops_floor, sync

from peagle_ext.train.profiling import KERNEL_CLASSES

T0 = float(os.environ.get("BENCH_T0", time.time()))  # children print the parent's clock
K8, K32 = 8192, 32768


def case(name, impl, n, *, layers=1, vocab=None, max_anchors=None, est_s=20, profile=False, shape="qwen3-8b"):
    """vocab: draft vocab size (None = the verifier's); est_s: expected seconds on an H200;
    shape: the verifier's (SHAPES)."""
    return dict(
        name=name,
        impl=impl,
        n=n,
        layers=layers,
        vocab=vocab,
        max_anchors=max_anchors,
        est_s=est_s,
        with_profile=profile,
        shape=shape,
    )


def default_cases():
    return [
        case("peagle-1L-8K", "peagle", K8, profile=True),
        case("peagle-4L-8K", "peagle", K8, layers=4, profile=True),
        case("peagle-1L-8K-v32K", "peagle", K8, vocab=K32, profile=True),
        case("peagle-1L-32K", "peagle", 4 * K8, est_s=30),
        case("peagle-1L-128K-a1024", "peagle", 16 * K8, max_anchors=1024, est_s=35),
        # its first step compiles FlexAttention + create_block_mask and autotunes its loss
        case("spec-1L-8K", "spec", K8, est_s=110, profile=True),
        case("spec-1L-8K-v32K", "spec", K8, vocab=K32, est_s=40, profile=True),
        case("spec-4L-8K", "spec", K8, layers=4, est_s=40, profile=True),
        case("spec-1L-32K", "spec", 4 * K8, est_s=60),  # may OOM (its [N, V] targets, T x V logits)
        # speculators' model with peagle_ext's backend: its forward on our attention and loss
        case("specx-1L-8K", "specx", K8, est_s=25, profile=True),
        case("specx-1L-32K", "specx", 4 * K8, est_s=35),
        # the SmolLM2 study's step: 16 rows x 2048 tokens, draft vocab 32K (scripts/smollm2_gpu.sh)
        case("peagle-smollm2-1L-32K", "peagle", 4 * K8, vocab=K32, est_s=20, profile=True, shape="smollm2"),
        case("spec-smollm2-1L-32K", "spec", 4 * K8, vocab=K32, est_s=60, profile=True, shape="smollm2"),
        # its four layers, at its batch and at twice it: where the host's launches bound a step,
        # twice the tokens cost less than twice the time
        case("peagle-smollm2-4L-32K", "peagle", 4 * K8, layers=4, vocab=K32, est_s=25, profile=True, shape="smollm2"),
        case("peagle-smollm2-4L-64K", "peagle", 8 * K8, layers=4, vocab=K32, est_s=30, profile=True, shape="smollm2"),
    ]


def tiny_cases():
    """The same cases at toy sizes (a CPU check of the harness, not a benchmark)."""
    return [
        case("peagle-1L-8K", "peagle", 512, est_s=5, profile=True),
        case("peagle-4L-8K", "peagle", 512, layers=4, est_s=5),
        case("peagle-1L-8K-v32K", "peagle", 512, vocab=256, est_s=5, profile=True),
        case("peagle-1L-128K-a1024", "peagle", 2048, max_anchors=64, est_s=5),
        case("spec-1L-8K", "spec", 512, est_s=10, profile=True),
        case("spec-1L-8K-v32K", "spec", 512, vocab=256, est_s=5),
        case("specx-1L-8K", "specx", 512, est_s=5, profile=True),
        case("peagle-smollm2-1L-32K", "peagle", 512, vocab=256, est_s=5, profile=True, shape="smollm2"),
        case("spec-smollm2-1L-32K", "spec", 512, vocab=256, est_s=5, shape="smollm2"),
        case("peagle-smollm2-4L-32K", "peagle", 512, layers=4, vocab=256, est_s=5, shape="smollm2"),
        case("peagle-smollm2-4L-64K", "peagle", 1024, layers=4, vocab=256, est_s=5, shape="smollm2"),
    ]


# the verifier shapes of the cases: config, the MASK id, the ids synthetic text draws from,
# document lengths of the synthetic packed row
SHAPES = ("qwen3-8b", "smollm2")


def shape_params(shape, tiny):
    from transformers import LlamaConfig, Qwen3Config

    import peagle_ext.testing as TT

    if shape not in SHAPES:
        raise SystemExit(f"unknown verifier shape {shape!r} (one of {SHAPES})")
    if tiny:
        cls = Qwen3Config if shape == "qwen3-8b" else LlamaConfig
        vcfg = cls(
            hidden_size=64,
            intermediate_size=192,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=1024,
            rms_norm_eps=1e-6,
        )
        mask_id = 1000 if shape == "qwen3-8b" else 1024  # smollm2: a new id past the vocab, as its trainer
        return dict(vcfg=vcfg, mask_id=mask_id, real_vocab=1000, doc_len=(64, 256))
    if shape == "qwen3-8b":  # mask: an unused embedding row
        return dict(vcfg=TT.qwen3_8b_config(), mask_id=151_669, real_vocab=151_643, doc_len=(512, 2048))
    vcfg = TT.smollm2_config()
    # every id is a token: MASK is a new id past the vocab (the trainer's choice); the study's
    # rows hold conversations of a few hundred tokens
    return dict(vcfg=vcfg, mask_id=49152, real_vocab=49152, doc_len=(128, 1024))


# ---------------------------------------------------------------------------------------------
# Child: the cases of one implementation
# ---------------------------------------------------------------------------------------------
class Result:
    """A case's result file, rewritten atomically after every milestone."""

    def __init__(self, path, c):
        self.path, self.d = path, {**c, "status": "started"}

    def set(self, what=None, **kw):
        self.d.update(kw)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.d, f)
        os.replace(tmp, self.path)
        if what:  # progress line: the short values only (the JSON holds everything)
            short = {k: v for k, v in kw.items() if len(repr(v)) <= 160}
            print(f"[{time.time() - T0:6.1f}s] {self.d['name']}: {what} {short}", flush=True)


def child_env(a):
    """What every case of a child shares; run_case adds its verifier shape (shape_params)."""
    import torch

    dev = torch.device(a.device)
    if dev.type == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = True
    return dict(
        torch=torch,
        dev=dev,
        tiny=a.tiny,
        amp=torch.bfloat16 if dev.type == "cuda" else None,
        state_dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32,
        k=a.num_depths,
        rates={},
    )


def make_ours(c, env, cls=None):
    from peagle_ext.model import PEagleOptions
    from peagle_ext.testing import make_peagle

    opts = PEagleOptions(max_anchors=c["max_anchors"], train_embeddings="all")
    return make_peagle(
        env["vcfg"],
        num_layers=c["layers"],
        num_depths=env["k"],
        mask_token_id=env["mask_id"],
        options=opts,
        device=env["dev"],
        cls=cls,
        draft_vocab_size=c["vocab"],
    )


def step_peagle(c, env, ex, cls=None):
    """(model, optimizer, step(i) -> (loss, T)) of our trainer's step."""
    from peagle_ext.train.optim import make_adamw

    model = make_ours(c, env, cls)
    opt = make_adamw([p for p in model.parameters() if p.requires_grad], lr=1e-5, betas=(0.9, 0.95), weight_decay=0)

    def step(i):
        opt.zero_grad(set_to_none=True)
        m = model.forward_backward(ex, None, seed=1000 + i, autocast_dtype=env["amp"])
        opt.step()
        return m["loss_sum"] / max(m["weight"], 1e-9), m["num_tokens"]

    return model, opt, step


def step_plain(c, env, ex):
    from peagle_ext.reference.draft_model import plain_model_class

    return step_peagle(c, env, ex, cls=plain_model_class())


def step_spec(c, env, ex):
    """speculators' own forward on its own COD samples; its whole-forward compile removed, its
    flex pieces compiled (module docstring)."""
    import peagle_ext.integrations.speculators as S

    torch, dev = env["torch"], env["dev"]
    ours = make_ours(c, env)
    spec, core = S.make_speculators_twin(ours, attn_impl="sdpa" if dev.type == "cpu" else "simple_flex_attention")
    del ours
    type(spec).forward = S.uncompiled(type(spec).forward)
    if dev.type == "cuda" and "flex" not in env:
        import speculators.models.attention as spec_attn
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        # dynamic shapes: T changes every step (static: the fallback, see first_step_of)
        env["flex"] = lambda dyn: (
            setattr(spec_attn, "flex_attention", torch.compile(flex_attention, dynamic=dyn)),
            env.__setitem__("mask_fn", torch.compile(create_block_mask, dynamic=dyn)),
            env.__setitem__("replay", not dyn),
        )
        env["flex"](True)
    if dev.type == "cuda":
        spec._create_mask_fn = env["mask_fn"]
    return spec_step(c, env, ex, spec, core)


def step_specx(c, env, ex):
    """speculators' model and COD sampler with peagle_ext's backend enabled (its forward on our COD
    attention and fused loss: peagle_ext.integrations.speculators_backend); its trainer's AdamW."""
    import peagle_ext.integrations.speculators as S

    ours = make_ours(c, env)
    spec, core = S.make_speculators_twin(ours, attn_impl="sdpa")  # the backend replaces the attention
    del ours
    S.enable_backend(spec)
    return spec_step(c, env, ex, spec, core)


def spec_step(c, env, ex, spec, core):
    """(model, optimizer, step(i) -> (loss, T)) of speculators' model called as its trainer calls
    it, with its loss config (fused on a GPU); T from its sampler, which the step wraps."""
    import peagle_ext.integrations.speculators as S

    torch, dev = env["torch"], env["dev"]
    seen_t, first = [], []
    orig_sampler = env.setdefault("sampler", core.generate_cod_sample_indices)

    def sampler(*args, **kw):  # records T; replays its first sample when compiled statically
        if env.get("replay") and first:
            anchor, depth = first[0]
        else:
            anchor, depth = orig_sampler(*args, **kw)
            first[:] = [(anchor, depth)]
        seen_t.append(anchor.shape[0])
        return anchor, depth

    core.generate_cod_sample_indices = sampler
    loss_cfg = S.speculators_loss_config("fused" if dev.type == "cuda" else "eager")
    batch = S.speculators_batch(ex, dev)
    opt = torch.optim.AdamW([p for p in spec.parameters() if p.requires_grad], lr=1e-5, betas=(0.9, 0.95))
    amp = env["amp"]

    def step(i):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=amp, enabled=amp is not None):
            _, loss, _m = spec(
                **batch,
                loss_config=loss_cfg,
                max_anchors=c["max_anchors"],
                num_depths=env["k"],
                down_sample_ratio=0.7,
                down_sample_ratio_min=0.2,
            )
        loss.backward()
        opt.step()
        return float(loss), seen_t[-1]

    return spec, opt, step


STEP_BUILDERS = {"peagle": step_peagle, "spec": step_spec, "specx": step_specx, "plain": step_plain}


def run_case(c, env, path, deadline):
    torch, dev = env["torch"], env["dev"]
    import peagle_ext.testing as TT
    from peagle_ext.cod import cod_sample

    res = Result(path, c)
    env.update(shape_params(c.get("shape", "qwen3-8b"), env["tiny"]))
    vcfg = env["vcfg"]
    ex = TT.synthetic_example(
        c["n"],
        hidden=vcfg.hidden_size,
        vocab=env["real_vocab"],
        device=dev,
        dtype=env["state_dtype"],
        doc_len=env["doc_len"],
        seed=1234,
    )
    lay = cod_sample(ex.document_ids, ex.loss_mask, num_depths=env["k"], max_anchors=c["max_anchors"], seed=7)
    weight = ex.loss_mask[(lay.anchor + lay.depth).long()]
    vocab = c["vocab"] or vcfg.vocab_size
    fl = step_flops_floor(lay, weight, vcfg, c["layers"], vocab)
    rates = gemm_rates(env, vocab)
    floor_s = sum(fl["heads"].values()) / (rates["head"] * 1e12) + sum(fl["body"].values()) / (rates["body"] * 1e12)
    res.set(
        "floor",
        floor_ms=round(floor_s * 1e3, 2),
        floor_tflop=round((sum(fl["heads"].values()) + sum(fl["body"].values())) / 1e12, 3),
        floor=fl,
        cublas_tflops=rates,
    )
    model, opt, step = STEP_BUILDERS[c["impl"]](c, env, ex)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    nbytes = step_bytes_floor(fl, trainable, vocab, logit_bytes=2 if dev.type == "cuda" else 4)  # bf16 / fp32
    gbps = copy_rate(env)
    bound_s = floor_s + sum(nbytes.values()) / (gbps * 1e9)
    res.set(
        "built",
        trainable_params=trainable,
        floor_bytes=nbytes,
        copy_gbps=round(gbps, 1),
        bound_ms=round(bound_s * 1e3, 2),
    )
    warm = []
    for w in range(2):
        t = time.perf_counter()
        try:
            loss, tt = step(-1 - w)
        except Exception as e:  # speculators: a dynamic flex compile that fails gets one static retry
            if (
                c["impl"] != "spec"
                or "flex" not in env
                or env.get("replay")
                or isinstance(e, torch.cuda.OutOfMemoryError)
            ):
                raise
            res.set("dynamic flex compile failed, retrying static", flex_error=repr(e)[:600])
            torch._dynamo.reset()
            env["flex"](False)
            model._create_mask_fn = env["mask_fn"]
            t = time.perf_counter()
            loss, tt = step(-1 - w)
        sync(env)
        warm.append(round(time.perf_counter() - t, 3))
        res.set(f"warmup{w}", warmup_s=warm, T=tt, loss=round(loss, 4))
        if time.time() + 3 * warm[-1] > deadline:
            break
    mem = (lambda f: round(f() / 2**30, 3)) if dev.type == "cuda" else (lambda f: None)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, ts = [], []
    while len(times) < env["steps"] and (not times or time.time() + 1.5 * min(times) < deadline):
        t = time.perf_counter()
        _, tt = step(len(times))
        sync(env)
        times.append(time.perf_counter() - t)
        ts.append(tt)
    med = sorted(times)[len(times) // 2]
    res.set(
        "timed",
        step_s=[round(x, 4) for x in times],
        median_s=round(med, 4),
        Ts=ts,
        peak_gb=mem(torch.cuda.max_memory_allocated) if dev.type == "cuda" else None,
        rest_gb=mem(torch.cuda.memory_allocated) if dev.type == "cuda" else None,
        x_floor=round(med / floor_s, 3),
        x_bound=round(med / bound_s, 3),
    )
    if c["with_profile"] and time.time() + 3 * med < deadline:
        trace = os.path.join(os.path.dirname(path), f"{c['name']}.trace.json.gz")
        res.set("profiled", profile=profile_step(env, step, trace_path=trace))
    res.set(status="ok")
    del model, opt, step


def child_main(a):
    cases = json.loads(a.child)
    env = child_env(a)
    env["steps"] = a.steps
    torch = env["torch"]
    deadline = float(a.deadline)
    for c in cases:
        path = os.path.join(a.logdir, f"{c['name']}.json")
        if time.time() + min(c["est_s"], 20) > deadline:
            Result(path, c).set("skipped", status=f"skipped: {deadline - time.time():.0f}s left")
            continue
        try:
            run_case(c, env, path, deadline)
        except Exception as e:  # an OOM or error ends this case, not the others
            low = repr(e).lower()
            status = "OOM" if "out of memory" in low else f"error: {repr(e)[:300]}"
            r = Result(path, c)
            if os.path.exists(path):
                with open(path) as f:
                    r.d.update(json.load(f))
            r.set("failed", status=status)
        import gc

        gc.collect()
        if env["dev"].type == "cuda":
            torch.cuda.empty_cache()
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown (nor leftover compile workers)


# ---------------------------------------------------------------------------------------------
# Parent: schedule, time-box, collect, report
# ---------------------------------------------------------------------------------------------
def run_child(a, cases, deadline, logdir):
    """Run `cases` in one child until done or `deadline`; kill its process group past that."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(cases), "--deadline", str(deadline)]
    cmd += ["--device", a.device, "--steps", str(a.steps), "--num-depths", str(a.num_depths), "--logdir", logdir]
    cmd += ["--tiny"] if a.tiny else []
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "BENCH_T0": str(T0)}
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with open(os.path.join(logdir, f"{cases[0]['impl']}.{len(os.listdir(logdir))}.log"), "w") as log:
        p = subprocess.Popen(cmd, stderr=log, env=env, start_new_session=True)
        try:
            p.wait(timeout=max(1.0, deadline - time.time() + 10))
        except subprocess.TimeoutExpired:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(p.pid, sig)
                    p.wait(timeout=5)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
    return p.returncode


CHILD_START_S = 15.0  # a child's imports, CUDA start and first model before its first case (~13 s on an H100)


def impl_seconds(todo, later_cases, later_impls: int) -> tuple[float, float]:
    """(this implementation's seconds, the later implementations' seconds) for share_deadline:
    the cases' estimates plus one child start each, which a short budget would otherwise take out
    of the first implementation's share (its child starting used up what its case needed)."""
    mine = sum(c["est_s"] for c in todo) + CHILD_START_S
    return mine, sum(c["est_s"] for c in later_cases) + CHILD_START_S * later_impls


def share_deadline(now, end, mine_s, later_s):
    """The deadline of the implementation about to run: its share of the time left to `end`, in
    proportion to its cases' estimates against those of the implementations after it (so a short
    budget shortens every implementation instead of starving the first); at least 10 s."""
    return max(now + 10, now + (end - now) * mine_s / max(mine_s + later_s, 1e-9))


def parent_main(a):
    cases = tiny_cases() if a.tiny else default_cases()
    if a.cases:
        want = a.cases.split(",")
        cases = [c for c in cases if c["name"] in want] + [parse_case(w) for w in want if w.count(":") >= 1]
    logdir = a.logdir or f"/tmp/bench_train_step_logs_{os.getpid()}"
    os.makedirs(logdir, exist_ok=True)
    end = T0 + a.budget_s - a.final_reserve_s
    impls = list(dict.fromkeys(c["impl"] for c in cases))
    for gi, impl in enumerate(impls):
        todo = [c for c in cases if c["impl"] == impl]
        later_cases = [c for c in cases if c["impl"] in impls[gi + 1 :]]
        while todo and time.time() < end - 5:
            deadline = share_deadline(time.time(), end, *impl_seconds(todo, later_cases, len(impls) - gi - 1))
            print(f"[{time.time() - T0:6.1f}s] -> {impl}: {[c['name'] for c in todo]}", flush=True)
            rc = run_child(a, todo, deadline, logdir)
            done = {c["name"] for c in todo if os.path.exists(os.path.join(logdir, f"{c['name']}.json"))}
            crashed = [c for c in todo if c["name"] in done and read(logdir, c).get("status") == "started"]
            for c in crashed:  # the case the child died in (a hard crash or the deadline)
                r = read(logdir, c)
                r["status"] = f"child ended (rc={rc}) during this case"
                with open(os.path.join(logdir, f"{c['name']}.json"), "w") as f:
                    json.dump(r, f)
            todo = [c for c in todo if c["name"] not in done]
            if time.time() >= deadline - 5:
                break
    results = [read(logdir, c) if os.path.exists(os.path.join(logdir, f"{c['name']}.json")) else c for c in cases]
    for r in results:
        r.setdefault("status", "not run: budget spent")
    write_outputs(a, results, logdir)
    return 0


def read(logdir, c):
    with open(os.path.join(logdir, f"{c['name']}.json")) as f:
        return json.load(f)


def parse_case(spec):
    """impl:N[:layers[:vocab[:max_anchors]]], e.g. peagle:65536 or plain:4096:1."""
    p = spec.split(":")
    if p[0] not in STEP_BUILDERS:
        raise SystemExit(f"--cases: unknown implementation in {spec!r} (one of {sorted(STEP_BUILDERS)})")
    num = [int(x) if x not in ("", "-") else None for x in p[1:]] + [None] * 4
    return case(spec, p[0], num[0], layers=num[1] or 1, vocab=num[2], max_anchors=num[3], est_s=60, profile=True)


def write_outputs(a, results, logdir):
    import tarfile

    os.makedirs(a.out, exist_ok=True)
    meta = {"budget_s": a.budget_s, "elapsed_s": round(time.time() - T0, 1), "device": a.device, "tiny": a.tiny}
    with open(os.path.join(a.out, "bench_train_step.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    with tarfile.open(os.path.join(a.out, "bench_train_step_logs.tgz"), "w:gz") as t:
        t.add(logdir, arcname="logs")
    print_tables(meta, results)


def print_tables(meta, res):
    print(f"\n== train step, {meta['device']}{' (tiny)' if meta['tiny'] else ''}: {meta['elapsed_s']}s ==")
    rates = {r["vocab"] or "full": r["cublas_tflops"] for r in res if r.get("cublas_tflops")}
    for v, rt in rates.items():
        print(f"cuBLAS TF/s in this run, vocab {v}: head GEMM {rt['head']:.1f}, MLP GEMM {rt['body']:.1f}")
    gbps = next((r["copy_gbps"] for r in res if r.get("copy_gbps")), None)
    if gbps:
        print(f"memory speed in this run (a plain copy): {gbps:.0f} GB/s")
    print(
        "| case | N | T | weighted rows | distinct targets | step ms | floor ms | x floor | bound ms | x bound "
        "| peak GB | at rest GB |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in res:
        ms = f"{r['median_s'] * 1e3:.1f}" if r.get("median_s") else "-"
        fl = r.get("floor") or {}
        print(
            f"| {r['name']} | {r['n']} | {r.get('T', '-')} | {fl.get('weighted_rows', '-')} | "
            f"{fl.get('distinct_targets', '-')} | {ms} | {r.get('floor_ms', '-')} | {r.get('x_floor', '-')} | "
            f"{r.get('bound_ms', '-')} | {r.get('x_bound', '-')} | {r.get('peak_gb') or '-'} | {r.get('rest_gb') or '-'} |"
            + ("" if r["status"] == "ok" else f" {r['status']}")
        )
    prof = [r for r in res if isinstance(r.get("profile"), dict)]
    if prof:
        print("\nkernel ms per step by class (torch.profiler, one step)")
        print("| case | " + " | ".join(KERNEL_CLASSES) + " | all kernels | step wall |")
        print("|---|" + "---:|" * (len(KERNEL_CLASSES) + 2))
        for r in prof:
            p = r["profile"]
            cl = " | ".join(f"{p['classes_ms'][k]:.1f}" for k in KERNEL_CLASSES)
            print(f"| {r['name']} | {cl} | {p['kernel_ms']:.1f} | {p['wall_ms']:.1f} |")
        for r in prof:
            p = r["profile"]
            if p.get("device_idle_ms") is not None:
                ops = ", ".join(f"{k} {v:.1f}" for k, v in p["idle_by_host_op"][:5])
                print(f"{r['name']}: device idle {p['device_idle_ms']:.1f} ms of the profiled step; host then in {ops}")
    by = {r["name"]: r for r in res}
    for r in res:
        pre = r["impl"] + "-"  # ours and the backend, each against speculators alone on the same case
        s = by.get("spec-" + r["name"][len(pre) :]) if r["impl"] in ("peagle", "specx") else None
        if not (s and r.get("median_s") and s.get("median_s")):
            continue
        line = f"{r['name']} vs {s['name']}: step time {r['median_s'] / s['median_s']:.3f}x"
        if r.get("peak_gb") and s.get("peak_gb"):
            above = (r["peak_gb"] - r["rest_gb"]) / max(s["peak_gb"] - s["rest_gb"], 1e-9)
            line += f", peak {r['peak_gb'] / s['peak_gb']:.3f}x, peak above rest {above:.3f}x"
        print(line)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-s", type=float, default=330.0, help="wall-clock budget of the whole run")
    p.add_argument("--final-reserve-s", type=float, default=5.0, help="kept for writing the outputs")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="toy shapes (CPU smoke test of the harness)")
    # a step's time moves by ~3% from step to step (the 4-layer step on the H200: 306-319 ms, in
    # two groups), so a median of 5 moves with which group has three of them
    p.add_argument("--steps", type=int, default=11, help="timed steps per case (fewer when time runs out)")
    p.add_argument("--num-depths", type=int, default=8)
    p.add_argument("--cases", default="", help="comma list of case names or impl:N[:layers[:vocab[:anchors]]]")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    p.add_argument("--logdir", default=None, help="per-case results and logs (default /tmp/...)")
    p.add_argument("--list", action="store_true", help="print the cases and exit")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--deadline", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        return child_main(a)
    if a.list:
        for c in tiny_cases() if a.tiny else default_cases():
            print(c)
        return 0
    return parent_main(a)


if __name__ == "__main__":
    sys.exit(main())
