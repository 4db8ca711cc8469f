"""torchrun worker of test_distributed.py: one optimizer step's gradient of a tiny random drafter,
N ranks (DDP / FSDP2 through peagle_ext.distributed, with gradient accumulation and sequence
partition) against 1 process computing the same global batch, on CPU with gloo.

    torchrun --standalone --nproc_per_node 2 tests/train/dist_grad_worker.py OUT.json CONFIGS_JSON

CONFIGS_JSON: a list of {"mode": "ddp"|"fsdp", "grad_accum": G, "segments": S, "attention":
"symmetric"|"cross", "num_layers": L}. Rank 0 writes OUT.json: per config, per parameter, the max
|grad_N_ranks - grad_1_process| and max |grad_1_process|.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist

from peagle_ext.data import TrainingExample
from peagle_ext.model import PEagleDraftModel, PEagleOptions
from peagle_ext.train.distributed import DistContext

H, V, K = 32, 97, 3


def make_model(seed: int, num_layers: int, attention: str) -> PEagleDraftModel:
    from transformers import LlamaConfig

    vc = LlamaConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=2 * H,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=H // 2,
        max_position_embeddings=512,
    )
    torch.manual_seed(seed)
    m = PEagleDraftModel.from_verifier(
        vc,
        num_layers=num_layers,
        num_depths=K,
        mask_token_id=V,
        options=PEagleOptions(attention=attention, train_embeddings="all"),
    )
    g = torch.Generator().manual_seed(seed + 1)
    m.attach_verifier(
        norm_weight=torch.rand(H, generator=g) + 0.5,
        lm_head_weight=torch.randn(V, H, generator=g) * 3.0,
        embed_weight=torch.randn(V, H, generator=g),
    )
    return m


def make_example(g: torch.Generator, n: int) -> TrainingExample:
    doc = torch.full((n,), -1, dtype=torch.int32)
    p, k = 0, 0
    while p < n - 8:  # documents of random length, a padded tail
        ln = int(torch.randint(8, max(9, n // 2), (1,), generator=g))
        ln = min(ln, n - 4 - p)
        doc[p : p + ln] = k
        p, k = p + ln, k + 1
    lm = (torch.rand(n, generator=g) < 0.8) & (doc >= 0)
    ids = torch.randint(0, V, (n,), generator=g)
    return TrainingExample(ids, doc, lm, torch.randn(n, 3 * H, generator=g), torch.randn(n, H, generator=g))


def run_config(cfg: dict, world: int) -> dict:
    ga, seg = int(cfg.get("grad_accum", 1)), int(cfg.get("segments", 1))
    model = make_model(7, int(cfg.get("num_layers", 1)), cfg.get("attention", "symmetric"))
    g = torch.Generator().manual_seed(11)
    n_units = ga * world
    examples = [make_example(g, int(torch.randint(40, 72, (1,), generator=g))) for _ in range(n_units)]
    layouts = [model.sample_layout(ex, seed=1000 + u) for u, ex in enumerate(examples)]
    weights = [float(ex.loss_mask[(lay.anchor.long() + lay.depth.long())].sum()) for ex, lay in zip(examples, layouts)]
    wtot = sum(weights)

    ref = copy.deepcopy(model)  # 1 process, every unit, in unit order
    for ex, lay in zip(examples, layouts):
        ref.forward_backward(ex, lay, segments=seg, loss_scale=1.0 / wtot)
    ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}

    ctx = DistContext.from_env(cfg["mode"], "cpu")
    ctx.wrap(model)
    mine = ctx.my_units([int((ex.document_ids >= 0).sum()) for ex in examples])
    assert len(mine) == ga
    local_w = sum(weights[u] for u in mine)
    assert ctx.sum_scalar(local_w) == wtot
    for j, u in enumerate(mine):
        ctx.forward_backward(
            model,
            examples[u],
            layouts[u],
            segments=seg,
            loss_scale=1.0 / wtot,
            autocast_dtype=None,
            last=j == len(mine) - 1,
        )
    out = {}
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        gr = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        r = ref_grads[n]
        out[n] = {"max_abs_diff": float((gr - r).abs().max()), "max_abs_ref": float(r.abs().max())}
    missing = sorted(set(ref_grads) - set(out))
    return {"grads": out, "missing": missing, "units": mine}


def main():
    out_path, configs = sys.argv[1], json.loads(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    results = [run_config(c, world) for c in configs]
    gathered = [None] * world
    dist.all_gather_object(gathered, [r["units"] for r in results])
    if rank == 0:
        for r, units in zip(results, zip(*gathered)):
            r["units"] = list(units)
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
