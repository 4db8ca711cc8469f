"""COD sampling speed: peagle_ext's cod_sample vs speculators' loop written in plain PyTorch.

pytest-benchmark:  PYTHONPATH=. python -m pytest bench/bench_cod.py --benchmark-only
table + JSON:      PYTHONPATH=. python bench/bench_cod.py [--sizes 4096,32768] [--reps 50]
                   (writes $OUT/bench_cod.json, or ./bench_out/bench_cod.json; QUICK=1 in the
                   environment: N = 4K and 32K only, fewer repetitions)

The baseline restates speculators' generate_cod_sample_indices (models/peagle/data.py):
positions with loss form the seed set (optionally a random subset of max_anchors), and each
depth takes a randperm-based random subset of its candidate pool, sorts it, shifts it by one
and keeps the shifted positions that carry loss (torch.isin). It has no document handling;
ours does more work (documents, padding) and must still be faster.

GPU timing: CUDA events around each call (both implementations block on the host inside, so
the events bracket the whole call), warm-up first, median of the repetitions. CPU: median of
perf_counter. The op's floor is bytes, not FLOPs: it reads document_ids and loss_mask (5 B per
position) and writes anchor/depth (8 B per token); at HBM speed that is well under a
microsecond, so what remains is kernel launches (2 per depth) and the one host sync.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import pytest
import torch

import peagle_ext  # noqa: F401
from peagle_ext.cod import cod_sample

SIZES = [4096, 8192, 16384, 32768, 65536, 131072]
NUM_DEPTHS, RATIO, RATIO_MIN = 8, 0.7, 0.2
HBM_BYTES_PER_S = 4.8e12  # H200


def speculators_cod_baseline(
    loss_mask: torch.Tensor,
    num_depths: int = NUM_DEPTHS,
    ratio: float = RATIO,
    ratio_min: float = RATIO_MIN,
    max_anchors: int | None = None,
):
    """speculators' COD loop (randperm per depth, isin for the next pool), restated."""
    n = loss_mask.shape[0]
    dev = loss_mask.device
    with_loss = torch.nonzero(loss_mask == 1).squeeze(1)
    seeds = with_loss
    if max_anchors is not None and with_loss.numel() > max_anchors:
        keep = torch.randperm(with_loss.numel(), device=dev)[:max_anchors]
        seeds = torch.sort(with_loss[keep]).values
    anchors = [torch.arange(n, device=dev)]
    counts = [n]
    pool = seeds
    for d in range(1, num_depths):
        size = int(max(0, seeds.numel() - d) * max(ratio**d, ratio_min))
        if size <= 0:
            break
        if pool.numel() >= size:
            chosen = torch.sort(pool[torch.randperm(pool.numel(), device=dev)[:size]]).values
        else:
            chosen = pool
        shifted = (chosen + 1) % n
        shifted = shifted[shifted != 0]
        pool = shifted[torch.isin(shifted, with_loss)]
        anchors.append(chosen - d)
        counts.append(chosen.numel())
    anchor = torch.cat(anchors)
    depth = torch.cat([torch.full((c,), i, device=dev, dtype=torch.long) for i, c in enumerate(counts)])
    return anchor, depth


def packed_sequence(n: int, device: str, seed: int = 0):
    """Documents of 200..4000 tokens, each a prompt without loss then a response with loss,
    and ~3% trailing padding: a packed SFT batch row."""
    g = torch.Generator().manual_seed(seed + n)
    doc = torch.full((n,), -1, dtype=torch.int32)
    lm = torch.zeros(n, dtype=torch.bool)
    pos, k, end = 0, 0, n - n // 32
    while pos < end:
        length = min(int(torch.randint(200, 4001, (1,), generator=g)), end - pos)
        prompt = int(length * float(torch.rand((), generator=g)) * 0.5)
        doc[pos : pos + length] = k
        lm[pos + prompt : pos + length] = True
        pos += length
        k += 1
    return doc.to(device), lm.to(device)


def _impls(doc, lm):
    return {
        "peagle": lambda: cod_sample(
            doc, lm, num_depths=NUM_DEPTHS, down_sample_ratio=RATIO, down_sample_ratio_min=RATIO_MIN, seed=1234
        ),
        "peagle_op": lambda: torch.ops.peagle.cod_sample(doc, lm, NUM_DEPTHS, RATIO, RATIO_MIN, -1, True, 1234),
        "speculators": lambda: speculators_cod_baseline(lm),
    }


def _devices():
    has_cuda = torch.cuda.is_available() and peagle_ext.has_cuda_kernels()
    return ["cpu"] + (["cuda"] if has_cuda else [])


# ---- pytest-benchmark ------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["peagle", "peagle_op", "speculators"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("n", SIZES)
def test_bench_cod(benchmark, n, device, impl):
    if device not in _devices():
        pytest.skip("needs a CUDA GPU and the CUDA build of peagle_ext")
    doc, lm = packed_sequence(n, device)
    fn = _impls(doc, lm)[impl]
    if device == "cuda":
        inner = fn

        def fn():
            out = inner()
            torch.cuda.synchronize()
            return out

    benchmark.group = f"cod N={n} {device}"
    benchmark.pedantic(fn, rounds=20 if device == "cuda" else 5, warmup_rounds=3)


# ---- table + JSON ---------------------------------------------------------------------------
def time_ms(fn, device: str, reps: int) -> float:
    for _ in range(5 if device == "cuda" else 1):
        fn()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        for _ in range(reps):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main():
    quick = os.environ.get("QUICK", "0") == "1"
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="4096,32768" if quick else ",".join(map(str, SIZES)))
    ap.add_argument("--reps", type=int, default=20 if quick else 50)
    ap.add_argument("--devices", default=",".join(_devices()))
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    print(
        f"COD sampling, K={NUM_DEPTHS}, r={RATIO}, r_min={RATIO_MIN}; median ms "
        f"(peagle = Python wrapper, op = torch.ops.peagle.cod_sample)"
    )
    print(
        f"{'N':>7} {'device':>6} {'peagle':>9} {'op':>9} {'specul.':>9} {'speedup':>8} {'op spd':>7} "
        f"{'T':>7} {'floor us':>8}"
    )
    for device in args.devices.split(","):
        reps = args.reps if device == "cuda" else max(5, args.reps // 5)
        for n in sizes:
            doc, lm = packed_sequence(n, device)
            impls = _impls(doc, lm)
            ms = {name: time_ms(fn, device, reps) for name, fn in impls.items()}
            layout = impls["peagle"]()
            tokens = layout.num_tokens
            floor_us = (5 * n + 8 * tokens) / HBM_BYTES_PER_S * 1e6
            row = dict(
                n=n,
                device=device,
                peagle_ms=ms["peagle"],
                peagle_op_ms=ms["peagle_op"],
                speculators_ms=ms["speculators"],
                speedup=ms["speculators"] / ms["peagle"],
                speedup_op=ms["speculators"] / ms["peagle_op"],
                tokens=tokens,
                bytes_floor_us=floor_us if device == "cuda" else None,
                num_depths=NUM_DEPTHS,
                ratio=RATIO,
                ratio_min=RATIO_MIN,
                reps=reps,
            )
            rows.append(row)
            print(
                f"{n:>7} {device:>6} {ms['peagle']:>9.3f} {ms['peagle_op']:>9.3f} {ms['speculators']:>9.3f} "
                f"{row['speedup']:>7.1f}x {row['speedup_op']:>6.1f}x {tokens:>7} "
                f"{floor_us if device == 'cuda' else float('nan'):>8.3f}"
            )
    target = [r for r in rows if r["device"] == "cuda" and r["n"] == 32768]
    if target:
        ok = target[0]["speedup"] >= 10
        print(
            f"target (GPU, N=32K, >= 10x vs speculators): {target[0]['speedup']:.1f}x "
            f"(op alone {target[0]['speedup_op']:.1f}x) -> {'MET' if ok else 'NOT MET'}"
        )
    out_dir = Path(os.environ.get("OUT") or "bench_out")
    out_dir.mkdir(parents=True, exist_ok=True)
    info = peagle_ext.build_info()
    payload = dict(
        benchmark="cod_sample",
        torch=torch.__version__,
        build=info,
        gpu=torch.cuda.get_device_name() if "cuda" in args.devices else None,
        rows=rows,
    )
    (out_dir / "bench_cod.json").write_text(json.dumps(payload, indent=2))
    print(f"wrote {out_dir / 'bench_cod.json'}")


if __name__ == "__main__":
    main()
