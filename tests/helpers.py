"""Helpers shared by the tests (fixtures are in conftest.py)."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, Qwen3Config

import peagle_ext
from peagle_ext.cod import CodLayout
from peagle_ext.model import PEagleDraftModel
from peagle_ext.testing import random_draft_batch
from peagle_ext.vllm import DraftBatch

ROOT = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available() and peagle_ext.has_cuda_kernels()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and the CUDA build of peagle_ext")

# the tiny drafters of the model tests: hidden size and verifier vocab
H, V = 64, 300


def devices():
    return ["cpu"] + (["cuda"] if HAS_CUDA else [])


def subprocess_env(**extra):
    """The environment of a test's subprocess: this one, the repo root importable (the tests run
    against the checkout), one OpenMP thread, plus `extra`."""
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
        **extra,
    }


def run_cli(args, timeout=120, env_extra=None):
    """`python -m peagle_ext.cli ARGS` in a subprocess from the repo root (one OpenMP thread)."""
    return subprocess.run(
        [sys.executable, "-m", "peagle_ext.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=subprocess_env(**(env_extra or {})),
        cwd=str(ROOT),
    )


def torchrun(nproc: int, args: list[str], *, env_extra=None, timeout=240, retry_teardown_abort=True):
    """torchrun --standalone (it picks a free rendezvous port) with nproc CPU processes running
    `args` (a script and its arguments, or `-m module ...`)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args]
    env = subprocess_env(**(env_extra or {}))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(ROOT))
    if retry_teardown_abort and r.returncode != 0 and "terminate called without an active exception" in r.stderr:
        # a rare gloo abort at process-group teardown, after the work is done; run once more
        # rather than fail on it. Real failures fail twice.
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(ROOT))
    return r


def tiny_run_inputs(d: Path, *, n=14, words=(4, 12)):
    """A tiny random Llama verifier and a chat JSONL of n one-turn conversations under d:
    (verifier_dir, data_path)."""
    from peagle_ext.testing import make_chat_jsonl, make_tiny_verifier

    return make_tiny_verifier(d / "verifier"), make_chat_jsonl(d / "chat.jsonl", n=n, turns=1, words=words)


def train_settings(tiny, out, **kw):
    """TrainSettings of a 2-step float32 CPU run on a (verifier_dir, data_path) pair writing to
    out: every conversation, the verifier's whole vocab, no validation split, a checkpoint every
    step, no progress bar. kw overrides any field; test files wrap it with their own defaults."""
    from peagle_ext.train import TrainSettings

    v, data = tiny
    base = dict(
        verifier=str(v),
        data=str(data),
        output=str(out),
        seq_len=64,
        num_depths=2,
        num_layers=1,
        max_steps=2,
        draft_vocab_size=None,
        dtype="float32",
        device="cpu",
        checkpoint_every=1,
        val_every=100,
        val_fraction=0.0,
        warmup_steps=1,
        progress=False,
        num_conversations=None,
    )
    return TrainSettings(**{**base, **kw})


def hidden_state_bytes(make_settings, tiny, out, **kw) -> tuple[float, int, int]:
    """(bytes one row's verifier states take, train rows, validation rows), read from the `hidden`
    and `data` events of a one-step run without a hidden-state cache made by make_settings(tiny,
    out, **kw): what a --hidden-cache-gb keeping a chosen number of rows is computed from."""
    import json

    from peagle_ext.train import train

    train(make_settings(tiny, out, **{**kw, "max_steps": 1, "hidden_cache_gb": 0}))
    ev = [json.loads(x) for x in (Path(out) / "log.jsonl").read_text().splitlines()]
    need = next(e for e in ev if e.get("event") == "hidden")["need_bytes"]
    data = next(e for e in ev if e.get("event") == "data")
    n_train, n_val = data["train_rows"], data["val_rows"]
    return need / (n_train + n_val), n_train, n_val


def hypothesis_settings(n: int, suppress_health_check):
    """hypothesis settings for one property: n examples (times PEAGLE_HYPOTHESIS_SCALE), no
    deadline, no example database, derandomized so CI sees the same examples every run unless
    PEAGLE_HYPOTHESIS_RANDOM is set to draw fresh ones."""
    from hypothesis import settings

    scale = float(os.environ.get("PEAGLE_HYPOTHESIS_SCALE", "1"))
    fresh = os.environ.get("PEAGLE_HYPOTHESIS_RANDOM", "0") not in ("", "0")
    return settings(
        max_examples=max(1, int(n * scale)),
        deadline=None,
        derandomize=not fresh,
        database=None,
        suppress_health_check=suppress_health_check,
    )


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))


def assert_same_weights(a_dir, b_dir):
    """The model.safetensors of two checkpoint directories hold the same tensors (floats to 1e-6)."""
    a, b = _weights(a_dir), _weights(b_dir)
    assert set(a) == set(b)
    for k in a:
        if a[k].is_floating_point():
            scale = float(a[k].abs().max())
            torch.testing.assert_close(b[k], a[k], rtol=1e-6, atol=1e-6 * scale, msg=lambda m, k=k: f"{k}: {m}")
        else:
            assert torch.equal(a[k], b[k]), k


def mask_from_metadata(lay, meta, cross):
    """Dense [T, N+T] count of how often each (query, key) pair is visited: range keys in the
    first N columns, layout tokens after them (symmetric depth-0 range rows map to tokens 0..N-1)."""
    t, n = lay.num_tokens, lay.seq_len
    rg = meta.ranges.cpu().long()
    ch = meta.chains[0].cpu().long()
    cnt = torch.zeros(t, n + t, dtype=torch.long)
    pos = torch.arange(n)
    for i in range(t):
        if not rg[4, i]:
            continue
        inr = ((pos >= rg[0, i]) & (pos < rg[1, i])) | ((pos >= rg[2, i]) & (pos < rg[3, i]))
        if not meta.use_sink:
            inr = (pos >= rg[0, i]) & (pos < rg[1, i])
        cnt[i, :n] += inr.long()
        for c in ch[i].tolist():
            if c >= 0:
                cnt[i, n + c] += 1
    if not cross:  # fold the symmetric depth-0 range keys onto their layout rows
        cnt[:, n : 2 * n] += cnt[:, :n]
        cnt = cnt[:, n:]
    return cnt


def seed_positions(doc: torch.Tensor, lm: torch.Tensor) -> list[int]:
    """Positions p >= 1 with loss_mask 1 whose predecessor is in the same real document."""
    d, m = doc.tolist(), lm.tolist()
    return [p for p in range(1, len(d)) if m[p] and d[p] >= 0 and d[p - 1] == d[p]]


def expected_size(num_seeds: int, d: int, r: float, r_min: float) -> int:
    return int(math.floor(max(0, num_seeds - d) * max(math.pow(r, d), r_min)))


def check_layout_rules(
    layout: CodLayout,
    doc,
    lm,
    *,
    num_depths=8,
    down_sample_ratio=0.7,
    down_sample_ratio_min=0.2,
    max_anchors=None,
    depth0="all",
    seed=None,
):
    """The rules of docs/design.md section 2, checked from the layout alone (no reference draw)."""
    doc_l, lm_l = doc.tolist(), lm.bool().tolist()
    n = len(doc_l)
    anchor, depth = layout.anchor.cpu().tolist(), layout.depth.cpu().tolist()
    off = layout.depth_offsets
    assert layout.anchor.dtype == torch.int32 and layout.depth.dtype == torch.int32
    assert len(off) == num_depths + 1 and off[0] == 0 and off[-1] == len(anchor) == len(depth)
    assert all(off[d] <= off[d + 1] for d in range(num_depths))
    per_depth = []
    for d in range(num_depths):
        assert all(x == d for x in depth[off[d] : off[d + 1]]), "depth-major order"
        a = anchor[off[d] : off[d + 1]]
        assert all(a[i] < a[i + 1] for i in range(len(a) - 1)), f"depth {d} anchors not strictly sorted"
        per_depth.append(a)
    assert all(0 <= a and a + d < n for a, d in zip(anchor, depth)), "anchor < 0 or position >= N"

    seeds = seed_positions(doc, lm)
    num_seeds = len(seeds) if max_anchors is None else min(len(seeds), max_anchors)
    if depth0 == "all":
        assert per_depth[0] == list(range(n))
        chosen_seeds = None
    else:
        assert len(per_depth[0]) == num_seeds
        chosen_seeds = {a + 1 for a in per_depth[0]}
        assert chosen_seeds <= set(seeds)
    seed_set = set(seeds)
    stopped = False
    prev = None
    for d in range(1, num_depths):
        a = per_depth[d]
        for x in a:
            assert x + 1 in seed_set, "a chain starts at a seed"
            assert doc_l[x] >= 0 and all(doc_l[x + i] == doc_l[x] for i in range(d + 1)), "chain crossed a document"
            assert lm_l[x + d], "a depth >= 1 token is at a loss-masked position"
        if chosen_seeds is not None:
            assert all(x + 1 in chosen_seeds for x in a)
        if d == 1:
            pool = num_seeds
        else:
            assert set(a) <= set(prev), f"(a, {d}) without (a, {d - 1})"
            pool = sum(1 for x in prev if x + d < n and lm_l[x + d] and doc_l[x + d] == doc_l[x + d - 1])
        size = expected_size(num_seeds, d, down_sample_ratio, down_sample_ratio_min)
        stopped = stopped or size <= 0
        assert len(a) == (0 if stopped else min(size, pool)), f"depth {d}: count"
        prev = a
    if max_anchors is not None and num_depths > 1:
        assert len(per_depth[1]) <= max_anchors


def reference_fused_linear_kl(xd, w_d, xt, w_t, weight, depth, k, *, d2t=None, kind="kl"):
    """Eager float64: (loss, correct, total, grad_xd, grad_wd).

    For fp16/bf16/fp32 inputs both logit matrices are rounded to the input dtype (as a GEMM in
    that dtype returns them; the gradient passes straight through the rounding), so that the
    argmaxes, which decide CE targets and the metrics, are taken over the same values.
    """
    dtype = xd.dtype
    xd = xd.detach().double().requires_grad_()
    w_d = w_d.detach().double().requires_grad_()
    ld = xd @ w_d.T
    ld = ld + (ld.detach().to(dtype).double() - ld.detach())
    with torch.no_grad():
        lt = (xt.double() @ w_t.double().T).to(dtype).double()
        if d2t is not None:
            lt = lt[:, torch.arange(w_d.shape[0], device=lt.device) + d2t.to(lt.device).long()]
    logq = F.log_softmax(ld, dim=-1)
    if kind == "kl":
        per = F.kl_div(logq, F.softmax(lt, dim=-1), reduction="none").sum(-1)
    else:
        per = F.cross_entropy(ld, lt.argmax(-1), reduction="none")
    w = weight.double()
    loss = (w * per).sum() / w.sum() if float(w.sum()) > 0 else (per * 0).sum()
    loss.backward()
    counted = w > 0
    agree = (ld.argmax(-1) == lt.argmax(-1)) & counted
    dep = depth.long()
    total = torch.zeros(k, dtype=torch.int64, device=dep.device).index_add_(0, dep, counted.long())
    correct = torch.zeros(k, dtype=torch.int64, device=dep.device).index_add_(0, dep, agree.long())
    return loss.detach(), correct, total, xd.grad, w_d.grad


DRAFT_BATCH_FIELDS = [f.name for f in dataclasses.fields(DraftBatch)]


def assert_same_batch(a: DraftBatch, b: DraftBatch, what=""):
    for f in DRAFT_BATCH_FIELDS:
        x, y = getattr(a, f).cpu(), getattr(b, f).cpu()
        assert x.dtype == y.dtype, f"{what}{f}: dtype {x.dtype} != {y.dtype}"
        assert x.shape == y.shape, f"{what}{f}: shape {tuple(x.shape)} != {tuple(y.shape)}"
        if not torch.equal(x, y):
            bad = (x != y).nonzero()[:5].tolist()
            raise AssertionError(f"{what}{f} differs at {bad}")


def verifier_config(model_type="llama", layers=6, head_dim=32):
    cls = LlamaConfig if model_type == "llama" else Qwen3Config
    return cls(
        hidden_size=H,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=head_dim,
        intermediate_size=128,
        num_hidden_layers=layers,
        vocab_size=V,
        rms_norm_eps=1e-6,
    )


def make_model(
    g, *, layer_type="llama", num_layers=2, k=4, mask=V, options=None, draft_vocab=None, d2t=None, head_dim=32
):
    """head_dim: 32 on the CPU (fast); the CUDA kernels take 64 or 128."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))
    m = PEagleDraftModel.from_verifier(
        verifier_config(layer_type, head_dim=head_dim),
        num_layers=num_layers,
        num_depths=k,
        mask_token_id=mask,
        layer_type=layer_type,
        options=options,
        draft_vocab_size=draft_vocab,
        d2t=d2t,
        verifier_name_or_path="tiny/verifier",
    )
    m.attach_verifier(
        norm_weight=torch.rand(H, generator=g) + 0.5,
        lm_head_weight=torch.randn(V, H, generator=g) * 3.0,
        embed_weight=torch.randn(V, H, generator=g),
    )
    return m


def first_pass_inputs(g, cad_cls, *, B, K, dtype=torch.bfloat16, device="cpu", near_max=False, none_rejected=False):
    """A random step of vLLM's set_inputs_first_pass (hidden size 32): (its keyword arguments with
    the attention metadata built as `cad_cls`, the op's (args, kw) from random_draft_batch).
    none_rejected passes None for the rejected counts, as vLLM does when it rejects nothing."""
    args, kw = random_draft_batch(g, B=B, K=K, H=32, dtype=dtype, near_max=near_max, device=device)
    qsl = args["query_start_loc"]
    num_reqs = qsl.shape[0] - 1
    cad = cad_cls(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.cpu().clone(),
        seq_lens=torch.randint(1, 100, (num_reqs,), generator=g, dtype=torch.int32).to(device),
        num_reqs=num_reqs,
        num_actual_tokens=int(qsl[-1]),
        max_query_len=int((qsl[1:] - qsl[:-1]).max()),
        max_seq_len=100,
        block_table_tensor=args["block_table"],
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64, device=device),
    )
    if none_rejected:
        args["num_rejected_tokens"] = None
    call = dict(
        target_token_ids=args["target_token_ids"],
        next_token_ids=args["next_token_ids"],
        target_positions=args["target_positions"],
        target_hidden_states=args["target_hidden"],
        token_indices_to_sample=None,
        cad=cad,
        num_rejected_tokens_gpu=args["num_rejected_tokens"],
    )
    return call, (args, kw)


def hidden_rows_written(p, cad, n):
    """Rows of hidden_states that vLLM's step writes: each request's input rows (the scatter)
    and its MASK rows. The others are rejected rows past the request's input length."""
    qsl = cad.query_start_loc.tolist()
    written = p.is_masked_token_mask[:n].cpu().clone()
    for r in range(len(qsl) - 1):
        start = qsl[r] + r * p.net_num_new_slots_per_request
        written[start : start + qsl[r + 1] - qsl[r]] = True
    return written


def assert_same_first_pass(p_a, p_b, res_a, res_b, cad_in=None):
    """Two set_inputs_first_pass steps (proposers and results) agree. With cad_in (the step's
    input metadata), the hidden rows that vLLM's step leaves as they were in the persistent buffer
    are compared separately: p_a's may be zero."""
    n, tis, cad = res_a
    n2, tis2, cad2 = res_b
    assert n == n2
    assert torch.equal(tis.cpu(), tis2.cpu())
    for name in ("input_ids", "positions", "is_rejected_token_mask", "is_masked_token_mask"):
        a, b = getattr(p_a, name), getattr(p_b, name)
        assert (a is None and b is None) if a is None or b is None else torch.equal(a[:n].cpu(), b[:n].cpu()), name
    ha, hb = p_a.hidden_states[:n].cpu(), p_b.hidden_states[:n].cpu()
    if cad_in is None:
        assert torch.equal(ha, hb)
    else:
        written = hidden_rows_written(p_b, cad_in, n)
        assert torch.equal(ha[written], hb[written])
        stale = ~written
        # don't-care rows: rejected, never sampled, and no KV-cache slot, so nothing reads them
        assert p_b.is_rejected_token_mask[:n].cpu()[stale].all()
        assert (cad2.slot_mapping.cpu()[stale] == -1).all()
        assert not torch.isin(tis2.cpu(), stale.nonzero().flatten().to(tis2.dtype)).any()
        assert (ha[stale] == 0).all()
    for f in dataclasses.fields(cad2):
        a, b = getattr(cad, f.name), getattr(cad2, f.name)
        assert torch.equal(a.cpu(), b.cpu()) if isinstance(a, torch.Tensor) else a == b, f.name


def flash_varlen_standin(q, k, v, cu_q, cu_k, max_k, scale, seqused_k):
    """What serving/cache_attention._flash_varlen (FlashAttention-2's variable-length forward,
    one query per sequence, non-causal) computes, in plain PyTorch: sequence b's query
    q[cu_q[b]:cu_q[b+1]] attends the seqused_k[b] key rows of k from cu_k[b], GQA by repeating K/V
    heads; float64 inside. It stands in for the CUDA kernel on the CPU, so the layouts and offsets
    around it are tested everywhere."""
    rep = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for b in range(cu_q.numel() - 1):
        q0, q1, k0, n = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(seqused_k[b])
        assert q1 - q0 == 1 and n <= max_k
        kb = k[k0 : k0 + n].double().transpose(0, 1).repeat_interleave(rep, 0)  # [heads, n, D]
        vb = v[k0 : k0 + n].double().transpose(0, 1).repeat_interleave(rep, 0)
        p = torch.softmax(torch.einsum("qhd,hnd->hqn", q[q0:q1].double(), kb) * scale, -1)
        out[q0:q1] = torch.einsum("hqn,hnd->qhd", p, vb).to(q.dtype)
    return out


def one_request_batch(drafter, ids, pos0: int, num_rejected: int, aux, *, k: int, capacity: int, mask_token_id: int):
    """The parallel-drafting batch of one request whose target rows are tokens `ids` at positions
    pos0.. with verifier aux states `aux`, bonus token 7 and the last `num_rejected` rows
    rejected, for `drafter` (its combine_hidden and MASK hidden), over a block table covering
    `capacity` positions in blocks of 16."""
    from peagle_ext.vllm import prepare_parallel_draft_inputs

    t = ids.numel()
    return prepare_parallel_draft_inputs(
        ids.int(),
        torch.arange(pos0, pos0 + t),
        torch.tensor([7], dtype=torch.int32),
        torch.tensor([0, t], dtype=torch.int32),
        torch.tensor([num_rejected], dtype=torch.int32),
        drafter.combine_hidden(aux).contiguous(),
        drafter.mask_hidden,
        torch.arange(capacity // 16, dtype=torch.int32)[None],
        num_spec_tokens=k,
        mask_token_id=mask_token_id,
        block_size=16,
        max_model_len=capacity,
    )
