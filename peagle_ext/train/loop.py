"""`peagle train`: trains a P-EAGLE drafter for a verifier on chat data (docs/design.md section 7).

Pipeline: verifier + tokenizer (peagle_ext.data) -> conversations -> chat-template tokens with an
assistant-only loss mask (truncated to seq_len, said in the log) -> validation split -> packing
-> draft vocab (d2t from token frequencies, or the full vocab) -> verifier hidden states (cached
in memory when they fit, else recomputed per step: both are deterministic) -> AdamW steps with
warmup + cosine/linear decay, grad clipping, gradient accumulation, optional sequence partition.

Determinism and resume: every random draw of a step (COD sampling) is seeded from (seed, step,
micro-batch) and the data order from (seed, epoch), so a run resumed from a checkpoint (model,
optimizer, scheduler, RNG states, data position) ends bitwise equal on CPU to an uninterrupted one.
Checkpoints are written to DIR/checkpoint-<step>.tmp and renamed into place (os.replace), with a
COMPLETE marker written last; resume takes the newest complete one and ignores .tmp leftovers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..data.conversations import check_conversation_sources
from ..model import PEagleDraftModel
from ..model.forward import DeviceMetrics
from .build import build_hidden_states, build_model, load_inputs
from .checkpoint import (
    CHECKPOINT_PREFIX,
    COMPLETE_MARKER,
    list_checkpoints,
    read_checkpoint_state,
    read_trainer_state,
    remove_path,
    set_rng_state,
    test_pause,
)
from .dataset import cod_seed, epoch_order, examples_to, take_rows
from .distributed import DistContext
from .early_stop import StopRule
from .hidden import HiddenStates
from .metrics import Meter
from .optim import MuonAdamW, lr_lambda, make_optimizer
from .plots import make_plots
from .prefetch import BatchPrefetcher
from .profiling import StepProfiler
from .run_guard import OutputLock, check_inputs_unchanged, input_fingerprints, verifier_fingerprints
from .run_log import NullLog, RunLog, progress_bar
from .settings import RESUME_ABSENT, RESUME_FIXED, TrainError, TrainSettings
from .tracking import Trackers, peak_memory_gib


@dataclass
class TrainResult:
    output: Path
    final_dir: Path | None
    steps: int
    train: dict
    val: dict | None
    plots: list[Path] = field(default_factory=list)
    skipped_steps: int = 0
    stopped_early: bool = False
    wall_s: float = 0.0
    stop_reason: str | None = None  # an early stop or the time budget ended the run before max_steps
    # this process's wall time by part: before the first step (data, verifier, states, model),
    # the steps, validation, checkpoints, the final save (seconds)
    time_split: dict = field(default_factory=dict)


def _optimizer_words(opt) -> str:
    if isinstance(opt, MuonAdamW):
        n = sum(p.numel() for g in opt.muon.param_groups for p in g["params"]) if opt.muon is not None else 0
        return f"Muon on {n / 1e6:.2f}M of them (the layers' matrices), AdamW on the rest"
    return "AdamW"


def train(s: TrainSettings, *, stop_after: int | None = None) -> TrainResult:
    """Run (or resume) training. stop_after: leave after that many steps of THIS process without
    the final save, as a killed run would (tests use it for resume). Under torchrun (WORLD_SIZE >
    1) every rank calls this; see peagle_ext.distributed."""
    s.validate()
    ctx = DistContext.from_env(s.dist, s.device)
    if s.optimizer == "muon" and ctx.world > 1 and s.dist == "fsdp":
        ctx.close()
        # Muon orthogonalizes whole matrices, and FSDP2's checkpoint of the optimizer (DCP) expects
        # one torch optimizer, not MuonAdamW's two
        raise TrainError("--optimizer muon runs in one process or under --dist ddp, not --dist fsdp")
    try:
        return _train_main(s, ctx, stop_after)
    finally:
        ctx.close()


def _train_main(s: TrainSettings, ctx, stop_after) -> TrainResult:
    t_start = time.time()
    check_conversation_sources(s.data)  # bad --data: said before anything is created or loaded
    out = Path(s.output)
    if out.exists() and not out.is_dir():
        raise TrainError(f"--output {out} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TrainError(f"--output {out}: cannot create it: {e.strerror or e}") from None
    if ctx.is_main and not os.access(out, os.W_OK | os.X_OK):
        raise TrainError(f"--output {out} is not writable")
    lock = OutputLock(out).acquire() if ctx.is_main else None
    try:
        return _train_locked(s, ctx, stop_after, out, t_start)
    finally:
        if lock is not None:
            lock.release()


def _check_resume_hidden_size(resume_from: Path, hidden: int) -> None:
    ckcfg = json.loads((resume_from / "config.json").read_text())
    if int(ckcfg.get("target_hidden_size") or 0) != hidden:
        raise TrainError(
            f"verifier/draft hidden size mismatch: checkpoint {resume_from} was trained for hidden "
            f"{ckcfg.get('target_hidden_size')}, this verifier has {hidden}"
        )


def _train_locked(s: TrainSettings, ctx, stop_after, out: Path, t_start: float) -> TrainResult:
    inputs = input_fingerprints(s) if ctx.is_main else {}
    changed_note = None
    resume_from = None
    if s.resume:
        ck = list_checkpoints(out)
        if not ck:
            raise TrainError(
                f"--resume: no complete checkpoint in {out} (looked for {CHECKPOINT_PREFIX}<step>/ "
                f"with a {COMPLETE_MARKER} marker)"
            )
        resume_from = ck[-1][1]
        # leftovers of a killed checkpoint write (.tmp) or directory swap (.old): never complete ones
        if ctx.is_main:
            stale = list(out.glob(f"{CHECKPOINT_PREFIX}*.tmp")) + list(out.glob(f"{CHECKPOINT_PREFIX}*.old"))
            for p in stale:
                remove_path(p)
        ck_state = read_checkpoint_state(resume_from)
        old = ck_state["settings"]
        was = {k: old.get(k, RESUME_ABSENT.get(k)) for k in RESUME_FIXED}
        diff = [k for k in RESUME_FIXED if was[k] != getattr(s, k)]
        if diff:
            raise TrainError(
                "--resume with settings that differ from the checkpoint's: "
                + ", ".join(f"{k}={getattr(s, k)!r} (checkpoint: {was[k]!r})" for k in diff)
            )
        old_world = int(ck_state.get("world_size", 1))
        old_micro = int(old.get("grad_accum", 1)) * old_world
        if old_micro != s.grad_accum * ctx.world:
            hint = f"; pass --grad-accum {old_micro // ctx.world} to keep it" if old_micro % ctx.world == 0 else ""
            raise TrainError(
                f"--resume: the checkpoint takes {old_micro} micro-batches per step (--grad-accum "
                f"{old.get('grad_accum')} x {old_world} rank(s)), this run {s.grad_accum} x {ctx.world}{hint}"
            )
        # after the settings and the verifier's width: a resume onto another verifier or data
        # is told that first, before the generic "inputs changed"
        vcfg = Path(s.verifier) / "config.json"
        if vcfg.is_file():
            try:
                width = json.loads(vcfg.read_text()).get("hidden_size")
            except (OSError, ValueError, AttributeError):
                width = None  # unreadable here: the verifier's loader names the file later
            if isinstance(width, int):
                _check_resume_hidden_size(resume_from, width)
        if ctx.is_main:
            changed_note = check_inputs_unchanged(ck_state.get("inputs"), inputs, resume_from, s.accept_changed_inputs)
        if ctx.is_main:
            for p in out.glob(f"{CHECKPOINT_PREFIX}*.tmp"):
                remove_path(p)
            RunLog.truncate_after(out / "log.jsonl", ck_state["step"])
    else:
        existing = list_checkpoints(out)
        if existing:
            raise TrainError(
                f"{out} already holds checkpoints (newest: {existing[-1][1].name}); continue them with "
                "--resume, or pick another --output (a fresh run would prune them)"
            )
        if ctx.is_main and (out / "log.jsonl").exists():
            (out / "log.jsonl").unlink()  # a log without checkpoints belongs to no resumable run
    ctx.barrier()  # every rank has decided before rank 0 writes anything
    if ctx.is_main:
        log = RunLog(out / "log.jsonl", echo=True)
        if changed_note:
            log.event("inputs_changed", changed_note)
        trackers = Trackers(s.report_to, out, dataclasses.asdict(s))
    else:
        log = NullLog()
        trackers = Trackers("none", out, {})
        s = dataclasses.replace(s, progress=False)
    threads = torch.get_num_threads()
    if s.threads and not s.device.startswith("cuda"):
        torch.set_num_threads(s.threads)
    try:
        return _train(s, out, log, resume_from, stop_after, t_start, ctx, trackers, inputs)
    finally:
        torch.set_num_threads(threads)
        trackers.close()
        log.close()


def _train(
    s: TrainSettings, out: Path, log: RunLog, resume_from: Path | None, stop_after, t_start, ctx, trackers, inputs
) -> TrainResult:
    device = ctx.device
    amp = s.autocast_dtype()
    torch.manual_seed(s.seed)
    random.seed(s.seed)
    np.random.seed(s.seed % (2**32))
    log.write(
        {
            "event": "start",
            "settings": dataclasses.asdict(s),
            "resume_from": str(resume_from) if resume_from else None,
            "autocast": str(amp) if amp else None,
            "time": time.time(),
            "world_size": ctx.world,
        }
    )
    if ctx.world > 1:
        log.event(
            "dist",
            f"{ctx.world} ranks ({s.dist.upper()}, {'NCCL' if device.type == 'cuda' else 'gloo'}): a step "
            f"takes {ctx.world} x {s.grad_accum} micro-batches of {s.batch_size} row(s)",
        )

    inp = load_inputs(s, device, amp, log)
    if ctx.is_main and inputs.get("verifier") is None:  # a hub verifier downloaded just now
        inputs["verifier"] = verifier_fingerprints(s)
    ds = inp.dataset
    if s.epochs is not None:  # --epochs: the step count that passes over the rows that often
        rows_per_step = s.batch_size * s.grad_accum * ctx.world
        s = dataclasses.replace(s, max_steps=max(1, math.ceil(s.epochs * len(ds.train_rows) / rows_per_step)))
        log.event("epochs", f"--epochs {s.epochs:g}: {s.max_steps} steps of {rows_per_step} rows", steps=s.max_steps)
    model = build_model(s, inp, device, log)
    if s.init_from and resume_from is None:
        warm_start(model, s.init_from, inp.head)
        log.event("init", f"weights from {s.init_from} (warm start; a fresh optimizer and schedule)")
    if resume_from is not None:  # the weights before any DDP/FSDP wrapping
        ck = read_trainer_state(resume_from)
        _check_resume_hidden_size(resume_from, int(inp.verifier_config.hidden_size))
        from safetensors.torch import load_file

        model.load_checkpoint_state_dict(load_file(str(resume_from / "model.safetensors")))
    model.to(device)
    ctx.wrap(model, amp)  # DDP / FSDP2 under torchrun; nothing in one process
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(model.named_parameters(), s)
    progress = float(ck.get("schedule_progress", 0.0)) if resume_from is not None else 0.0
    # --time-schedule's clock: the share of the budget's training time (from the first step to
    # the end of --max-minutes) spent; start-up (data, verifier, cached states) is not schedule time
    train_clock = {"t0": None, "span": 1.0}

    def clock() -> float:
        t0 = train_clock["t0"]
        return 0.0 if t0 is None else (time.time() - t0) / train_clock["span"]

    schedule = lr_lambda(s, clock=clock, progress=progress)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    step, epoch, cursor = 0, 0, 0
    history_skipped = 0
    if resume_from is not None:
        try:
            ctx.load_optimizer_state(model, opt, ck, resume_from)
            sched.load_state_dict(ck["scheduler"])
            set_rng_state(ck["rng"])
        except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as e:
            raise TrainError(
                f"--resume: the trainer state of {resume_from} does not fit this run ({type(e).__name__}: {e})"
            ) from None
        step, epoch, cursor = ck["step"], ck["epoch"], ck["cursor"]
        history_skipped = ck.get("skipped_steps", 0)
        log.event("resume", f"resumed from {resume_from} at step {step}", step=step)

    nparams = sum(p.numel() for p in params)
    log.event(
        "model",
        f"drafter: {s.num_layers} {model.config.layer_type} layer(s), K={s.num_depths}, draft vocab "
        f"{model.config.draft_vocab_size}, {nparams / 1e6:.2f}M trainable params, {s.attention} attention, "
        f"autocast {amp or 'off'}, {_optimizer_words(opt)}",
    )

    n_rows = len(ds.train_rows)
    order = epoch_order(s.seed, epoch, n_rows)
    train_h, val_h = build_hidden_states(s, inp, device, amp, ctx, log, order=order, step=step, cursor=cursor)
    prefetcher = None
    # every way out (an error, a refused checkpoint, Ctrl-C) stops the background thread first
    try:
        del inp  # the verifier goes when the hidden states no longer need it

        # a step: world x grad_accum micro-batches ("units"); unit g is COD-seeded by g, so the
        # numbers do not depend on which rank computes it (train/distributed.py)
        n_units = s.grad_accum * ctx.world
        rows_per_step = s.batch_size * n_units
        row_tokens = [int((r.document_ids >= 0).sum()) for r in ds.train_rows]

        def my_units(picked: list[int]) -> tuple[list[int], list[list[int]]]:
            """The units this rank computes among a step's rows: their numbers and row indices."""
            micro = [picked[i * s.batch_size : (i + 1) * s.batch_size] for i in range(n_units)]
            mine = ctx.my_units([sum(row_tokens[i] for i in mb) for mb in micro])
            return mine, [micro[g] for g in mine]

        # with every row's states cached (or, on CUDA, some), the next step's rows are concatenated
        # and copied to the device while this step runs (train/prefetch.py)
        prefetch = train_h.verifier is None or (train_h.partial and device.type == "cuda")
        prefetcher = BatchPrefetcher(train_h, device) if s.prefetch and prefetch else None
        meter = Meter(s.num_depths)
        window_meter = Meter(s.num_depths)
        skipped = history_skipped
        val_summary = None
        stopped = False
        rule = StopRule(s.early_stop_patience, s.early_stop_min_delta, s.max_minutes, t_start)
        stop_reason = None
        bar = progress_bar(
            range(step, s.max_steps), desc="train", unit="step", initial=step, total=s.max_steps, disable=not s.progress
        )
        t_tok, n_tok_window = time.time(), 0
        profiler = StepProfiler(out / "profile", s.profile_steps if ctx.is_main else 0, s.profile_warmup, device, log)
        autocast = (lambda: torch.autocast(device.type, dtype=amp)) if amp is not None else _null
        steps_here = 0
        model.train()
        train_clock["t0"] = time.time()
        spent = {"validation": 0.0, "checkpoints": 0.0}
        if s.max_minutes is not None:
            train_clock["span"] = max(1e-3, s.max_minutes * 60.0 - (train_clock["t0"] - t_start))
        for _ in bar:
            profiler.before_step(steps_here, step)
            profiler.enter("data")  # rows of this step
            picked, order, cursor, epoch = take_rows(order, cursor, epoch, rows_per_step, n_rows, s.seed)
            mine, my_rows = my_units(picked)
            if prefetcher is not None:
                examples = prefetcher.get(my_rows)
                if step + 1 < s.max_steps:  # the next step's rows, read while this one runs
                    ahead = take_rows(order, cursor, epoch, rows_per_step, n_rows, s.seed)[0]
                    prefetcher.schedule(my_units(ahead)[1])
            else:
                examples = [examples_to(train_h.get_many(mb), device) for mb in my_rows]
            profiler.enter("layout")
            layouts = [model.sample_layout(ex, seed=cod_seed(s.seed, step, g)) for g, ex in zip(mine, examples)]
            weights = [
                float(ex.loss_mask[(lay.anchor.long() + lay.depth.long()).to(ex.loss_mask.device)].sum())
                for ex, lay in zip(examples, layouts)
            ]
            wtot = ctx.sum_scalar(sum(weights))  # the GLOBAL loss-token count: every rank divides by it
            profiler.enter("forward_backward")
            step_meter = Meter(s.num_depths)
            opt.zero_grad(set_to_none=True)
            pending = {}
            for j, (g, ex, lay) in enumerate(zip(mine, examples, layouts)):
                m = ctx.forward_backward(
                    model,
                    ex,
                    lay,
                    segments=s.seq_partition,
                    loss_scale=1.0 / wtot if wtot > 0 else 0.0,
                    autocast_dtype=amp,
                    last=j == len(mine) - 1,
                    sync=False,
                )
                pending[g] = (m, (ex.document_ids >= 0).sum())
            profiler.enter("optimizer")
            gnorm = ctx.clip_grad_norm_(params, s.grad_clip if s.grad_clip > 0 else float("inf"))
            if hasattr(opt, "prepare"):  # Muon's kernels launch while the device still runs the backward,
                opt.prepare()  # before the metrics below wait for it (whether to step at all needs them)
            unit_metrics = {
                g: {**(m.read() if isinstance(m, DeviceMetrics) else m), "num_tokens": int(ntok)}
                for g, (m, ntok) in pending.items()
            }
            per_unit = ctx.ordered_metrics(n_units, unit_metrics, s.num_depths)  # all units, in unit order
            for m in per_unit:
                step_meter.add(m)
            loss_val = step_meter.loss_sum / step_meter.weight if step_meter.weight > 0 else 0.0
            ok = math.isfinite(loss_val) and bool(torch.isfinite(gnorm))
            if ok and step_meter.weight > 0:
                opt.step()
            elif ok:  # no loss-masked token in this step: nothing to learn, leave AdamW's moments alone
                opt.zero_grad(set_to_none=True)
            else:
                skipped += 1
                opt.zero_grad(set_to_none=True)
                log.event(
                    "nan",
                    f"step {step + 1}: non-finite loss ({loss_val}) or gradient norm ({float(gnorm)}); "
                    "step skipped, weights unchanged",
                    step=step + 1,
                )
            lr_now = sched.get_last_lr()[0]
            sched.step()
            profiler.enter("bookkeeping")
            step += 1
            steps_here += 1
            ntoks = sum(m["num_tokens"] for m in per_unit)
            n_tok_window += ntoks
            if ok:
                meter.add(
                    {
                        "loss_sum": step_meter.loss_sum,
                        "weight": step_meter.weight,
                        "correct": step_meter.correct,
                        "total": step_meter.total,
                    }
                )
                window_meter.add(
                    {
                        "loss_sum": step_meter.loss_sum,
                        "weight": step_meter.weight,
                        "correct": step_meter.correct,
                        "total": step_meter.total,
                    }
                )
            if step % s.log_every == 0 or step == s.max_steps:
                now = time.time()
                tps = n_tok_window / max(now - t_tok, 1e-9)
                summ = window_meter.summary()
                rec = {
                    "step": step,
                    "split": "train",
                    "epoch": epoch,
                    "lr": lr_now,
                    "grad_norm": float(gnorm),
                    "tokens": n_tok_window,
                    "tokens_per_s": tps,
                    "elapsed_s": now - t_start,
                    "skipped": not ok,
                    **summ,
                    **({"world_size": ctx.world, "tokens_per_s_per_rank": tps / ctx.world} if ctx.world > 1 else {}),
                }
                log.write(rec)
                trackers.log({**rec, "memory_gib": peak_memory_gib(device)})
                bar.set_postfix(
                    loss=f"{summ['loss']:.3f}",
                    acc0=f"{summ['acc'][0]:.3f}",
                    acc=f"{summ['full_acc']:.3f}",
                    tok_s=f"{tps:.0f}",
                )
                window_meter.reset()
                t_tok, n_tok_window = now, 0
            if ds.val_rows and (step % s.val_every == 0 or step == s.max_steps):
                t_val = time.time()
                val_summary = evaluate(model, val_h, s, autocast, device, ctx)
                spent["validation"] += time.time() - t_val
                log.write({"step": step, "split": "val", **val_summary})
                trackers.log({"step": step, "split": "val", **val_summary})
                log.event(
                    "validation",
                    f"step {step}: validation loss {val_summary['loss']:.4f}, accuracy "
                    + " ".join(f"d{i}={a:.3f}" for i, a in enumerate(val_summary["acc"]))
                    + f", estimated acceptance length {val_summary['accept_len']:.2f}",
                )
                stop_reason = rule.after_val(val_summary["loss"])
            if s.max_minutes is not None and stop_reason is None and ctx.sum_scalar(float(rule.over_time())) > 0:
                stop_reason = f"the time budget of {s.max_minutes:g} min is spent (--max-minutes)"
            if step % s.checkpoint_every == 0 or step == s.max_steps or stop_reason:
                t_ck = time.time()
                ctx.save_checkpoint(
                    out,
                    step,
                    model,
                    opt,
                    sched,
                    {
                        "step": step,
                        "epoch": epoch,
                        "cursor": cursor,
                        "settings": dataclasses.asdict(s),
                        "skipped_steps": skipped,
                        "schedule_progress": schedule.progress(),
                        "inputs": inputs,
                    },
                    s.keep_checkpoints,
                )
                spent["checkpoints"] += time.time() - t_ck
            profiler.after_step()
            test_pause("step", step)
            if stop_after is not None and steps_here >= stop_after and step < s.max_steps:
                stopped = True
                break
            if stop_reason:
                log.event("stop", f"stopping at step {step}: {stop_reason}", step=step)
                break
        bar.close()
        profiler.close()
        loop_s = time.time() - train_clock["t0"]
        train_summary = meter.summary()
        result = TrainResult(
            out, None, step, train_summary, val_summary, [], skipped, stopped, time.time() - t_start, stop_reason
        )
        result.time_split = {
            "to_first_step": train_clock["t0"] - t_start,
            "steps": loop_s - spent["validation"] - spent["checkpoints"],
            "validation": spent["validation"],
            "checkpoints": spent["checkpoints"],
        }
        if stopped:
            return result
        final = out / "final"
        t_final = time.time()
        written_here = ctx.save_final(model, final)  # tmp + rename, by rank 0
        result.time_split["final_save"] = time.time() - t_final
        result.final_dir = final
        if not written_here:
            return result
        result.plots = make_plots(out / "log.jsonl", out, s.num_depths)
        result.wall_s = time.time() - t_start
        log.write(
            {
                "event": "done",
                "step": step,
                "final": str(final),
                "wall_s": result.wall_s,
                "time_s": result.time_split,
                "train": train_summary,
                "val": val_summary,
                "skipped_steps": skipped,
                "inputs": inputs,
                "stop_reason": stop_reason,
            }
        )
        return result
    finally:
        if prefetcher is not None:
            prefetcher.close()
        train_h.stop_background()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@torch.no_grad()
def evaluate(model: PEagleDraftModel, hs: HiddenStates, s: TrainSettings, autocast, device, ctx=None) -> dict:
    """Loss and per-depth accuracy over the validation rows, --batch-size rows side by side per
    forward as in training (COD layouts with fixed seeds, one per group of rows). A small drafter's
    forwards on a GPU are host-bound, so one forward per row made validation take seconds where a
    step takes tens of milliseconds. Under torchrun the groups are split over the ranks and their
    metrics summed in group order, so any world size gives the same numbers."""
    was = model.training
    model.eval()
    m = Meter(s.num_depths)
    distributed = ctx is not None and ctx.world > 1
    fwd = ctx.eval_module() if distributed else model
    n = len(hs.rows)
    groups = [list(range(i, min(i + s.batch_size, n))) for i in range(0, n, s.batch_size)]
    per_group = {}
    for g in ctx.eval_units(len(groups)) if distributed else range(len(groups)):
        j = g if g >= 0 else next(iter(per_group), 0)  # -1: a padding forward (FSDP), result dropped
        ex = examples_to(hs.get_many(groups[j]), device)
        lay = model.sample_layout(ex, seed=cod_seed(s.seed + 1, 10**9, j))
        with autocast():
            _, met = fwd(ex, lay)
        if g >= 0:
            per_group[g] = met
    for met in (
        ctx.ordered_metrics(len(groups), per_group, s.num_depths)
        if distributed
        else [per_group[g] for g in range(len(groups))]
    ):
        m.add(met)
    if was:
        model.train()
    return m.summary()


def warm_start(model: PEagleDraftModel, src: str, head) -> None:
    """--init-from: the weights of a drafter checkpoint (config.json + model.safetensors, e.g. an
    export, a final/ or checkpoint-<step>/ directory, or a training output's final/) for a
    drafter of the same shape; the verifier head rows follow the loaded draft vocab."""
    from safetensors.torch import load_file

    p = Path(src)
    pick = p if (p / "model.safetensors").is_file() else p / "final"
    if not (pick / "model.safetensors").is_file():
        raise TrainError(f"--init-from {src}: no model.safetensors there (nor in its final/)")
    try:
        model.load_checkpoint_state_dict(load_file(str(pick / "model.safetensors")))
    except Exception as e:  # shape / key / dtype mismatches, unreadable file
        raise TrainError(f"--init-from {src}: not a drafter of this shape: {e}") from None
    model.attach_verifier(
        norm_weight=head.norm_weight,
        lm_head_weight=head.lm_head_weight,
        norm_eps=head.norm_eps,
        embed_weight=head.embed_weight,
        init_from_verifier=False,
    )
