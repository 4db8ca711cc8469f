"""What one training step has to do and where its GPU time goes: the matmul floor of a layout
(step_flops_floor), the cuBLAS rates it is priced at (gemm_rates), the bytes the step's
bandwidth-bound work must move (step_bytes_floor) and the memory speed they are priced at
(copy_rate), and the profiled kernel time by class (profile_step). Used by bench_train_step.py;
importable without a GPU."""

from __future__ import annotations

import time

from peagle_ext.train.profiling import idle_by_host, time_by_class


def gemm_rates(env, vocab):
    """cuBLAS bf16 TF/s (fp32 on the CPU) on the step's two GEMM shapes: the head ([2048, H] x
    [H, vocab]) and the MLP ([8192, H] x [H, I]); measured once per shape in this run."""
    torch, dev = env["torch"], env["dev"]
    h, i_sz = env["vcfg"].hidden_size, env["vcfg"].intermediate_size
    key = (h, i_sz, vocab)
    if key in env["rates"]:
        return env["rates"][key]
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    out = {}
    for key, (m, nn) in {"head": (2048, vocab), "body": (8192, i_sz)}.items():
        a = torch.randn(m, h, device=dev, dtype=dt)
        b = torch.randn(h, nn, device=dev, dtype=dt)
        reps = 20 if dev.type == "cuda" else 2
        for _ in range(2):
            a @ b
        sync(env)
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        sync(env)
        out[key] = 2.0 * m * h * nn * reps / (time.perf_counter() - t) / 1e12
        del a, b
    env["rates"][key] = out
    return out


def copy_rate(env, nbytes: int = 2**30):
    """Memory speed in GB/s (bytes read plus bytes written per second) of a plain copy of an
    `nbytes` buffer: what a bandwidth-bound kernel reaches on this device. Measured once per run."""
    if "copy_gbps" in env:
        return env["copy_gbps"]
    torch, dev = env["torch"], env["dev"]
    if dev.type != "cuda":
        nbytes = min(nbytes, 2**26)  # the CPU smoke test: a rate, not a benchmark
    src = torch.empty(nbytes // 4, device=dev, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    reps = 20 if dev.type == "cuda" else 3
    dst.copy_(src)
    sync(env)
    t = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(env)
    env["copy_gbps"] = 2.0 * src.numel() * 4 * reps / (time.perf_counter() - t) / 1e9
    del src, dst
    return env["copy_gbps"]


def step_bytes_floor(floor: dict, trainable_params: int, vocab: int, logit_bytes: int = 2) -> dict:
    """Bytes the step's two bandwidth-bound parts must move however they are written (floor:
    step_flops_floor's result):
      optimizer  AdamW on fp32 parameters: parameter, gradient and both moments read, parameter
                 and moments written                                    28 * trainable parameters
      loss       each weighted draft logit read once and its gradient written once, each distinct
                 weighted target row's logits read once                 (2 Tw + Mw) * V * logit bytes
    The GEMMs that write and read the logits are in the matmul floor."""
    tw, mw = floor["weighted_rows"], floor["distinct_targets"]
    return {"optimizer": 28.0 * trainable_params, "loss": float((2 * tw + mw) * vocab * logit_bytes)}


def sync(env):
    if env["dev"].type == "cuda":
        env["torch"].cuda.synchronize()


def profile_step(env, step, trace_path=None):
    """Kernel ms per class of one step (CPU smoke test: self time of the leaf ops); on CUDA also
    where the device waits for the host (host activity is recorded too, which slows the host a
    little: the idle time is an upper bound). trace_path: where the step's chrome trace goes (.json.gz:
    gzipped), for attributing a class to its kernels and host ops afterwards."""
    dev = env["dev"]
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        with record_function("peagle.step"):
            step(10_000)
            sync(env)
        wall = time.perf_counter() - t
    by = time_by_class(prof, dev.type, 1)
    out = {
        "classes_ms": {k: round(v, 2) for k, v in by["classes_ms"].items()},
        "kernel_ms": round(by["total_ms"], 2),
        "wall_ms": round(wall * 1e3, 2),
        "top": by["top"],
    }
    if dev.type == "cuda":
        idle = idle_by_host(prof.events(), 1)
        out["device_idle_ms"] = idle["idle_ms"]
        out["idle_by_host_op"] = idle["by_host_op"]
    if trace_path:
        prof.export_chrome_trace(trace_path)  # a path ending in .gz is written gzipped
    return out


def step_flops_floor(layout, weight, cfg, num_layers: int, vocab: int) -> dict:
    """bf16 matmul FLOPs of the work a step cannot avoid on this layout (elementwise work, norms,
    softmaxes and the optimizer are not counted). weight: the loss mask at each token.
      fc            fwd + weight grad on the N unique stream rows        4 * N * 3H * H
      layer-0 q/k/v on the N unique rows (fwd, input and weight grad)    6 * N * 2H * (Hq + 2 Hkv) D
      o_proj + MLP  every token, but only the Tw weighted ones in the
                    last layer (nobody reads the others' output)         6 * rows * (Hq D H + 3 H I)
      layers >= 1   q/k/v on all T tokens                                6 * T * H * (Hq + 2 Hkv) D
      attention     4 D Hq per (query, allowed key) pair, x3.5 with the backward
      heads         draft lm_head fwd + input grad on the Tw rows         4 * Tw * H * V
                    verifier logits at the Mw distinct weighted positions 2 * Mw * H * V
    Returns the FLOPs per group (floats) and the counts."""
    import torch as _t

    from peagle_ext.reference import document_starts

    h, i_sz = cfg.hidden_size, cfg.intermediate_size
    hq = cfg.num_attention_heads
    hkv = getattr(cfg, "num_key_value_heads", None) or hq
    d = getattr(cfg, "head_dim", None) or h // hq
    n, t = layout.seq_len, layout.num_tokens
    doc = layout.document_ids.long()
    a, dep = layout.anchor.long(), layout.depth.long()
    pos = a + dep
    tw = int((weight > 0).sum())
    mw = int(pos[weight > 0].unique().numel())
    starts = document_starts(doc)
    pairs = float(_t.where(doc[a] >= 0, (a - starts[a] + 1) + dep, _t.zeros_like(a)).sum())
    post = 6.0 * (hq * d * h + 3 * h * i_sz)
    body = {
        "fc": 4.0 * n * 3 * h * h,
        "layer0_qkv": 6.0 * n * 2 * h * (hq + 2 * hkv) * d,
        "post": post * (t * (num_layers - 1) + tw),
        "deep_qkv": 6.0 * t * h * (hq + 2 * hkv) * d * (num_layers - 1),
        "attention": 3.5 * 4.0 * d * hq * pairs * num_layers,
    }
    heads = {"draft_head": 4.0 * tw * h * vocab, "verifier_head": 2.0 * mw * h * vocab}
    return {"body": body, "heads": heads, "T": t, "weighted_rows": tw, "distinct_targets": mw}
