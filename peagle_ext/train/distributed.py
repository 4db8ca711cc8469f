"""Distributed training on torchrun: DDP (default) or FSDP2, over PyTorch's own distributed stack.

    torchrun --nproc_per_node 8 -m peagle_ext.cli train --device cuda --dist ddp|fsdp ...

The training loop (train/loop.py) calls into one `DistContext`; with one process (plain `peagle train`, or
torchrun with a world of 1) every method is the single-process trainer's own code path, so a
1-process run is bitwise the non-distributed trainer.

What is global and what is per rank (N ranks, --batch-size B, --grad-accum G):
- A step consumes N*G*B packed rows from the epoch order (the same order for every N). They form
  N*G micro-batches ("units") of B consecutive rows; unit g is sampled (COD) with seed
  (seed, step, g). So the unit contents and layouts do not depend on N, and N ranks with
  --grad-accum G compute exactly the units of 1 rank with --grad-accum N*G.
- Units go to ranks by longest-processing-time bin packing on their real-token counts, G units
  per rank (deterministic: ties by unit index, then by rank), so ranks do equal work.
- The loss each rank backprops is its units' weighted-loss SUM divided by the GLOBAL loss-token
  count of the step (all-reduced before the forward), and the gradient reduction SUMS (a DDP comm
  hook; FSDP2 with divide factor 1): the summed gradient is the 1-rank gradient of the global mean.
- Reported metrics: every rank's per-unit (loss numerator, loss tokens, correct[K], total[K])
  are all-reduced (SUM) into a table and accumulated in unit order, the same additions in the
  same order as 1 rank, so N ranks report the same numbers as 1 rank on the same global batch.
  Validation rows are dealt round-robin to the ranks and their metrics reduced the same way.
- Gradient accumulation: DDP `no_sync()` on all micro-steps but the last; FSDP2
  `set_requires_gradient_sync(False)` likewise. Sequence partition (--seq-partition > 1) runs
  several backward passes per micro-step, which DDP's reducer cannot sync inside one forward: those
  micro-steps all accumulate locally (no_sync) and one zero-valued forward/backward through DDP
  (touching every trainable parameter) then triggers DDP's own bucketed all-reduce of the
  accumulated gradients. Under FSDP2 a partitioned micro-step runs inside one call of the root
  module with the root group kept gathered across its backward passes (each pass reduce-scatters,
  or with sync off accumulates, what it produced; FSDP2 sums them into the sharded gradients).
- Verifier hidden states: the verifier is replicated; each rank computes (and, when they fit,
  keeps) the hidden states of the rows it trains on. With --hidden-cache-dir, every rank fills
  its own slice of the one on-disk cache and waits (with a no-progress timeout) for the others,
  then every rank reads its rows; a cache that is already complete (`peagle hidden-states`)
  needs no verifier layers at all.
- Checkpoints: rank 0 writes the section-5 model and the trainer state; DDP's optimizer state is
  rank 0's `optimizer.state_dict()` (the single-process format); FSDP2's is saved sharded with
  torch.distributed.checkpoint (DCP) under checkpoint-<step>/optimizer/ and loads on any rank
  count (DCP reshards), also into DDP or a single process. Tmp dir + rename by rank 0 after a
  barrier, as the single-process trainer does.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn as nn

from . import checkpoint as C
from .settings import TrainError

DIST_MODES = ("ddp", "fsdp")
OPTIMIZER_DCP_DIR = "optimizer"


# ---------------------------------------------------------------------------------------------
# Balanced assignment
# ---------------------------------------------------------------------------------------------
def lpt_partition(costs, bins: int, per_bin: int | None = None) -> list[list[int]]:
    """Longest-processing-time bin packing: items in decreasing cost (ties: lower index first)
    each go to the least-loaded bin that still has room (ties: lower bin). per_bin caps the item
    count of every bin (None = no cap). Returns each bin's item indices, ascending. Deterministic."""
    costs = [int(c) for c in costs]
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    if per_bin is not None and per_bin * bins < len(costs):
        raise ValueError(f"{len(costs)} items do not fit {bins} bins of {per_bin}")
    load = [0] * bins
    members: list[list[int]] = [[] for _ in range(bins)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        b = min((b for b in range(bins) if per_bin is None or len(members[b]) < per_bin), key=lambda b: (load[b], b))
        members[b].append(i)
        load[b] += costs[i]
    return [sorted(m) for m in members]


# ---------------------------------------------------------------------------------------------
# The module DDP / FSDP2 wrap
# ---------------------------------------------------------------------------------------------
class LossSumStep(nn.Module):
    """forward(example, layout) -> (weighted loss SUM over the layout's loss tokens, metrics) of a
    PEagleDraftModel: the training forward as one module call, which is what DDP's reducer and
    FSDP2's root hooks need. forward(sync_only=True) -> a zero that depends on every trainable
    parameter (the synchronising DDP backward after locally accumulated micro-steps)."""

    def __init__(self, model: nn.Module, autocast_dtype: torch.dtype | None = None):
        super().__init__()
        self.model = model
        self.autocast_dtype = autocast_dtype

    def forward(self, example=None, layout=None, sync_only: bool = False, partitioned: dict | None = None):
        if partitioned is not None:
            # forward + all backward passes of a sequence-partitioned micro-step, inside this
            # module's call (FSDP2 keeps the root parameters gathered across them); the metrics
            return self.model.forward_backward(example, layout, autocast_dtype=self.autocast_dtype, **partitioned)
        if sync_only:
            zero = None
            for p in self.model.parameters():
                if p.requires_grad:
                    t = p.reshape(-1)[:1].sum()
                    zero = t if zero is None else zero + t
            return zero * 0.0
        dt = self.autocast_dtype
        dev = self.model.fc.weight.device
        amp = torch.autocast(dev.type, dtype=dt) if dt is not None else contextlib.nullcontext()
        with amp:
            return self.model.forward_sum(example, layout)


def _allreduce_sum_hook(process_group, bucket):
    """DDP comm hook: SUM the gradients (DDP's default averages); the loss is already divided by
    the global token count."""
    import torch.distributed as dist

    fut = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


# ---------------------------------------------------------------------------------------------
# The context
# ---------------------------------------------------------------------------------------------
class DistContext:
    """Rank, world and the wrapped model of one training process (see the module docstring)."""

    def __init__(
        self,
        mode: str = "ddp",
        *,
        world: int = 1,
        rank: int = 0,
        local_rank: int = 0,
        device: torch.device | None = None,
        owns_group: bool = False,
    ):
        if mode not in DIST_MODES:
            raise ValueError(f"--dist must be one of {DIST_MODES}, got {mode!r}")
        self.mode = mode
        self.world = int(world)
        self.rank = int(rank)
        self.local_rank = int(local_rank)
        self.device = device if device is not None else torch.device("cpu")
        self._owns_group = owns_group
        self.model = None
        self.step_module: LossSumStep | None = None
        self._ddp = None
        self._fsdp = False

    # -- setup ------------------------------------------------------------------------------
    @classmethod
    def from_env(cls, mode: str, device: str, *, timeout_s: float = 1800.0) -> DistContext:
        """One process (WORLD_SIZE unset or 1): a trivial context on `device`. Under torchrun
        (WORLD_SIZE > 1): init the default process group (NCCL on cuda, gloo on cpu) unless one is
        already up, and pin this process to cuda:LOCAL_RANK."""
        import torch.distributed as dist

        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1 and not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return cls(mode, device=torch.device(device))
        if not dist.is_available():
            raise RuntimeError("WORLD_SIZE > 1 but this torch has no torch.distributed")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        cuda = device.startswith("cuda")
        dev = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        owns = False
        if cuda:
            torch.cuda.set_device(dev)
        if not dist.is_initialized():
            backend = "nccl" if cuda else "gloo"
            kw = {"device_id": dev} if cuda else {}
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kw)
            owns = True
        return cls(
            mode, world=dist.get_world_size(), rank=dist.get_rank(), local_rank=local_rank, device=dev, owns_group=owns
        )

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_fsdp(self) -> bool:
        return self._fsdp

    def close(self):
        import torch.distributed as dist

        if self._owns_group and dist.is_initialized():
            # The DDP reducer holds a reference to the process group: freed after the group, it
            # would run the group's destructor itself, which joins gloo's worker threads while
            # holding the GIL. A worker still freeing the last collective's work needs the GIL
            # to drop its tensors, so that join can wait for good (seen on a loaded 2-core CPU).
            # Free the wrapper first, and give the workers a moment without the GIL to finish.
            self.unwrap()
            gc.collect()
            if dist.get_backend() == "gloo":
                time.sleep(0.2)
            dist.destroy_process_group()
            self._owns_group = False

    def barrier(self):
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def _comm_device(self) -> torch.device:
        import torch.distributed as dist

        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    # -- wrapping ---------------------------------------------------------------------------
    def wrap(
        self, model: nn.Module, autocast_dtype: torch.dtype | None = None, *, fsdp_bf16_params: bool | None = None
    ) -> None:
        """DDP or FSDP2 around `model` (already on self.device, identical on every rank). The
        optimizer must be built after this, from model.parameters() (FSDP2 swaps them for shards).
        fsdp_bf16_params: FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32);
        default on cuda (fp32 on cpu; False gives fp32 params on the GPU too, for exact checks)."""
        self.model = model
        self.step_module = LossSumStep(model, autocast_dtype)
        if self.world == 1:
            return
        if self.mode == "ddp":
            # buffers (vocab maps, the verifier's frozen head) are identical on every rank and never
            # change: broadcasting them at every forward would move GBs for nothing
            import inspect

            from torch.nn.parallel import DistributedDataParallel as DDP

            no_buffer_sync = (
                {"forward_sync_buffers": False}
                if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
                else {"broadcast_buffers": False}
            )
            # gradient_as_bucket_view: .grad are views into the all-reduce buckets, so the trainable
            # gradients are held once, not twice (3.3 GiB for a Qwen3-8B-shaped drafter)
            self._ddp = DDP(
                self.step_module,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                gradient_as_bucket_view=True,
                **no_buffer_sync,
            )
            self._ddp.register_comm_hook(None, _allreduce_sum_hook)
            return
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        # a layer returns its (k, v) as views; nothing ever modifies them in place, which is
        # what this warning is about
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        mesh = init_device_mesh(self.device.type, (self.world,))
        if fsdp_bf16_params is None:
            fsdp_bf16_params = self.device.type == "cuda"
        if fsdp_bf16_params:
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        else:  # CPU/gloo: fp32 throughout
            mp = MixedPrecisionPolicy()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        # the root group: embeddings, fc, norm, lm_head, mask_hidden (mask_embed)
        fully_shard(self.step_module, mesh=mesh, mp_policy=mp)
        for m in self.step_module.modules():
            if isinstance(m, FSDPModule):
                # SUM the gradients (the loss is already divided by the global token count)
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
        self._fsdp = True

    def unwrap(self) -> None:
        """Forget the wrapped model (and its DDP wrapper), so a context reused for another model
        does not keep the previous one's parameters and gradients alive."""
        self.model = None
        self.step_module = None
        self._ddp = None
        self._fsdp = False

    def eval_module(self) -> nn.Module:
        """What evaluation calls as `module(example, layout) -> (_, metrics)`."""
        return self.step_module

    # -- one step ---------------------------------------------------------------------------
    def my_units(self, unit_costs: list[int]) -> list[int]:
        """Global unit indices this rank computes (ascending): LPT over the step's units."""
        if self.world == 1:
            return list(range(len(unit_costs)))
        if len(unit_costs) % self.world:
            raise ValueError(f"{len(unit_costs)} units do not split over {self.world} ranks")
        return lpt_partition(unit_costs, self.world, len(unit_costs) // self.world)[self.rank]

    def sum_scalar(self, x: float) -> float:
        if self.world == 1:
            return x
        import torch.distributed as dist

        t = torch.tensor([float(x)], dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t)
        return float(t.item())

    def all_true(self, flag: bool) -> bool:
        if self.world == 1:
            return bool(flag)
        import torch.distributed as dist

        t = torch.tensor([1.0 if flag else 0.0], device=self._comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item() > 0)

    def forward_backward(
        self, model, example, layout, *, segments: int, loss_scale: float, autocast_dtype, last: bool, sync: bool = True
    ):
        """Forward + backward of one micro-step (loss SUM * loss_scale); gradients are synced
        across ranks by the backward of the step's last micro-step. Returns the metrics: on one
        rank with sync=False, as the model's DeviceMetrics where it gives them."""
        if self.world == 1:
            return model.forward_backward(
                example, layout, segments=segments, loss_scale=loss_scale, autocast_dtype=autocast_dtype, sync=sync
            )
        if self._fsdp:
            self.step_module.set_requires_gradient_sync(last)
            if segments > 1:
                # several backward passes inside one root forward: the root group must stay gathered
                # between them (each backward reduce-scatters or accumulates what it produced;
                # FSDP2 sums those into the sharded gradients), and is resharded by hand afterwards
                self.step_module.set_reshard_after_backward(False, recurse=False)
                try:
                    return self.step_module(
                        example, layout, partitioned={"segments": segments, "loss_scale": loss_scale}
                    )
                finally:
                    self.step_module.reshard()
                    self.step_module.set_reshard_after_backward(True, recurse=False)
            loss_sum, m = self.step_module(example, layout)
            (loss_sum * loss_scale).backward()
            return m
        if segments > 1:
            # several backward passes: accumulate locally, then sync with one zero backward
            with self._ddp.no_sync():
                m = model.forward_backward(
                    example, layout, segments=segments, loss_scale=loss_scale, autocast_dtype=autocast_dtype
                )
            if last:
                self._ddp(sync_only=True).backward()
            return m
        with contextlib.nullcontext() if last else self._ddp.no_sync():
            loss_sum, m = self._ddp(example, layout)
            (loss_sum * loss_scale).backward()
        return m

    def clip_grad_norm_(self, params, max_norm: float) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the global gradient (FSDP2: over the shards, the
        norm all-reduced). Returns the total norm as a plain (replicated) tensor."""
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return norm

    def ordered_metrics(self, n_items: int, mine: dict[int, dict], k: int) -> list[dict]:
        """The metrics of all n_items units in unit order, from each rank's own (`mine`: unit ->
        metrics with loss_sum, weight, correct[k], total[k], optional num_tokens): one all-reduce
        SUM of a [n_items, 3+2k] float64 table (each row has one non-zero source, so the sums are
        exact), so callers accumulate the same numbers in the same order as 1 rank."""
        if self.world == 1:
            return [mine[i] for i in range(n_items)]
        import torch.distributed as dist

        table = torch.zeros(n_items, 3 + 2 * k, dtype=torch.float64)
        for i, m in mine.items():
            table[i, 0] = float(m["loss_sum"])
            table[i, 1] = float(m["weight"])
            table[i, 2] = float(m.get("num_tokens", 0))
            table[i, 3 : 3 + k] = m["correct"].to(torch.float64).cpu()
            table[i, 3 + k :] = m["total"].to(torch.float64).cpu()
        t = table.to(self._comm_device())
        dist.all_reduce(t)
        table = t.cpu()
        return [
            {
                "loss_sum": float(r[0]),
                "weight": float(r[1]),
                "num_tokens": int(r[2]),
                "correct": r[3 : 3 + k].round().long(),
                "total": r[3 + k :].round().long(),
            }
            for r in table
        ]

    # -- evaluation -------------------------------------------------------------------------
    def eval_units(self, n_units: int) -> list[int]:
        """Validation units (groups of rows, one forward each) of this rank: rank, rank + N, ...
        Under FSDP2 every rank must run the same number of forwards (each all-gathers), so short
        lists are padded with -1 (a forward whose metrics are dropped)."""
        if self.world == 1:
            return list(range(n_units))
        mine = list(range(self.rank, n_units, self.world))
        if self._fsdp:
            mine += [-1] * (-(-n_units // self.world) - len(mine))
        return mine

    # -- hidden states ----------------------------------------------------------------------
    def prepare_hidden_states(self, parts, progress: bool, timeout_s: float = 1800.0) -> str:
        """World > 1: without a disk cache nothing happens up front (each rank computes its rows'
        states on first use); with one, every rank fills its own slice of it (shards i with
        i % world == rank; those already there are skipped) and then waits until all slices
        are there, giving up with an error when no shard has appeared for timeout_s seconds.
        parts: HiddenStates objects (train, val). Returns a sentence for the log."""
        disk = [h for h in parts if h.disk is not None and h.rows]
        if not disk:
            return "verifier hidden states: each rank computes those of the rows it trains on, on first use" + (
                " (kept in memory)" if parts[0].cache else ""
            )
        for h in disk:
            h.disk.generate(
                h.verifier,
                h.rows,
                h.aux,
                rows_per_shard=h.ROWS_PER_SHARD,
                dtype=h.store_dtype,
                progress=progress,
                rank=self.rank,
                world=self.world,
            )
        # a file poll with a no-progress timeout, not a barrier: filling a large cache can
        # outlast any collective timeout, and a dead rank must not leave the others waiting
        for h in disk:
            h.disk.wait_complete(-(-len(h.rows) // h.ROWS_PER_SHARD), timeout_s=timeout_s, world=self.world)
        self.barrier()
        return f"verifier hidden states: on-disk cache filled by all {self.world} ranks, read by all"

    # -- checkpoints ------------------------------------------------------------------------
    def _holder(self, model) -> nn.Module:
        """The module whose parameter names key DCP optimizer state ("model.<name>")."""
        if self.step_module is not None and self.step_module.model is model:
            return self.step_module
        return LossSumStep(model)

    def _full_model_for_save(self, model):
        """A module whose save_pretrained writes the full fp32 weights: the model itself, or under
        FSDP2 (collective) a CPU copy built from the gathered full state dict on rank 0 (None on
        the others)."""
        if not self._fsdp:
            return model if self.is_main else None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.step_module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.is_main:
            return None
        full = {k[len("model.") :]: v for k, v in sd.items() if k.startswith("model.")}
        with torch.device("meta"):
            shadow = type(model)(model.config, model.options)
        # strict: every persistent tensor must come from the gathered state (the non-persistent
        # verifier buffers and RoPE table stay on meta; they are never saved)
        shadow.load_state_dict(full, assign=True, strict=True)
        return shadow

    def _params_finite(self, model) -> bool:
        ok = True
        for p in model.parameters():
            t = p.to_local() if hasattr(p, "to_local") else p
            if t.numel() and not bool(torch.isfinite(t).all()):
                ok = False
                break
        return self.all_true(ok)

    def save_checkpoint(self, out: Path, step: int, model, opt, sched, state: dict, keep: int) -> Path:
        """checkpoint-<step>/ (every rank calls this): section-5 model + trainer state by rank 0;
        optimizer state by rank 0 (DDP) or sharded by every rank via DCP (FSDP2)."""
        if self.world == 1:
            return C.save_checkpoint(out, step, model, opt, sched, state, keep)
        if not self._params_finite(model):
            raise TrainError(f"refusing to write checkpoint {step}: a parameter is not finite")
        final = out / f"{C.CHECKPOINT_PREFIX}{step}"
        tmp = out / f"{C.CHECKPOINT_PREFIX}{step}.tmp"
        writer = self._full_model_for_save(model)  # collective under FSDP2
        if self.is_main:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        self.barrier()
        opt_state = None
        if self._fsdp:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            dcp.save(
                {"optimizer": get_optimizer_state_dict(self.step_module, opt)},
                checkpoint_id=str(tmp / OPTIMIZER_DCP_DIR),
            )
        elif self.is_main:
            opt_state = opt.state_dict()
        self.barrier()
        if self.is_main:
            writer.save_pretrained(tmp)
            C.save_trainer_state(
                tmp,
                {
                    "optimizer": opt_state,
                    "optimizer_dcp": OPTIMIZER_DCP_DIR if self._fsdp else None,
                    "scheduler": sched.state_dict(),
                    "rng": C.rng_state(),
                    "world_size": self.world,
                    "dist": self.mode,
                    **state,
                },
            )
            C.publish_checkpoint(out, step, tmp, keep)
        self.barrier()
        return final

    def load_optimizer_state(self, model, opt, ck: dict, ck_dir: Path) -> None:
        """Load a checkpoint's optimizer state whatever wrote it (1 process, DDP, FSDP2 on any
        rank count) into this run's optimizer (1 process, DDP or FSDP2)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        holder = self._holder(model)
        if ck.get("optimizer") is not None:  # a full, index-keyed optimizer.state_dict()
            if not self._fsdp:
                opt.load_state_dict(ck["optimizer"])
                return
            names = ["model." + n for n, p in model.named_parameters() if p.requires_grad]
            sd = ck["optimizer"]
            fqn = {
                "state": {names[i]: v for i, v in sd["state"].items()},
                "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]],
            }
            set_optimizer_state_dict(holder, opt, fqn, options=StateDictOptions(full_state_dict=True))
            return
        sub = ck.get("optimizer_dcp")
        if not sub:
            raise ValueError(f"checkpoint {ck_dir} holds no optimizer state")
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        osd = get_optimizer_state_dict(holder, opt)  # the template (initialises the state)
        single = not (dist.is_available() and dist.is_initialized())
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"optimizer": osd}, checkpoint_id=str(ck_dir / sub), no_dist=single)
        set_optimizer_state_dict(holder, opt, osd)

    def save_final(self, model, directory: Path) -> bool:
        """final/ (tmp + rename by rank 0). Every rank calls it; True on rank 0."""
        writer = self._full_model_for_save(model) if self.world > 1 else model
        if self.is_main:
            tmp = directory.with_name(directory.name + ".tmp")
            try:
                C.remove_path(tmp)
                writer.save_pretrained(tmp)
                C.replace_dir(tmp, directory)  # a kill leaves the old or the new final/, never neither
            except OSError as e:
                raise C.write_error("final/", tmp, e) from None
        self.barrier()
        return self.is_main
