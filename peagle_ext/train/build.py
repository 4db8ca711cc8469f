"""What a run builds before its first step: the verifier and the data, the drafter attached to
the verifier's head, and the source of the verifier hidden states."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import data as D
from ..model import PEagleDraftModel, build_vocab_mapping, resolve_mask_token_id
from .dataset import Dataset, prepare_data
from .hidden import HiddenStates
from .run_log import RunLog
from .settings import TrainError, TrainSettings


@dataclass
class RunInputs:
    """The verifier (model or None, tokenizer, its text config, its head parts), the aux layer
    ids, the data, the MASK id and the on-disk hidden-state caches (train, val) if any."""

    verifier: object
    tokenizer: object
    verifier_config: object
    aux_layer_ids: list[int]
    dataset: Dataset
    mask_token_id: int
    train_tokens: int
    head: D.VerifierHead | None = None
    disks: tuple = (None, None)


ROWS_PER_SHARD = HiddenStates.ROWS_PER_SHARD


def cache_meta(s: TrainSettings, aux_ids: list[int]) -> dict:
    """What the cached hidden states depend on (besides the packed rows, fingerprinted by the
    cache itself); `peagle hidden-states` and `peagle train` build the same one."""
    return {
        "verifier": s.verifier,
        "verifier_revision": s.verifier_revision,
        "aux_layer_ids": list(aux_ids),
        "seq_len": s.seq_len,
        "data": s.data,
        "data_split": s.data_split,
        "chat_template_kwargs": s.chat_template_kwargs,
        "num_conversations": s.num_conversations,
        "val_fraction": s.val_fraction,
        "dedup": s.dedup,
        "seed": s.seed,
    }


def open_hidden_caches(s: TrainSettings, aux_ids: list[int]) -> tuple:
    """(train, val) HiddenStateCache under --hidden-cache-dir (DataError on other settings)."""
    meta = cache_meta(s, aux_ids)
    return tuple(
        D.HiddenStateCache(Path(s.hidden_cache_dir) / split, meta={**meta, "split": split})
        for split in ("train", "val")
    )


def cache_is_complete(cache, rows) -> bool:
    """Whether `cache` holds every shard of exactly these packed rows."""
    if not rows:
        return True
    layout = cache.index.get("layout") or {}
    if layout.get("data_sha256") != D.packed_fingerprint(rows) or layout.get("rows_per_shard") != ROWS_PER_SHARD:
        return False
    return not cache.missing_shards(-(-len(rows) // ROWS_PER_SHARD))


def load_inputs(s: TrainSettings, device: torch.device, amp, log: RunLog) -> RunInputs:
    """Tokenizer, config and data first; then the verifier, or, when --hidden-cache-dir already
    holds every row's hidden states, only its final norm, lm_head and embeddings (read from its
    safetensors by name), so a verifier of any size trains on any number of ranks."""
    t0 = time.time()
    tokenizer = D.load_tokenizer(s.verifier, revision=s.verifier_revision)
    config = D.load_config(s.verifier, revision=s.verifier_revision)
    vcfg = getattr(config, "text_config", None) or config
    vocab = int(vcfg.vocab_size)
    aux_ids = list(s.aux_layer_ids) if s.aux_layer_ids else D.default_aux_layer_ids(int(vcfg.num_hidden_layers))
    ds = prepare_data(s, tokenizer, vocab, log)
    t_data = time.time()
    mask_id, how = resolve_mask_token_id(tokenizer, vocab, s.mask_token_id)
    for rows, where in ((ds.train_rows, "the training data"), (ds.val_rows, "the validation data")):
        for r in rows:
            if bool((r.input_ids[r.document_ids >= 0] == mask_id).any()):
                raise TrainError(
                    f"mask_token_id {mask_id} ({how}) occurs as a real token in {where}; "
                    "pick an id the data never uses (--mask-token-id)"
                )
    disks = open_hidden_caches(s, aux_ids) if s.hidden_cache_dir else (None, None)
    cached = s.hidden_cache_dir and all(
        cache_is_complete(c, rows) for c, rows in zip(disks, (ds.train_rows, ds.val_rows))
    )
    if cached:
        verifier = None
        head = D.load_verifier_head(s.verifier, revision=s.verifier_revision)
        loaded = f"hidden states from {s.hidden_cache_dir}: only its final norm, lm_head and embeddings loaded"
    else:
        vdtype = amp if amp is not None else torch.float32
        verifier, _ = D.load_verifier(s.verifier, device=device, dtype=vdtype, revision=s.verifier_revision)
        head = D.verifier_head_from_model(verifier)
        loaded = "loaded"
    log.event(
        "verifier",
        f"verifier {s.verifier}: {vcfg.model_type}, {vcfg.num_hidden_layers} layers, hidden "
        f"{vcfg.hidden_size}, vocab {vocab}, aux layers {aux_ids}; {loaded} ({time.time() - t_data:.1f}s, after "
        f"{t_data - t0:.1f}s of tokenizer and data preparation)",
    )
    ntok = sum(int((r.document_ids >= 0).sum()) for r in ds.train_rows)
    log.event(
        "data",
        f"data {s.data}: {ds.num_train_conversations} train / {ds.num_val_conversations} val conversations "
        f"-> {len(ds.train_rows)} train / {len(ds.val_rows)} val rows of {s.seq_len} tokens "
        f"({ntok} train tokens, {int(ds.token_counts.sum())} assistant tokens); mask token {mask_id} ({how})",
        train_rows=len(ds.train_rows),
        val_rows=len(ds.val_rows),
        train_tokens=ntok,
    )
    return RunInputs(verifier, tokenizer, vcfg, aux_ids, ds, mask_id, ntok, head, disks)


def build_model(s: TrainSettings, inp: RunInputs, device: torch.device, log: RunLog) -> PEagleDraftModel:
    """The drafter for the verifier: draft vocab from the data's token counts, verifier head and
    embeddings attached (on the CPU; the caller moves it)."""
    vcfg, ds = inp.verifier_config, inp.dataset
    vocab = int(vcfg.vocab_size)
    d2t = None
    dv = s.draft_vocab_size
    if dv is not None and dv >= vocab:
        dv = None
    if dv is not None:
        d2t, t2d = build_vocab_mapping(ds.token_counts, dv)
        cover = float(ds.token_counts[t2d].sum()) / max(1.0, float(ds.token_counts.sum()))
        log.event(
            "vocab",
            f"draft vocab: the {dv} most frequent assistant tokens (cover {100 * cover:.1f}% of them)",
            coverage=cover,
        )
    model = PEagleDraftModel.from_verifier(
        vcfg,
        num_layers=s.num_layers,
        num_depths=s.num_depths,
        mask_token_id=inp.mask_token_id,
        draft_vocab_size=dv,
        aux_layer_ids=inp.aux_layer_ids,
        layer_type=s.layer_type,
        d2t=d2t,
        verifier_name_or_path=D.verifier_name(s.verifier),
        options=s.options(),
        norm_before_residual=s.norm_before_residual,
    )
    model.config.speculators_config["verifier"]["architectures"] = list(inp.head.architectures)
    if s.verifier_revision:  # the export then names the exact weights the drafter was trained on
        model.config.speculators_config["verifier"]["revision"] = s.verifier_revision
    if int(vcfg.hidden_size) != model.config.hidden_size:
        raise TrainError(
            f"verifier/draft hidden size mismatch: verifier {vcfg.hidden_size}, draft {model.config.hidden_size}"
        )
    head_dim = model.layers[0].self_attn.head_dim
    if device.type == "cuda" and head_dim not in (64, 128):
        # say it before the verifier pass, not from inside the first forward
        raise TrainError(
            f"the drafter's attention head dim is {head_dim} (from the verifier config); the CUDA "
            f"COD attention kernels support 64 and 128: train on --device cpu, or use a verifier "
            f"with head dim 64/128"
        )
    model.attach_verifier(
        norm_weight=inp.head.norm_weight,
        lm_head_weight=inp.head.lm_head_weight,
        norm_eps=inp.head.norm_eps,
        embed_weight=inp.head.embed_weight,
    )
    return model


def build_hidden_states(
    s: TrainSettings,
    inp: RunInputs,
    device: torch.device,
    amp,
    ctx,
    log: RunLog,
    *,
    order: list[int],
    step: int,
    cursor: int,
) -> tuple[HiddenStates, HiddenStates]:
    """(train, val) hidden-state sources: in memory when they fit --hidden-cache-gb (on CPU computed on
    a background thread in the order training reads them), on disk with --hidden-cache-dir, else
    as many rows in memory as fit (validation's first: it reads them every --val-every steps) and
    the rest recomputed per step. Drops the verifier when every row is cached. Under torchrun
    every rank fills its own slice of the on-disk cache (train/distributed.py) and a cache that
    does not fit keeps no rows."""
    vcfg, ds, aux_ids = inp.verifier_config, inp.dataset, inp.aux_layer_ids
    feat = (len(aux_ids) + 1) * int(vcfg.hidden_size)
    store_dtype = torch.bfloat16 if amp is not None else torch.float32
    fp8 = s.hidden_cache_dtype == "fp8"
    if fp8 and ctx.world > 1:
        raise TrainError(
            "--hidden-cache-dtype fp8 keeps states in one process's memory; under torchrun the ranks share "
            "an on-disk cache: peagle hidden-states --dtype fp8, then --hidden-cache-dir"
        )
    # a position's bytes: fp8 stores one byte a feature plus a float32 scale for each of the two tensors
    per_row = s.seq_len * (feat + 8 if fp8 else feat * (2 if store_dtype == torch.bfloat16 else 4))
    n_rows = len(ds.train_rows) + len(ds.val_rows)
    cache = per_row * n_rows <= s.hidden_cache_gb * 2**30
    fit = 0 if cache or ctx.world > 1 or s.hidden_cache_dir else min(int(s.hidden_cache_gb * 2**30 // per_row), n_rows)
    val_kept = min(fit, len(ds.val_rows))
    train_kept = fit - val_kept
    train_h, val_h = (
        HiddenStates(
            inp.verifier,
            aux_ids,
            rows,
            cache=kept if fit else cache,
            store_dtype=store_dtype,
            device=device,
            disk=disk,
            fp8=fp8,
        )
        for rows, kept, disk in zip((ds.train_rows, ds.val_rows), (train_kept, val_kept), inp.disks)
    )
    t0 = time.time()
    background = cache and not s.hidden_cache_dir and device.type == "cpu" and s.background_hidden and ctx.world == 1
    if ctx.world > 1:  # each rank: only the rows it trains on (train/distributed.py)
        log.event("hidden", ctx.prepare_hidden_states((train_h, val_h), s.progress, s.hidden_timeout_s))
    elif background:
        # rows in the order this epoch consumes them; training starts as soon as the first is ready
        first_val = (s.val_every - step % s.val_every) * s.batch_size * s.grad_accum
        train_h.start_background(order[cursor:] + order[:cursor], then=val_h, then_after=first_val)
        log.event(
            "hidden",
            f"verifier hidden states for {n_rows} rows: computed on a "
            f"background thread while training runs (kept in memory{' as fp8' if fp8 else ''})",
        )
    elif cache or device.type == "cuda":
        train_h.warm("verifier hidden states (train)", s.progress)
        val_h.warm("verifier hidden states (val)", s.progress)
    # else (on CPU, not every row kept): a kept row is cached when a step first reads it, so a run
    # of less than one pass computes no row it does not train on
    if cache and not background and ctx.world == 1:
        ntok_all = inp.train_tokens + sum(int((r.document_ids >= 0).sum()) for r in ds.val_rows)
        dt_h = time.time() - t0
        split = {k: train_h.warm_seconds[k] + val_h.warm_seconds[k] for k in train_h.warm_seconds}
        parts = (
            f": verifier passes {split['verifier']:.1f}s, shift and copies to host memory {split['to_host']:.1f}s"
            if split["verifier"] > 0
            else ""
        )
        log.event(
            "hidden",
            f"verifier hidden states for {n_rows} rows cached in memory{' as fp8' if fp8 else ''} "
            f"({dt_h:.1f}s, {ntok_all / max(dt_h, 1e-9):.0f} tokens/s{parts})",
            seconds=dt_h,
            verifier_s=round(split["verifier"], 3),
            to_host_s=round(split["to_host"], 3),
        )
    if (cache and not background and ctx.world == 1) or s.hidden_cache_dir:
        # every row is cached: the verifier itself is no longer needed
        train_h.verifier = val_h.verifier = None
        inp.verifier = None
    elif fit:
        kept_dt = time.time() - t0
        log.event(
            "hidden",
            f"verifier hidden states of {n_rows} rows need {per_row * n_rows / 2**30:.3g} GiB, more than "
            f"--hidden-cache-gb {s.hidden_cache_gb:g}: {fit} rows ({val_kept} of them validation's) are kept "
            + (f"in memory ({kept_dt:.1f}s)" if device.type == "cuda" else "in memory from their first use")
            + f", the other {n_rows - fit} recomputed at each use with a verifier pass; a larger "
            "--hidden-cache-gb or --hidden-cache-dir caches them all"
            + ("" if fp8 else ", and --hidden-cache-dtype fp8 keeps more of them"),
            need_bytes=per_row * n_rows,
            kept_rows=fit,
            seconds=round(kept_dt, 3),
        )
    elif not cache:
        log.event(
            "hidden",
            f"verifier hidden states of {n_rows} rows need {per_row * n_rows / 2**30:.3g} GiB, more than "
            f"--hidden-cache-gb {s.hidden_cache_gb:g}: every step recomputes its rows' states with a verifier "
            "pass (on a GPU several times a cached step's time); a larger --hidden-cache-gb or "
            "--hidden-cache-dir caches them" + ("" if fp8 else ", and --hidden-cache-dtype fp8 keeps more of them"),
            need_bytes=per_row * n_rows,
        )
    return train_h, val_h
