"""`peagle train`: trains a P-EAGLE drafter for a verifier on chat data (DESIGN.md section 7).

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
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .model import PEagleDraftModel, PEagleOptions, acceptance_length, build_vocab_mapping, resolve_mask_token_id

CHECKPOINT_PREFIX = "checkpoint-"
COMPLETE_MARKER = "COMPLETE"
TRAINER_STATE = "trainer_state.pt"


class TrainError(ValueError):
    """Bad input or an unusable run state; the message says which and what to do."""


# ---------------------------------------------------------------------------------------------
# Settings: defaults < --config file < command-line flags
# ---------------------------------------------------------------------------------------------
@dataclass
class TrainSettings:
    # what to train on
    verifier: str = "smollm2"
    data: str = "sharegpt"
    output: str = "runs/peagle"
    num_conversations: int | None = 400
    val_fraction: float = 0.05
    seq_len: int = 512
    # the drafter
    num_layers: int = 1
    num_depths: int = 4
    layer_type: str | None = None
    draft_vocab_size: int | None = 8192
    mask_token_id: int | None = None
    aux_layer_ids: list[int] | None = None
    norm_before_residual: bool = False
    train_lm_head: bool = False
    train_embeddings: str = "auto"  # all | mask | none | auto (all on GPU, mask on CPU)
    # COD sampling / attention
    down_sample_ratio: float = 0.7
    down_sample_ratio_min: float = 0.2
    max_anchors: int | None = None
    attention: str = "symmetric"
    window: int | None = None
    sink: int = 0
    seq_partition: int = 1
    loss: str = "kl"
    # optimisation
    max_steps: int = 1200
    batch_size: int = 1  # packed rows per micro-batch
    grad_accum: int = 1
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    schedule: str = "cosine"
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    grad_clip: float = 1.0
    # bookkeeping
    device: str = "cpu"
    dtype: str = "auto"  # auto | float32 | bfloat16
    # CPU intra-op threads. 1 by default: on a 2-core machine that anything else also uses,
    # OpenMP's barriers make 2 threads several times SLOWER (measured: SmolLM2 forward 350 tok/s
    # with 1 thread vs 50 with 2 under light load); 0 = torch's default
    threads: int = 1
    seed: int = 0
    checkpoint_every: int = 200
    keep_checkpoints: int = 2
    val_every: int = 200
    log_every: int = 10
    hidden_cache_gb: float = 6.0
    hidden_cache_dir: str | None = None  # on-disk hidden states (resumable, reusable across runs)
    background_hidden: bool = True  # CPU: run the verifier on a 2nd thread while training starts
    resume: bool = False
    progress: bool = True
    # under torchrun (WORLD_SIZE > 1): ddp | fsdp (peagle_ext.distributed); ignored by one process
    dist: str = "ddp"

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def validate(self) -> "TrainSettings":
        def need(cond, msg):
            if not cond:
                raise TrainError(msg)
        need(self.seq_len >= 8, f"--seq-len must be >= 8, got {self.seq_len}")
        need(self.max_steps >= 1, f"--max-steps must be >= 1, got {self.max_steps}")
        need(self.num_layers >= 1, f"--num-layers must be >= 1, got {self.num_layers}")
        need(1 <= self.num_depths <= 64, f"--num-depths must be in [1, 64], got {self.num_depths}")
        need(self.batch_size >= 1 and self.grad_accum >= 1, "--batch-size and --grad-accum must be >= 1")
        need(self.seq_partition >= 1, f"--seq-partition must be >= 1, got {self.seq_partition}")
        need(self.lr > 0, f"--lr must be > 0, got {self.lr}")
        need(0 <= self.min_lr_ratio <= 1, f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        need(self.warmup_steps >= 0, "--warmup-steps must be >= 0")
        need(self.schedule in ("cosine", "linear", "constant"), f"--schedule must be cosine|linear|constant, got {self.schedule!r}")
        need(0 <= self.val_fraction < 1, f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        need(self.device in ("cpu", "cuda") or self.device.startswith("cuda:"), f"--device must be cpu or cuda, got {self.device!r}")
        need(self.dtype in ("auto", "float32", "bfloat16"), f"--dtype must be auto|float32|bfloat16, got {self.dtype!r}")
        need(self.checkpoint_every >= 1 and self.val_every >= 1 and self.log_every >= 1,
             "--checkpoint-every, --val-every and --log-every must be >= 1")
        need(self.keep_checkpoints >= 1, "--keep-checkpoints must be >= 1")
        need(self.threads >= 0, "--threads must be >= 0 (0 = torch's default)")
        need(self.loss in ("kl", "ce"), f"--loss must be kl or ce, got {self.loss!r}")
        need(self.dist in ("ddp", "fsdp"), f"--dist must be ddp or fsdp, got {self.dist!r}")
        need(self.num_conversations is None or self.num_conversations >= 1, "--num-conversations must be >= 1")
        need(self.draft_vocab_size is None or self.draft_vocab_size >= 1, "--draft-vocab-size must be >= 1")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise TrainError("--device cuda was asked for but torch sees no CUDA GPU (use --device cpu)")
        try:
            self.options().validate(self.num_depths)
        except ValueError as e:
            raise TrainError(str(e)) from None
        return self

    def options(self) -> PEagleOptions:
        return PEagleOptions(down_sample_ratio=self.down_sample_ratio, down_sample_ratio_min=self.down_sample_ratio_min,
                             max_anchors=self.max_anchors, attention=self.attention, window=self.window,
                             sink=self.sink, loss_kind=self.loss, train_lm_head=self.train_lm_head,
                             train_embeddings=self.resolved_train_embeddings())

    def resolved_train_embeddings(self) -> str:
        """auto: the whole embedding on GPU (P-EAGLE), only the MASK row on CPU, where the dense
        [V, H] embedding gradient + AdamW update would cost more than the drafter's own step."""
        if self.train_embeddings == "auto":
            return "all" if self.device.startswith("cuda") else "mask"
        return self.train_embeddings

    def autocast_dtype(self) -> torch.dtype | None:
        """bf16 autocast (fp32 master weights) on GPU, and on CPUs with native bf16 matmuls."""
        if self.dtype == "float32":
            return None
        if self.dtype == "bfloat16":
            return torch.bfloat16
        if self.device.startswith("cuda"):
            return torch.bfloat16
        return torch.bfloat16 if _cpu_has_bf16() else None


def _cpu_has_bf16() -> bool:
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except Exception:
        return False


# these settings shape the model or the data stream: a resume must use the checkpoint's values
# (grad_accum is checked as the global micro-batch count per step, grad_accum x world size)
_RESUME_FIXED = ("verifier", "data", "num_conversations", "val_fraction", "seq_len", "num_layers", "num_depths",
                 "layer_type", "draft_vocab_size", "mask_token_id", "aux_layer_ids", "batch_size",
                 "seed", "attention", "train_lm_head", "train_embeddings", "norm_before_residual")


def load_config_file(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise TrainError(f"--config file {path} does not exist")
    text = p.read_text()
    try:
        if p.suffix.lower() in (".yaml", ".yml"):
            import yaml
            d = yaml.safe_load(text) or {}
        else:
            d = json.loads(text)
    except Exception as e:
        raise TrainError(f"--config file {path} is not valid {'YAML' if p.suffix.lower() in ('.yaml', '.yml') else 'JSON'}: {e}")
    if not isinstance(d, dict):
        raise TrainError(f"--config file {path} must hold a mapping of option: value")
    out = {}
    names = set(TrainSettings.field_names())
    for k, v in d.items():
        key = str(k).replace("-", "_")
        if key not in names:
            raise TrainError(f"--config file {path}: unknown option {k!r} (known: {', '.join(sorted(names))})")
        out[key] = v
    return out


def settings_from(cli: dict, config_file: str | None = None) -> TrainSettings:
    merged = {}
    if config_file:
        merged.update(load_config_file(config_file))
    merged.update(cli)
    s = TrainSettings(**merged)
    return s.validate()


# ---------------------------------------------------------------------------------------------
# Logging
# ---------------------------------------------------------------------------------------------
class RunLog:
    """DIR/log.jsonl (one JSON object a line) + echo of events to stderr."""

    def __init__(self, path: Path, echo=True):
        self.path = path
        self.echo = echo
        self._f = open(path, "a", buffering=1)

    def write(self, rec: dict):
        self._f.write(json.dumps(rec) + "\n")

    def event(self, name: str, msg: str, **kw):
        self.write({"event": name, "message": msg, **kw})
        if self.echo:
            print(f"[peagle] {msg}", file=sys.stderr, flush=True)

    def close(self):
        self._f.close()

    @staticmethod
    def truncate_after(path: Path, step: int):
        """Drop the step records a killed run wrote after the checkpoint we resume from."""
        if not path.exists():
            return
        keep = []
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "step" in rec and rec["step"] > step:
                continue
            keep.append(line)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(x + "\n" for x in keep))
        os.replace(tmp, path)


def _say(msg: str):
    print(f"[peagle] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------
@dataclass
class Dataset:
    train_rows: list  # PackedSequence
    val_rows: list
    token_counts: torch.Tensor
    truncated: int
    dropped: int
    num_train_conversations: int
    num_val_conversations: int


def prepare_data(s: TrainSettings, tokenizer, vocab_size: int, log: RunLog) -> Dataset:
    from . import data as D
    convs = D.load_conversations(s.data, limit=s.num_conversations)
    if not convs:
        raise TrainError(f"--data {s.data}: empty dataset (no conversations)")
    order = list(range(len(convs)))
    random.Random(s.seed).shuffle(order)
    n_val = int(round(len(convs) * s.val_fraction)) if len(convs) > 1 else 0
    val_idx = set(order[:n_val])
    tok_train, tok_val = [], []
    truncated = dropped = 0
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i, msgs in enumerate(convs):
        ids, mask = D.tokenize_conversation(tokenizer, msgs, max_len=s.seq_len + 1)
        if ids.shape[0] > s.seq_len:
            truncated += 1
            ids, mask = ids[: s.seq_len], mask[: s.seq_len]
        if ids.shape[0] < 2 or not bool(mask[1:].any()):
            dropped += 1
            continue
        if int(ids.max()) >= vocab_size or int(ids.min()) < 0:
            raise TrainError(f"conversation {i}: token id {int(ids.max())} is outside the verifier vocab "
                             f"({vocab_size}): tokenizer and verifier do not match")
        (tok_val if i in val_idx else tok_train).append((ids, mask))
        if i not in val_idx:
            counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    if truncated:
        log.event("truncated", f"{truncated} conversation(s) longer than --seq-len {s.seq_len} were truncated "
                  f"to {s.seq_len} tokens", count=truncated)
    if dropped:
        log.event("dropped", f"{dropped} conversation(s) without assistant tokens were skipped", count=dropped)
    if not tok_train:
        raise TrainError(f"--data {s.data}: empty dataset after tokenization (no conversation with assistant tokens)")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    train_rows = D.pack_conversations(tok_train, s.seq_len, pad_token_id=pad)
    val_rows = D.pack_conversations(tok_val, s.seq_len, pad_token_id=pad) if tok_val else []
    return Dataset(train_rows, val_rows, counts, truncated, dropped, len(tok_train), len(tok_val))


class HiddenStates:
    """Verifier hidden states per packed row -> TrainingExample: kept in memory when they fit
    (--hidden-cache-gb), else recomputed on use; or, with a `disk` HiddenStateCache, generated
    once into it (resumable, reusable by later runs on the same data) and read back from it.
    All three give the same bits (the verifier forward is deterministic)."""

    ROWS_PER_SHARD = 16

    def __init__(self, verifier, aux_layer_ids, rows, *, cache: bool, store_dtype, device, disk=None):
        self.verifier = verifier
        self.aux = list(aux_layer_ids)
        self.rows = rows
        self.cache = cache
        self.store_dtype = store_dtype
        self.device = device
        self.disk = disk
        self._mem: dict[int, object] = {}
        self._shard: tuple[int, list] | None = None

    def compute(self, i: int):
        from . import data as D
        if self.disk is not None:
            k, j = divmod(i, self.ROWS_PER_SHARD)
            if self._shard is None or self._shard[0] != k:
                self._shard = (k, self.disk.read_shard(k))
            return self._shard[1][j]
        aux, last = D.verifier_hidden_states(self.verifier, self.rows[i], self.aux)
        ex = D.eagle_shift(self.rows[i], aux, last)
        return ex.to("cpu", self.store_dtype) if self.cache else ex

    def get(self, i: int):
        if self.cache:
            if self._producer is not None:
                return self._wait_for(i)
            if i not in self._mem:
                self._mem[i] = self.compute(i)
            return self._mem[i]
        return self.compute(i)

    # -- background extraction: the verifier runs on a second thread while training starts --
    _producer = None

    def start_background(self, order: list[int], then: "HiddenStates | None" = None, then_after: int = 0):
        """Compute every row's states on a background thread, in `order` (the order training
        will ask for them), with `then`'s rows (validation) inserted after the first `then_after`
        of them (when the first validation needs them). torch ops release the GIL and, with one
        intra-op thread each, two Python threads use two cores without OpenMP barriers. get()
        waits for a row that is not done yet. Same bits as computing in the foreground."""
        import threading
        cond = threading.Condition()
        cut = max(0, min(then_after, len(order)))
        jobs = [(self, i) for i in order[:cut]] + ([(then, i) for i in range(len(then.rows))] if then else []) \
            + [(self, i) for i in order[cut:]]
        for hs in (self, then) if then else (self,):
            hs._cond, hs._error, hs._producer = cond, [None], True

        def run():
            try:
                with torch.inference_mode(False), torch.no_grad():
                    for hs, i in jobs:
                        if i in hs._mem:
                            continue
                        ex = hs.compute(i)
                        with cond:
                            hs._mem[i] = ex
                            cond.notify_all()
            except BaseException as e:  # surfaced by the next get()
                with cond:
                    for hs in (self, then) if then else (self,):
                        hs._error[0] = e
                    cond.notify_all()
            finally:
                with cond:
                    for hs in (self, then) if then else (self,):
                        hs._done = True
                    cond.notify_all()

        for hs in (self, then) if then else (self,):
            hs._done = False
        t = threading.Thread(target=run, name="peagle-hidden-states", daemon=True)
        t.start()
        self._thread = t
        return t

    def _wait_for(self, i: int):
        with self._cond:
            while i not in self._mem:
                if self._error[0] is not None:
                    raise self._error[0]
                if self._done:
                    raise RuntimeError(f"hidden states of row {i} were never computed")
                self._cond.wait(timeout=1.0)
            return self._mem[i]

    def warm(self, desc: str, progress: bool):
        if self.disk is not None and self.rows:
            self.disk.generate(self.verifier, self.rows, self.aux, rows_per_shard=self.ROWS_PER_SHARD,
                               dtype=self.store_dtype, progress=progress)
        if not self.cache:
            return
        it = range(len(self.rows))
        bar = _tqdm(it, desc=desc, unit="row", disable=not progress)
        t0 = time.time()
        ntok = 0
        for i in bar:
            self.get(i)
            ntok += int(self.rows[i].input_ids.shape[0])
            bar.set_postfix(tok_s=f"{ntok / max(time.time() - t0, 1e-9):.0f}")
        bar.close()
        self._shard = None


def _tqdm(it, **kw):
    from tqdm import tqdm
    # redrawn every second on a terminal; into a log file only every 30 s
    interval = 1.0 if sys.stderr.isatty() else 30.0
    return tqdm(it, dynamic_ncols=True, file=sys.stderr, mininterval=interval, **kw)


def concat_examples(examples):
    """Packed rows side by side as one sequence; document ids offset so rows never mix."""
    from . import data as D
    if len(examples) == 1:
        return examples[0]
    docs, off = [], 0
    for ex in examples:
        d = ex.document_ids.to(torch.int32)
        docs.append(torch.where(d >= 0, d + off, d))
        if bool((d >= 0).any()):
            off += int(d.max()) + 1
    return D.TrainingExample(
        input_ids=torch.cat([e.input_ids for e in examples]), document_ids=torch.cat(docs),
        loss_mask=torch.cat([e.loss_mask for e in examples]), hidden=torch.cat([e.hidden for e in examples]),
        last_hidden=torch.cat([e.last_hidden for e in examples]))


def _epoch_order(seed: int, epoch: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def _cod_seed(seed: int, step: int, micro: int) -> int:
    return (seed * 0x9E3779B1 + step * 7919 + micro * 104729 + 12345) % (2**62)


# ---------------------------------------------------------------------------------------------
# Schedule, metrics
# ---------------------------------------------------------------------------------------------
def lr_lambda(s: TrainSettings):
    def f(step: int) -> float:
        if s.warmup_steps and step < s.warmup_steps:
            return (step + 1) / s.warmup_steps
        if s.schedule == "constant":
            return 1.0
        span = max(1, s.max_steps - s.warmup_steps)
        t = min(1.0, (step - s.warmup_steps) / span)
        shape = 0.5 * (1 + math.cos(math.pi * t)) if s.schedule == "cosine" else 1.0 - t
        return s.min_lr_ratio + (1 - s.min_lr_ratio) * shape
    return f


class Meter:
    """Sums over steps: loss_sum / weight, per-depth correct / total."""

    def __init__(self, k: int):
        self.k = k
        self.reset()

    def reset(self):
        self.loss_sum = 0.0
        self.weight = 0.0
        self.correct = torch.zeros(self.k, dtype=torch.int64)
        self.total = torch.zeros(self.k, dtype=torch.int64)

    def add(self, m: dict):
        self.loss_sum += float(m["loss_sum"])
        self.weight += float(m["weight"])
        self.correct += m["correct"].cpu().long()
        self.total += m["total"].cpu().long()

    def summary(self) -> dict:
        acc = [float(c) / float(t) if int(t) > 0 else 0.0 for c, t in zip(self.correct, self.total)]
        tot = int(self.total.sum())
        return {"loss": self.loss_sum / self.weight if self.weight > 0 else float("nan"),
                "acc": acc, "full_acc": float(self.correct.sum()) / tot if tot else 0.0,
                "accept_len": acceptance_length(acc), "counted": [int(t) for t in self.total]}


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------
def _rng_state() -> dict:
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _set_rng_state(st: dict):
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def list_checkpoints(out: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first (a .tmp dir or one without its marker is not one)."""
    found = []
    if not out.is_dir():
        return found
    for p in out.iterdir():
        name = p.name
        if not p.is_dir() or not name.startswith(CHECKPOINT_PREFIX):
            continue
        tail = name[len(CHECKPOINT_PREFIX):]
        if not tail.isdigit():
            continue
        if not (p / COMPLETE_MARKER).is_file() or not (p / TRAINER_STATE).is_file():
            continue
        found.append((int(tail), p))
    return sorted(found)


def save_checkpoint(out: Path, step: int, model: PEagleDraftModel, opt, sched, state: dict, keep: int) -> Path:
    for name, p in model.named_parameters():
        if not bool(torch.isfinite(p).all()):
            raise TrainError(f"refusing to write checkpoint {step}: parameter {name} is not finite")
    tmp = out / f"{CHECKPOINT_PREFIX}{step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    _test_pause("weights", step)
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "rng": _rng_state(), **state},
               tmp / TRAINER_STATE)
    return _publish_checkpoint(out, step, tmp, keep)


def _publish_checkpoint(out: Path, step: int, tmp: Path, keep: int) -> Path:
    """Mark the written tmp dir complete, rename it to checkpoint-<step>, prune old ones."""
    final = out / f"{CHECKPOINT_PREFIX}{step}"
    (tmp / COMPLETE_MARKER).write_text(f"{step}\n")
    _fsync_dir(tmp)
    _test_pause("written", step)
    _replace_dir(tmp, final)
    for s, p in list_checkpoints(out)[:-keep]:
        _remove_checkpoint(p)
    return final


def _replace_dir(tmp: Path, dst: Path):
    """Move the complete directory `tmp` to `dst` (replacing an older `dst`) so that a kill at any
    instant leaves `dst` absent, the old complete one, or the new complete one; never a mix."""
    if dst.exists():
        old = dst.with_name(dst.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(dst, old)
        os.replace(tmp, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dst)
    _fsync_dir(dst.parent)


def _remove_checkpoint(p: Path):
    """Prune a checkpoint: its COMPLETE marker goes first, so a kill in the middle of the
    rmtree leaves an incomplete directory (ignored, later pruned) rather than a marked one
    with missing files."""
    try:
        (p / COMPLETE_MARKER).unlink(missing_ok=True)
        _fsync_dir(p)
    except OSError:
        pass
    shutil.rmtree(p, ignore_errors=True)


def _test_pause(point: str, step: int):
    """Test hook, used only by python_tests/test_crash_safety.py to SIGKILL the trainer at a known
    point: PEAGLE_TEST_PAUSE="<point>:<step>:<flag file>" makes the trainer create the flag file
    and sleep (10 min) when it reaches <point> at <step>. Points: "weights" (checkpoint tmp dir
    holds the weights only), "written" (tmp dir complete, before its rename), "step" (after step
    <step>, its checkpoint included). Unset (always, outside those tests): does nothing."""
    spec = os.environ.get("PEAGLE_TEST_PAUSE")
    if not spec:
        return
    want_point, want_step, flag = spec.split(":", 2)
    if want_point == point and int(want_step) == step:
        Path(flag).touch()
        time.sleep(600)


def _read_checkpoint_state(ck: Path) -> dict:
    """The trainer state of a complete checkpoint, after checking that its files are readable.
    A complete checkpoint was fsynced before its rename, so this fails only on later damage
    (disk errors, manual edits): say which checkpoint, and how to go back to the one before."""
    try:
        from safetensors import safe_open
        with safe_open(str(ck / "model.safetensors"), "pt"):
            pass
        json.loads((ck / "config.json").read_text())
        return torch.load(ck / TRAINER_STATE, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001  (pickle, safetensors and OS errors alike)
        raise TrainError(f"--resume: checkpoint {ck} is marked complete but cannot be read ({type(e).__name__}: "
                         f"{e}); move it out of the output directory to resume from the checkpoint before it") from None


def _fsync_dir(d: Path):
    try:
        for f in d.iterdir() if d.is_dir() else []:
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------
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


def train(s: TrainSettings, *, stop_after: int | None = None) -> TrainResult:
    """Run (or resume) training. stop_after: leave after that many steps of THIS process without
    the final save, as a killed run would (tests use it for resume). Under torchrun (WORLD_SIZE >
    1) every rank calls this; see peagle_ext.distributed."""
    from .distributed import DistContext
    s.validate()
    ctx = DistContext.from_env(s.dist, s.device)
    try:
        return _train_main(s, ctx, stop_after)
    finally:
        ctx.close()


def _train_main(s: TrainSettings, ctx, stop_after) -> TrainResult:
    from .distributed import NullLog
    t_start = time.time()
    out = Path(s.output)
    if out.exists() and not out.is_dir():
        raise TrainError(f"--output {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    resume_from = None
    if s.resume:
        ck = list_checkpoints(out)
        if not ck:
            raise TrainError(f"--resume: no complete checkpoint in {out} (looked for {CHECKPOINT_PREFIX}<step>/ "
                             f"with a {COMPLETE_MARKER} marker)")
        resume_from = ck[-1][1]
        # leftovers of a killed checkpoint write (.tmp) or directory swap (.old): never complete ones
        if ctx.is_main:
            stale = list(out.glob(f"{CHECKPOINT_PREFIX}*.tmp")) + list(out.glob(f"{CHECKPOINT_PREFIX}*.old"))
            for p in stale:
                shutil.rmtree(p, ignore_errors=True)
        ck_state = _read_checkpoint_state(resume_from)
        old = ck_state["settings"]
        diff = [k for k in _RESUME_FIXED if old.get(k) != getattr(s, k)]
        if diff:
            raise TrainError("--resume with settings that differ from the checkpoint's: " +
                             ", ".join(f"{k}={getattr(s, k)!r} (checkpoint: {old.get(k)!r})" for k in diff))
        old_world = int(ck_state.get("world_size", 1))
        old_micro = int(old.get("grad_accum", 1)) * old_world
        if old_micro != s.grad_accum * ctx.world:
            hint = (f"; pass --grad-accum {old_micro // ctx.world} to keep it" if old_micro % ctx.world == 0 else "")
            raise TrainError(f"--resume: the checkpoint takes {old_micro} micro-batches per step (--grad-accum "
                             f"{old.get('grad_accum')} x {old_world} rank(s)), this run {s.grad_accum} x {ctx.world}{hint}")
        if ctx.is_main:
            for p in out.glob(f"{CHECKPOINT_PREFIX}*.tmp"):
                shutil.rmtree(p, ignore_errors=True)
            RunLog.truncate_after(out / "log.jsonl", ck_state["step"])
    else:
        existing = list_checkpoints(out)
        if existing:
            raise TrainError(f"{out} already holds checkpoints (newest: {existing[-1][1].name}); continue them with "
                             "--resume, or pick another --output (a fresh run would prune them)")
        if ctx.is_main and (out / "log.jsonl").exists():
            (out / "log.jsonl").unlink()  # a log without checkpoints belongs to no resumable run
    ctx.barrier()  # every rank has decided before rank 0 writes anything
    if ctx.is_main:
        log = RunLog(out / "log.jsonl", echo=True)
    else:
        log = NullLog()
        s = dataclasses.replace(s, progress=False)
    threads = torch.get_num_threads()
    if s.threads and not s.device.startswith("cuda"):
        torch.set_num_threads(s.threads)
    try:
        return _train(s, out, log, resume_from, stop_after, t_start, ctx)
    finally:
        torch.set_num_threads(threads)
        log.close()


def _train(s: TrainSettings, out: Path, log: RunLog, resume_from: Path | None, stop_after, t_start, ctx) -> TrainResult:
    from . import data as D
    device = ctx.device
    amp = s.autocast_dtype()
    torch.manual_seed(s.seed)
    random.seed(s.seed)
    np.random.seed(s.seed % (2**32))
    log.write({"event": "start", "settings": dataclasses.asdict(s), "resume_from": str(resume_from) if resume_from else None,
               "autocast": str(amp) if amp else None, "time": time.time(), "world_size": ctx.world})
    if ctx.world > 1:
        log.event("dist", f"{ctx.world} ranks ({s.dist.upper()}, {'NCCL' if device.type == 'cuda' else 'gloo'}): a step "
                  f"takes {ctx.world} x {s.grad_accum} micro-batches of {s.batch_size} row(s)")

    # verifier + data
    t0 = time.time()
    vdtype = amp if amp is not None else torch.float32
    verifier, tokenizer = D.load_verifier(s.verifier, device=device, dtype=vdtype)
    vcfg = getattr(verifier.config, "text_config", None) or verifier.config
    vocab = int(vcfg.vocab_size)
    aux_ids = list(s.aux_layer_ids) if s.aux_layer_ids else D.default_aux_layer_ids(int(vcfg.num_hidden_layers))
    log.event("verifier", f"verifier {s.verifier}: {vcfg.model_type}, {vcfg.num_hidden_layers} layers, hidden "
              f"{vcfg.hidden_size}, vocab {vocab}, aux layers {aux_ids} ({time.time() - t0:.1f}s)")
    ds = prepare_data(s, tokenizer, vocab, log)
    mask_id, how = resolve_mask_token_id(tokenizer, vocab, s.mask_token_id)
    for rows, where in ((ds.train_rows, "the training data"), (ds.val_rows, "the validation data")):
        for r in rows:
            if bool((r.input_ids[r.document_ids >= 0] == mask_id).any()):
                raise TrainError(f"mask_token_id {mask_id} ({how}) occurs as a real token in {where}; "
                                 "pick an id the data never uses (--mask-token-id)")
    ntok = sum(int((r.document_ids >= 0).sum()) for r in ds.train_rows)
    log.event("data", f"data {s.data}: {ds.num_train_conversations} train / {ds.num_val_conversations} val conversations "
              f"-> {len(ds.train_rows)} train / {len(ds.val_rows)} val rows of {s.seq_len} tokens "
              f"({ntok} train tokens, {int(ds.token_counts.sum())} assistant tokens); mask token {mask_id} ({how})")

    # draft vocab
    d2t = None
    dv = s.draft_vocab_size
    if dv is not None and dv >= vocab:
        dv = None
    if dv is not None:
        d2t, t2d = build_vocab_mapping(ds.token_counts, dv)
        cover = float(ds.token_counts[t2d].sum()) / max(1.0, float(ds.token_counts.sum()))
        log.event("vocab", f"draft vocab: the {dv} most frequent assistant tokens (cover {100 * cover:.1f}% of them)",
                  coverage=cover)

    # model
    model = PEagleDraftModel.from_verifier(
        vcfg, num_layers=s.num_layers, num_depths=s.num_depths, mask_token_id=mask_id, draft_vocab_size=dv,
        aux_layer_ids=aux_ids, layer_type=s.layer_type, d2t=d2t, verifier_name_or_path=s.verifier,
        options=s.options(), norm_before_residual=s.norm_before_residual)
    model.config.speculators_config["verifier"]["architectures"] = list(getattr(verifier.config, "architectures", None) or [])
    base = verifier.get_decoder() if hasattr(verifier, "get_decoder") else verifier.model
    norm = getattr(base, "norm", None)
    if norm is None:
        raise TrainError("the verifier has no final norm (model.norm): not a llama/qwen-style causal LM")
    if int(vcfg.hidden_size) != model.config.hidden_size:
        raise TrainError(f"verifier/draft hidden size mismatch: verifier {vcfg.hidden_size}, draft {model.config.hidden_size}")
    head_dim = model.layers[0].self_attn.head_dim
    if torch.device(device).type == "cuda" and head_dim not in (64, 128):
        # say it before the verifier pass, not from inside the first forward
        raise TrainError(f"the drafter's attention head dim is {head_dim} (from the verifier config); the CUDA "
                         f"COD attention kernels support 64 and 128: train on --device cpu, or use a verifier "
                         f"with head dim 64/128")
    model.attach_verifier(norm_weight=norm.weight.detach().float().cpu(),
                          lm_head_weight=verifier.get_output_embeddings().weight.detach().float().cpu(),
                          norm_eps=getattr(vcfg, "rms_norm_eps", 1e-6),
                          embed_weight=verifier.get_input_embeddings().weight.detach().float().cpu())
    if resume_from is not None:  # the weights before any DDP/FSDP wrapping
        ck = torch.load(resume_from / TRAINER_STATE, map_location="cpu", weights_only=False)
        ckcfg = json.loads((resume_from / "config.json").read_text())
        if int(ckcfg.get("target_hidden_size") or 0) != int(vcfg.hidden_size):
            raise TrainError(f"verifier/draft hidden size mismatch: checkpoint {resume_from} was trained for hidden "
                             f"{ckcfg.get('target_hidden_size')}, this verifier has {vcfg.hidden_size}")
        from safetensors.torch import load_file
        model.load_checkpoint_state_dict(load_file(str(resume_from / "model.safetensors")))
    model.to(device)
    ctx.wrap(model, amp)  # DDP / FSDP2 under torchrun; nothing in one process
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr, betas=(s.adam_beta1, s.adam_beta2), weight_decay=s.weight_decay,
                            fused=device.type == "cuda" and not ctx.is_fsdp)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(s))
    step, epoch, cursor = 0, 0, 0
    history_skipped = 0
    if resume_from is not None:
        ctx.load_optimizer_state(model, opt, ck, resume_from)
        sched.load_state_dict(ck["scheduler"])
        _set_rng_state(ck["rng"])
        step, epoch, cursor = ck["step"], ck["epoch"], ck["cursor"]
        history_skipped = ck.get("skipped_steps", 0)
        log.event("resume", f"resumed from {resume_from} at step {step}", step=step)

    nparams = sum(p.numel() for p in params)
    log.event("model", f"drafter: {s.num_layers} {model.config.layer_type} layer(s), K={s.num_depths}, draft vocab "
              f"{model.config.draft_vocab_size}, {nparams / 1e6:.2f}M trainable params, {s.attention} attention, "
              f"autocast {amp or 'off'}")

    # hidden states
    feat = (len(aux_ids) + 1) * int(vcfg.hidden_size)
    store_dtype = torch.bfloat16 if amp is not None else torch.float32
    per_row = s.seq_len * feat * (2 if store_dtype == torch.bfloat16 else 4)
    cache = per_row * (len(ds.train_rows) + len(ds.val_rows)) <= s.hidden_cache_gb * 2**30
    disks = (None, None)
    if s.hidden_cache_dir:
        meta = {"verifier": s.verifier, "aux_layer_ids": aux_ids, "seq_len": s.seq_len, "dtype": str(store_dtype),
                "data": s.data, "num_conversations": s.num_conversations, "val_fraction": s.val_fraction,
                "seed": s.seed}
        disks = tuple(D.HiddenStateCache(Path(s.hidden_cache_dir) / split, meta={**meta, "split": split})
                      for split in ("train", "val"))
    train_h = HiddenStates(verifier, aux_ids, ds.train_rows, cache=cache, store_dtype=store_dtype, device=device,
                           disk=disks[0])
    val_h = HiddenStates(verifier, aux_ids, ds.val_rows, cache=cache, store_dtype=store_dtype, device=device,
                         disk=disks[1])
    n_rows = len(ds.train_rows)
    order = _epoch_order(s.seed, epoch, n_rows)
    t0 = time.time()
    background = cache and not s.hidden_cache_dir and device.type == "cpu" and s.background_hidden and ctx.world == 1
    if ctx.world > 1:  # each rank: only the rows it trains on (peagle_ext.distributed)
        log.event("hidden", ctx.prepare_hidden_states((train_h, val_h), s.progress))
    elif background:
        # rows in the order this epoch consumes them; training starts as soon as the first is ready
        first_val = (s.val_every - step % s.val_every) * s.batch_size * s.grad_accum
        train_h.start_background(order[cursor:] + order[:cursor], then=val_h, then_after=first_val)
        log.event("hidden", f"verifier hidden states for {len(ds.train_rows) + len(ds.val_rows)} rows: computed on a "
                  "background thread while training runs (kept in memory)")
    else:
        train_h.warm("verifier hidden states (train)", s.progress)
        val_h.warm("verifier hidden states (val)", s.progress)
    if cache and not background and ctx.world == 1:
        ntok_all = ntok + sum(int((r.document_ids >= 0).sum()) for r in ds.val_rows)
        dt_h = time.time() - t0
        log.event("hidden", f"verifier hidden states for {len(ds.train_rows) + len(ds.val_rows)} rows cached in memory "
                  f"({dt_h:.1f}s, {ntok_all / max(dt_h, 1e-9):.0f} tokens/s)", seconds=dt_h)
    if (cache and not background and ctx.world == 1) or s.hidden_cache_dir:
        # every row is cached: the verifier itself is no longer needed
        train_h.verifier = val_h.verifier = None
        del verifier
        base = norm = None  # noqa: F841  (drop the last references to the verifier decoder)
    elif not cache:
        log.event("hidden", "verifier hidden states do not fit --hidden-cache-gb: recomputed every step")

    # a step: world x grad_accum micro-batches ("units"); unit g is COD-seeded by g, so the
    # numbers do not depend on which rank computes it (peagle_ext.distributed)
    n_units = s.grad_accum * ctx.world
    rows_per_step = s.batch_size * n_units
    row_tokens = [int((r.document_ids >= 0).sum()) for r in ds.train_rows]
    meter = Meter(s.num_depths)
    window_meter = Meter(s.num_depths)
    skipped = history_skipped
    val_summary = None
    stopped = False
    bar = _tqdm(range(step, s.max_steps), desc="train", unit="step", initial=step, total=s.max_steps,
                disable=not s.progress)
    t_tok, n_tok_window = time.time(), 0
    autocast = (lambda: torch.autocast(device.type, dtype=amp)) if amp is not None else _null
    steps_here = 0
    model.train()
    for _ in bar:
        # rows of this step
        picked = []
        for _r in range(rows_per_step):
            if cursor >= n_rows:
                epoch, cursor = epoch + 1, 0
                order = _epoch_order(s.seed, epoch, n_rows)
            picked.append(order[cursor])
            cursor += 1
        micro = [picked[i * s.batch_size:(i + 1) * s.batch_size] for i in range(n_units)]
        mine = ctx.my_units([sum(row_tokens[i] for i in mb) for mb in micro])
        examples = [concat_examples([train_h.get(i) for i in micro[g]]).to(device) for g in mine]
        layouts = [model.sample_layout(ex, seed=_cod_seed(s.seed, step, g)) for g, ex in zip(mine, examples)]
        weights = [float(ex.loss_mask[(lay.anchor.long() + lay.depth.long()).to(ex.loss_mask.device)].sum())
                   for ex, lay in zip(examples, layouts)]
        wtot = ctx.sum_scalar(sum(weights))  # the GLOBAL loss-token count: every rank divides by it
        step_meter = Meter(s.num_depths)
        opt.zero_grad(set_to_none=True)
        unit_metrics = {}
        for j, (g, ex, lay) in enumerate(zip(mine, examples, layouts)):
            m = ctx.forward_backward(model, ex, lay, segments=s.seq_partition,
                                     loss_scale=1.0 / wtot if wtot > 0 else 0.0, autocast_dtype=amp,
                                     last=j == len(mine) - 1)
            unit_metrics[g] = {**m, "num_tokens": int((ex.document_ids >= 0).sum())}
        per_unit = ctx.ordered_metrics(n_units, unit_metrics, s.num_depths)  # all units, in unit order
        for m in per_unit:
            step_meter.add(m)
        gnorm = ctx.clip_grad_norm_(params, s.grad_clip if s.grad_clip > 0 else float("inf"))
        loss_val = step_meter.loss_sum / step_meter.weight if step_meter.weight > 0 else 0.0
        ok = math.isfinite(loss_val) and bool(torch.isfinite(gnorm))
        if ok and step_meter.weight > 0:
            opt.step()
        elif ok:  # no loss-masked token in this step: nothing to learn, leave AdamW's moments alone
            opt.zero_grad(set_to_none=True)
        else:
            skipped += 1
            opt.zero_grad(set_to_none=True)
            log.event("nan", f"step {step + 1}: non-finite loss ({loss_val}) or gradient norm ({float(gnorm)}); "
                      "step skipped, weights unchanged", step=step + 1)
        lr_now = sched.get_last_lr()[0]
        sched.step()
        step += 1
        steps_here += 1
        ntoks = sum(m["num_tokens"] for m in per_unit)
        n_tok_window += ntoks
        if ok:
            meter.add({"loss_sum": step_meter.loss_sum, "weight": step_meter.weight,
                       "correct": step_meter.correct, "total": step_meter.total})
            window_meter.add({"loss_sum": step_meter.loss_sum, "weight": step_meter.weight,
                              "correct": step_meter.correct, "total": step_meter.total})
        if step % s.log_every == 0 or step == s.max_steps:
            now = time.time()
            tps = n_tok_window / max(now - t_tok, 1e-9)
            summ = window_meter.summary()
            rec = {"step": step, "split": "train", "epoch": epoch, "lr": lr_now, "grad_norm": float(gnorm),
                   "tokens": n_tok_window, "tokens_per_s": tps, "elapsed_s": now - t_start,
                   "skipped": not ok, **summ,
                   **({"world_size": ctx.world, "tokens_per_s_per_rank": tps / ctx.world} if ctx.world > 1 else {})}
            log.write(rec)
            bar.set_postfix(loss=f"{summ['loss']:.3f}", acc0=f"{summ['acc'][0]:.3f}",
                            acc=f"{summ['full_acc']:.3f}", tok_s=f"{tps:.0f}")
            window_meter.reset()
            t_tok, n_tok_window = now, 0
        if ds.val_rows and (step % s.val_every == 0 or step == s.max_steps):
            val_summary = evaluate(model, val_h, s, autocast, device, ctx)
            log.write({"step": step, "split": "val", **val_summary})
        if step % s.checkpoint_every == 0 or step == s.max_steps:
            ctx.save_checkpoint(out, step, model, opt, sched,
                                {"step": step, "epoch": epoch, "cursor": cursor, "settings": dataclasses.asdict(s),
                                 "skipped_steps": skipped}, s.keep_checkpoints)
        _test_pause("step", step)
        if stop_after is not None and steps_here >= stop_after and step < s.max_steps:
            stopped = True
            break
    bar.close()
    train_summary = meter.summary()
    result = TrainResult(out, None, step, train_summary, val_summary, [], skipped, stopped, time.time() - t_start)
    if stopped:
        return result
    final = out / "final"
    written_here = ctx.save_final(model, final)  # tmp + rename, by rank 0
    result.final_dir = final
    if not written_here:
        return result
    result.plots = make_plots(out / "log.jsonl", out, s.num_depths)
    result.wall_s = time.time() - t_start
    log.write({"event": "done", "step": step, "final": str(final), "wall_s": result.wall_s,
               "train": train_summary, "val": val_summary, "skipped_steps": skipped})
    return result


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@torch.no_grad()
def evaluate(model: PEagleDraftModel, hs: HiddenStates, s: TrainSettings, autocast, device, ctx=None) -> dict:
    """Loss and per-depth accuracy over the validation rows (COD layouts with fixed seeds). Under
    torchrun the rows are split over the ranks and the per-row metrics summed in row order."""
    was = model.training
    model.eval()
    m = Meter(s.num_depths)
    distributed = ctx is not None and ctx.world > 1
    fwd = ctx.eval_module() if distributed else model
    per_row = {}
    for i in (ctx.eval_rows(len(hs.rows)) if distributed else range(len(hs.rows))):
        j = i if i >= 0 else next(iter(per_row), 0)  # -1: a padding forward (FSDP), result dropped
        ex = hs.get(j).to(device)
        lay = model.sample_layout(ex, seed=_cod_seed(s.seed + 1, 10**9, j))
        with autocast():
            _, met = fwd(ex, lay)
        if i >= 0:
            per_row[i] = met
    for met in (ctx.ordered_metrics(len(hs.rows), per_row, s.num_depths) if distributed
                else [per_row[i] for i in range(len(hs.rows))]):
        m.add(met)
    if was:
        model.train()
    return m.summary()


def make_plots(log_path: Path, out: Path, k: int) -> list[Path]:
    """loss.png and accuracy.png (per-depth accuracy) from log.jsonl, train and validation."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tr, va = [], []
    for line in log_path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if r.get("split") == "train" and not r.get("skipped") and math.isfinite(r.get("loss", float("nan"))):
            tr.append(r)
        elif r.get("split") == "val":
            va.append(r)
    paths = []

    def smooth(y, w):
        if len(y) < 3 or w <= 1:
            return y
        out_, acc = [], 0.0
        q = []
        for v in y:
            q.append(v)
            acc += v
            if len(q) > w:
                acc -= q.pop(0)
            out_.append(acc / len(q))
        return out_

    w = max(1, len(tr) // 50)
    fig, ax = plt.subplots(figsize=(7, 4))
    if tr:
        ax.plot([r["step"] for r in tr], smooth([r["loss"] for r in tr], w), label="train")
    if va:
        ax.plot([r["step"] for r in va], [r["loss"] for r in va], "o-", label="val")
    ax.set_xlabel("step")
    ax.set_ylabel("KL loss")
    ax.set_title("P-EAGLE drafter loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    p = out / "loss.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    fig, ax = plt.subplots(figsize=(7, 4))
    cmap = plt.get_cmap("viridis")
    for d in range(k):
        c = cmap(d / max(1, k - 1))
        if tr:
            ax.plot([r["step"] for r in tr], smooth([r["acc"][d] for r in tr], w), color=c, alpha=0.8,
                    label=f"d{d} train")
        if va:
            ax.plot([r["step"] for r in va], [r["acc"][d] for r in va], "o--", color=c, label=f"d{d} val")
    ax.set_xlabel("step")
    ax.set_ylabel("argmax agreement with the verifier")
    ax.set_ylim(0, 1)
    ax.set_title("per-depth accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    p = out / "accuracy.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------
def export(src: str, dst: str, *, dtype: str = "bfloat16") -> Path:
    """Write a vLLM-loadable speculators checkpoint (config.json + model.safetensors) from a
    final/ dir, a checkpoint-<step>/ dir, or a training output dir (its final/, else its newest
    complete checkpoint)."""
    p = Path(src)
    if not p.exists():
        raise TrainError(f"export: {src} does not exist")
    if (p / "config.json").is_file():
        pick = p
    elif (p / "final" / "config.json").is_file():
        pick = p / "final"
    else:
        ck = list_checkpoints(p)
        if not ck:
            raise TrainError(f"export: {src} holds no P-EAGLE checkpoint (no config.json, final/ or complete "
                             f"{CHECKPOINT_PREFIX}<step>/)")
        pick = ck[-1][1]
    dt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(dtype)
    if dt is None:
        raise TrainError(f"export: --dtype must be bfloat16|float16|float32, got {dtype!r}")
    model = PEagleDraftModel.from_pretrained(pick)
    for name, t in model.checkpoint_state_dict().items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise TrainError(f"export: {pick} has non-finite values in {name}")
    d = Path(dst)
    if d.resolve() == pick.resolve():
        raise TrainError("export: destination equals the source")
    if d.exists() and not (d.is_dir() and (not any(d.iterdir()) or (d / "config.json").is_file())):
        # only an empty directory or an earlier export is replaced: never a file or another directory
        raise TrainError(f"export: {dst} exists and is not a P-EAGLE checkpoint directory; refusing to replace it")
    tmp = d.with_name(d.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, dtype=dt)
    _replace_dir(tmp, d)
    return d
