"""Quality at equal work: peagle_ext vs speculators 0.9.0's P-EAGLE model, side by side.

Both drafters start from the SAME weights (ours, copied into speculators' model by name) and
train on the same packed ShareGPT rows with SmolLM2-135M verifier states, the same COD samples,
the same optimizer (AdamW, warmup + cosine, grad clip 1.0) and the same number of steps:

- peagle_ext: `PEagleDraftModel.forward_backward` (COD attention op + fused linear-KL op).
- speculators: its own `PEagleDraftModel.forward` (its mask_mod, its attention, its loss and
  per-depth metrics). Its forward draws COD indices by calling the module-global
  `generate_cod_sample_indices`; for each call we replace that name in
  `speculators.models.peagle.core` with a function returning OUR layout's (anchor, depth)
  (peagle_ext.integrations.speculators.speculators_layout), so both see identical token sets. Our layout has
  the two docs/design.md fixes (no chain crosses a document, no anchor -1); on such a layout the two
  attention rules are the same, so any difference measured here comes from the model/loss code.
  Its loss is mean KL over the loss-masked sampled tokens (+1e-5 in the denominator); ours the
  same mean without the epsilon.
- Attention backend of speculators: on CPU its `--draft-attn-impl sdpa` (its own mask_mod
  evaluated densely by torch's create_mask, then SDPA; FlexAttention has no CPU backward, so its
  default flex path cannot train on CPU); on CUDA its default flex_attention, with its forward
  run uncompiled and flex_attention + create_block_mask compiled (bench_train_step.py explains
  why its fully compiled forward is impractical).

Reported: per-step train loss and per-depth accuracy of both (identical data => the curves must
track each other; floating-point summation order is the only source of divergence), and a
held-out evaluation (fixed layouts) at step 0 and at the end with binomial standard errors.
Verdict: |delta acc| at every depth within 3 standard errors (+0.5% absolute) and |delta loss|
within 5% relative.

CPU (a few minutes on 2 cores; hidden states are cached under ~/.cache/peagle_ext/bench_quality):
    PYTHONPATH=/tmp/specsite:$PWD python bench/bench_quality.py      (1 layer, seq 256, 120 steps)
GPU:
    PYTHONPATH=/tmp/site:$PWD python bench/bench_quality.py --device cuda --seq-len 2048 \
        --steps 300 --num-depths 8 --draft-vocab 0 --train-rows 300 --val-rows 16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

import peagle_ext.integrations.speculators as S


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--num-depths", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--train-rows", type=int, default=40, help="distinct packed training rows (cycled)")
    p.add_argument("--val-rows", type=int, default=6)
    p.add_argument("--num-conversations", type=int, default=400)
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=8192,
        help="draft vocab size (most frequent assistant tokens); 0 = the full vocab",
    )
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-noise-ref",
        dest="noise_ref",
        action="store_false",
        help="skip the noise reference (a rounding-perturbed copy of our model trained alongside)",
    )
    p.add_argument("--spec-attn", default=None, help="speculators attention: sdpa (CPU default) | flex (CUDA default)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--cache-dir", default=None)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
def load_data(a, device):
    from peagle_ext import data as D
    from peagle_ext.data import HiddenStateCache, packed_fingerprint

    t0 = time.time()
    vdtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    verifier, tok = D.load_verifier("smollm2", device=device, dtype=vdtype)
    vcfg = verifier.config
    vocab = int(vcfg.vocab_size)
    convs = D.load_conversations("sharegpt", limit=a.num_conversations)
    g = torch.Generator().manual_seed(a.seed)
    order = torch.randperm(len(convs), generator=g).tolist()
    n_val = max(1, len(convs) // 10)
    val_c = [convs[i] for i in order[:n_val]]
    train_c = [convs[i] for i in order[n_val:]]
    tok_train, _ = D.tokenize_conversations(tok, train_c, max_len=a.seq_len)
    tok_val, _ = D.tokenize_conversations(tok, val_c, max_len=a.seq_len)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    train_rows = D.pack_conversations(tok_train, a.seq_len, pad_token_id=pad)[: a.train_rows]
    val_rows = D.pack_conversations(tok_val, a.seq_len, pad_token_id=pad)[: a.val_rows]
    if len(train_rows) < a.train_rows or len(val_rows) < a.val_rows:
        print(
            f"note: only {len(train_rows)} train / {len(val_rows)} val rows of {a.seq_len} tokens "
            f"from {a.num_conversations} conversations",
            flush=True,
        )
    counts = torch.zeros(vocab, dtype=torch.long)
    for r in train_rows:
        counts += torch.bincount(r.input_ids[r.loss_mask], minlength=vocab)[:vocab]
    aux_ids = D.default_aux_layer_ids(int(vcfg.num_hidden_layers))
    root = a.cache_dir or os.path.join(str(D.cache_root()), "bench_quality")

    def states(rows, tag):
        key = packed_fingerprint(rows)[:16]
        cache = HiddenStateCache(
            os.path.join(root, f"{tag}-{a.seq_len}-{key}"),
            meta={"verifier": "smollm2", "dtype": str(vdtype), "aux": aux_ids},
        )
        cache.generate(verifier, rows, aux_ids, rows_per_shard=8, dtype=torch.float32)
        return [ex for ex in cache]

    train = states(train_rows, "train")
    val = states(val_rows, "val")
    print(
        f"data: {len(train)} train / {len(val)} val rows of {a.seq_len} tokens, "
        f"{sum(int(e.loss_mask.sum()) for e in train)} train loss tokens, verifier states in "
        f"{time.time() - t0:.1f}s",
        flush=True,
    )
    return verifier, tok, vcfg, aux_ids, counts, train, val


def build_models(a, device, verifier, tok, vcfg, aux_ids, counts):
    from peagle_ext.model import PEagleDraftModel, PEagleOptions, build_vocab_mapping, resolve_mask_token_id

    vocab = int(vcfg.vocab_size)
    mask_id, how = resolve_mask_token_id(tok, vocab)
    dv = a.draft_vocab if a.draft_vocab and a.draft_vocab < vocab else None
    d2t = build_vocab_mapping(counts, dv)[0] if dv else None
    torch.manual_seed(a.seed)
    ours = PEagleDraftModel.from_verifier(
        vcfg,
        num_layers=a.num_layers,
        num_depths=a.num_depths,
        mask_token_id=mask_id,
        draft_vocab_size=dv,
        aux_layer_ids=aux_ids,
        d2t=d2t,
        verifier_name_or_path="smollm2",
        options=PEagleOptions(train_embeddings="all"),
    )  # speculators trains the whole embedding
    base = verifier.get_decoder() if hasattr(verifier, "get_decoder") else verifier.model
    ours.attach_verifier(
        norm_weight=base.norm.weight.detach().float().cpu(),
        lm_head_weight=verifier.get_output_embeddings().weight.detach().float().cpu(),
        norm_eps=getattr(vcfg, "rms_norm_eps", 1e-6),
        embed_weight=verifier.get_input_embeddings().weight.detach().float().cpu(),
    )
    ours.to(device)
    attn = a.spec_attn or ("sdpa" if device.type == "cpu" else "flex")
    impl = {"flex": "simple_flex_attention"}.get(attn, attn)
    spec, core = S.make_speculators_twin(ours, attn_impl=impl, device=device)
    if spec.d2t is not None:  # draft vocab: speculators holds the same mapping buffers
        with torch.no_grad():
            spec.d2t.copy_(ours.d2t)
            spec.t2d.copy_(ours.t2d)
    if device.type == "cuda":
        # its forward as a plain function; FlexAttention pieces compiled (see bench_train_step.py)
        import speculators.models.attention as spec_attn
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        type(spec).forward = S.uncompiled(type(spec).forward)
        # dynamic shapes: T changes every step (as in bench_train_step.py's spec_eager case)
        spec_attn.flex_attention = torch.compile(flex_attention, dynamic=True)
        spec._create_mask_fn = torch.compile(create_block_mask, dynamic=True)
    print(
        f"models: {a.num_layers} layer(s), K={a.num_depths}, draft vocab {dv or vocab} of {vocab}, mask token "
        f"{mask_id} ({how}); speculators attention: {impl}",
        flush=True,
    )
    return ours, spec, core, impl


def make_opt(model, a):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)

    def lam(step):
        if step < a.warmup:
            return (step + 1) / a.warmup
        t = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lam), params


def same_trainable_sets(ours, spec):
    a = {n for n, p in ours.named_parameters() if p.requires_grad}
    b = {n for n, p in spec.named_parameters() if p.requires_grad}
    if a != b:
        raise RuntimeError(f"trainable parameters differ: ours-only {sorted(a - b)}, speculators-only {sorted(b - a)}")
    return sorted(a)


def evaluate(model, rows, layouts, k, amp, device, *, spec_core=None, loss_cfg=None):
    """Held-out loss and per-depth accuracy of one model on fixed layouts (a peagle_ext model, or
    speculators' when spec_core is given)."""
    loss_sum = w_sum = 0.0
    cs, ts = [0.0] * k, [0.0] * k
    ctx = torch.autocast(device.type, dtype=amp) if amp else torch.autocast(device.type, enabled=False)
    with torch.no_grad(), ctx:
        for ex, lay in zip(rows, layouts):
            ex = ex.to(device)
            w = float(ex.loss_mask.to(device)[(lay.anchor.long() + lay.depth.long())].float().sum())
            if spec_core is None:
                lo, mo = model(ex, lay)
                c, t = [float(x) for x in mo["correct"]], [float(x) for x in mo["total"]]
            else:
                lo, mo = S.speculators_forward(
                    model, spec_core, S.speculators_batch(ex, device), num_depths=k, loss_config=loss_cfg, layout=lay
                )
                c, t = S.speculators_per_depth(mo, k)
            loss_sum += float(lo) * w
            w_sum += w
            cs = [x + y for x, y in zip(cs, c)]
            ts = [x + y for x, y in zip(ts, t)]
    return {
        "loss": loss_sum / max(w_sum, 1e-9),
        "acc": [c / t if t else 0.0 for c, t in zip(cs, ts)],
        "counted": [int(t) for t in ts],
    }


def evaluate_all(models, spec_core, loss_cfg, rows, layouts, k, amp, device):
    return {
        name: evaluate(
            m, rows, layouts, k, amp, device, spec_core=spec_core if name == "spec" else None, loss_cfg=loss_cfg
        )
        for name, m in models.items()
    }


def param_distance(m1, m2, init):
    """||theta_1 - theta_2|| / ||theta_1 - theta_init|| over the trainable parameters."""
    p2 = dict(m2.named_parameters())
    num = den = 0.0
    for n, p in m1.named_parameters():
        if not p.requires_grad:
            continue
        num += float((p.detach() - p2[n].detach()).double().pow(2).sum())
        den += float((p.detach() - init[n]).double().pow(2).sum())
    return math.sqrt(num) / max(math.sqrt(den), 1e-30)


def compare_gradients(ours, spec, core, loss_cfg, ex, k, amp, device):
    """One forward+backward of both models on the same row and layout, before any update:
    loss and every trainable parameter's gradient, max |g_ours - g_spec| / max |g_ours|."""
    from peagle_ext.cod import cod_sample

    lay = cod_sample(ex.document_ids, ex.loss_mask, num_depths=k, seed=4242).to(device)
    ours.zero_grad(set_to_none=True)
    spec.zero_grad(set_to_none=True)
    m = ours.forward_backward(ex, lay, autocast_dtype=amp)
    ctx = torch.autocast(device.type, dtype=amp) if amp else torch.autocast(device.type, enabled=False)
    with ctx:
        ls, _ = S.speculators_forward(
            spec, core, S.speculators_batch(ex, device), num_depths=k, loss_config=loss_cfg, layout=lay
        )
    ls.backward()
    sp = dict(spec.named_parameters())
    per = {}
    for n, p in ours.named_parameters():
        if not p.requires_grad:
            continue
        g1, g2 = p.grad, sp[n].grad
        if g1 is None or g2 is None:
            per[n] = None if (g1 is None and g2 is None) else float("inf")
            continue
        per[n] = float((g1.float() - g2.float()).abs().max() / (g1.float().abs().max() + 1e-30))
    worst = max((v for v in per.values() if v is not None), default=0.0)
    ours.zero_grad(set_to_none=True)
    spec.zero_grad(set_to_none=True)
    return {
        "loss_ours": m["loss_sum"] / max(m["weight"], 1e-9),
        "loss_spec": float(ls),
        "per_param_rel": per,
        "worst_rel": worst,
        "worst_param": max(per, key=lambda n: -1 if per[n] is None else per[n]),
    }


def verdict(ev, k):
    rows = []
    ok = True
    for d in range(k):
        n = ev["ours"]["counted"][d]
        ref = ev["ref"]["acc"][d] if "ref" in ev else None
        p1, p2 = ev["ours"]["acc"][d], ev["spec"]["acc"][d]
        se = math.sqrt(max(p1 * (1 - p1), 1e-12) / max(n, 1) + max(p2 * (1 - p2), 1e-12) / max(n, 1))
        diff = p1 - p2
        good = abs(diff) <= 3 * se + 0.005
        ok &= good
        rows.append(
            {
                "depth": d,
                "ours": p1,
                "speculators": p2,
                "diff": diff,
                "se": se,
                "within_noise": good,
                "n": n,
                "noise_ref": ref,
                "ref_diff": None if ref is None else p1 - ref,
            }
        )
    l1, l2 = ev["ours"]["loss"], ev["spec"]["loss"]
    loss_ok = abs(l1 - l2) <= 0.05 * max(abs(l1), abs(l2), 1e-6)
    return ok and loss_ok, rows, loss_ok


def main(argv=None):
    a = parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cpu" and a.threads:
        torch.set_num_threads(a.threads)
    os.makedirs(a.out, exist_ok=True)
    t_start = time.time()
    S.import_speculators()  # stub modules in place before anything imports speculators
    verifier, tok, vcfg, aux_ids, counts, train, val = load_data(a, device)
    ours, spec, core, impl = build_models(a, device, verifier, tok, vcfg, aux_ids, counts)
    del verifier
    trainable = same_trainable_sets(ours, spec)
    k = a.num_depths
    amp = torch.bfloat16 if device.type == "cuda" else None
    loss_cfg = S.speculators_loss_config("fused" if device.type == "cuda" else "eager")
    opt_o, sch_o, par_o = make_opt(ours, a)
    opt_s, sch_s, par_s = make_opt(spec, a)
    # the optimizers must see the parameters in the same order (same names) for equal updates
    names_o = [n for n, p in ours.named_parameters() if p.requires_grad]
    names_s = [n for n, p in spec.named_parameters() if p.requires_grad]
    if names_o != names_s:
        print("note: parameter order differs (AdamW is per-parameter, so this does not matter)", flush=True)

    init = {n: p.detach().clone() for n, p in ours.named_parameters() if p.requires_grad}
    # noise reference: our model again, every trainable weight scaled by (1 + 1e-6 * N(0, 1)) (a
    # few fp32 ulps), trained on the same rows and layouts. How far it ends from `ours` is the
    # spread that rounding alone produces under this training; ours-vs-speculators is judged
    # against it.
    ref = None
    if a.noise_ref:
        import copy as _copy

        ref = _copy.deepcopy(ours)
        gen = torch.Generator(device="cpu").manual_seed(a.seed + 99)
        with torch.no_grad():
            for p in ref.parameters():
                if p.requires_grad:
                    p.mul_(1 + 1e-6 * torch.randn(p.shape, generator=gen).to(p.device, p.dtype))
        opt_r, sch_r, par_r = make_opt(ref, a)
    models = {"ours": ours, "spec": spec, **({"ref": ref} if ref is not None else {})}
    from peagle_ext.cod import cod_sample

    val_layouts = [
        cod_sample(ex.document_ids, ex.loss_mask, num_depths=k, seed=10_000 + i).to(device) for i, ex in enumerate(val)
    ]
    grad_check = compare_gradients(ours, spec, core, loss_cfg, train[0].to(device), k, amp, device)
    print(
        f"step-0 gradients on one row: loss ours {grad_check['loss_ours']:.6f} speculators "
        f"{grad_check['loss_spec']:.6f}; worst relative grad difference {grad_check['worst_rel']:.2e} "
        f"({grad_check['worst_param']})",
        flush=True,
    )
    ev0 = evaluate_all(models, core, loss_cfg, val, val_layouts, k, amp, device)
    print(f"step 0 held-out: ours loss {ev0['ours']['loss']:.5f}, speculators {ev0['spec']['loss']:.5f}", flush=True)

    g = torch.Generator().manual_seed(a.seed + 1)
    order = []
    log = []
    t_loop = time.time()
    time_o = time_s = 0.0
    for step in range(a.steps):
        if not order:
            order = torch.randperm(len(train), generator=g).tolist()
        ex = train[order.pop()].to(device)
        lay = cod_sample(ex.document_ids, ex.loss_mask, num_depths=k, seed=step * 7919 + 17).to(device)
        rec = {"step": step, "T": lay.num_tokens}
        # peagle_ext
        t0 = time.perf_counter()
        opt_o.zero_grad(set_to_none=True)
        m = ours.forward_backward(ex, lay, autocast_dtype=amp)
        gn_o = float(torch.nn.utils.clip_grad_norm_(par_o, 1.0))
        opt_o.step()
        sch_o.step()
        time_o += time.perf_counter() - t0
        rec["ours"] = {
            "loss": m["loss_sum"] / max(m["weight"], 1e-9),
            "grad_norm": gn_o,
            "correct": [int(x) for x in m["correct"]],
            "total": [int(x) for x in m["total"]],
        }
        # speculators (same row, same layout)
        t0 = time.perf_counter()
        opt_s.zero_grad(set_to_none=True)
        ctx = torch.autocast(device.type, dtype=amp) if amp else torch.autocast(device.type, enabled=False)
        with ctx:
            ls, ms = S.speculators_forward(
                spec, core, S.speculators_batch(ex, device), num_depths=k, loss_config=loss_cfg, layout=lay
            )
        ls.backward()
        gn_s = float(torch.nn.utils.clip_grad_norm_(par_s, 1.0))
        opt_s.step()
        sch_s.step()
        time_s += time.perf_counter() - t0
        c, t = S.speculators_per_depth(ms, k)
        rec["spec"] = {
            "loss": float(ls),
            "grad_norm": gn_s,
            "correct": [int(x) for x in c],
            "total": [int(x) for x in t],
        }
        if ref is not None:
            opt_r.zero_grad(set_to_none=True)
            mr = ref.forward_backward(ex, lay, autocast_dtype=amp)
            torch.nn.utils.clip_grad_norm_(par_r, 1.0)
            opt_r.step()
            sch_r.step()
            rec["ref"] = {
                "loss": mr["loss_sum"] / max(mr["weight"], 1e-9),
                "correct": [int(x) for x in mr["correct"]],
                "total": [int(x) for x in mr["total"]],
            }
        log.append(rec)
        if step % 10 == 0 or step == a.steps - 1:
            print(
                f"step {step:4d} T={lay.num_tokens:5d}  loss ours {rec['ours']['loss']:.5f} spec "
                f"{rec['spec']['loss']:.5f}  |grad| {gn_o:.4f} / {gn_s:.4f}  "
                f"({time.time() - t_loop:.0f}s)",
                flush=True,
            )

    ev1 = evaluate_all(models, core, loss_cfg, val, val_layouts, k, amp, device)
    ok, rows, loss_ok = verdict(ev1, k)
    # parameter drift between the two after identical updates
    sp = dict(spec.named_parameters())
    drift = max(
        float((p.detach() - sp[n].detach()).abs().max() / (p.detach().abs().max() + 1e-12))
        for n, p in ours.named_parameters()
        if p.requires_grad
    )
    # how far apart the runs ended relative to how far training moved them (identical math would
    # give ~0; training amplifies rounding differences, see the noise reference)
    dist = {"ours_vs_spec": param_distance(ours, spec, init)}
    if ref is not None:
        dist["ours_vs_ref"] = param_distance(ours, ref, init)
    last = log[-min(20, len(log)) :]

    def window(side):
        c = [sum(r[side]["correct"][d] for r in last) for d in range(k)]
        t = [sum(r[side]["total"][d] for r in last) for d in range(k)]
        return {
            "loss": sum(r[side]["loss"] for r in last) / len(last),
            "acc": [x / y if y else 0.0 for x, y in zip(c, t)],
        }

    summary = {
        "bench": "quality",
        "device": str(device),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
        "settings": vars(a),
        "speculators_attention": impl,
        "trainable_parameters": trainable,
        "step0_gradients": grad_check,
        "max_abs_step_loss_diff": max(abs(r["ours"]["loss"] - r["spec"]["loss"]) for r in log),
        "max_rel_param_drift_end": drift,
        "param_distance_over_update_norm": dist,
        "max_abs_step_loss_diff_ref": max(abs(r["ours"]["loss"] - r["ref"]["loss"]) for r in log)
        if ref is not None
        else None,
        "train_last20": {name: window(name) for name in models},
        "heldout_step0": ev0,
        "heldout_end": ev1,
        "per_depth_end": rows,
        "agree_within_noise": ok,
        "loss_agrees": loss_ok,
        "seconds": {"total": time.time() - t_start, "ours_steps": time_o, "spec_steps": time_s},
        "log": log,
    }
    path = os.path.join(a.out, "bench_quality.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    plot(log, ev1, k, os.path.join(a.out, "bench_quality.png"))
    print_table(summary, k)
    print(f"wrote {path}", flush=True)
    return 0 if ok else 1


def plot(log, ev, k, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # plotting is a convenience; the JSON holds everything
        print(f"no plot: {e}")
        return
    fig, ax = plt.subplots(1, 3, figsize=(16, 4))
    s = [r["step"] for r in log]
    ax[0].plot(s, [r["ours"]["loss"] for r in log], label="peagle_ext", lw=1)
    ax[0].plot(s, [r["spec"]["loss"] for r in log], label="speculators", lw=1, ls="--")
    ax[0].set_xlabel("step")
    ax[0].set_ylabel("train KL loss (same rows, same COD samples)")
    ax[0].legend()
    ax[1].semilogy(
        s, [abs(r["ours"]["loss"] - r["spec"]["loss"]) + 1e-12 for r in log], label="|ours - speculators|", lw=1
    )
    if "ref" in log[0]:
        ax[1].semilogy(
            s,
            [abs(r["ours"]["loss"] - r["ref"]["loss"]) + 1e-12 for r in log],
            label="|ours - ours(weights x (1+1e-6 N(0,1)))|",
            lw=1,
            ls="--",
        )
    ax[1].set_xlabel("step")
    ax[1].set_ylabel("|train loss difference|")
    ax[1].legend(fontsize=8)
    d = list(range(k))
    names = [n for n in ("ours", "spec", "ref") if n in ev]
    width = 0.8 / len(names)
    labels = {"ours": "peagle_ext", "spec": "speculators", "ref": "peagle_ext, perturbed (noise ref)"}
    for j, n in enumerate(names):
        ax[2].bar([x - 0.4 + width * (j + 0.5) for x in d], ev[n]["acc"], width, label=labels[n])
    ax[2].set_xlabel("depth")
    ax[2].set_ylabel("held-out argmax agreement")
    ax[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_table(s, k):
    e = s["heldout_end"]
    has_ref = "ref" in e
    print(
        "\n== quality at equal work ("
        + s["device"]
        + ", "
        + str(s["settings"]["steps"])
        + " steps, speculators attention "
        + s["speculators_attention"]
        + ") =="
    )
    g = s["step0_gradients"]
    print(
        f"step-0 gradients (same weights, row, layout): worst relative difference {g['worst_rel']:.2e} ({g['worst_param']})"
    )
    first = [abs(r["ours"]["loss"] - r["spec"]["loss"]) for r in s["log"][:20]]
    line = (
        f"|train loss diff| ours vs speculators: max {max(first):.2e} over the first 20 steps, "
        f"{s['max_abs_step_loss_diff']:.2e} over all"
    )
    if has_ref:
        first_r = [abs(r["ours"]["loss"] - r["ref"]["loss"]) for r in s["log"][:20]]
        line += f"; ours vs noise ref: {max(first_r):.2e} / {s['max_abs_step_loss_diff_ref']:.2e}"
    print(line)
    dist = s["param_distance_over_update_norm"]
    print(
        "parameters at the end, ||a - b|| / ||ours - init||: ours vs speculators "
        f"{dist['ours_vs_spec']:.3g}" + (f", ours vs noise ref {dist['ours_vs_ref']:.3g}" if has_ref else "")
    )
    tl = s["train_last20"]
    print("train loss (last 20 steps): " + ", ".join(f"{n} {tl[n]['loss']:.5f}" for n in tl))
    print(
        "held-out loss: "
        + ", ".join(f"{n} {e[n]['loss']:.5f}" for n in e)
        + f"  (step 0: ours {s['heldout_step0']['ours']['loss']:.5f} / speculators {s['heldout_step0']['spec']['loss']:.5f})"
    )
    hdr = (
        "| depth | n | ours acc | speculators acc | diff | 3 SE |"
        + (" noise ref acc | ours - ref |" if has_ref else "")
        + " within noise |"
    )
    print(hdr)
    print("|" + "---:|" * (hdr.count("|") - 2) + ":--:|")
    for r in s["per_depth_end"]:
        extra = f" {r['noise_ref']:.4f} | {r['ref_diff']:+.4f} |" if has_ref else ""
        print(
            f"| {r['depth']} | {r['n']} | {r['ours']:.4f} | {r['speculators']:.4f} | {r['diff']:+.4f} | "
            f"{3 * r['se']:.4f} |{extra} {'yes' if r['within_noise'] else 'NO'} |"
        )
    print(
        f"verdict: {'AGREE within noise' if s['agree_within_noise'] else 'DISAGREE'} (|diff| <= 3 SE + 0.005 at "
        "every depth and held-out loss within 5%)"
    )


if __name__ == "__main__":
    sys.exit(main())
