"""`peagle train`'s settings: defaults < --config file < command-line flags, and their validation."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..model import PEagleOptions
from .tracking import check_report_to


class TrainError(ValueError):
    """Bad input or an unusable run state; the message says which and what to do."""


@dataclass
class TrainSettings:
    # what to train on
    verifier: str = "smollm2"
    verifier_revision: str | None = None  # a hub verifier's branch, tag or commit
    data: str | list[str] = "sharegpt"  # one source or several, mixed
    data_split: str | None = None  # split of a dataset directory / hub dataset (default train)
    chat_template_kwargs: dict | None = None  # options for the chat template, e.g. enable_thinking
    output: str = "runs/peagle"
    num_conversations: int | None = 400
    val_fraction: float = 0.05
    # exact duplicate conversations dropped, and no validation conversation opens with a prompt
    # that a training one has (data/dedup.py); false: every conversation, a plain random split
    dedup: bool = True
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
    epochs: float | None = None  # passes over the training rows; sets max_steps when given
    init_from: str | None = None  # warm start: a drafter checkpoint / export dir (new optimizer)
    batch_size: int = 1  # packed rows per micro-batch
    grad_accum: int = 1
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    schedule: str = "cosine"
    weight_decay: float = 0.0
    # adamw | muon: Muon (BatchedMuon) on the layers' matrices, AdamW on the rest (train/optim.py)
    optimizer: str = "adamw"
    muon_weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    grad_clip: float = 1.0
    # stop before max_steps (train/early_stop.py): validation evaluations without improvement,
    # the relative improvement that counts, and a wall-clock budget in minutes
    early_stop_patience: int | None = None
    early_stop_min_delta: float = 0.002
    max_minutes: float | None = None
    # the schedule also runs on the clock: it ends decayed when max_minutes does (train/optim.py)
    time_schedule: bool = False
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
    # states kept in memory as: auto, the training's dtype (bf16 under autocast, else fp32); fp8,
    # float8 e4m3 with one float32 scale per position and tensor (half bf16's bytes; on a GPU the
    # rows cross to it in fp8 and are dequantized there)
    hidden_cache_dtype: str = "auto"
    hidden_cache_dir: str | None = None  # on-disk hidden states (resumable, reusable across runs)
    background_hidden: bool = True  # CPU: run the verifier on a 2nd thread while training starts
    # cached states: build the next step's batch (pinned, side-stream copy on CUDA) during this step
    prefetch: bool = True
    # torchrun: give up when no shard of the shared --hidden-cache-dir appeared for this long
    hidden_timeout_s: float = 1800.0
    resume: bool = False
    # --resume after a data file or the verifier changed in place: continue (logged) instead of refusing
    accept_changed_inputs: bool = False
    progress: bool = True
    # torch.profiler over steps W+1 .. W+N of this process (DIR/profile/; train/profiling.py)
    profile_steps: int = 0
    profile_warmup: int = 5
    report_to: str | list[str] = "none"  # none | tensorboard | wandb, several allowed
    # under torchrun (WORLD_SIZE > 1): ddp | fsdp (peagle_ext.distributed); ignored by one process
    dist: str = "ddp"

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def validate(self) -> TrainSettings:
        def need(cond, msg):
            if not cond:
                raise TrainError(msg)

        for f in dataclasses.fields(self):  # the types first: the range checks below compare them
            setattr(self, f.name, check_setting_type(f.name, getattr(self, f.name)))
        need(self.output.strip() != "", "--output must name a directory, got ''")
        need(self.verifier.strip() != "", "--verifier must not be empty")
        need(math.isfinite(self.lr), f"--lr must be finite, got {self.lr}")
        need(
            self.grad_clip == 0 or (self.grad_clip > 0 and math.isfinite(self.grad_clip)),
            f"--grad-clip must be a finite number > 0, or 0 (off), got {self.grad_clip}",
        )
        need(
            0 <= self.hidden_cache_gb and math.isfinite(self.hidden_cache_gb),
            f"--hidden-cache-gb must be a finite number >= 0, got {self.hidden_cache_gb}",
        )
        need(
            self.hidden_cache_dtype in ("auto", "fp8"),
            f"--hidden-cache-dtype must be auto or fp8, got {self.hidden_cache_dtype!r}",
        )
        need(
            self.hidden_cache_dtype == "auto" or not self.hidden_cache_dir,
            "--hidden-cache-dtype fp8 is for states kept in memory; an on-disk cache (--hidden-cache-dir) "
            "stores the dtype it was made with (peagle hidden-states --dtype fp8)",
        )
        need(
            0 <= self.weight_decay and math.isfinite(self.weight_decay),
            f"--weight-decay must be a finite number >= 0, got {self.weight_decay}",
        )
        need(
            0 <= self.muon_weight_decay and math.isfinite(self.muon_weight_decay),
            f"--muon-weight-decay must be a finite number >= 0, got {self.muon_weight_decay}",
        )
        need(self.optimizer in ("adamw", "muon"), f"--optimizer must be adamw or muon, got {self.optimizer!r}")
        need(0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1, "adam_beta1 and adam_beta2 must be in [0, 1)")
        need(
            self.hidden_timeout_s > 0 and not math.isnan(self.hidden_timeout_s),
            f"--hidden-timeout-s must be > 0, got {self.hidden_timeout_s}",
        )
        need(0 <= self.seed < 2**63, f"--seed must be in [0, 2**63), got {self.seed}")
        need(self.mask_token_id is None or self.mask_token_id >= 0, "--mask-token-id must be >= 0")
        need(
            self.aux_layer_ids is None or (len(self.aux_layer_ids) >= 1 and min(self.aux_layer_ids) >= 0),
            f"--aux-layer-ids must list at least one layer id >= 0, got {self.aux_layer_ids}",
        )
        need(self.epochs is None or math.isfinite(self.epochs), f"--epochs must be finite, got {self.epochs}")

        need(self.seq_len >= 8, f"--seq-len must be >= 8, got {self.seq_len}")
        need(self.max_steps >= 1, f"--max-steps must be >= 1, got {self.max_steps}")
        need(self.num_layers >= 1, f"--num-layers must be >= 1, got {self.num_layers}")
        need(1 <= self.num_depths <= 64, f"--num-depths must be in [1, 64], got {self.num_depths}")
        need(self.batch_size >= 1 and self.grad_accum >= 1, "--batch-size and --grad-accum must be >= 1")
        need(self.seq_partition >= 1, f"--seq-partition must be >= 1, got {self.seq_partition}")
        need(self.lr > 0, f"--lr must be > 0, got {self.lr}")
        need(0 <= self.min_lr_ratio <= 1, f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        need(self.warmup_steps >= 0, "--warmup-steps must be >= 0")
        need(
            self.schedule in ("cosine", "linear", "constant"),
            f"--schedule must be cosine|linear|constant, got {self.schedule!r}",
        )
        need(0 <= self.val_fraction < 1, f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        need(
            self.device in ("cpu", "cuda") or self.device.startswith("cuda:"),
            f"--device must be cpu or cuda, got {self.device!r}",
        )
        need(
            self.dtype in ("auto", "float32", "bfloat16"), f"--dtype must be auto|float32|bfloat16, got {self.dtype!r}"
        )
        need(
            self.checkpoint_every >= 1 and self.val_every >= 1 and self.log_every >= 1,
            "--checkpoint-every, --val-every and --log-every must be >= 1",
        )
        need(self.keep_checkpoints >= 1, "--keep-checkpoints must be >= 1")
        need(self.profile_steps >= 0, f"--profile-steps must be >= 0 (0 = off), got {self.profile_steps}")
        need(self.profile_warmup >= 0, f"--profile-warmup must be >= 0, got {self.profile_warmup}")
        need(self.threads >= 0, "--threads must be >= 0 (0 = torch's default)")
        need(self.loss in ("kl", "ce"), f"--loss must be kl or ce, got {self.loss!r}")
        need(self.dist in ("ddp", "fsdp"), f"--dist must be ddp or fsdp, got {self.dist!r}")
        need(self.early_stop_patience is None or self.early_stop_patience >= 1, "--early-stop-patience must be >= 1")
        need(0 <= self.early_stop_min_delta < 1, "--early-stop-min-delta must be in [0, 1)")
        need(self.max_minutes is None or self.max_minutes > 0, "--max-minutes must be > 0")
        need(not self.time_schedule or self.max_minutes is not None, "--time-schedule needs --max-minutes")
        need(self.num_conversations is None or self.num_conversations >= 1, "--num-conversations must be >= 1")
        need(self.draft_vocab_size is None or self.draft_vocab_size >= 1, "--draft-vocab-size must be >= 1")
        need(self.epochs is None or self.epochs > 0, f"--epochs must be > 0, got {self.epochs}")
        try:
            check_report_to(self.report_to)
        except ValueError as e:
            raise TrainError(str(e)) from None
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise TrainError("--device cuda was asked for but torch sees no CUDA GPU (use --device cpu)")
        try:
            self.options().validate(self.num_depths)
        except ValueError as e:  # PEagleOptions names its fields; a user knows the flags
            head, _, rest = str(e).partition(" ")
            flag = {"loss_kind": "--loss"}.get(head, _flag(head))
            raise TrainError(f"{flag} {rest}") from None
        return self

    def options(self) -> PEagleOptions:
        return PEagleOptions(
            down_sample_ratio=self.down_sample_ratio,
            down_sample_ratio_min=self.down_sample_ratio_min,
            max_anchors=self.max_anchors,
            attention=self.attention,
            window=self.window,
            sink=self.sink,
            loss_kind=self.loss,
            train_lm_head=self.train_lm_head,
            train_embeddings=self.resolved_train_embeddings(),
        )

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
RESUME_FIXED = (
    "verifier",
    "verifier_revision",
    "data",
    "data_split",
    "chat_template_kwargs",
    "num_conversations",
    "val_fraction",
    "dedup",
    "seq_len",
    "num_layers",
    "num_depths",
    "layer_type",
    "draft_vocab_size",
    "mask_token_id",
    "aux_layer_ids",
    "batch_size",
    "seed",
    "attention",
    "train_lm_head",
    "train_embeddings",
    "norm_before_residual",
)

# what a checkpoint written before one of RESUME_FIXED existed ran with
RESUME_ABSENT = {"dedup": False}

# the type of every setting, read from the annotations: "int", "float | None", ...
_TYPES = {f.name: f.type for f in dataclasses.fields(TrainSettings)}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_setting_type(name: str, value, where: str = ""):
    """`value` as setting `name` needs it, or a TrainError naming the flag (and `where`: the
    config file it came from). No coercion that changes meaning: a bool is not an int, a string
    is not a number ("3e-3" in YAML is a string), 3.9 is not an int; an int is a float."""
    kinds = [k.strip() for k in _TYPES[name].split("|")]
    if value is None and "None" in kinds:
        return None
    for k in kinds:
        if k == "bool" and isinstance(value, bool):
            return value
        if k == "int" and isinstance(value, int) and not isinstance(value, bool):
            return value
        if k == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
            if math.isnan(value):  # NaN passes every `<` / `>` range check
                raise TrainError(f"{where}{_flag(name)} must be a number, got NaN")
            return float(value)
        if k == "str" and isinstance(value, str):
            return value
        if k == "dict" and isinstance(value, dict):
            return value
        if k == "list[str]" and isinstance(value, list) and value and all(isinstance(x, str) for x in value):
            return value
        if k == "list[int]" and isinstance(value, list):
            if all(isinstance(x, int) and not isinstance(x, bool) for x in value):
                return value
    want = " or ".join(
        {"None": "none", "list[str]": "a list of strings", "list[int]": "a list of ints"}.get(
            k, f"an {k}" if k == "int" else f"a {k}"
        )
        for k in kinds
    )
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    hint = ""
    if isinstance(value, str) and "float" in kinds:
        hint = " (a quoted number is a string; YAML also reads 3e-3 without a dot as one: write 3.0e-3)"
    raise TrainError(f"{where}{_flag(name)} must be {want}, got {shown} ({type(value).__name__}){hint}")


def load_config_file(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise TrainError(f"--config file {path} does not exist")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise TrainError(f"--config file {path} is not UTF-8 text (a binary file?)") from None
    except OSError as e:
        raise TrainError(f"--config file {path} cannot be read: {e.strerror or e}") from None
    try:
        if p.suffix.lower() in (".yaml", ".yml"):
            import yaml

            d = yaml.safe_load(text) or {}
        else:
            d = json.loads(text)
    except RecursionError:
        raise TrainError(f"--config file {path} is nested too deeply") from None
    except Exception as e:
        raise TrainError(
            f"--config file {path} is not valid {'YAML' if p.suffix.lower() in ('.yaml', '.yml') else 'JSON'}: {e}"
        ) from None
    if not isinstance(d, dict):
        raise TrainError(f"--config file {path} must hold a mapping of option: value")
    out = {}
    names = set(TrainSettings.field_names())
    for k, v in d.items():
        key = str(k).replace("-", "_")
        if key not in names:
            raise TrainError(f"--config file {path}: unknown option {k!r} (known: {', '.join(sorted(names))})")
        out[key] = check_setting_type(key, v, f"--config file {path}: ")
    return out


def settings_from(cli: dict, config_file: str | None = None) -> TrainSettings:
    merged = {}
    if config_file:
        merged.update(load_config_file(config_file))
    merged.update(cli)
    s = TrainSettings(**merged)
    return s.validate()
