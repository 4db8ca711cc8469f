"""One training step (forward + backward + AdamW step) of a Qwen3-8B-shaped P-EAGLE drafter:
peagle_ext vs speculators 0.9.0 vs a plain-PyTorch path, on one GPU, time-boxed.

Drafter: hidden 4096, 32/8 heads, head dim 128, intermediate 12288, vocab 151,936 with the
DRAFT VOCAB = THE FULL VOCAB (no d2t reduction: the lm_head, the verifier head and the logits are
all 151,936 wide), 3 aux layers (fc 12288 -> 4096), K=8 depths, r=0.7, r_min=0.2. Random weights
and random verifier states of the right shapes (no verifier model), fp32 master weights + bf16
autocast (as both trainers do), AdamW over the same trainable set (embedding, fc, layers,
mask_hidden; lm_head frozen, as speculators does). Each step draws a new COD sample inside the
step (ours: cod_sample op; speculators: its own generate_cod_sample_indices) from one synthetic
packed row: documents of 512-2048 tokens, 10-40% prompt (no loss) then answer, EAGLE-shift
padding at each document's end.

Implementations (case "impl"):
  peagle        peagle_ext PEagleDraftModel.forward_backward (COD attention + fused linear-KL ops)
  spec_eager    speculators' PEagleDraftModel.forward run as a plain function (its
                @conditional_torch_compile wrapper removed via _torchdynamo_orig_callable), with
                the two FlexAttention pieces compiled as PyTorch recommends for eager callers:
                flex_attention (in speculators.models.attention) and create_block_mask (the
                model's _create_mask_fn; speculators' own DFlash does the same), both with
                dynamic=True because T changes every step; its loss = its default fused Triton KL.
  spec_compiled speculators as shipped: torch.compile over the whole forward (re-wrapped with
                dynamic=True unless --spec-compile-dynamic=none keeps its own default wrapper).
                Run with dynamo INFO logs and Python stack dumps every 10 s: evidence of where the
                first step spends its time (see RESULTS in the report / bench/RESULTS.md).
  plain         our model with the two fused ops replaced by plain PyTorch: SDPA over the dense
                [T, T] COD mask and full [T, V] logits + log_softmax KL.
Uncompiled flex_attention is not benchmarked: PyTorch then runs an unfused reference that
materialises [32, T, T] fp32 scores (~67 GB at N=8K, T~23K, for the scores alone).

Time box: the parent (this script, which never imports torch) runs every case in its own
subprocess (own session, killed with its process group on timeout, so an OOM or hang cannot
take down the run) and stops launching cases when --budget-s is spent; each child rewrites its
result file after every milestone, so a killed case still reports what it measured.
Order: priority order (cases 1-5 of the issue first), except that speculators' 8K case, whose
first step compiles FlexAttention + create_block_mask and autotunes its fused loss (1-2 minutes
of mostly CPU work on a cold machine), starts at t=0 in the BACKGROUND on the upper half of the
CPUs while our cases run in the foreground on the lower half. One file lock (GpuLock) is held
by every timed step (and second warmup step) of every case and by speculators' Triton autotune
benchmarks, so no timed step and no autotune measurement shares the GPU (time spent waiting for
the lock is not timed). Only cases whose memory fits beside it run beside it (bg_ok); the 128K
case goes first, while the background case is still importing/compiling. Cases that ran beside
it say so ("beside_background"), and the 8K headline case is re-run alone at the end when the
budget allows. The background case imports and builds at once but waits for a gate (a file the
parent creates when the 128K case is done) before its first step, so the two memory peaks
(72 GB and ~50 GB) never meet. Outputs in --out: bench_train_step.json, bench_train_step.png (peak memory and
step time vs N), bench_train_step_logs.tgz (per-case logs); the compact table is printed last.

GPU (speculators' wheels installed with --no-deps into /tmp/site; needs the
CUDA build of peagle_ext, e.g. `bash bench/gpu_suite.sh build`):
    pip install --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:$PWD python bench/bench_train_step.py --budget-s 160
CPU smoke test of the harness (tiny shapes; speculators with its sdpa backend + eager loss):
    PYTHONPATH=/tmp/specsite:$PWD python bench/bench_train_step.py --device cpu --tiny --budget-s 300
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
T0 = float(os.environ.get("BENCH_TRAIN_STEP_T0", time.time()))  # children print the parent's clock

# ---------------------------------------------------------------------------------------------
# Cases, in priority order. est_s: expected wall time on an H200 (launch + build + warmup +
# timed steps); a case is only started when at least min_s of budget is left; timeout_s caps it.
# ---------------------------------------------------------------------------------------------
K8 = 8192


def case(
    name,
    impl,
    n,
    layers=1,
    max_anchors=None,
    timeout_s=45,
    min_s=15,
    est_s=20,
    protect=False,
    bg_ok=False,
    bg_first=False,
    note="",
):
    return dict(
        name=name,
        impl=impl,
        n=n,
        layers=layers,
        max_anchors=max_anchors,
        timeout_s=timeout_s,
        min_s=min_s,
        est_s=est_s,
        protect=protect,
        bg_ok=bg_ok,
        bg_first=bg_first,
        note=note,
    )


def default_cases():
    # bg_ok: may run beside speculators' background case (memory fits next to its ~50 GB);
    # bg_first: runs first; the background case imports and builds meanwhile but starts its first
    # step only when these are done (a gate file), so their peaks never meet (128K: 72 GB)
    return [
        case("peagle-1L-8K", "peagle", 8 * 1024, bg_ok=True),
        # its first step compiles FlexAttention + create_block_mask and autotunes its fused loss:
        # run in the background from t=0 (parent_main), else it gets what is left after keeping
        # room for the protected cases still pending
        case("spec_eager-1L-8K", "spec_eager", 8 * 1024, timeout_s=150, min_s=30),
        case("peagle-1L-32K", "peagle", 32 * 1024, timeout_s=45, est_s=20, protect=True, bg_ok=True),
        case(
            "peagle-1L-128K-a1024",
            "peagle",
            128 * 1024,
            max_anchors=1024,
            timeout_s=50,
            min_s=20,
            est_s=28,
            protect=True,
            bg_ok=True,
            bg_first=True,
        ),
        # ~80 GB peak on an H200 (2026-11-29 run): never beside the background case
        case("plain-1L-4K", "plain", 4 * 1024, timeout_s=40),
        case("peagle-1L-16K", "peagle", 16 * 1024, timeout_s=35, bg_ok=True),
        case("peagle-1L-4K", "peagle", 4 * 1024, timeout_s=30, bg_ok=True),
        case("peagle-4L-8K", "peagle", 8 * 1024, layers=4, timeout_s=35, bg_ok=True),
        case("peagle-1L-64K", "peagle", 64 * 1024, timeout_s=45, min_s=20),
        case("spec_compiled-1L-8K", "spec_compiled", 8 * 1024, timeout_s=150, min_s=25),
        case("peagle-4L-32K", "peagle", 32 * 1024, layers=4, timeout_s=45, min_s=20),
        case("spec_eager-4L-8K", "spec_eager", 8 * 1024, layers=4, timeout_s=90, min_s=40),
        case("peagle-1L-128K", "peagle", 128 * 1024, timeout_s=60, min_s=25),
    ]


def tiny_cases():
    """CPU smoke test: the same implementations at toy sizes."""
    return [
        case("peagle-1L-512", "peagle", 512, timeout_s=120, bg_ok=True),
        case("spec_eager-1L-512", "spec_eager", 512, timeout_s=120),
        case("peagle-1L-1K", "peagle", 1024, timeout_s=120, bg_ok=True),
        case("peagle-1L-2K-a64", "peagle", 2048, max_anchors=64, timeout_s=120, bg_ok=True, bg_first=True),
        case("plain-1L-512", "plain", 512, timeout_s=120, bg_ok=True),
        case("peagle-2L-512", "peagle", 512, layers=2, timeout_s=120),
    ]


# ---------------------------------------------------------------------------------------------
# Child: one case
# ---------------------------------------------------------------------------------------------
class Result:
    """The child's result file, rewritten atomically after every milestone."""

    def __init__(self, path, case_):
        self.path = path
        self.d = {**case_, "status": "started", "events": []}
        self.t0 = time.time()

    def event(self, what, **kw):
        self.d["events"].append({"t": round(time.time() - self.t0, 2), "what": what, **kw})
        self.d.update(kw)
        self.write()
        print(f"[{time.time() - T0:6.1f}s] {self.d['name']}: {what} {kw if kw else ''}", flush=True)

    def write(self):
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.d, f)
        os.replace(tmp, self.path)


class GpuLock:
    """An exclusive flock on a file shared by all cases of a run: timed steps (and second warmup
    steps) hold it, and the background speculators case holds it while Triton benchmarks its
    autotune candidates, so none of these overlap on the GPU (waiting is not in any step time)."""

    def __init__(self, path):
        self.f = open(path, "a+") if path else None

    def __enter__(self):
        if self.f:
            import fcntl

            fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.f:
            import fcntl

            fcntl.flock(self.f, fcntl.LOCK_UN)


def child_main(a):
    if a.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(x) for x in a.cpus.split(",")})
    import torch

    c = json.loads(a.child)
    res = Result(a.result, c)
    deadline = float(a.deadline)
    gpu_lock = GpuLock(a.gpu_lock)
    if c.get("background"):
        # Triton's autotuner times each candidate config with triton.testing.do_bench (looked up
        # at call time through the driver's get_benchmarker): run the candidate once outside the
        # lock (its JIT compile happens there), then time it holding the lock, so no foreground
        # timed step shares the GPU with a measurement and no compile holds the lock.
        try:
            import triton.testing as triton_testing

            orig_do_bench = triton_testing.do_bench

            def locked_do_bench(fn, *args, **kw):
                fn()
                torch.cuda.synchronize()
                with gpu_lock:
                    return orig_do_bench(fn, *args, **kw)

            triton_testing.do_bench = locked_do_bench
            res.d["autotune_lock"] = "installed (triton.testing.do_bench)"
        except Exception as e:  # it then runs unlocked (said in the result)
            res.d["autotune_lock"] = f"not installed: {e!r}"
    import peagle_ext.integrations.speculators as S
    import peagle_ext.testing as TT
    from peagle_ext.reference.draft_model import plain_model_class

    dev = torch.device(a.device)
    tiny = a.tiny
    if dev.type == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = True
        res.d["gpu"] = torch.cuda.get_device_name()
    res.d["torch"] = torch.__version__
    amp = torch.bfloat16 if dev.type == "cuda" else None
    state_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if tiny:
        from transformers import Qwen3Config

        vcfg = Qwen3Config(
            hidden_size=64,
            intermediate_size=192,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=1024,
            rms_norm_eps=1e-6,
        )
        mask_id, real_vocab, doc_len = 1000, 1000, (64, 256)
    else:
        vcfg = TT.qwen3_8b_config()
        mask_id, real_vocab, doc_len = 151_669, 151_643, (512, 2048)  # mask: an unused embedding row
    k = a.num_depths
    impl = c["impl"]
    from peagle_ext.model import PEagleOptions

    opts = PEagleOptions(
        down_sample_ratio=0.7, down_sample_ratio_min=0.2, max_anchors=c["max_anchors"], train_embeddings="all"
    )
    cls = plain_model_class() if impl == "plain" else None
    ours = TT.make_peagle(
        vcfg, num_layers=c["layers"], num_depths=k, mask_token_id=mask_id, options=opts, device=dev, cls=cls
    )
    ex = TT.synthetic_example(
        c["n"], hidden=vcfg.hidden_size, vocab=real_vocab, device=dev, dtype=state_dtype, doc_len=doc_len, seed=1234
    )
    res.d["loss_tokens"] = int(ex.loss_mask.sum())
    res.d["docs"] = int(ex.document_ids.max()) + 1
    # the work floor of this step, from one of OUR layouts of this row (T differs by < 1% from
    # step to step; speculators' own sampler gives a slightly larger T, see "T")
    from peagle_ext.cod import cod_sample

    fl = step_flops_floor(
        cod_sample(ex.document_ids, ex.loss_mask, num_depths=k, max_anchors=c["max_anchors"], seed=7), vcfg, c["layers"]
    )
    res.d["floor_tflop"] = round(fl["total"] / 1e12, 3)
    res.d["floor_attention_tflop"] = round(fl["attention"] / 1e12, 3)

    if impl.startswith("spec"):
        spec, core = S.make_speculators_twin(
            ours, attn_impl="sdpa" if dev.type == "cpu" else "simple_flex_attention", device=dev
        )
        del ours
        model = spec
        loss_cfg = S.speculators_loss_config("fused" if dev.type == "cuda" else "eager")
        batch = S.speculators_batch(ex, dev)
        fwd_raw = S.uncompiled(type(spec).forward)
        seen_t = []
        # Python stacks every 15 s: if its first step does not finish, the log says where it is
        import faulthandler

        stacks = open(os.path.join(a.logdir, f"{c['name']}.stacks.txt"), "w")
        faulthandler.dump_traceback_later(15, repeat=True, file=stacks)
        if impl == "spec_eager":
            if hasattr(fwd_raw, "_torchdynamo_orig_callable"):
                raise RuntimeError("could not unwrap speculators' compiled forward")
            type(spec).forward = fwd_raw
            replay, first = [False], []  # see use_flex("static")
            if dev.type == "cuda":
                import speculators.models.attention as spec_attn_mod
                from torch.nn.attention.flex_attention import create_block_mask, flex_attention

                def use_flex(variant):
                    """ "dynamic": flex_attention and create_block_mask compiled with dynamic
                    shapes (T changes every step). "static": the fallback if that fails to
                    compile: both compiled for one T, and its sampler replays its own first COD
                    sample on later steps so that T stays fixed (no recompile per step; its
                    sampler, ~6 ms on an H200 per bench_cod.py, is then not in the step time)."""
                    dyn = variant == "dynamic"
                    spec_attn_mod.flex_attention = torch.compile(flex_attention, dynamic=dyn)
                    spec._create_mask_fn = torch.compile(create_block_mask, dynamic=dyn)
                    res.d["flex_variant"] = variant
                    replay[0] = not dyn

                use_flex("dynamic")
            # record T (number of sampled tokens) from its own sampler, unchanged otherwise
            orig_sampler = core.generate_cod_sample_indices

            def recording_sampler(*args, **kw):
                if replay[0] and first:
                    anchor, depth = first[0]
                else:
                    anchor, depth = orig_sampler(*args, **kw)
                    first[:] = [(anchor, depth)]
                seen_t.append(anchor.shape[0])
                return anchor, depth

            core.generate_cod_sample_indices = recording_sampler
        else:  # spec_compiled
            import logging

            torch._logging.set_logs(dynamo=logging.INFO, recompiles=True, graph_breaks=True)
            if a.spec_compile_dynamic == "true":
                type(spec).forward = torch.compile(fwd_raw, dynamic=True)
            elif dev.type == "cpu":
                type(spec).forward = torch.compile(fwd_raw)
            res.d["compile"] = {"dynamic": a.spec_compile_dynamic}

            def report_compile_times():
                try:
                    from torch._dynamo.utils import compile_times

                    res.d["compile_times"] = compile_times(repr="str")[:4000]
                    res.write()
                except Exception as e:  # diagnostics only
                    res.d["compile_times"] = f"unavailable: {e}"

            import threading

            threading.Timer(max(1.0, deadline - time.time() - 4.0), report_compile_times).start()

        def step(i):
            ctx = torch.autocast(dev.type, dtype=amp) if amp else torch.autocast(dev.type, enabled=False)
            opt.zero_grad(set_to_none=True)
            with ctx:
                _, loss, _m = spec(
                    **batch,
                    loss_config=loss_cfg,
                    max_anchors=c["max_anchors"],
                    num_depths=k,
                    down_sample_ratio=0.7,
                    down_sample_ratio_min=0.2,
                )
            loss.backward()
            opt.step()
            return float(loss), (seen_t[-1] if seen_t else None)
    else:
        model = ours

        def step(i):
            opt.zero_grad(set_to_none=True)
            m = ours.forward_backward(ex, None, seed=1000 + i, autocast_dtype=amp)
            opt.step()
            return m["loss_sum"] / max(m["weight"], 1e-9), m["num_tokens"]

    params = [p for p in model.parameters() if p.requires_grad]
    res.d["trainable_params"] = sum(p.numel() for p in params)
    res.d["total_params"] = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    opt = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def mem_gb(fn):
        return round(fn() / 2**30, 3) if dev.type == "cuda" else None

    sync()
    res.event("built", model_gb=mem_gb(torch.cuda.memory_allocated))
    gate = os.environ.get("BENCH_TRAIN_STEP_GATE") if c.get("background") else None
    if gate:
        # the first step's memory peak must not meet the foreground's largest case (see default_cases)
        t = time.time()
        while not os.path.exists(gate) and time.time() < min(deadline - 30, t + 90):
            time.sleep(0.2)
        res.event("gate open", gate_wait_s=round(time.time() - t, 1))
    # warmup: the first step (compiles, autotunes, allocates AdamW state); a second one when the
    # first was slow (a compile) so that recompiles, if any, are not timed
    warm = []
    for w in range(2):
        if w == 1:
            gpu_lock.__enter__()  # the second warmup runs at full speed: keep it off timed steps
        t = time.perf_counter()
        try:
            loss, tt = step(-1 - w)
        except Exception as e:  # a compile failure of the dynamic flex variant: retry once, static
            if (
                impl != "spec_eager"
                or dev.type != "cuda"
                or res.d.get("flex_variant") != "dynamic"
                or isinstance(e, torch.cuda.OutOfMemoryError)
            ):
                raise
            res.event("dynamic flex variant failed, retrying static", error=repr(e)[:800])
            torch._dynamo.reset()  # drop whatever the failed attempt cached on flex_attention's code
            torch.cuda.empty_cache()
            use_flex("static")
            t = time.perf_counter()
            loss, tt = step(-1 - w)
        sync()
        warm.append(time.perf_counter() - t)
        if w == 1:
            gpu_lock.__exit__()
        res.event(
            f"warmup{w}",
            warmup_s=[round(x, 3) for x in warm],
            T=tt,
            loss=round(loss, 4),
            peak_first_gb=mem_gb(torch.cuda.max_memory_allocated),
        )
        if warm[-1] < 5.0 or time.time() + warm[-1] * 2 > deadline:
            break
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, ts = [], []
    while len(times) < a.steps:
        est = min(times) if times else warm[-1]
        if times and time.time() + 1.3 * est > deadline:
            break
        with gpu_lock:
            t = time.perf_counter()
            loss, tt = step(len(times))
            sync()
            times.append(time.perf_counter() - t)
        ts.append(tt)
        srt = sorted(times)
        res.event(
            f"step{len(times)}",
            step_s=[round(x, 4) for x in times],
            median_s=round(srt[len(srt) // 2], 4),
            T=tt,
            Ts=ts,
            loss=round(loss, 4),
            peak_gb=mem_gb(torch.cuda.max_memory_allocated),
            reserved_gb=mem_gb(torch.cuda.max_memory_reserved),
            rest_gb=mem_gb(torch.cuda.memory_allocated),
        )
    res.d["status"] = "ok" if times else "no timed step"
    res.write()
    os._exit(0)  # skip interpreter teardown (and any leftover compile workers)


# ---------------------------------------------------------------------------------------------
# Parent: schedule, time-box, collect, report
# ---------------------------------------------------------------------------------------------
class Running:
    """A case's child process (own session) with its deadline."""

    def __init__(self, a, c, timeout, logdir, cpus=None, env_extra=None):
        self.c, self.timeout, self.logdir = c, timeout, logdir
        self.path = os.path.join(logdir, f"{c['name']}.json")
        if os.path.exists(self.path):
            os.remove(self.path)
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            json.dumps(c),
            "--result",
            self.path,
            "--deadline",
            str(time.time() + timeout - 2.0),
            "--device",
            a.device,
            "--steps",
            str(c.get("steps") or a.steps),
            "--num-depths",
            str(a.num_depths),
            "--logdir",
            logdir,
            "--spec-compile-dynamic",
            a.spec_compile_dynamic,
            "--gpu-lock",
            os.path.join(logdir, "gpu.lock"),
        ]
        if cpus:
            cmd += ["--cpus", ",".join(str(x) for x in sorted(cpus))]
        if a.tiny:
            cmd.append("--tiny")
        env = dict(os.environ)
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        env["PYTHONUNBUFFERED"] = "1"
        env["BENCH_TRAIN_STEP_T0"] = str(T0)
        env.update(env_extra or {})
        self.log = open(os.path.join(logdir, f"{c['name']}.log"), "w")
        self.t0 = time.time()
        sys.stdout.flush()
        # the child's progress lines go straight to our stdout; its stderr (warnings, logs) to a file
        self.p = subprocess.Popen(cmd, stdout=None, stderr=self.log, env=env, start_new_session=True)
        self.status = None
        self.collected = False

    def alive(self):
        return self.p.poll() is None

    def kill(self, why):
        self.status = why
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.p.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.p.wait(timeout=3)
                break
            except subprocess.TimeoutExpired:
                continue

    def wait(self, until=None):
        """Wait for the child (at most until its own timeout, or `until` if earlier: then kill)."""
        limit = self.t0 + self.timeout if until is None else min(until, self.t0 + self.timeout)
        try:
            self.p.wait(timeout=max(0.0, limit - time.time()))
        except subprocess.TimeoutExpired:
            self.kill(f"timeout after {time.time() - self.t0:.0f}s")
        return self.collect()

    def collect(self):
        self.collected = True
        self.log.close()
        c = self.c
        r = {**c}
        if os.path.exists(self.path):
            with open(self.path) as f:
                r.update(json.load(f))
        logpath = os.path.join(self.logdir, f"{c['name']}.log")
        with open(logpath, errors="replace") as f:
            tail = f.read()[-3000:]
        status = self.status
        if status is None and self.p.returncode != 0:
            low = tail.lower()
            status = "OOM" if ("out of memory" in low or "outofmemory" in low) else f"error rc={self.p.returncode}"
        if status is not None:
            r["status"] = status if r.get("status") in (None, "started") else f"{status} ({r.get('status')})"
            r["stderr_tail"] = tail[-1500:]
        r["wall_s"] = round(time.time() - self.t0, 1)
        if c["impl"] == "spec_compiled":
            # the frame-by-frame compile timeline (dynamo INFO lines carry wall-clock stamps)
            keys = (
                "torchdynamo start tracing",
                "done compiler function",
                "Recompiling function",
                "Graph break in user code",
                "Skipping the frame",
                "size mismatch",
            )
            with open(logpath, errors="replace") as f:
                r["compile_log"] = [ln.rstrip()[:240] for ln in f if any(k in ln for k in keys)][:150]
        return r


def run_case(a, c, timeout, logdir, cpus=None):
    return Running(a, c, timeout, logdir, cpus=cpus).wait()


def summarize(r):
    med = r.get("median_s")
    tok_s = round(r["n"] / med) if med else None
    floor_tfs = round(r["floor_tflop"] / med, 1) if med and r.get("floor_tflop") else None
    return {**r, "tokens_per_s": tok_s, "floor_tflops_per_s": floor_tfs}


def write_outputs(a, results, logdir):
    out = a.out
    os.makedirs(out, exist_ok=True)
    res = [summarize(r) for r in results]
    meta = {
        "bench": "train_step",
        "budget_s": a.budget_s,
        "elapsed_s": round(time.time() - T0, 1),
        "device": a.device,
        "tiny": a.tiny,
        "num_depths": a.num_depths,
        "drafter": "Qwen3-8B-shaped: hidden 4096, 32/8 heads x 128, intermediate 12288, vocab 151936 "
        "(draft vocab = full vocab), 3 aux layers, K=8, r=0.7, r_min=0.2; fp32 weights + bf16 "
        "autocast; AdamW",
        "gpu": next((r.get("gpu") for r in res if r.get("gpu")), None),
        "torch": next((r.get("torch") for r in res if r.get("torch")), None),
    }
    with open(os.path.join(out, "bench_train_step.json"), "w") as f:
        json.dump({"meta": meta, "results": res}, f, indent=1)
    try:
        plot(res, os.path.join(out, "bench_train_step.png"))
    except Exception as e:  # the JSON and the table hold everything
        print(f"no plot: {e}")
    # logs as one archive (the device returns few files)
    try:
        import tarfile

        with tarfile.open(os.path.join(out, "bench_train_step_logs.tgz"), "w:gz") as t:
            t.add(logdir, arcname="logs")
    except Exception as e:
        print(f"no log archive: {e}")
    print_table(meta, res)


def plot(res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    groups = {}
    for r in res:
        if not r.get("median_s"):
            continue
        key = f"{r['impl']} {r['layers']}L" + (f" anchors<={r['max_anchors']}" if r.get("max_anchors") else "")
        groups.setdefault(key, []).append(r)
    for key, rs in sorted(groups.items()):
        by_n = {}
        for r in rs:  # one point per N: prefer a run that had the machine to itself
            if r["n"] not in by_n or (by_n[r["n"]].get("beside_background") and not r.get("beside_background")):
                by_n[r["n"]] = r
        rs = sorted(by_n.values(), key=lambda r: r["n"])
        xs = [r["n"] for r in rs]
        style = "o-" if len(rs) > 1 else "s"
        ax[0].plot(xs, [r["peak_gb"] for r in rs], style, label=key)
        ax[1].plot(xs, [r["median_s"] for r in rs], style, label=key)
    for x, lab in ((ax[0], "peak memory allocated (GB)"), (ax[1], "step time fwd+bwd+AdamW (s)")):
        x.set_xscale("log", base=2)
        x.set_xlabel("packed sequence length N")
        x.set_ylabel(lab)
        x.grid(True, alpha=0.3)
    ax[1].set_yscale("log")
    ax[0].legend(fontsize=8)
    fig.suptitle("P-EAGLE drafter train step, Qwen3-8B shape (vocab 151,936 = draft vocab), K=8", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_table(meta, res):
    print(
        f"\n== train step: {meta['gpu'] or meta['device']}, torch {meta['torch']}, {meta['elapsed_s']}s of "
        f"{meta['budget_s']}s budget =="
    )
    print(meta["drafter"])
    print(
        "floor TF/s = the step's unavoidable matmul FLOPs (step_flops_floor) / step "
        "time; H200 dense bf16 peak is ~989 TF/s"
    )
    print(
        "| case | N | T | step ms (median) | min ms | tokens/s | floor TF/s | peak GB | at rest GB | first step s | status |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in res:
        med = r.get("median_s")
        warm = r.get("warmup_s")
        note = " (beside bg)" if r.get("beside_background") else ""
        print(
            f"| {r['name']}{note} | {r['n']} | {r.get('T') or '-'} | {med * 1e3:.0f} | {min(r['step_s']) * 1e3:.0f} | "
            f"{r['tokens_per_s']} | {r.get('floor_tflops_per_s')} | {r.get('peak_gb', '-')} | {r.get('rest_gb', '-')} | "
            f"{warm[0] if warm else '-'} | {r.get('status')} |"
            if med
            else f"| {r['name']}{note} | {r['n']} | {r.get('T') or '-'} | - | - | - | - | {r.get('peak_first_gb', '-')} | - | "
            f"{warm[0] if warm else '-'} | {r.get('status')} |"
        )
    by = {r["name"]: r for r in res}
    o, s = by.get("peagle-1L-8K"), by.get("spec_eager-1L-8K")
    if o and s and o.get("median_s") and s.get("median_s"):
        print(
            f"8K uncapped, 1 layer: peak memory ours/speculators = {o['peak_gb'] / s['peak_gb']:.3f} (target <= 1/3), "
            f"step time ours/speculators = {o['median_s'] / s['median_s']:.3f} (target <= 1/2)"
        )


def parent_main(a):
    cases = tiny_cases() if a.tiny else default_cases()
    if a.cases:
        want = a.cases.split(",")
        names = {x["name"] for x in cases}
        cases = [c for c in cases if c["name"] in want] + [
            c for w in want if w not in names for c in [parse_case(w)] if c
        ]
    # per-case logs live outside --out (the GPU device returns only a few files from $OUT); they
    # travel as one archive, bench_train_step_logs.tgz
    logdir = a.logdir or os.path.join("/tmp", f"bench_train_step_logs_{os.getpid()}")
    os.makedirs(logdir, exist_ok=True)
    results = []
    deadline = T0 + a.budget_s - a.final_reserve_s
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    half = len(allowed) // 2
    low_cpus, high_cpus = (allowed[:half], allowed[half:]) if half >= 2 else (None, None)
    queue = list(cases)

    # speculators' 8K case runs in the BACKGROUND from t=0 (its first step compiles FlexAttention
    # and create_block_mask and autotunes its fused loss: mostly CPU time, 1-2 minutes cold) on
    # the upper half of the CPUs, while the foreground runs our cases on the lower half. Timed
    # steps of every case, and its autotune benchmarks, hold one GPU lock (GpuLock), so no timed
    # step and no autotune measurement shares the GPU. Only cases marked bg_ok (their memory fits
    # beside it) run beside it; the 128K case goes first, while it is still importing/compiling.
    bg = None
    first_spec = next((c for c in queue if c["impl"] == "spec_eager"), None)
    if a.background and first_spec is not None and (a.device == "cuda" and not a.tiny or a.background_anyway):
        queue.remove(first_spec)
        big = [c for c in queue if c.get("bg_first")]
        queue = big + [c for c in queue if not c.get("bg_first")]
        gate = os.path.join(logdir, "background.gate")
        if os.path.exists(gate):
            os.remove(gate)
        env = {"TORCHINDUCTOR_COMPILE_THREADS": str(max(1, len(high_cpus or allowed))), "BENCH_TRAIN_STEP_GATE": gate}
        if not big:
            open(gate, "w").close()
        first_spec = {**first_spec, "background": True}
        bg = Running(a, first_spec, deadline - time.time(), logdir, cpus=high_cpus, env_extra=env)
        print(f"[{time.time() - T0:6.1f}s] -> {first_spec['name']} in the background (CPUs {high_cpus})", flush=True)
    p1_beside = rerun_queued = False
    while queue or (bg is not None and not bg.collected):
        bg_alive = bg is not None and bg.alive()
        if bg is not None and not bg_alive and not bg.collected:
            results.append(bg.collect())
            continue
        if not queue:
            print(f"[{time.time() - T0:6.1f}s] waiting for {bg.c['name']}", flush=True)
            results.append(bg.wait(until=deadline))
            break
        idx = 0 if not bg_alive else next((i for i, c in enumerate(queue) if c.get("bg_ok")), None)
        if idx is None:
            print(
                f"[{time.time() - T0:6.1f}s] waiting for {bg.c['name']} (the next cases need the whole GPU)", flush=True
            )
            results.append(bg.wait(until=deadline))
            continue
        c = queue.pop(idx)
        left = deadline - time.time()
        if left < c["min_s"]:
            results.append({**c, "status": f"skipped: {left:.0f}s of budget left (< {c['min_s']}s)"})
            if bg is not None and c.get("bg_first") and not any(x.get("bg_first") for x in queue):
                open(gate, "w").close()
            continue
        timeout = min(c["timeout_s"] * (a.timeout_scale if a.tiny else 1.0), left)
        if c["impl"].startswith("spec"):
            # keep room for the protected cases still pending (the 32K and 128K claims)
            keep = sum(x["est_s"] for x in queue if x.get("protect"))
            timeout = max(min(c["min_s"], left), min(timeout, left - keep))
        print(
            f"[{time.time() - T0:6.1f}s] -> {c['name']} (timeout {timeout:.0f}s, {left:.0f}s left"
            f"{', beside ' + bg.c['name'] if bg_alive else ''})",
            flush=True,
        )
        r = Running(a, c, timeout, logdir, cpus=low_cpus if bg_alive else None).wait()
        if bg_alive:
            r["beside_background"] = bg.c["name"] if bg.alive() else f"{bg.c['name']} (ended during this case)"
            p1_beside |= c["name"] == "peagle-1L-8K"
        results.append(r)
        write_outputs_quiet(a, results, logdir)
        if bg is not None and c.get("bg_first") and not any(x.get("bg_first") for x in queue):
            open(gate, "w").close()  # the background case may start its first step now
        pending = {x["name"] for x in queue}
        if p1_beside and not rerun_queued and not (bg is not None and bg.alive()) and "plain-1L-4K" not in pending:
            # the headline 8K number again, alone on the machine (after cases 1-5)
            queue.insert(0, case("peagle-1L-8K-alone", "peagle", 8 * 1024, timeout_s=35))
            rerun_queued = True
    if bg is not None and not bg.collected:
        results.append(bg.wait(until=time.time()) if bg.alive() else bg.collect())
    write_outputs(a, results, logdir)
    return 0


def write_outputs_quiet(a, results, logdir):
    """Partial JSON after every case, so a killed parent still leaves results behind."""
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bench_train_step.json"), "w") as f:
        json.dump(
            {
                "meta": {"partial": True, "elapsed_s": round(time.time() - T0, 1)},
                "results": [summarize(r) for r in results],
            },
            f,
            indent=1,
        )


def parse_case(spec):
    """impl:N[:layers[:max_anchors]] for ad-hoc cases, e.g. peagle:65536:1 or spec_eager:4096."""
    parts = spec.split(":")
    if len(parts) < 2 or parts[0] not in ("peagle", "spec_eager", "spec_compiled", "plain"):
        return None
    n = int(parts[1])
    layers = int(parts[2]) if len(parts) > 2 else 1
    anchors = int(parts[3]) if len(parts) > 3 else None
    return case(spec, parts[0], n, layers=layers, max_anchors=anchors, timeout_s=120, min_s=10)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-s", type=float, default=170.0, help="wall-clock budget of the whole run")
    p.add_argument("--final-reserve-s", type=float, default=4.0, help="kept for writing JSON/PNG/table")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="toy shapes (CPU smoke test of the harness)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per case (fewer when its time runs out)")
    p.add_argument("--num-depths", type=int, default=8)
    p.add_argument("--cases", default="", help="comma list of case names (or impl:N[:layers[:anchors]])")
    p.add_argument(
        "--spec-compile-dynamic",
        default="true",
        choices=["true", "none"],
        help="spec_compiled: torch.compile(forward, dynamic=True), or 'none' = its own wrapper",
    )
    p.add_argument("--timeout-scale", type=float, default=1.0, help="(tiny) multiply case timeouts")
    p.add_argument(
        "--no-background",
        dest="background",
        action="store_false",
        help="run speculators' 8K case in the foreground, in priority order",
    )
    p.add_argument("--background-anyway", action="store_true", help="(testing) background mode on CPU / --tiny")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    p.add_argument("--list", action="store_true", help="print the cases and exit")
    # child-only
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--deadline", help=argparse.SUPPRESS)
    p.add_argument("--logdir", default=None, help="per-case logs (default /tmp/bench_train_step_logs_<pid>)")
    p.add_argument("--cpus", help=argparse.SUPPRESS)
    p.add_argument("--gpu-lock", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        return child_main(a)
    if a.list:
        for c in tiny_cases() if a.tiny else default_cases():
            print(c)
        return 0
    return parent_main(a)


def step_flops_floor(layout, cfg, num_layers: int) -> dict:
    """Matmul FLOPs a P-EAGLE training step cannot avoid for this layout (bf16 tensor-core work;
    elementwise ops, norms, softmax, the optimizer are not counted):
      fc            fwd + weight grad on the N unique stream rows        4 * N * 3H * H
      layer-0 q/k/v on the N unique rows (fwd, input grad, weight grad)  6 * N * 2H * (Hq + 2 Hkv) D
      o_proj + MLP  on all T tokens, every layer                         6 * T * (Hq D H + 3 H I)
      layers >= 1   q/k/v on all T tokens                                6 * T * H * (Hq + 2 Hkv) D
      attention     4 D Hq per (query, allowed key) pair forward, x3.5 with the backward
                    (flash-style backward recomputes QK^T), pairs counted from the COD rule
      heads         draft lm_head fwd + input grad (frozen weight)       4 * T * H * V
                    verifier logits at the N unique positions            2 * N * H * V
    Returns {"total": flops, "attention": ..., "pairs": ...} (floats)."""
    import torch as _t

    from peagle_ext.reference import document_starts

    h = cfg.hidden_size
    i_sz = cfg.intermediate_size
    hq = cfg.num_attention_heads
    hkv = getattr(cfg, "num_key_value_heads", None) or hq
    d = getattr(cfg, "head_dim", None) or h // hq
    v = cfg.vocab_size
    n = layout.seq_len
    t = layout.num_tokens
    doc = layout.document_ids.long()
    a = layout.anchor.long()
    dep = layout.depth.long()
    valid = doc[a] >= 0
    starts = document_starts(doc)
    # keys of query i: depth-0 positions start(a_i)..a_i of its document, plus its chain's deeper
    # tokens with depth <= d_i (d_i of them); padding rows attend nothing
    pairs = float(_t.where(valid, (a - starts[a] + 1) + dep, _t.zeros_like(a)).sum())
    f_fc = 4.0 * n * 3 * h * h
    f_l0 = 6.0 * n * 2 * h * (hq + 2 * hkv) * d
    f_post = 6.0 * t * (hq * d * h + 3 * h * i_sz) * num_layers
    f_deep = 6.0 * t * h * (hq + 2 * hkv) * d * max(0, num_layers - 1)
    f_attn = 3.5 * 4.0 * d * hq * pairs * num_layers
    f_heads = 4.0 * t * h * v + 2.0 * n * h * v
    return {
        "total": f_fc + f_l0 + f_post + f_deep + f_attn + f_heads,
        "attention": f_attn,
        "pairs": pairs,
        "heads": f_heads,
    }


if __name__ == "__main__":
    sys.exit(main())
