"""`peagle export`: write a vLLM-loadable (bf16) copy of a trained drafter."""

from __future__ import annotations

import argparse

HELP = "write a vLLM-loadable checkpoint"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="final/ dir, checkpoint-<step>/ dir, or a training output dir")
    p.add_argument("dst", help="directory to write (config.json + model.safetensors)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument(
        "--verifier",
        default=None,
        help="name to record for the verifier (hub id or path vLLM loads it by); default: the checkpoint's",
    )


def run(args) -> int:
    from ..train import export
    from ..train.export import vllm_serve_command

    d = export(args.src, args.dst, dtype=args.dtype, verifier=getattr(args, "verifier", None))
    print(f"exported {args.src} -> {d} ({args.dtype}); serve it with its verifier (vLLM >= 0.16):")
    print(vllm_serve_command(d))
    return 0
