"""Why a `peagle eval` prompt is not lossless: a rounding-flipped near-tie, or a real mismatch.

Greedy speculative decoding picks each token as the verifier's argmax over a forward of K + 1
tokens; the baseline picks it over a forward of one token. In bf16 the two forwards round
differently (other GEMM shapes, other reduction orders), so where the verifier's two best
tokens are nearly tied the argmax can flip, and the texts part from there on. A bug (a wrong
position, a stale cache row, a misplaced accepted token) instead parts them where the verifier
clearly prefers one token.

For every prompt of an eval report (`peagle eval --json`) whose output differs from the
baseline, this rescores the common prefix (prompt + tokens before the first difference) with
the verifier in float32 and prints the fp32 logit gap between the baseline's token and the
speculative run's token there, with the fp32 top-2 margin for scale. A gap near 0 (within bf16's
resolution of the logits, |logit| x 2^-8) is a near-tie; a gap of whole logits is a mismatch to
debug.

python tools/mismatch_gaps.py --eval eval.json [--verifier smollm2] [--device cpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peagle_ext.data import load_verifier  # noqa: E402


def bf16_resolution(x: float) -> float:
    """The spacing of bf16 numbers at |x| (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 7)


def gaps(model, mismatches: list[dict], device) -> list[dict]:
    rows = []
    for m in mismatches:
        mm = m["mismatch"]
        a, b = mm["token"], mm["baseline_token"]
        if a is None or b is None:  # one run stopped (EOS) where the other went on
            rows.append({"id": m["id"], "position": mm["position"], "kind": "length"})
            continue
        ids = torch.tensor([mm["prefix"]], device=device)
        with torch.no_grad():
            z = model(input_ids=ids).logits[0, -1].float()
        top = torch.topk(z, 2)
        gap = float(z[b] - z[a])
        res = bf16_resolution(float(top.values[0]))
        rows.append(
            {
                "id": m["id"],
                "position": mm["position"],
                "kind": "near-tie" if abs(gap) <= 4 * res else "mismatch",
                "gap_fp32": gap,
                "bf16_resolution": res,
                "top2_margin_fp32": float(top.values[0] - top.values[1]),
                "fp32_argmax_is": "baseline"
                if int(top.indices[0]) == b
                else "speculative"
                if int(top.indices[0]) == a
                else "other",
            }
        )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--eval", required=True, help="a `peagle eval --json` report")
    p.add_argument("--verifier", default=None, help="default: the report's verifier")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, help="write the rows here")
    a = p.parse_args(argv)
    path = Path(a.eval)
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        print(f"mismatch_gaps: --eval {a.eval}: {e}", file=sys.stderr)
        return 2
    prompts = report.get("prompts") if isinstance(report, dict) else None
    if not isinstance(prompts, list):
        print(f"mismatch_gaps: --eval {a.eval}: not a `peagle eval --json` report (no prompts)", file=sys.stderr)
        return 2
    bad = [q for q in prompts if not q.get("lossless")]
    if any("prefix" not in (q.get("mismatch") or {}) for q in bad):
        print(
            f"mismatch_gaps: --eval {a.eval}: written by an older `peagle eval` (no mismatch prefixes)", file=sys.stderr
        )
        return 2
    print(f"{len(prompts) - len(bad)}/{len(prompts)} prompts token-identical to the baseline")
    if not bad:
        return 0
    model, _ = load_verifier(a.verifier or report["verifier"], device=a.device, dtype=torch.float32)
    model.eval()
    rows = gaps(model, bad, torch.device(a.device))
    print(f"{'prompt':>16} {'pos':>4} {'kind':>9} {'fp32 gap':>9} {'bf16 res.':>9} {'top-2 margin':>12}  fp32 argmax")
    for r in rows:
        if r["kind"] == "length":
            print(f"{r['id']:>16} {r['position']:>4} {'length':>9}")
            continue
        print(
            f"{r['id']:>16} {r['position']:>4} {r['kind']:>9} {r['gap_fp32']:>9.4f} {r['bf16_resolution']:>9.4f} "
            f"{r['top2_margin_fp32']:>12.4f}  {r['fp32_argmax_is']}"
        )
    kinds = [r["kind"] for r in rows]
    print(
        f"near-ties {kinds.count('near-tie')}, mismatches {kinds.count('mismatch')}, "
        f"length only {kinds.count('length')} (of {len(rows)} differing prompts)"
    )
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
