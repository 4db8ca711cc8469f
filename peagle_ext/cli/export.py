"""`peagle export`: write a vLLM-loadable (bf16) copy of a trained drafter."""

from __future__ import annotations

import argparse
import json

HELP = "write a vLLM-loadable checkpoint"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="final/ dir, checkpoint-<step>/ dir, or a training output dir")
    p.add_argument("dst", help="directory to write (config.json + model.safetensors)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])


def run(args) -> int:
    from ..train import export

    d = export(args.src, args.dst, dtype=args.dtype)
    k = json.loads((d / "config.json").read_text())["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    spec = json.dumps({"model": str(d), "method": "eagle3", "parallel_drafting": True, "num_speculative_tokens": k})
    print(f"exported {args.src} -> {d} ({args.dtype}); serve with vLLM >= 0.16: --speculative-config '{spec}'")
    return 0
