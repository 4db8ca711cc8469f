"""`peagle hidden-states`: compute a data set's verifier hidden states once into the cache that
`peagle train --hidden-cache-dir` reads (device_map across GPUs, or data-parallel under torchrun)."""

from __future__ import annotations

import argparse
import json
import os

from .train import _bool

HELP = "precompute verifier hidden states into a cache for peagle train --hidden-cache-dir"


def _opt_int(v: str):
    return None if v.lower() in ("none", "null", "") else int(v)


def _json_object(v: str) -> dict:
    try:
        d = json.loads(v)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(d, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(d).__name__}")
    return d


def _max_memory(v: str) -> dict:
    # accelerate keys GPUs by int index: {"0": "20GiB", "cpu": "60GiB"} -> {0: ..., "cpu": ...}
    return {int(k) if str(k).isdigit() else k: val for k, val in _json_object(v).items()}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..train import TrainSettings

    d = TrainSettings()
    g = p.add_argument_group("the data (the same flags and defaults as peagle train, so train finds the rows)")
    g.add_argument("--verifier", help=f"hub id, local directory, .gguf or 'smollm2'. Default {d.verifier}")
    g.add_argument("--verifier-revision")
    g.add_argument("--data", action="append", help=f"as for peagle train (several allowed). Default {d.data}")
    g.add_argument("--data-split")
    g.add_argument("--chat-template-kwargs", type=_json_object)
    g.add_argument("--num-conversations", type=_opt_int, help=f"Default {d.num_conversations}")
    g.add_argument("--val-fraction", type=float, help=f"Default {d.val_fraction}")
    g.add_argument("--dedup", type=_bool, help=f"Default {str(d.dedup).lower()}")
    g.add_argument("--seq-len", type=int, help=f"Default {d.seq_len}")
    g.add_argument("--seed", type=int, help=f"Default {d.seed}")
    g.add_argument("--aux-layer-ids", type=lambda v: [int(x) for x in v.split(",")])
    g = p.add_argument_group("the cache")
    g.add_argument("--output", required=True, help="cache directory (pass it to peagle train --hidden-cache-dir)")
    g.add_argument(
        "--dtype",
        dest="storage",
        default="bfloat16",
        choices=["bfloat16", "float32", "fp8"],
        help="storage: bf16 (default), fp32, or fp8 e4m3 with a float32 scale per position",
    )
    g.add_argument("--device", help="cpu | cuda (under torchrun: cuda:LOCAL_RANK). Default cpu")
    g.add_argument("--device-map", default=None, help="e.g. auto: one verifier spread over the GPUs (accelerate)")
    g.add_argument("--max-memory", type=_max_memory, default=None, help='with --device-map, e.g. \'{"0": "20GiB"}\'')
    g.add_argument("--verifier-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    g.add_argument("--timeout-s", type=float, default=1800.0, help="rank 0 gives up when no shard appeared this long")
    g.add_argument("--threads", type=int, help="CPU threads (0 = torch's default). Default 1")
    g.add_argument("--no-progress", dest="progress", action="store_const", const=False)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..train import TrainSettings
    from ..train.precompute import precompute_hidden_states

    fields = set(TrainSettings.field_names())
    kw = {k: v for k, v in vars(args).items() if k in fields and k not in ("output",)}
    if isinstance(kw.get("data"), list) and len(kw["data"]) == 1:
        kw["data"] = kw["data"][0]
    s = TrainSettings(**kw).validate()
    if s.threads and not s.device.startswith("cuda"):
        torch.set_num_threads(s.threads)
    r = precompute_hidden_states(
        s,
        args.output,
        storage=args.storage,
        verifier_dtype=args.verifier_dtype,
        device_map=args.device_map,
        max_memory=args.max_memory,
        timeout_s=args.timeout_s,
    )
    if int(os.environ.get("RANK", "0")) == 0:
        rows = ", ".join(f"{n} {k}" for k, n in r["rows"].items())
        print(
            f"hidden-state cache {r['output']}: {rows} rows complete ({r['seconds']:.1f} s; this process "
            f"{r['computed_tokens']} tokens, {r.get('tokens_per_s', 0):.0f} tokens/s)"
        )
        print(f"train on it: peagle train --hidden-cache-dir {r['output']} (with the same data flags)")
    return 0
