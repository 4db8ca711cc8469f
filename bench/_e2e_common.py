"""Shared pieces of the end-to-end benches (bench_train_step.py, bench_quality.py).

- `make_peagle(...)`: a peagle_ext PEagleDraftModel with the verifier head attached.
- `make_speculators_twin(ours, ...)`: speculators 0.9.0's PEagleDraftModel with the SAME config
  and a copy of the same weights (speculators' state dict uses the same names, DESIGN.md s5).
- `speculators_forward(...)`: one call of speculators' own forward (its loss, its metrics), with
  optionally OUR COD layout fed in by replacing `generate_cod_sample_indices` in its core module
  for the duration of the call (the function the forward calls by module-global name).
- `PlainTorchDraftModel`: our model with the two fused ops replaced by plain PyTorch: SDPA with
  the dense [T, T] COD mask and full [T, V] logits + log_softmax KL (the "no kernels" baseline).
- `synthetic_example(...)`: a packed row with realistic structure (several documents, a
  prompt part without loss, EAGLE-shift padding at each document's last position) and random
  verifier states of the right shapes.
"""
from __future__ import annotations

import contextlib
import copy
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)


# ---------------------------------------------------------------------------------------------
# peagle_ext side
# ---------------------------------------------------------------------------------------------
def qwen3_8b_config(vocab_size: int = 151_936):
    """Qwen3-8B's shape (the drafter mirrors it): hidden 4096, 32/8 heads, head dim 128,
    intermediate 12288, 36 layers (aux layers 2, 18, 33), rope theta 1e6."""
    from transformers import Qwen3Config
    return Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       vocab_size=vocab_size, rms_norm_eps=1e-6, max_position_embeddings=131072,
                       rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})


def make_peagle(verifier_config, *, num_layers: int, num_depths: int, mask_token_id: int,
                options=None, device="cpu", seed: int = 0, cls=None):
    """A drafter with random weights and a random verifier head (norm weight near 1, head rows
    of the verifier's scale), built directly on `device` (no 2B-parameter CPU init on GPU runs)."""
    from peagle_ext.model import PEagleDraftModel
    cls = cls or PEagleDraftModel
    torch.manual_seed(seed)
    with torch.device(device):
        m = cls.from_verifier(verifier_config, num_layers=num_layers, num_depths=num_depths,
                              mask_token_id=mask_token_id, options=options,
                              verifier_name_or_path="synthetic/qwen3-shaped")
    m = m.to(device)
    h = verifier_config.hidden_size
    v = verifier_config.vocab_size
    g = torch.Generator(device=device).manual_seed(seed + 1)
    norm_w = torch.rand(h, generator=g, device=device) + 0.5
    head_w = torch.randn(v, h, generator=g, device=device) * (1.0 / h ** 0.5) * 4.0
    m.attach_verifier(norm_weight=norm_w, lm_head_weight=head_w, init_from_verifier=True)
    return m


def synthetic_example(n: int, *, hidden: int, n_aux: int = 3, vocab: int, device="cpu",
                      dtype=torch.bfloat16, doc_len=(512, 2048), prompt_frac=(0.1, 0.4), seed: int = 0,
                      avoid_id: int | None = None):
    """A packed row of length n: documents of random length in doc_len, each a prompt part
    (loss 0) then an answer part (loss 1), with the EAGLE-shift padding (document id -1) at each
    document's last position and at the row's tail. Verifier states ~ N(0, 1) in `dtype`."""
    from peagle_ext.data import TrainingExample
    g = torch.Generator().manual_seed(seed)
    doc = torch.full((n,), -1, dtype=torch.int32)
    lm = torch.zeros(n, dtype=torch.bool)
    p, k = 0, 0
    lo, hi = doc_len
    while p < n:
        ln = int(torch.randint(lo, hi + 1, (1,), generator=g))
        ln = min(ln, n - p)
        if ln < 8:
            break
        doc[p:p + ln - 1] = k  # last position: no partner after the shift -> padding
        pf = float(torch.empty(1).uniform_(*prompt_frac, generator=g))
        lm[p + int(ln * pf):p + ln - 1] = True
        p += ln
        k += 1
    ids = torch.randint(0, vocab, (n,), generator=g)
    if avoid_id is not None:
        ids[ids == avoid_id] = (avoid_id + 1) % vocab
    dev_g = torch.Generator(device=device).manual_seed(seed + 7)
    hid = torch.randn(n, n_aux * hidden, generator=dev_g, device=device, dtype=torch.float32).to(dtype)
    last = torch.randn(n, hidden, generator=dev_g, device=device, dtype=torch.float32).to(dtype)
    valid = (doc >= 0).to(device)
    hid = hid * valid[:, None]
    last = last * valid[:, None]
    return TrainingExample(input_ids=ids.to(device), document_ids=doc.to(device), loss_mask=lm.to(device),
                           hidden=hid, last_hidden=last)


def plain_model_class():
    """A PEagleDraftModel subclass whose attention is SDPA over the dense COD mask
    (peagle_ext.reference.reference_cod_attention: [T, T] mask, GQA by repeat_interleave) and
    whose loss holds the full [T, V] draft and target logits (log_softmax KL in fp32).
    Layers, RoPE, COD sampling and the optimizer are shared with the fused model."""
    from peagle_ext.model import PEagleDraftModel
    from peagle_ext.reference import reference_cod_attention

    class PlainTorch(PEagleDraftModel):
        def _attend(self, q, k, v, tok, context=None):
            o = self.options
            dt = self._compute_dtype(q)
            ck = None if context is None else context[0].to(dt)
            cv = None if context is None else context[1].to(dt)
            return reference_cod_attention(q.to(dt), k.to(dt), v.to(dt), tok.layout, context_k=ck, context_v=cv,
                                           window=o.window, sink=o.sink)

        def _loss_terms(self, h, layout, example, target_normed):
            pos = layout.anchor.long() + layout.depth.long()
            weight = example.loss_mask.to(pos.device)[pos].float()
            hn = self.norm(h)
            dt = self._compute_dtype(hn)
            logits = hn.to(dt) @ self.lm_head.weight.to(dt).t()                               # [T, V]
            with torch.no_grad():
                tlogits = target_normed[pos].to(dt) @ self.verifier_lm_head_weight.to(dt).t()  # [T, V]
                tlogp = torch.log_softmax(tlogits.float(), -1)
            logp = torch.log_softmax(logits.float(), -1)
            kl = (tlogp.exp() * (tlogp - logp)).sum(-1)
            k = self.num_depths
            with torch.no_grad():
                ok = (logits.argmax(-1) == tlogits.argmax(-1)) & (weight > 0)
                d = layout.depth.long()
                correct = torch.bincount(d[ok], minlength=k)[:k].cpu()
                total = torch.bincount(d[weight > 0], minlength=k)[:k].cpu()
            return (kl * weight).sum(), weight.sum(), correct, total

    return PlainTorch


# ---------------------------------------------------------------------------------------------
# speculators side
# ---------------------------------------------------------------------------------------------
def import_speculators():
    import _speculators_shim as shim
    return shim.import_speculators_peagle()


def make_speculators_twin(ours, *, attn_impl: str = "simple_flex_attention", device=None):
    """speculators' PEagleDraftModel with our drafter's config and a copy of its weights.

    attn_impl: "simple_flex_attention" (speculators' default), "sdpa" or "eager" (its
    `--draft-attn-impl` choices: a dense mask from its own mask_mod via create_mask)."""
    SpecModel, SpecConfig, core, _stubs = import_speculators()
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    tl = copy.deepcopy(ours.config.transformer_layer_config)
    tl._attn_implementation = attn_impl
    # speculators builds nn.Embedding(padding_idx=tl.pad_token_id): that row never gets a
    # gradient. Its own CLI builds the layer config WITHOUT pad_token_id (None); ours records the
    # verifier's pad id (for SmolLM2 that is <|im_end|>, a real end-of-turn token), so clear it
    # here to get speculators' training behaviour.
    tl.pad_token_id = None
    cfg = SpecConfig(
        transformer_layer_config=tl, draft_vocab_size=ours.config.draft_vocab_size,
        norm_before_residual=ours.config.norm_before_residual, norm_before_fc=ours.config.norm_before_fc,
        eagle_aux_hidden_state_layer_ids=list(ours.config.eagle_aux_hidden_state_layer_ids),
        mask_token_id=ours.config.mask_token_id,
        speculators_config=SpeculatorsConfig(
            algorithm="peagle",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=ours.num_depths)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=[])))
    device = device or ours.fc.weight.device
    with torch.device(device):
        spec = SpecModel(cfg)
    spec = spec.to(device)
    copy_weights_to_speculators(ours, spec)
    return spec, core


def copy_weights_to_speculators(ours, spec):
    """Our checkpoint tensors -> speculators' parameters of the same name; the frozen verifier
    norm/head buffers -> verifier_norm / verifier_lm_head. Fails on any unmatched name."""
    src = ours.checkpoint_state_dict()
    dst = spec.state_dict()
    skip = {"d2t", "t2d"}  # full draft vocab: speculators holds no mapping (None buffers)
    missing = [k for k in dst if k not in src and not k.startswith("verifier_") and k not in skip]
    extra = [k for k in src if k not in dst and k not in skip]
    if missing or extra:
        raise RuntimeError(f"weight names differ: speculators-only {missing}, ours-only {extra}")
    with torch.no_grad():
        for k, t in src.items():
            if k in skip:
                continue
            if tuple(dst[k].shape) != tuple(t.shape):
                raise RuntimeError(f"{k}: shape {tuple(t.shape)} (ours) vs {tuple(dst[k].shape)} (speculators)")
            dst[k].copy_(t)
        dst["verifier_norm.weight"].copy_(ours.verifier_norm_weight)
        dst["verifier_lm_head.weight"].copy_(ours.verifier_lm_head_weight)
        spec.verifier_norm.variance_epsilon = ours.verifier_norm_eps
    # speculators trains the embedding and keeps lm_head frozen, as we do with train_embeddings="all"
    spec.embed_tokens.weight.requires_grad_(True)
    spec.lm_head.weight.requires_grad_(False)


@contextlib.contextmanager
def speculators_layout(core, layout):
    """Inside the block, speculators' forward uses OUR COD layout: core.generate_cod_sample_indices
    (looked up by module-global name at call time) returns our (anchor, depth) as int64."""
    if layout is None:
        yield
        return
    orig = core.generate_cod_sample_indices
    anchor = layout.anchor.long()
    depth = layout.depth.long()

    def ours(seq_length, loss_mask, **_kw):
        if seq_length != layout.seq_len:
            raise RuntimeError(f"layout is for N={layout.seq_len}, forward got {seq_length}")
        return anchor.to(loss_mask.device), depth.to(loss_mask.device)

    core.generate_cod_sample_indices = ours
    try:
        yield
    finally:
        core.generate_cod_sample_indices = orig


def speculators_batch(example, device):
    """speculators' batch layout: [1, N, ...] tensors, float loss mask, int64 document ids."""
    return dict(
        hidden_states=example.hidden.to(device)[None],
        input_ids=example.input_ids.to(device).long()[None],
        document_ids=example.document_ids.to(device).long()[None],
        loss_mask=example.loss_mask.to(device).float()[None],
        verifier_last_hidden_states=example.last_hidden.to(device)[None],
    )


def speculators_forward(spec, core, batch, *, num_depths, loss_config, layout=None, max_anchors=None,
                        down_sample_ratio=0.7, down_sample_ratio_min=0.2):
    """(loss, metrics) of speculators' own forward."""
    with speculators_layout(core, layout):
        _, loss, metrics = spec(**batch, loss_config=loss_config, max_anchors=max_anchors,
                                num_depths=num_depths, down_sample_ratio=down_sample_ratio,
                                down_sample_ratio_min=down_sample_ratio_min)
    return loss, metrics


def speculators_per_depth(metrics, k):
    """(correct[K], total[K]) from speculators' metrics dict."""
    c = [float(metrics[f"position_{d}_acc_sum"]) for d in range(k)]
    t = [float(metrics[f"position_{d}_acc_total"]) for d in range(k)]
    return c, t


def uncompiled(fn):
    """The function under a torch.compile wrapper (speculators' `conditional_torch_compile`
    wraps PEagleDraftModel.forward at class definition when CUDA is available)."""
    inner = getattr(fn, "_torchdynamo_orig_callable", None) or getattr(fn, "__wrapped__", None)
    return inner if inner is not None else fn


def speculators_loss_config(implementation: str):
    """speculators' KL loss config: "fused" (its Triton kernels, the default; CUDA only) or
    "eager" (log_softmax/softmax over the full [T, V] logits)."""
    import_speculators()
    from speculators.losses import resolve_loss_config
    return resolve_loss_config("kl_div", implementation)


def step_flops_floor(layout, cfg, num_layers: int) -> dict:
    """Matmul FLOPs a P-EAGLE training step cannot avoid for this layout (bf16 tensor-core work;
    elementwise ops, norms, softmax, the optimizer are not counted):
      fc            fwd + weight grad on the N unique stream rows        4 * N * 3H * H
      layer-0 q/k/v on the N unique rows (fwd, input grad, weight grad)  6 * N * 2H * (Hq + 2 Hkv) D
      o_proj + MLP  on all T tokens, every layer                         6 * T * (Hq D H + 3 H I)
      layers >= 1   q/k/v on all T tokens                                6 * T * H * (Hq + 2 Hkv) D
      attention     4 D Hq per (query, allowed key) pair forward, x3.5 with the backward
                    (flash-style backward recomputes QK^T), pairs counted from the COD rule
      heads         draft lm_head fwd + input grad (frozen weight)       4 * T * H * V
                    verifier logits at the N unique positions            2 * N * H * V
    Returns {"total": flops, "attention": ..., "pairs": ...} (floats)."""
    import torch as _t
    from peagle_ext.reference import document_starts
    h = cfg.hidden_size
    i_sz = cfg.intermediate_size
    hq = cfg.num_attention_heads
    hkv = getattr(cfg, "num_key_value_heads", None) or hq
    d = getattr(cfg, "head_dim", None) or h // hq
    v = cfg.vocab_size
    n = layout.seq_len
    t = layout.num_tokens
    doc = layout.document_ids.long()
    a = layout.anchor.long()
    dep = layout.depth.long()
    valid = doc[a] >= 0
    starts = document_starts(doc)
    # keys of query i: depth-0 positions start(a_i)..a_i of its document, plus its chain's deeper
    # tokens with depth <= d_i (d_i of them); padding rows attend nothing
    pairs = float(_t.where(valid, (a - starts[a] + 1) + dep, _t.zeros_like(a)).sum())
    f_fc = 4.0 * n * 3 * h * h
    f_l0 = 6.0 * n * 2 * h * (hq + 2 * hkv) * d
    f_post = 6.0 * t * (hq * d * h + 3 * h * i_sz) * num_layers
    f_deep = 6.0 * t * h * (hq + 2 * hkv) * d * max(0, num_layers - 1)
    f_attn = 3.5 * 4.0 * d * hq * pairs * num_layers
    f_heads = 4.0 * t * h * v + 2.0 * n * h * v
    return {"total": f_fc + f_l0 + f_post + f_deep + f_attn + f_heads, "attention": f_attn, "pairs": pairs,
            "heads": f_heads}
