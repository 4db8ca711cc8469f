"""COD attention benchmark: peagle_ext.attention.cod_attention vs
torch create_block_mask + compiled flex_attention with speculators' P-EAGLE mask_mod, and vs SDPA
causal over all T tokens (flash backend, a dense kernel doing more work).

Layouts: one document of N tokens, every position loss-masked (the reference sizes:
N=8K max_anchors=1024 -> T~10.6K, N=4K uncapped -> T~13.8K), r=0.7, K=8. 32 q heads, 8 kv
heads, D=128 (BENCH_D=64 for the other head dim), bf16. Times include the metadata build (ours) /
create_block_mask (flex). "ours" runs the kernels the heuristics pick (csrc/attention/
attention_dispatch.h: the Hopper wgmma kernels on sm_90); at two sizes the portable mma.sync kernels
(PEAGLE_ATTN_KERNEL=portable, what Ampere / Ada / Blackwell run) are timed too.

  python bench/bench_attention.py            # table + $OUT/bench_attention.json (or ./bench_out)
  QUICK=1 python bench/bench_attention.py    # fewer sizes
  python bench/bench_attention.py --kernels  # the chosen kernels vs the portable ones: fwd, fwd+bwd
                                             # and bwd ms, bwd TF/s, ratio, grad diffs, memory
  pytest bench/bench_attention.py            # pytest-benchmark entries (GPU ones skip without a GPU)

Useful FLOPs = allowed (query, key) pairs x 4 x D x Hq per forward (pairs counted in O(T) from
the metadata); fwd+bwd counts 3.5x that (2 forward + 5 backward matmuls), the same convention
as for SDPA causal (T(T+1)/2 pairs). The floor is the time at the H200's dense bf16 peak.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from peagle_ext.attention import cod_attention, cod_attention_metadata
from peagle_ext.cod import cod_sample

HQ, HKV, K, R = 32, 8, 8, 0.7
D = int(os.environ.get("BENCH_D", "128"))  # head dim (the kernels take 64 and 128)
PEAK_BF16_TFLOPS = 989.0  # H200 SXM dense bf16 (tensor cores)
PEAK_HBM_TBS = 4.8


def make_layout(n: int, max_anchors, device="cuda", seed=0):
    doc = torch.zeros(n, dtype=torch.int32)
    lm = torch.ones(n, dtype=torch.bool)
    return cod_sample(
        doc.to(device), lm.to(device), num_depths=K, down_sample_ratio=R, max_anchors=max_anchors, seed=seed
    )


def allowed_pairs(meta) -> int:
    """Allowed (query, key) pairs per head, O(T) from the metadata."""
    rg = meta.ranges.long()
    valid = rg[4] != 0
    win = (rg[1] - rg[0]).clamp(min=0)
    sink = (rg[3] - rg[2]).clamp(min=0) if meta.use_sink else torch.zeros_like(win)
    chain = (meta.chains[0] >= 0).sum(1)
    return int(((win + sink + chain) * valid).sum())


def peagle_mask_mod(anchor, depth, document_ids, window=None, sink=0):
    """speculators' create_peagle_mask_mod rules (docs/design.md section 3) plus the sink, written here."""
    n = document_ids.shape[0]
    pos = torch.arange(n, device=document_ids.device)
    new_run = torch.ones(n, dtype=torch.bool, device=document_ids.device)
    new_run[1:] = document_ids[1:] != document_ids[:-1]
    doc_start = torch.cummax(torch.where(new_run, pos, torch.zeros_like(pos)), 0).values

    def mask_mod(b, h, q_idx, kv_idx):
        qa, ka = anchor[q_idx], anchor[kv_idx]
        qd, kd = depth[q_idx], depth[kv_idx]
        qdoc = document_ids[qa]
        ok = (qdoc != -1) & (qdoc == document_ids[ka])
        ctx = (kd == 0) & (ka <= qa)
        if window is not None:
            in_w = ka > qa + qd - window
            if sink > 0:
                in_w = in_w | ((ka - doc_start[qa]) < sink)
            ctx = ctx & in_w
        chain = (qa == ka) & (kd <= qd)
        return ok & (ctx | chain)

    return mask_mod


# PEAGLE_ATTN_KERNEL: the one override of the kernel choice ("portable" = the mma.sync kernels).
KERNEL_ENV = "PEAGLE_ATTN_KERNEL"
FAMILIES = ("auto", "portable")


class kernel_family:
    """Context manager: run the CUDA kernels of `family` ("auto": the heuristics' choice)."""

    def __init__(self, family):
        self.family = family

    def __enter__(self):
        self.saved = os.environ.pop(KERNEL_ENV, None)
        if self.family != "auto":
            os.environ[KERNEL_ENV] = self.family

    def __exit__(self, *exc):
        os.environ.pop(KERNEL_ENV, None)
        if self.saved is not None:
            os.environ[KERNEL_ENV] = self.saved


def chosen_family(head_dim=D):
    from peagle_ext.ops.attention import attention_kernel

    with kernel_family("auto"):
        return attention_kernel(head_dim)["family"]


def cuda_time(fn, warmup=2, reps=5, target_s=1.5):
    """Median of `reps` timed runs (fewer when one run is long, so big sizes fit the budget)."""
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = time.perf_counter() - t0
    if one > 0.2:
        warmup, reps = 0, max(1, min(reps, int(target_s / one)))
    for _ in range(max(0, warmup - 1)):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def peak_mem(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def inputs(t, n=None, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda h: torch.randn(t, h, D, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    q, k, v = mk(HQ), mk(HKV), mk(HKV)
    return q, k, v, torch.randn(t, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)


def bench_ours(lay, window=None, sink=0):
    t = lay.num_tokens
    q, k, v, go = inputs(t)
    qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))

    def fwd():
        with torch.no_grad():
            return cod_attention(q, k, v, lay, window=window, sink=sink)

    def fwd_bwd():
        out = cod_attention(qg, kg, vg, lay, window=window, sink=sink)
        torch.autograd.grad(out, [qg, kg, vg], go)

    def meta_only():
        cod_attention_metadata(lay, window=window, sink=sink)

    res = {"meta_ms": cuda_time(meta_only), "fwd_ms": cuda_time(fwd), "fwd_bwd_ms": cuda_time(fwd_bwd)}
    res["fwd_bwd_mem_mib"] = peak_mem(fwd_bwd)
    res["pairs"] = allowed_pairs(cod_attention_metadata(lay, window=window, sink=sink))
    return res


_flex_compiled = None


def bench_flex(lay, window=None, sink=0):
    global _flex_compiled
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _flex_compiled is None:
        # (`import torch._dynamo` here would make `torch` a local name of this function, unbound on
        # every later call, and the closures below would fail with a NameError from the 2nd layout on)
        import torch._dynamo as dynamo

        # one compiled graph per (T, grad mode): raise dynamo's recompile limits above our config count
        for name in (
            "cache_size_limit",
            "recompile_limit",
            "accumulated_cache_size_limit",
            "accumulated_recompile_limit",
        ):
            if hasattr(dynamo.config, name):
                setattr(dynamo.config, name, max(256, getattr(dynamo.config, name)))
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    t = lay.num_tokens
    q, k, v, go = inputs(t)
    q4, k4, v4, go4 = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v, go))
    qg, kg, vg = (x.clone().requires_grad_(True) for x in (q4, k4, v4))
    mm = peagle_mask_mod(lay.anchor.long(), lay.depth.long(), lay.document_ids.long(), window, sink)

    def build():
        return create_block_mask(mm, None, None, t, t, device="cuda")

    bm = build()

    def fwd():
        with torch.no_grad():
            return _flex_compiled(q4, k4, v4, block_mask=bm, enable_gqa=True)

    def fwd_bwd():
        out = _flex_compiled(qg, kg, vg, block_mask=bm, enable_gqa=True)
        torch.autograd.grad(out, [qg, kg, vg], go4)

    def fwd_bwd_with_mask():
        b2 = build()
        out = _flex_compiled(qg, kg, vg, block_mask=b2, enable_gqa=True)
        torch.autograd.grad(out, [qg, kg, vg], go4)

    res = {"mask_ms": cuda_time(build, 1, 3), "fwd_ms": cuda_time(fwd), "fwd_bwd_ms": cuda_time(fwd_bwd)}
    res["fwd_bwd_mem_mib"] = peak_mem(fwd_bwd_with_mask)
    # correctness cross-check on a few rows: flex vs ours (same mask semantics)
    with torch.no_grad():
        ours = cod_attention(q, k, v, lay, window=window, sink=sink).float()
        theirs = fwd()[0].transpose(0, 1).float()
        valid = lay.document_ids[lay.anchor.long()] >= 0
        res["max_abs_diff_vs_ours"] = float((ours[valid] - theirs[valid]).abs().max())
    return res


def bench_sdpa(t):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, go = inputs(t)
    q4, go4 = q.transpose(0, 1).unsqueeze(0), go.transpose(0, 1).unsqueeze(0)
    # the flash backend takes equal head counts: expand k/v outside the timed region
    k4 = k.repeat_interleave(HQ // HKV, 1).transpose(0, 1).unsqueeze(0)
    v4 = v.repeat_interleave(HQ // HKV, 1).transpose(0, 1).unsqueeze(0)
    qg, kg, vg = (x.detach().clone().requires_grad_(True) for x in (q4, k4, v4))

    def fwd():
        with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q4, k4, v4, is_causal=True)

    def fwd_bwd():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
        torch.autograd.grad(out, [qg, kg, vg], go4)

    res = {"fwd_ms": cuda_time(fwd, 1, 3), "fwd_bwd_ms": cuda_time(fwd_bwd, 1, 3)}
    res["fwd_bwd_mem_mib"] = peak_mem(fwd_bwd)
    res["pairs"] = t * (t + 1) // 2
    return res


def tflops(pairs, ms, factor=1.0):
    return pairs * 4 * D * HQ * factor / (ms * 1e-3) / 1e12


def main():
    quick = os.environ.get("QUICK", "0") not in ("", "0")
    out_dir = Path(os.environ.get("OUT", "bench_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    budget_s = float(os.environ.get("BENCH_BUDGET_S", "200"))
    t_start = time.time()
    sizes = [4096, 8192, 131072] if quick else [4096, 8192, 16384, 32768, 131072]
    flex_max_t = int(os.environ.get("FLEX_MAX_T", "60000"))  # O(T^2) mask build and memory beyond this
    sdpa_max_t = int(os.environ.get("SDPA_MAX_T", "200000"))
    rows, notes = [], []
    dev = torch.cuda.get_device_name()
    print(
        f"# COD attention bench on {dev}, torch {torch.__version__}; Hq={HQ} Hkv={HKV} D={D} K={K} r={R} bf16; "
        f"kernels: {chosen_family()}"
    )
    for n in sizes:
        for cap in (None, 1024):
            lay = make_layout(n, cap)
            t = lay.num_tokens
            row = {"N": n, "max_anchors": cap, "T": t}
            row["ours"] = bench_ours(lay)
            if (n, cap) in ((8192, 1024), (4096, None)) and chosen_family() != "portable":
                # the portable kernels against the chosen (Hopper) ones; --kernels times more layouts
                with kernel_family("portable"):
                    alt = bench_ours(lay)
                row["ours_portable"] = {"fwd_ms": alt["fwd_ms"], "fwd_bwd_ms": alt["fwd_bwd_ms"]}
                print(
                    f"  portable kernels at N={n} cap={cap}: fwd {alt['fwd_ms']:.2f} ms vs {row['ours']['fwd_ms']:.2f} "
                    f"({alt['fwd_ms'] / row['ours']['fwd_ms']:.2f}x), f+b {alt['fwd_bwd_ms']:.2f} vs "
                    f"{row['ours']['fwd_bwd_ms']:.2f} ms ({alt['fwd_bwd_ms'] / row['ours']['fwd_bwd_ms']:.2f}x)",
                    flush=True,
                )
            pairs = row["ours"]["pairs"]
            o = row["ours"]
            o["fwd_tflops"] = tflops(pairs, o["fwd_ms"])
            o["fwd_bwd_tflops"] = tflops(pairs, o["fwd_bwd_ms"], 3.5)
            # floors: tensor-core time of the useful FLOPs vs HBM time of reading q/k/v once and
            # writing out (fwd; x3 traffic for fwd+bwd); the larger one bounds the kernel
            flop_fwd = pairs * 4 * D * HQ / (PEAK_BF16_TFLOPS * 1e12) * 1e3
            bytes_fwd = 2 * D * t * (2 * HQ + 2 * HKV)
            byte_fwd = bytes_fwd / (PEAK_HBM_TBS * 1e12) * 1e3
            o["fwd_floor_ms"] = max(flop_fwd, byte_fwd)
            o["fwd_bwd_floor_ms"] = max(flop_fwd * 3.5, byte_fwd * 3)
            o["floor_bound"] = "flops" if flop_fwd >= byte_fwd else "bytes"
            o["fwd_bwd_vs_floor"] = o["fwd_bwd_ms"] / o["fwd_bwd_floor_ms"]
            elapsed = time.time() - t_start
            if t > flex_max_t:
                row["flex"] = None
                notes.append(
                    f"N={n} cap={cap}: flex skipped (T={t} > FLEX_MAX_T={flex_max_t}: O(T^2) block-mask build)"
                )
            elif elapsed > budget_s * 0.6:
                row["flex"] = None
                notes.append(f"N={n} cap={cap}: flex skipped (time budget, {elapsed:.0f}s used)")
            else:
                try:
                    row["flex"] = bench_flex(lay)
                except Exception as e:  # noqa: BLE001 (report, keep going)
                    row["flex"] = None
                    notes.append(f"N={n} cap={cap}: flex failed: {type(e).__name__}: {str(e)[:200]}")
                    torch.cuda.empty_cache()
            elapsed = time.time() - t_start
            if t > sdpa_max_t or elapsed > budget_s * 0.85:
                row["sdpa"] = None
                notes.append(f"N={n} cap={cap}: sdpa skipped (T={t}, {elapsed:.0f}s used)")
            else:
                try:
                    row["sdpa"] = bench_sdpa(t)
                    s = row["sdpa"]
                    s["fwd_tflops"] = tflops(s["pairs"], s["fwd_ms"])
                    s["fwd_bwd_tflops"] = tflops(s["pairs"], s["fwd_bwd_ms"], 3.5)
                except Exception as e:  # noqa: BLE001
                    row["sdpa"] = None
                    notes.append(f"N={n} cap={cap}: sdpa failed: {type(e).__name__}: {str(e)[:200]}")
                    torch.cuda.empty_cache()
            rows.append(row)
            print_row(row)
            torch.cuda.empty_cache()
    print_summary(rows)
    for nline in notes:
        print("note:", nline)
    (out_dir / "bench_attention.json").write_text(
        json.dumps(
            {"device": dev, "torch": torch.__version__, "kernels": chosen_family(), "rows": rows, "notes": notes},
            indent=1,
        )
    )
    print(f"wrote {out_dir / 'bench_attention.json'}")


def print_row(r):
    o, f, s = r["ours"], r["flex"], r["sdpa"]
    cap = "none" if r["max_anchors"] is None else r["max_anchors"]
    line = (
        f"N={r['N']:>6} cap={cap:>5} T={r['T']:>7} | ours meta {o['meta_ms']:6.2f} fwd {o['fwd_ms']:7.2f} "
        f"f+b {o['fwd_bwd_ms']:7.2f} ms ({o['fwd_tflops']:5.0f}/{o['fwd_bwd_tflops']:5.0f} TF/s, f+b floor "
        f"{o['fwd_bwd_floor_ms']:.2f} ms [{o['floor_bound']}] = {o['fwd_bwd_vs_floor']:.1f}x floor, "
        f"{o['fwd_bwd_mem_mib']:.0f} MiB)"
    )
    if f:
        tot_f = f["mask_ms"] + f["fwd_bwd_ms"]
        line += (
            f" | flex mask {f['mask_ms']:6.1f} fwd {f['fwd_ms']:6.2f} f+b {f['fwd_bwd_ms']:6.2f} ms, "
            f"f+b+mask {tot_f / o['fwd_bwd_ms']:5.1f}x ours, fwd+mask {(f['mask_ms'] + f['fwd_ms']) / o['fwd_ms']:5.1f}x "
            f"({f['fwd_bwd_mem_mib']:.0f} MiB, max|diff| {f['max_abs_diff_vs_ours']:.3f})"
        )
    if s:
        line += (
            f" | sdpa-causal fwd {s['fwd_ms']:7.2f} f+b {s['fwd_bwd_ms']:7.2f} ms ({s['fwd_tflops']:4.0f}/"
            f"{s['fwd_bwd_tflops']:4.0f} TF/s), ours useful TF/s = {o['fwd_bwd_tflops'] / s['fwd_bwd_tflops']:.2f}x sdpa"
        )
    print(line, flush=True)


def print_summary(rows):
    print(
        "\n# summary (targets: fwd+bwd incl. metadata >= 3x faster than flex incl. mask at 8K; "
        "useful TF/s >= 0.5x SDPA-causal; N=128K runs)"
    )
    print(
        f"{'N':>7} {'cap':>5} {'T':>7} {'ours f+b ms':>12} {'flex f+b+mask':>14} {'speedup':>8} "
        f"{'TF/s ours':>10} {'TF/s sdpa':>10} {'ratio':>6} {'mem MiB':>8}"
    )
    for r in rows:
        o, f, s = r["ours"], r["flex"], r["sdpa"]
        ours_tot = o["fwd_bwd_ms"] + o["meta_ms"]
        flex_tot = f"{f['mask_ms'] + f['fwd_bwd_ms']:.2f}" if f else "-"
        speedup = f"{(f['mask_ms'] + f['fwd_bwd_ms']) / ours_tot:.1f}x" if f else "-"
        sdpa_tf = f"{s['fwd_bwd_tflops']:.0f}" if s else "-"
        ratio = f"{o['fwd_bwd_tflops'] / s['fwd_bwd_tflops']:.2f}" if s else "-"
        print(
            f"{r['N']:>7} {str(r['max_anchors']):>5} {r['T']:>7} {ours_tot:>12.2f} {flex_tot:>14} {speedup:>8} "
            f"{o['fwd_bwd_tflops']:>10.0f} {sdpa_tf:>10} {ratio:>6} {o['fwd_bwd_mem_mib']:>8.0f}"
        )


def kernels_main():
    """fwd and fwd+bwd of the chosen kernels and of the portable ones on the bench layouts plus a
    windowed one: ms, backward ms (fwd+bwd minus the forward alone), backward useful TF/s (5
    matmuls per allowed pair: 2.5x the forward's FLOPs), speed-up of the chosen kernels, peak
    extra memory, and the outputs' / gradients' relative L2 difference between the two."""
    out_dir = Path(os.environ.get("OUT", "bench_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    cases = [(4096, None, None, 0), (8192, 1024, None, 0), (8192, None, None, 0), (8192, None, 1024, 4)]
    if os.environ.get("QUICK", "0") in ("", "0"):
        cases += [(32768, None, None, 0), (131072, 1024, None, 0)]
    dev = torch.cuda.get_device_name()
    chosen = chosen_family()
    print(
        f"# COD attention kernels on {dev}; Hq={HQ} Hkv={HKV} D={D} K={K} r={R} bf16; auto = {chosen}; "
        f"speed-up = portable ms / auto ms"
    )
    print(
        f"{'N':>7} {'cap':>5} {'win':>5} {'T':>7} "
        + " ".join(f"{f + ' fwd':>13} {'f+b':>8} {'bwd':>8} {'TF/s':>5} {'MiB':>6}" for f in FAMILIES)
        + f" {'fwd x':>6} {'bwd x':>6}  rel-L2 auto vs portable"
    )
    rows = []
    for n, cap, window, sink in cases:
        lay = make_layout(n, cap)
        t = lay.num_tokens
        q, k, v, go = inputs(t)
        qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
        pairs = allowed_pairs(cod_attention_metadata(lay, window=window, sink=sink))

        def fwd():
            with torch.no_grad():
                return cod_attention(q, k, v, lay, window=window, sink=sink)

        def fwd_bwd():
            out = cod_attention(qg, kg, vg, lay, window=window, sink=sink)
            return [out.detach()] + list(torch.autograd.grad(out, [qg, kg, vg], go))

        row = {"N": n, "max_anchors": cap, "window": window, "sink": sink, "T": t, "pairs": pairs, "kernels": {}}
        results = {}
        for family in FAMILIES:
            with kernel_family(family):
                results[family] = [x.float() for x in fwd_bwd()]
                fwd_ms, fb_ms = cuda_time(fwd), cuda_time(fwd_bwd)
                mem = peak_mem(fwd_bwd)
            bwd_ms = max(fb_ms - fwd_ms, 1e-6)
            row["kernels"][family] = {
                "fwd_ms": fwd_ms,
                "fwd_bwd_ms": fb_ms,
                "bwd_ms": bwd_ms,
                "bwd_tflops": pairs * 4 * D * HQ * 2.5 / (bwd_ms * 1e-3) / 1e12,
                "fwd_bwd_mem_mib": mem,
                "finite": all(bool(torch.isfinite(x).all()) for x in results[family]),
            }
        a, p = row["kernels"]["auto"], row["kernels"]["portable"]
        row["fwd_speedup"] = p["fwd_ms"] / a["fwd_ms"]
        row["bwd_speedup"] = p["bwd_ms"] / a["bwd_ms"]
        row["rel_l2_auto_vs_portable"] = {
            name: float((x - y).norm() / y.norm().clamp_min(1e-30))
            for name, x, y in zip(("out", "dq", "dk", "dv"), results["auto"], results["portable"])
        }
        print(
            f"{n:>7} {str(cap):>5} {str(window):>5} {t:>7} "
            + " ".join(
                f"{c['fwd_ms']:>13.2f} {c['fwd_bwd_ms']:>8.2f} {c['bwd_ms']:>8.2f} {c['bwd_tflops']:>5.0f} "
                f"{c['fwd_bwd_mem_mib']:>6.0f}"
                for c in (a, p)
            )
            + f" {row['fwd_speedup']:>6.2f} {row['bwd_speedup']:>6.2f}  "
            + " ".join(f"{k_}={e:.1e}" for k_, e in row["rel_l2_auto_vs_portable"].items())
            + ("" if a["finite"] and p["finite"] else "  NON-FINITE"),
            flush=True,
        )
        rows.append(row)
        q = k = v = go = qg = kg = vg = results = None
        torch.cuda.empty_cache()
    (out_dir / "bench_attention_kernels.json").write_text(
        json.dumps({"device": dev, "torch": torch.__version__, "auto": chosen, "rows": rows}, indent=1)
    )
    print(f"wrote {out_dir / 'bench_attention_kernels.json'}")


# ---------------------------------------------------------------- pytest-benchmark entries
def _has_cuda():
    try:
        import peagle_ext

        return torch.cuda.is_available() and peagle_ext.has_cuda_kernels()
    except Exception:  # noqa: BLE001
        return False


try:
    import pytest

    @pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU and the CUDA build")
    @pytest.mark.parametrize("n,cap", [(8192, 1024), (4096, None)])
    def test_bench_cod_attention_cuda_fwd_bwd(benchmark, n, cap):
        lay = make_layout(n, cap)
        q, k, v, go = inputs(lay.num_tokens)
        q, k, v = (x.requires_grad_(True) for x in (q, k, v))

        def run():
            out = cod_attention(q, k, v, lay)
            torch.autograd.grad(out, [q, k, v], go)
            torch.cuda.synchronize()

        benchmark(run)

    def test_bench_cod_attention_cpu_fwd_bwd(benchmark):
        g = torch.Generator().manual_seed(0)
        doc = torch.zeros(1024, dtype=torch.int32)
        lay = cod_sample(doc, torch.ones(1024, dtype=torch.bool), num_depths=8, seed=0)
        t = lay.num_tokens
        q = torch.randn(t, 4, 64, generator=g, requires_grad=True)
        k = torch.randn(t, 2, 64, generator=g, requires_grad=True)
        v = torch.randn(t, 2, 64, generator=g, requires_grad=True)

        def run():
            out = cod_attention(q, k, v, lay, window=256)
            out.sum().backward()

        benchmark.pedantic(run, rounds=2, iterations=1)

    def test_bench_cod_attention_cpu_main_job(benchmark):
        """The main job's attention on one thread: one 512-token document, K=4, SmolLM2's heads
        (9 q, 3 kv, D 64), bf16 (CPU autocast), forward + backward."""
        g = torch.Generator().manual_seed(0)
        lay = cod_sample(torch.zeros(512, dtype=torch.int32), torch.ones(512, dtype=torch.bool), num_depths=4, seed=0)
        t = lay.num_tokens
        q, k, v = (torch.randn(t, h, 64, generator=g).bfloat16().requires_grad_(True) for h in (9, 3, 3))
        go = torch.randn(t, 9, 64, generator=g).bfloat16()
        benchmark.group = "cod_attention cpu main job N=512 K=4"

        def run():
            torch.autograd.grad(cod_attention(q, k, v, lay), [q, k, v], go)

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            benchmark.pedantic(run, rounds=5, iterations=1, warmup_rounds=1)
        finally:
            torch.set_num_threads(threads)
except ImportError:  # pragma: no cover
    pass


if __name__ == "__main__":
    if "--kernels" in sys.argv:
        kernels_main()
    else:
        main()
