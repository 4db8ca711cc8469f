"""Throughput of the data pipeline on the real SmolLM2 verifier and ShareGPT.

    python bench/bench_data.py [--device cpu|cuda] [--seq-lens 512,2048] [--rows 2]
Prints one line per stage and writes bench_data.json to $OUT (or ./bench_out). QUICK=1 shrinks it.
Stages: GGUF->safetensors conversion (only when the cache is cold), ShareGPT parse, chat-template
tokenization, packing, and verifier hidden states (tokens/s, against the FLOP floor
2 * non-embedding params * tokens, which ignores attention).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

import torch

from peagle_ext import data as D


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq-lens", default="512,2048")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=400)
    args = ap.parse_args()
    quick = os.environ.get("QUICK", "0") == "1"
    rows_per = 1 if quick else args.rows
    out_dir = pathlib.Path(os.environ.get("OUT", "bench_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    res = {"device": args.device, "torch_threads": torch.get_num_threads(),
           "loadavg": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}

    t = time.perf_counter()
    path = D.resolve_verifier_path("smollm2")
    res["resolve_or_convert_s"] = time.perf_counter() - t
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model, tok = D.load_verifier(str(path), device=args.device, dtype=dtype)
    emb = model.get_input_embeddings().weight.numel()
    flops_per_token = 2 * (sum(p.numel() for p in model.model.parameters()) - emb)

    t = time.perf_counter()
    convs = D.load_conversations("sharegpt")
    res["sharegpt_parse_s"] = time.perf_counter() - t
    res["sharegpt_conversations"] = len(convs)
    convs = convs[: args.conversations]
    ids = D.default_aux_layer_ids(model.config.num_hidden_layers)
    for L in [int(x) for x in args.seq_lens.split(",")]:
        t = time.perf_counter()
        tokd, st = D.tokenize_conversations(tok, convs, max_len=L)
        tok_s = time.perf_counter() - t
        t = time.perf_counter()
        rows = D.pack_conversations(tokd, L, pad_token_id=tok.pad_token_id)
        pack_s = time.perf_counter() - t
        D.verifier_hidden_states(model, rows[0], ids)  # warm-up
        if args.device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        n_tok = 0
        for r in rows[1:1 + rows_per]:
            D.verifier_hidden_states(model, r, ids)
            n_tok += int((r.document_ids >= 0).sum())
        if args.device == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        res[f"seq{L}"] = {
            "tokenize_conversations_per_s": len(convs) / tok_s, "truncated": st.truncated,
            "pack_s": pack_s, "rows": len(rows), "fill": st.tokens / (len(rows) * L),
            "hidden_tokens": n_tok, "hidden_s": dt, "hidden_tokens_per_s": n_tok / dt,
            "achieved_gflops_vs_floor": flops_per_token * n_tok / dt / 1e9,
        }
        r = res[f"seq{L}"]
        print(f"seq_len {L}: tokenize {r['tokenize_conversations_per_s']:.0f} conv/s, fill {r['fill']:.2f}, "
              f"hidden states {r['hidden_tokens_per_s']:.0f} tok/s ({r['achieved_gflops_vs_floor']:.1f} GFLOP/s "
              f"of matmul floor) on {args.device}")
    print(f"resolve/convert {res['resolve_or_convert_s']:.1f} s, ShareGPT parse {res['sharegpt_parse_s']:.2f} s "
          f"({res['sharegpt_conversations']} conversations), load avg {res['loadavg']}")
    (out_dir / "bench_data.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
