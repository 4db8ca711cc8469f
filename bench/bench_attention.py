"""COD attention benchmark: peagle_ext.attention.cod_attention vs
torch create_block_mask + compiled flex_attention with speculators' P-EAGLE mask_mod, and vs SDPA
causal over all T tokens (flash backend, a dense kernel doing more work).

Layouts: one document of N tokens, every position loss-masked (the issue's reference numbers:
N=8K max_anchors=1024 -> T~10.6K, N=4K uncapped -> T~13.8K), r=0.7, K=8. 32 q heads, 8 kv
heads, D=128 (BENCH_D=64 for the other head dim), bf16. Times include the metadata build (ours) /
create_block_mask (flex). "ours" runs the default kernels (wgmma on sm_90); at two sizes the
mma.sync kernels are timed too.

  python bench/bench_attention.py            # table + $OUT/bench_attention.json (or ./bench_out)
  QUICK=1 python bench/bench_attention.py    # fewer sizes
  python bench/bench_attention.py --fwd-configs   # forward only, every CTA shape (FWD_CONFIGS, incl.
                                                  # the sm_90 wgmma forward; FWD_NAMES=mma,wgmma
                                                  # to pick) vs the first: ms, TF/s, ratio, max|diff|
  python bench/bench_attention.py --bwd-configs   # fwd+bwd under each backward variant
                                                  # (BWD_CONFIGS: deterministic / atomic dQ / wgmma
                                                  # dQ+dK/dV; BWD_NAMES=mma,wgmma to pick) vs the
                                                  # first: ms, bwd TF/s, ratio, grad diffs, memory
  python bench/bench_attention.py --sanitize # one small fwd+bwd (for compute-sanitizer)
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


# Forward kernels (env read per call by the CUDA glue): the mma.sync forward's CTA shapes
# (csrc/attention/cuda/cod_attn_configs.cuh), 16 or 32 query rows per warp (PEAGLE_ATTN_FWD_MF=1|2)
# x 4 or 8 warps (PEAGLE_ATTN_FWD_WARPS); the sm_90a wgmma forward; "auto" = what runs without the
# env (wgmma on sm_90, mma elsewhere).
FWD_CONFIGS = {
    "mma": {"PEAGLE_ATTN_FWD": "mma"},  # mma.sync, 16 rows per warp; 8 warps at D=64, 4 at D=128
    "mf1w8": {"PEAGLE_ATTN_FWD_WARPS": "8"},
    "mf1w4": {"PEAGLE_ATTN_FWD_WARPS": "4"},
    "mf2w4": {"PEAGLE_ATTN_FWD_MF": "2"},
    "mf2w8": {"PEAGLE_ATTN_FWD_MF": "2", "PEAGLE_ATTN_FWD_WARPS": "8"},
    # one warpgroup per 64 query rows on sm_90a warpgroup MMAs (only where the GPU is sm_90)
    "wgmma": {"PEAGLE_ATTN_FWD": "wgmma", "PEAGLE_ATTN_WGMMA_PIPE": "0"},  # unpipelined (unset = 2)
    # its pipelined key-block loops (PEAGLE_ATTN_WGMMA_PIPE, bitwise the same results): 1 = O += P V
    # left in flight; 2 = the softmax of the next block overlapped with P V (FlashAttention-3 style)
    "wgmma_pipe1": {"PEAGLE_ATTN_FWD": "wgmma", "PEAGLE_ATTN_WGMMA_PIPE": "1"},
    "wgmma_pipe": {"PEAGLE_ATTN_FWD": "wgmma", "PEAGLE_ATTN_WGMMA_PIPE": "2"},
    "auto": {},
}
_FWD_ENV_KEYS = ("PEAGLE_ATTN_FWD_MF", "PEAGLE_ATTN_FWD_WARPS", "PEAGLE_ATTN_FWD", "PEAGLE_ATTN_WGMMA_PIPE")


class env_config:
    """Context manager: clear the variables `keys`, set `env`, restore all of `keys` on exit."""

    def __init__(self, env, keys):
        self.env, self.keys = env, keys

    def __enter__(self):
        self.saved = {k: os.environ.pop(k) for k in self.keys if k in os.environ}
        os.environ.update(self.env)

    def __exit__(self, *exc):
        for k in self.keys:
            os.environ.pop(k, None)
        os.environ.update(self.saved)


def fwd_config(name):
    """Context manager: run the CUDA forward as `name` of FWD_CONFIGS."""
    return env_config(FWD_CONFIGS[name], _FWD_ENV_KEYS)


# Backward variants (env PEAGLE_ATTN_BWD, read per call by the CUDA glue, csrc/attention/cuda/
# cod_attn_bwd.cuh launch_bwd): "mma", the deterministic mma.sync backward (separate query-major dQ
# pass: 7 matmuls per pair), "atomic" (dQ summed with fp32 atomics in the key-major dK/dV pass: 5
# matmuls) and "wgmma" (the deterministic one with its dQ and dK/dV passes on sm_90a warpgroup MMAs;
# only where the GPU is sm_90).
BWD_CONFIGS = {
    "mma": {"PEAGLE_ATTN_BWD": "mma"},
    "atomic": {"PEAGLE_ATTN_BWD": "atomic"},
    "wgmma": {"PEAGLE_ATTN_BWD": "wgmma", "PEAGLE_ATTN_WGMMA_PIPE": "0"},  # unpipelined (unset = 2)
    "wgmma64": {
        "PEAGLE_ATTN_BWD": "wgmma",
        "PEAGLE_ATTN_WGMMA_BMQ": "64",  # 64-query blocks at D = 128
        "PEAGLE_ATTN_WGMMA_PIPE": "0",
    },
    # the pipelined dQ and dK/dV loops (PEAGLE_ATTN_WGMMA_PIPE, bitwise the same gradients): 1 =
    # each block's second MMA left in flight; 2 = the dK/dV elementwise overlapped with the previous
    # block's dV / dK MMAs too (FlashAttention-3 style; at D = 128 only with 32-query blocks: the
    # BMQ = 64 pass runs level 1 under 2)
    "wgmma_pipe1": {"PEAGLE_ATTN_BWD": "wgmma", "PEAGLE_ATTN_WGMMA_PIPE": "1"},
    "wgmma_pipe": {"PEAGLE_ATTN_BWD": "wgmma", "PEAGLE_ATTN_WGMMA_PIPE": "2"},
    "wgmma64_pipe": {"PEAGLE_ATTN_BWD": "wgmma", "PEAGLE_ATTN_WGMMA_BMQ": "64", "PEAGLE_ATTN_WGMMA_PIPE": "2"},
    "auto": {},  # what runs without the env: wgmma64 at D=128 / wgmma at D=64 on sm_90, mma elsewhere
}
_BWD_ENV_KEYS = ("PEAGLE_ATTN_BWD", "PEAGLE_ATTN_WGMMA_BMQ", "PEAGLE_ATTN_WGMMA_PIPE")
MMA_ENV = {"PEAGLE_ATTN_FWD": "mma", "PEAGLE_ATTN_BWD": "mma"}  # the mma.sync kernels everywhere


def bwd_config_runs(name):
    """wgmma needs compute capability 9.0 and a build with sm_90a kernels; the others run anywhere."""
    if not name.startswith("wgmma"):
        return True
    import peagle_ext

    return torch.cuda.get_device_capability() == (9, 0) and "90" in peagle_ext.build_info().get("cuda_archs", [])


def bwd_config(name):
    """Context manager: run the CUDA backward as the variant `name` of BWD_CONFIGS."""
    return env_config(BWD_CONFIGS[name], _BWD_ENV_KEYS)


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
    print(f"# COD attention bench on {dev}, torch {torch.__version__}; Hq={HQ} Hkv={HKV} D={D} K={K} r={R} bf16")
    for n in sizes:
        for cap in (None, 1024):
            lay = make_layout(n, cap)
            t = lay.num_tokens
            row = {"N": n, "max_anchors": cap, "T": t}
            row["ours"] = bench_ours(lay)
            if (n, cap) in ((8192, 1024), (4096, None)) and bwd_config_runs("wgmma"):
                # the mma.sync kernels (forward and backward) against the default (wgmma) ones;
                # --fwd-configs / --bwd-configs time every variant
                with env_config(MMA_ENV, _FWD_ENV_KEYS + _BWD_ENV_KEYS):
                    alt = bench_ours(lay)
                row["ours_mma"] = {"fwd_ms": alt["fwd_ms"], "fwd_bwd_ms": alt["fwd_bwd_ms"]}
                print(
                    f"  mma.sync kernels at N={n} cap={cap}: fwd {alt['fwd_ms']:.2f} ms vs {row['ours']['fwd_ms']:.2f} "
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
        json.dumps({"device": dev, "torch": torch.__version__, "rows": rows, "notes": notes}, indent=1)
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


def _variant_cases():
    """(output dir, (N, max_anchors, window, sink) cases) of --fwd-configs / --bwd-configs: the
    bench layouts plus a windowed one (QUICK: up to 8K)."""
    out_dir = Path(os.environ.get("OUT", "bench_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    cases = [(4096, None, None, 0), (8192, 1024, None, 0), (8192, None, None, 0), (8192, None, 1024, 4)]
    if os.environ.get("QUICK", "0") in ("", "0"):
        cases += [(32768, None, None, 0), (131072, 1024, None, 0)]
    return out_dir, cases


def _variant_names(env_var, configs, what):
    """The variants named in env_var (comma list; default: all of `configs`) that run here (wgmma
    ones need an sm_90 GPU, bwd_config_runs); the first is the baseline. Prints the skipped ones."""
    wanted = [x for x in os.environ.get(env_var, "").split(",") if x] or list(configs)
    names = [nm for nm in wanted if nm in configs and bwd_config_runs(nm)]
    skipped = [nm for nm in wanted if nm not in names]
    if skipped:
        print(f"# skipped {what} variants (not runnable here or unknown): {skipped}")
    return names


def fwd_configs_main():
    """Forward only, every variant of FWD_CONFIGS on the bench layouts (plus a windowed one):
    time, useful TF/s, speed-up over the baseline (the first name), and max |diff| of out against it."""
    out_dir, cases = _variant_cases()
    dev = torch.cuda.get_device_name()
    names = _variant_names("FWD_NAMES", FWD_CONFIGS, "forward")  # e.g. FWD_NAMES=mma,wgmma
    print(
        f"# COD attention forward variants on {dev}; Hq={HQ} Hkv={HKV} D={D} K={K} r={R} bf16; "
        f"ratio = {names[0]} ms / variant ms (>1: faster than {names[0]})"
    )
    print(
        f"{'N':>7} {'cap':>5} {'win':>5} {'T':>7} "
        + " ".join(f"{nm + ' ms':>10} {'TF/s':>5} {'ratio':>5}" for nm in names)
        + f"  max|diff| vs {names[0]}"
    )
    rows = []
    for n, cap, window, sink in cases:
        lay = make_layout(n, cap)
        t = lay.num_tokens
        q, k, v, _ = inputs(t)
        pairs = allowed_pairs(cod_attention_metadata(lay, window=window, sink=sink))
        row = {"N": n, "max_anchors": cap, "window": window, "sink": sink, "T": t, "pairs": pairs, "configs": {}}
        ref = None
        for name in names:
            with fwd_config(name), torch.no_grad():
                out = cod_attention(q, k, v, lay, window=window, sink=sink)
                ms = cuda_time(lambda: cod_attention(q, k, v, lay, window=window, sink=sink))  # noqa: B023
            if ref is None:
                ref = out.float()
            diff = float((out.float() - ref).abs().max())
            row["configs"][name] = {
                "fwd_ms": ms,
                "fwd_tflops": tflops(pairs, ms),
                "max_abs_diff_vs_baseline": diff,
                "finite": bool(torch.isfinite(out).all()),
            }
            del out
        base = row["configs"][names[0]]["fwd_ms"]
        for c in row["configs"].values():
            c["speedup_vs_baseline"] = base / c["fwd_ms"]
        cs = row["configs"]
        print(
            f"{n:>7} {str(cap):>5} {str(window):>5} {t:>7} "
            + " ".join(
                f"{cs[nm]['fwd_ms']:>10.3f} {cs[nm]['fwd_tflops']:>5.0f} {cs[nm]['speedup_vs_baseline']:>5.2f}"
                for nm in names
            )
            + "  "
            + " ".join(f"{nm}:{cs[nm]['max_abs_diff_vs_baseline']:.4f}" for nm in names[1:])
            + ("" if all(c["finite"] for c in cs.values()) else "  NON-FINITE OUTPUT"),
            flush=True,
        )
        rows.append(row)
        q = k = v = ref = None
        torch.cuda.empty_cache()
    (out_dir / "bench_attention_fwd_configs.json").write_text(
        json.dumps(
            {
                "device": dev,
                "torch": torch.__version__,
                "baseline": names[0],
                "configs": {nm: FWD_CONFIGS[nm] for nm in names},
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {out_dir / 'bench_attention_fwd_configs.json'}")


def bwd_configs_main():
    """fwd+bwd under every backward variant of BWD_CONFIGS, on the bench layouts plus a windowed
    one: fwd+bwd ms, backward ms (fwd+bwd minus the forward alone), backward useful TF/s (5 matmuls
    per allowed pair: 2.5x the forward's FLOPs) and its distance from the dense bf16 peak, speed-up
    over the baseline (the first name), peak extra memory, and the gradients' relative L2 difference
    from the baseline."""
    out_dir, cases = _variant_cases()
    dev = torch.cuda.get_device_name()
    names = _variant_names("BWD_NAMES", BWD_CONFIGS, "backward")  # e.g. BWD_NAMES=mma,wgmma
    print(
        f"# COD attention backward variants on {dev}; Hq={HQ} Hkv={HKV} D={D} K={K} r={R} bf16; forward as the env "
        f"says (auto if unset); bwd = f+b - fwd; ratio = {names[0]} ms / variant ms (>1: faster); floor = bwd "
        f"FLOPs at {PEAK_BF16_TFLOPS:.0f} TF/s"
    )
    print(
        f"{'N':>7} {'cap':>5} {'win':>5} {'T':>7} {'fwd ms':>7} "
        + " ".join(f"{nm + ' f+b':>12} {'bwd':>7} {'TF/s':>5} {'xflr':>5} {'ratio':>5} {'MiB':>6}" for nm in names)
        + f"  grads rel-L2 vs {names[0]}"
    )
    rows = []
    for n, cap, window, sink in cases:
        lay = make_layout(n, cap)
        t = lay.num_tokens
        q, k, v, go = inputs(t)
        qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
        pairs = allowed_pairs(cod_attention_metadata(lay, window=window, sink=sink))
        bwd_flop_ms = pairs * 4 * D * HQ * 2.5 / (PEAK_BF16_TFLOPS * 1e12) * 1e3

        def fwd():
            with torch.no_grad():
                return cod_attention(q, k, v, lay, window=window, sink=sink)

        def fwd_bwd():
            out = cod_attention(qg, kg, vg, lay, window=window, sink=sink)
            return torch.autograd.grad(out, [qg, kg, vg], go)

        fwd_ms = cuda_time(fwd)
        row = {
            "N": n,
            "max_anchors": cap,
            "window": window,
            "sink": sink,
            "T": t,
            "pairs": pairs,
            "fwd_ms": fwd_ms,
            "bwd_floor_ms": bwd_flop_ms,
            "configs": {},
        }
        ref = None
        for name in names:
            with bwd_config(name):
                grads = fwd_bwd()
                ms = cuda_time(fwd_bwd)
                mem = peak_mem(fwd_bwd)
            c = {
                "fwd_bwd_ms": ms,
                "bwd_ms": ms - fwd_ms,
                "fwd_bwd_mem_mib": mem,
                "finite": all(bool(torch.isfinite(x).all()) for x in grads),
            }
            c["bwd_tflops"] = pairs * 4 * D * HQ * 2.5 / (max(c["bwd_ms"], 1e-6) * 1e-3) / 1e12
            c["bwd_vs_floor"] = c["bwd_ms"] / bwd_flop_ms
            if ref is None:
                ref = [x.float() for x in grads]
            c["rel_l2_vs_baseline"] = {
                gname: float((x.float() - r).norm() / r.norm().clamp_min(1e-30))
                for gname, x, r in zip(("dq", "dk", "dv"), grads, ref)
            }
            c["max_abs_diff_vs_baseline"] = {
                gname: float((x.float() - r).abs().max()) for gname, x, r in zip(("dq", "dk", "dv"), grads, ref)
            }
            row["configs"][name] = c
            del grads
        base = row["configs"][names[0]]
        for c in row["configs"].values():
            c["fwd_bwd_speedup_vs_baseline"] = base["fwd_bwd_ms"] / c["fwd_bwd_ms"]
            c["bwd_speedup_vs_baseline"] = base["bwd_ms"] / max(c["bwd_ms"], 1e-6)
        cs = row["configs"]
        print(
            f"{n:>7} {str(cap):>5} {str(window):>5} {t:>7} {fwd_ms:>7.2f} "
            + " ".join(
                f"{cs[nm]['fwd_bwd_ms']:>12.2f} {cs[nm]['bwd_ms']:>7.2f} {cs[nm]['bwd_tflops']:>5.0f} "
                f"{cs[nm]['bwd_vs_floor']:>5.1f} {cs[nm]['bwd_speedup_vs_baseline']:>5.2f} "
                f"{cs[nm]['fwd_bwd_mem_mib']:>6.0f}"
                for nm in names
            )
            + "  "
            + " ".join(
                f"{nm}:" + ",".join(f"{g}={e:.1e}" for g, e in cs[nm]["rel_l2_vs_baseline"].items()) for nm in names[1:]
            )
            + ("" if all(c["finite"] for c in cs.values()) else "  NON-FINITE GRADIENTS"),
            flush=True,
        )
        rows.append(row)
        q = k = v = go = qg = kg = vg = ref = None
        torch.cuda.empty_cache()
    (out_dir / "bench_attention_bwd_configs.json").write_text(
        json.dumps(
            {
                "device": dev,
                "torch": torch.__version__,
                "baseline": names[0],
                "configs": {nm: BWD_CONFIGS[nm] for nm in names},
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {out_dir / 'bench_attention_bwd_configs.json'}")


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
except ImportError:  # pragma: no cover
    pass


if __name__ == "__main__":
    if "--fwd-configs" in sys.argv:
        fwd_configs_main()
    elif "--bwd-configs" in sys.argv:
        bwd_configs_main()
    else:
        main()
