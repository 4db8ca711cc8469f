"""`peagle train`: train a P-EAGLE drafter; every flag also reads from --config."""

from __future__ import annotations

import argparse
import os

HELP = "train a P-EAGLE drafter"


def _opt_int(v: str):
    return None if v.lower() in ("none", "null", "") else int(v)


def _int_list(v: str) -> list[int]:
    return [int(x) for x in v.split(",")]


def _opt_float(v: str):
    return None if v.lower() in ("none", "") else float(v)


# argparse names a type function in its error ("invalid int value: 'x'")
_opt_int.__name__ = "int (or none)"
_int_list.__name__ = "comma-separated int list"
_opt_float.__name__ = "float (or none)"


def _json_object(v: str) -> dict:
    import json

    try:
        d = json.loads(v)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(d, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(d).__name__}")
    return d


def _bool(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {v!r}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..train import TrainSettings

    d = TrainSettings()
    # flags default to "absent" (argparse.SUPPRESS) so --config values are only overridden when given
    g = p.add_argument_group("what to train on")
    g.add_argument(
        "--verifier",
        help="hub id (org/name, from the local HF cache, downloaded when missing unless offline), local HF "
        f"causal-LM directory, .gguf file or 'smollm2' (bundled SmolLM2-135M-Instruct). Default {d.verifier}",
    )
    g.add_argument("--verifier-revision", help="branch, tag or commit of a hub verifier")
    g.add_argument(
        "--data",
        action="append",
        help="JSON / JSONL(.gz/.xz) / Parquet file, datasets.save_to_disk directory, hub dataset id or "
        f"'sharegpt'; give it several times to mix sources. Default {d.data}",
    )
    g.add_argument("--data-split", help="split of a dataset directory or hub dataset (default train)")
    g.add_argument(
        "--chat-template-kwargs",
        type=_json_object,
        help="JSON object of chat-template options, e.g. '{\"enable_thinking\": false}'",
    )
    g.add_argument("--output", help=f"output directory. Default {d.output}")
    g.add_argument(
        "--num-conversations",
        type=_opt_int,
        help=f"use the first N conversations (none = all). Default {d.num_conversations}",
    )
    g.add_argument("--val-fraction", type=float, help=f"held-out fraction of conversations. Default {d.val_fraction}")
    g.add_argument(
        "--dedup",
        type=_bool,
        help="drop exact duplicate conversations and keep the validation split's prompts out of training "
        f"(false: a plain random split of every conversation). Default {str(d.dedup).lower()}",
    )
    g.add_argument(
        "--seq-len", type=int, help=f"packed row length; longer conversations are truncated. Default {d.seq_len}"
    )
    g = p.add_argument_group("the drafter")
    g.add_argument("--num-layers", type=int, help=f"decoder layers. Default {d.num_layers}")
    g.add_argument("--num-depths", type=int, help=f"K, tokens drafted in parallel. Default {d.num_depths}")
    g.add_argument("--layer-type", choices=["llama", "qwen3"], help="default: the verifier's, else llama")
    g.add_argument(
        "--draft-vocab-size",
        type=_opt_int,
        help=f"most frequent tokens kept (none = full vocab). Default {d.draft_vocab_size}",
    )
    g.add_argument("--mask-token-id", type=_opt_int, help="default: tokenizer's mask token, else a new id")
    g.add_argument("--aux-layer-ids", type=_int_list, help="e.g. 2,15,27 (default 2,L//2,L-3)")
    g.add_argument("--norm-before-residual", type=_bool)
    g.add_argument(
        "--train-embeddings",
        choices=["all", "mask", "none", "auto"],
        help="all (P-EAGLE), only the MASK row (much cheaper on CPU), none; auto = all on GPU, mask on CPU (default)",
    )
    g.add_argument(
        "--train-lm-head", type=_bool, help=f"also train the (verifier-initialised) lm_head. Default {d.train_lm_head}"
    )
    g = p.add_argument_group("COD sampling and attention")
    g.add_argument("--down-sample-ratio", type=float, help=f"r. Default {d.down_sample_ratio}")
    g.add_argument("--down-sample-ratio-min", type=float, help=f"r_min. Default {d.down_sample_ratio_min}")
    g.add_argument("--max-anchors", type=_opt_int, help="cap on COD seeds per row (none = all)")
    g.add_argument("--attention", choices=["symmetric", "cross"], help=f"Default {d.attention}")
    g.add_argument("--window", type=_opt_int, help="sliding window (none = full)")
    g.add_argument("--sink", type=int, help="attention-sink tokens kept at each document start")
    g.add_argument("--seq-partition", type=int, help="segments per row (exact gradients, less memory). Default 1")
    g.add_argument("--loss", choices=["kl", "ce"], help=f"Default {d.loss}")
    g = p.add_argument_group("optimisation")
    g.add_argument("--max-steps", type=int, help=f"Default {d.max_steps}")
    g.add_argument("--epochs", type=float, help="passes over the training rows (sets --max-steps)")
    g.add_argument("--init-from", help="warm start from a drafter checkpoint or export directory (a fresh optimizer)")
    g.add_argument("--batch-size", type=int, help=f"packed rows per micro-batch. Default {d.batch_size}")
    g.add_argument("--grad-accum", type=int, help=f"micro-batches per step. Default {d.grad_accum}")
    g.add_argument("--lr", type=float, help=f"peak learning rate. Default {d.lr}")
    g.add_argument("--min-lr-ratio", type=float, help=f"final lr / peak. Default {d.min_lr_ratio}")
    g.add_argument("--warmup-steps", type=int, help=f"Default {d.warmup_steps}")
    g.add_argument("--schedule", choices=["cosine", "linear", "constant"], help=f"Default {d.schedule}")
    g.add_argument("--weight-decay", type=float, help=f"AdamW's. Default {d.weight_decay}")
    g.add_argument(
        "--optimizer",
        choices=["adamw", "muon"],
        help="muon: Muon on the layers' matrices (its update scaled to AdamW's RMS, so "
        f"--lr serves both), AdamW on the rest; not under --dist fsdp. Default {d.optimizer}",
    )
    g.add_argument("--muon-weight-decay", type=float, help=f"Muon's. Default {d.muon_weight_decay}")
    g.add_argument("--grad-clip", type=float, help=f"max grad norm (0 = off). Default {d.grad_clip}")
    g.add_argument(
        "--early-stop-patience",
        type=_opt_int,
        help="stop (saving final/) after this many validation evaluations without improvement (none = off)",
    )
    g.add_argument(
        "--early-stop-min-delta",
        type=float,
        help=f"relative validation-loss improvement that counts. Default {d.early_stop_min_delta}",
    )
    g.add_argument(
        "--max-minutes",
        type=_opt_float,
        help="wall-clock budget: stop there, saving final/ (none = off)",
    )
    g.add_argument(
        "--time-schedule",
        type=_bool,
        help="the schedule's progress is the larger of the steps' share and the share of --max-minutes' "
        "training time (from the first step) spent, so a run the clock stops ends with its learning rate "
        "decayed. Default false",
    )
    g = p.add_argument_group("run")
    g.add_argument("--device", help=f"cpu | cuda. Default {d.device}")
    g.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        help="autocast dtype; auto = bf16 on GPU and on CPUs with native bf16, else fp32",
    )
    g.add_argument(
        "--threads",
        type=int,
        help="CPU threads (0 = torch's default). Default 1: on a shared 2-core "
        "machine 2 OpenMP threads run several times slower",
    )
    g.add_argument("--seed", type=int, help=f"Default {d.seed}")
    g.add_argument("--checkpoint-every", type=int, help=f"Default {d.checkpoint_every}")
    g.add_argument("--keep-checkpoints", type=int, help=f"Default {d.keep_checkpoints}")
    g.add_argument(
        "--val-every",
        "--eval-every",
        dest="val_every",
        type=int,
        help=f"validation every N steps. Default {d.val_every}",
    )
    g.add_argument("--log-every", type=int, help=f"Default {d.log_every}")
    g.add_argument(
        "--hidden-cache-gb",
        type=float,
        help=f"keep verifier hidden states in memory up to this (GiB): every row's when they fit, else as many "
        f"rows as fit (validation's first), the others recomputed at each use with one batched verifier pass "
        f"for the step's rows. Default {d.hidden_cache_gb}",
    )
    g.add_argument(
        "--hidden-cache-dtype",
        choices=("auto", "fp8"),
        help="how the states kept in memory are stored: auto = the training's dtype (bf16 under autocast); "
        "fp8 = float8 e4m3 with a scale per position, half the memory of bf16, so twice the rows fit "
        "(the drafter then trains on states rounded to fp8). Default auto",
    )
    g.add_argument(
        "--hidden-cache-dir",
        help="store verifier hidden states here (resumable; reused by later runs on the same data and settings)",
    )
    g.add_argument(
        "--background-hidden",
        type=_bool,
        help="CPU: compute verifier hidden states on a second thread while training runs (default true)",
    )
    g.add_argument(
        "--prefetch",
        type=_bool,
        help="with every row's hidden states cached: concatenate the next step's rows and copy them to the "
        "device (pinned memory, a side stream) while this step runs. Same numbers either way (default true)",
    )
    g.add_argument(
        "--hidden-timeout-s",
        type=float,
        help="under torchrun: fail when no rank added a shard to --hidden-cache-dir for this long. "
        f"Default {d.hidden_timeout_s:.0f}",
    )
    g.add_argument(
        "--report-to",
        action="append",
        help="none | tensorboard | wandb (repeat or comma-separate for several; wandb runs offline unless "
        "WANDB_MODE=online). Default none",
    )
    g.add_argument("--no-progress", dest="progress", action="store_const", const=False, help="no tqdm bars")
    g.add_argument(
        "--profile-steps",
        type=int,
        help="torch.profiler over N steps after --profile-warmup: DIR/profile/summary.json (wall, host phases, "
        "device time by kernel class) and trace.json.gz. Default 0 (off)",
    )
    g.add_argument("--profile-warmup", type=int, help=f"steps before the profiled ones. Default {d.profile_warmup}")
    g.add_argument(
        "--dist",
        choices=["ddp", "fsdp"],
        help="under torchrun (WORLD_SIZE > 1): DDP (default) or FSDP2 "
        "(fully_shard per decoder layer + root, bf16 params / fp32 reduce on GPU)",
    )
    g.add_argument("--config", help="YAML/JSON file of option: value (flags given here win)")
    g.add_argument(
        "--resume", action="store_const", const=True, help="continue from the newest complete checkpoint in --output"
    )
    g.add_argument(
        "--accept-changed-inputs",
        action="store_const",
        const=True,
        help="--resume even though a data file or the verifier changed since the checkpoint (logged)",
    )


def run(args: argparse.Namespace) -> int:
    from ..train import TrainSettings, settings_from, train

    cli = {k: getattr(args, k) for k in TrainSettings.field_names() if hasattr(args, k)}
    if isinstance(cli.get("data"), list) and len(cli["data"]) == 1:
        cli["data"] = cli["data"][0]  # one --data: the plain string, as a config file writes it
    s = settings_from(cli, getattr(args, "config", None))
    r = train(s)
    if int(os.environ.get("RANK", "0")) != 0:  # torchrun: rank 0 reports
        return 0
    out = r.output
    summ = r.val or r.train
    which = "validation" if r.val else "training (all steps)"
    print()
    print(
        f"P-EAGLE drafter trained: {r.steps} steps in {r.wall_s / 60:.1f} min"
        + (f" ({r.skipped_steps} non-finite steps skipped)" if r.skipped_steps else "")
        + (f"; stopped before --max-steps: {r.stop_reason}" if r.stop_reason else "")
    )
    if r.time_split:
        t = r.time_split
        print(
            f"  time: {t['to_first_step']:.1f} s to the first step (data, verifier, states, model), "
            f"{t['steps']:.1f} s of steps, {t['validation']:.1f} s of validation, "
            f"{t['checkpoints']:.1f} s of checkpoints, {t.get('final_save', 0.0):.1f} s for the final save"
        )
    print(f"per-depth accuracy ({which}, argmax agreement with the verifier inside the draft vocab):")
    print("  " + "  ".join(f"d{i}={a:.3f}" for i, a in enumerate(summ["acc"])))
    print(f"  full accuracy {summ['full_acc']:.3f}, loss {summ['loss']:.4f}")
    print(
        f"  estimated acceptance length {summ['accept_len']:.2f} tokens per verifier round "
        "(1 bonus token + sum_k prod_(j<=k) acc_j accepted drafts, as `peagle eval` counts them)"
    )
    print(f"checkpoint: {r.final_dir}  (vLLM/speculators format; `peagle export {r.final_dir} DST` for bf16)")
    for p in r.plots:
        print(f"plot: {p}")
    print(f"log: {out / 'log.jsonl'}")
    return 0
