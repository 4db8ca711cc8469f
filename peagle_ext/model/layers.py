"""Building blocks of the drafter: RMSNorm, RoPE, and llama / qwen3 decoder layers (layer 0 is
EAGLE-3's first layer on [embeds ; hidden])."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PretrainedConfig
from transformers.activations import ACT2FN


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.weight.dtype == torch.float32:
            return fused_rms_norm_fp32(x, self.weight, self.eps)
        if x.is_cuda and self.weight.dtype == x.dtype and not torch.is_grad_enabled():
            # inference in the weights' dtype (a drafter served in bf16): torch's one-kernel norm,
            # fp32 statistics and one rounding, where rms_norm launches eight kernels per call
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    def for_linears(self, x: torch.Tensor) -> torch.Tensor:
        """The norm of x as the linear layers that read it see it: autocast_input(self(x)). In a
        training step on CUDA (fp32 weights, autocast on, gradients on) one compiled kernel each
        way computes the fp32 norm and writes it in the autocast dtype, instead of torch's fused
        fp32 norm, an fp32 output and a cast, each way."""
        dev = x.device.type
        if x.is_cuda and self.weight.dtype == torch.float32 and torch.is_autocast_enabled(dev) and _training(x):
            return compiled("rms_norm_to", rms_norm_to_math, x, self.weight, self.eps, torch.get_autocast_dtype(dev))
        return autocast_input(self(x))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # fp32 statistics like the HF llama/qwen3 norms, output in the input's dtype
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def fused_rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) in fp32 through torch's one-kernel RMSNorm (forward and backward), for
    fp32 weights: the eager rms_norm spends a broadcast fp32 kernel per statistic and product on
    every row (the largest elementwise cost of a training step). Same output dtype (fp32) as
    rms_norm with fp32 weights; it skips rms_norm's rounding of x / rms(x) to x's dtype."""
    with torch.autocast("cuda", enabled=False):
        return F.rms_norm(x.float(), (x.shape[-1],), weight, eps)


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """x as autocast's linear layers will read it: cast once to the autocast dtype for the several
    projections that share an input (q/k/v, gate/up) instead of once per projection, with the
    same values."""
    dev = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        if x.dtype != dt:
            return x.to(dt)
    return x


def rms_norm_to_math(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """weight * x / rms(x) in fp32, rounded once to `dtype` (what RMSNorm.for_linears compiles)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(dtype)


def silu_mul_math(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32, rounded once to up's dtype (what DraftMLP compiles)."""
    return (F.silu(gate.float()) * up.float()).to(up.dtype)


def _training(x: torch.Tensor) -> bool:
    """A training step's tensor: gradients on and wanted. Decoding (no grad, CUDA graphs) keeps
    the eager ops, which capture without compiling anything."""
    return torch.is_grad_enabled() and x.requires_grad


def rope_inv_freq(tl: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    params = getattr(tl, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", getattr(tl, "rope_theta", 10000.0)))
    if rope_type == "default":
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        return inv.float(), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = copy.deepcopy(tl)
    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    return inv.float(), float(scale)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, heads, D]; cos/sin [T, 1, D]; HF's rotate_half convention
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_math(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """apply_rope with bf16/fp16 inputs lifted to fp32 and one rounding to `dtype` at the end."""
    if x.dtype in (torch.bfloat16, torch.float16):
        x = x.float()
    return apply_rope(x, cos.to(x.dtype), sin.to(x.dtype)).to(dtype)


_COMPILED: dict = {}  # name -> compiled function, or None where compiling failed (eager for good)
# Inductor compiles these (forward, and backward at the first backward) in this process, not in
# its pool of worker processes: a few small kernels are not worth a pool, and a pool whose workers
# stall leaves the compiling process waiting for good (pytorch#108586, #121197)
_COMPILE_OPTIONS = {"compile_threads": 1}


def compiled(name: str, fn, *args):
    """fn(*args) through torch.compile (Inductor: one fused kernel each way for these elementwise
    and row-reduction functions), compiled on the first call with dynamic shapes; where that
    fails (no Triton, an Inductor error) fn runs eagerly from then on, with a warning."""
    c = _COMPILED.get(name, False)
    if c is False:
        try:
            c = torch.compile(fn, dynamic=True, fullgraph=True, options=_COMPILE_OPTIONS)
            out = c(*args)
        except Exception as e:  # noqa: BLE001 - any Inductor/Triton build failure
            import warnings

            warnings.warn(f"{name} runs eagerly: torch.compile failed here ({type(e).__name__}: {e})", stacklevel=2)
            _COMPILED[name] = None
            return fn(*args)
        _COMPILED[name] = c
        return out
    return c(*args) if c is not None else fn(*args)


def rope_to(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """RoPE for the attention op, output in its compute dtype. In a CUDA training step one
    Inductor-fused kernel forward and one backward: in eager PyTorch RoPE is six full passes over
    q and k each way (broadcast multiplies by cos/sin [T, 1, D], the negated half, the
    concatenation, the sum, the cast), the largest elementwise cost of a training step.
    Elsewhere, validation included, the same math eagerly: a no-grad call would recompile (grad
    mode is part of a compiled graph's guards), for a pass that is a small share of the time."""
    if x.is_cuda and _training(x):
        return compiled("rope", rope_math, x, cos, sin, dtype)
    return rope_math(x, cos, sin, dtype)


def norm_rope_math(
    x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """apply_rope(weight * x / rms(x)) with bf16/fp16 inputs lifted to fp32 and one rounding to
    `dtype` at the end: a per-head q/k norm and RoPE as one function (what norm_rope_to compiles)."""
    if x.dtype in (torch.bfloat16, torch.float16):
        x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(x.dtype)
    return apply_rope(x, cos.to(x.dtype), sin.to(x.dtype)).to(dtype)


def folds_head_norm(x: torch.Tensor, norm: RMSNorm | None) -> bool:
    """Whether a q/k head norm runs inside the RoPE kernel (norm_rope_to) for attention input x:
    in a CUDA training step with fp32 norm weights, where the separate norm is torch's fused fp32
    kernel whose fp32 [T, heads, D] output RoPE reads back."""
    return norm is not None and x.is_cuda and norm.weight.dtype == torch.float32 and _training(x)


def norm_rope_to(x: torch.Tensor, norm: RMSNorm, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype):
    """RoPE of norm(x) in `dtype`, one compiled kernel each way (norm_rope_math), for the inputs
    folds_head_norm accepts: the norm's fp32 output never goes to memory."""
    return compiled("norm_rope", norm_rope_math, x, norm.weight, norm.eps, cos, sin, dtype)


class DraftAttention(nn.Module):
    def __init__(self, tl: PretrainedConfig, in_dim: int):
        super().__init__()
        h = tl.hidden_size
        self.num_heads = tl.num_attention_heads
        self.num_kv_heads = getattr(tl, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(tl, "head_dim", None) or h // self.num_heads
        bias = bool(getattr(tl, "attention_bias", False))
        self.q_proj = nn.Linear(in_dim, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        if tl.model_type == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, tl.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, tl.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def q(self, x):
        q = self.q_heads(x)
        return self.q_norm(q) if self.q_norm is not None else q

    def kv(self, x):
        k, v = self.kv_heads(x)
        return (self.k_norm(k) if self.k_norm is not None else k), v

    def q_heads(self, x):
        """q by head before the head norm."""
        return self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))

    def kv_heads(self, x):
        """k and v by head before k's head norm."""
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return k, self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))


class DraftMLP(nn.Module):
    def __init__(self, tl: PretrainedConfig):
        super().__init__()
        bias = bool(getattr(tl, "mlp_bias", False))
        self.gate_proj = nn.Linear(tl.hidden_size, tl.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(tl.hidden_size, tl.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(tl.intermediate_size, tl.hidden_size, bias=bias)
        self.act = ACT2FN[tl.hidden_act]
        self.silu = tl.hidden_act == "silu"

    def forward(self, x):
        x = autocast_input(x)
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.silu and gate.is_cuda and _training(gate):
            # one kernel each way for silu(gate) * up (eager: silu, its rounding, the product)
            return self.down_proj(compiled("silu_mul", silu_mul_math, gate, up))
        return self.down_proj(self.act(gate) * up)


class DraftLayer(nn.Module):
    """A llama/qwen3 decoder layer; layer 0 is EAGLE-3's first layer on [embeds ; hidden]."""

    def __init__(self, tl: PretrainedConfig, layer_idx: int, norm_before_residual: bool):
        super().__init__()
        self.first = layer_idx == 0
        h = tl.hidden_size
        self.input_layernorm = RMSNorm(h, tl.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, tl.rms_norm_eps)
        self.self_attn = DraftAttention(tl, 2 * h if self.first else h)
        self.mlp = DraftMLP(tl)
        self.norm_before_residual = norm_before_residual
        if self.first:
            self.hidden_norm = RMSNorm(h, tl.rms_norm_eps)

    def pre_attention(self, x, hid=None):
        """(attention input as the q/k/v projections read it, residual). Layer 0 takes x = embeds
        and hid = fc(hidden)."""
        if not self.first:
            return self.input_layernorm.for_linears(x), x
        hn = self.hidden_norm(hid)
        residual = hn if self.norm_before_residual else hid
        return autocast_input(torch.cat([self.input_layernorm(x), hn], dim=-1)), residual

    def post_attention(self, attn_out, residual):
        h = residual + self.self_attn.o_proj(attn_out.flatten(-2))
        return h + self.mlp(self.post_attention_layernorm.for_linears(h))

    def forward(self, layer_pass, *args, **kwargs):
        """One pass of this layer, `layer_pass(self, *args, **kwargs)` (built by the model, which
        owns the attention layout and RoPE tables). Going through the module call lets module hooks
        see the whole layer: FSDP2's per-layer all-gather/reshard (peagle_ext.distributed), and
        activation checkpointing wrappers."""
        return layer_pass(self, *args, **kwargs)
