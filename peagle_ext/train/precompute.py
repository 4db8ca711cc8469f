"""`peagle hidden-states`: the verifier hidden states of a data set, computed once into the
on-disk cache that `peagle train --hidden-cache-dir` reads, for verifiers bigger than one GPU.

- One process: the verifier on --device, or spread over the GPUs it needs with
  --device-map auto (accelerate; --max-memory caps each device).
- torchrun: data-parallel, one replica per rank on cuda:LOCAL_RANK (or the CPU); every rank
  writes its own shards (i % world == rank) of the one cache, and rank 0 waits for the others
  with a no-progress timeout. No process group is needed: the cache's index is the only shared
  state (an flock serialises its updates).
- Resumable (shards already there are skipped, whatever the rank count was), sha256-checked,
  bf16 storage by default, fp8 with a scale per position on request.

The packed rows and the cache's settings are those `peagle train` builds from the same data
flags, so a later `peagle train --hidden-cache-dir CACHE` with those flags finds every row and
loads only the verifier's final norm, lm_head and embeddings.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import torch

from .. import data as D
from .build import ROWS_PER_SHARD, cache_is_complete, open_hidden_caches
from .dataset import prepare_data
from .run_log import say
from .settings import TrainError, TrainSettings

STORAGE = {"bfloat16": torch.bfloat16, "float32": torch.float32, "fp8": None}


class _Echo:
    """The RunLog calls prepare_data makes, said on stderr by rank 0."""

    def __init__(self, loud: bool):
        self.loud = loud

    def event(self, name, msg, **kw):
        if self.loud:
            say(msg)


def _kill_hook(rank: int):
    """Test hook: PEAGLE_TEST_KILL_AFTER="<rank>:<n>" SIGKILLs that rank after its n-th shard."""
    spec = os.environ.get("PEAGLE_TEST_KILL_AFTER")
    if not spec:
        return None
    want_rank, n = (int(x) for x in spec.split(":"))
    if want_rank != rank:
        return None
    done = []

    def hook(i):
        done.append(i)
        if len(done) >= n:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def precompute_hidden_states(
    s: TrainSettings,
    output: str,
    *,
    storage: str = "bfloat16",
    verifier_dtype: str = "auto",
    device_map=None,
    max_memory: dict | None = None,
    timeout_s: float = 1800.0,
) -> dict:
    """Fill the cache at `output` for the data of `s` (see the module docstring). Returns a
    summary: rows and shards per split, seconds, tokens/s of this process."""
    if storage not in STORAGE:
        raise TrainError(f"--dtype must be one of {', '.join(STORAGE)}, got {storage!r}")
    if verifier_dtype not in ("auto", "float32", "bfloat16"):
        raise TrainError(f"--verifier-dtype must be auto, float32 or bfloat16, got {verifier_dtype!r}")
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and device_map is not None:
        raise TrainError("--device-map places one verifier over several GPUs: run it in one process, not torchrun")
    s = dataclasses.replace(s, hidden_cache_dir=str(output), progress=s.progress and (rank == 0 or world > 1))
    log = _Echo(rank == 0)
    t0 = time.time()
    tokenizer = D.load_tokenizer(s.verifier, revision=s.verifier_revision)
    config = D.load_config(s.verifier, revision=s.verifier_revision)
    vcfg = getattr(config, "text_config", None) or config
    aux = list(s.aux_layer_ids) if s.aux_layer_ids else D.default_aux_layer_ids(int(vcfg.num_hidden_layers))
    ds = prepare_data(s, tokenizer, int(vcfg.vocab_size), log)
    parts = [(c, rows) for c, rows in zip(open_hidden_caches(s, aux), (ds.train_rows, ds.val_rows)) if rows]
    summary = {"output": str(output), "rows": {c.dir.name: len(r) for c, r in parts}, "world_size": world}
    if all(cache_is_complete(c, r) for c, r in parts):
        log.event("hidden", f"{output} already holds every row's hidden states; nothing to do")
        return {**summary, "seconds": 0.0, "computed_tokens": 0}
    if device_map is not None:
        device = None
    elif s.device.startswith("cuda"):
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if world > 1 else torch.device(s.device)
    else:
        device = torch.device("cpu")
    on_gpu = device_map is not None or (device is not None and device.type == "cuda")
    vdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        verifier_dtype, torch.bfloat16 if on_gpu else torch.float32
    )
    verifier, _ = D.load_verifier(
        s.verifier,
        device=device or "cpu",
        dtype=vdtype,
        revision=s.verifier_revision,
        device_map=device_map,
        max_memory=max_memory,
    )
    placed = getattr(verifier, "hf_device_map", None)
    log.event(
        "verifier",
        f"verifier {s.verifier}: {vcfg.num_hidden_layers} layers, aux layers {aux}, {vdtype}, "
        + (f"placed by device_map over {sorted(set(map(str, placed.values())))}" if placed else f"on {device}")
        + (f"; rank {rank} of {world} writes shards i % {world} == rank" if world > 1 else ""),
    )
    hook = _kill_hook(rank)
    t1 = time.time()
    computed = 0
    for cache, rows in parts:
        before = set(cache.index["shards"])
        cache.generate(
            verifier,
            rows,
            aux,
            rows_per_shard=ROWS_PER_SHARD,
            dtype=STORAGE[storage],
            fp8=storage == "fp8",
            progress=s.progress,
            rank=rank,
            world=world,
            after_shard=hook,
        )
        new = [int(k) for k in set(cache.index["shards"]) - before if int(k) % world == rank]
        computed += sum(
            int((r.document_ids >= 0).sum()) for k in new for r in rows[k * ROWS_PER_SHARD : (k + 1) * ROWS_PER_SHARD]
        )
    dt = time.time() - t1
    if rank == 0:
        for cache, rows in parts:
            cache.wait_complete(-(-len(rows) // ROWS_PER_SHARD), timeout_s=timeout_s, world=world)
    summary.update(seconds=time.time() - t0, computed_tokens=computed, tokens_per_s=computed / max(dt, 1e-9))
    return summary
