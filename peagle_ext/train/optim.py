"""The optimizer side of a run: AdamW (or Muon with AdamW, --optimizer muon) and the learning-rate
schedule."""

from __future__ import annotations

import math

import torch

from .settings import TrainSettings


def make_adamw(params, *, lr: float, betas: tuple[float, float], weight_decay: float) -> torch.optim.AdamW:
    """AdamW over `params`, fused (one multi-tensor kernel per step, at memory speed) when every
    parameter is on CUDA. FSDP2's sharded DTensor parameters are included: DTensor shards the
    fused op like its foreach ops. On the CPU: torch's default implementation, whose results
    the CPU tests and bit-exact resumes pin."""
    params = list(params)
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=fused)


# Vocabulary-sized matrices stay on AdamW under --optimizer muon (standard Muon practice: they
# map ids to vectors and back rather than vectors to vectors, and speculators does the same).
_NOT_MUON = ("embed_tokens.weight", "lm_head.weight")


def muon_split(named_params) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(Muon's parameters, AdamW's): the trainable 2D matrices of the layers and the fc, and the
    rest (norms, the MASK hidden state, the token embedding and the lm_head)."""
    muon, adamw = [], []
    for name, p in named_params:
        if not p.requires_grad:
            continue
        (muon if p.ndim == 2 and not name.endswith(_NOT_MUON) else adamw).append(p)
    return muon, adamw


def _closure_loss(closure):
    """An optimizer step's closure, run with gradients on (torch.optim's contract), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _muon_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """The learning rate of one [A, B] matrix under Muon: "match_rms_adamw" scales the update to
    AdamW's RMS (0.2 sqrt(max(A, B)), Moonshot's rule), "original" by sqrt(max(1, A / B)) (Keller
    Jordan's); torch.optim.Muon's two rules."""
    a, b = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, a / b))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(a, b))
    return lr


class BatchedMuon(torch.optim.Muon):
    """torch.optim.Muon's update, orthogonalizing all matrices of one shape together.

    torch's Muon runs Newton-Schulz one matrix at a time: 24 kernels per matrix (696 for a 4-layer
    SmolLM2 drafter's 29 matrices), each microseconds of GPU work, so on a GPU its step is host
    time. A drafter's matrices come in a handful of shapes once each is oriented wide (rows <=
    columns, as Newton-Schulz runs it): q/o, k/v, gate/up/down, the fc (6 shapes there, the first
    layer's inputs being twice as wide). Here the momentum runs as two foreach ops and
    Newton-Schulz as one batched iteration per shape: the same arithmetic in 152 kernels. Same
    constructor, param_groups and state ("momentum_buffer") as torch.optim.Muon, so either loads
    the other's state; on the CPU the update is bitwise torch's (tests/train/test_optim.py).

    prepare() computes a step's momentum and orthogonalized updates from the gradients as they are,
    changing nothing; the next step() applies them, and zero_grad() or load_state_dict() drops them.
    A training loop prepares before it waits for the step's metrics (to decide whether to step at
    all), so the host launches Newton-Schulz's kernels while the device still runs the backward."""

    _prepared: list | None = None

    @torch.no_grad()
    def prepare(self) -> None:
        self._prepared = [self._updates(group) for group in self.param_groups]

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        prepared = self._prepared if closure is None and self._prepared is not None else None
        self._prepared = None
        if prepared is None:
            prepared = [self._updates(group) for group in self.param_groups]
        for group, upd in zip(self.param_groups, prepared):
            if upd is None:
                continue
            params, bufs, ortho = upd
            for p, b in zip(params, bufs):
                self.state[p]["momentum_buffer"] = b
            lr = group["lr"]
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
            for p, o in zip(params, ortho):
                p.add_(o, alpha=-_muon_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._prepared = None
        super().zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict) -> None:
        self._prepared = None
        super().load_state_dict(state_dict)

    def _updates(self, group: dict):
        """(params with a gradient, their next momentum buffers, their orthogonalized updates), or
        None when no parameter of the group has a gradient. Changes no parameter or state."""
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return None
        for p in params:
            if p.grad.is_sparse or torch.is_complex(p):
                raise RuntimeError("Muon takes dense real gradients")
        grads = [p.grad for p in params]
        # self.state.get, not self.state[p]: the state is a defaultdict, and preparing adds nothing
        held = [self.state.get(p, {}).get("momentum_buffer") for p in params]
        bufs = [
            torch.zeros_like(p.grad, memory_format=torch.preserve_format) if b is None else b
            for p, b in zip(params, held)
        ]
        momentum = group["momentum"]
        bufs = torch._foreach_lerp(bufs, grads, 1 - momentum)
        updates = torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"] else bufs
        return params, bufs, self._orthogonalize(updates, group)

    @staticmethod
    def _orthogonalize(updates: list[torch.Tensor], group: dict) -> list[torch.Tensor]:
        """Newton-Schulz in bf16 on each update, batched over the updates of one oriented shape."""
        a, b, c = group["ns_coefficients"]
        tall = [u.size(0) > u.size(1) for u in updates]
        by_shape: dict[tuple, list[int]] = {}
        for i, u in enumerate(updates):
            by_shape.setdefault((min(u.shape), max(u.shape), u.device), []).append(i)
        out: list[torch.Tensor] = [updates[0]] * len(updates)
        for members in by_shape.values():
            x = torch.stack([updates[i].T if tall[i] else updates[i] for i in members]).bfloat16()
            x.div_(torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True).clamp(min=group["eps"]))
            for _ in range(group["ns_steps"]):
                gram = torch.bmm(x, x.mT)
                x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
            for j, i in enumerate(members):
                out[i] = x[j].T if tall[i] else x[j]
        return out


class MuonAdamW(torch.optim.Optimizer):
    """Muon (BatchedMuon) on the layers' matrices and make_adamw on the rest, as one optimizer: its
    param_groups are the two optimizers' own group dicts, so a scheduler's per-group lr reaches
    both, and its state_dict holds both. Muon's update is scaled to AdamW's RMS
    (adjust_lr_fn="match_rms_adamw"), so one --lr serves both groups."""

    def __init__(self, muon_params, adamw_params, *, lr: float, betas, weight_decay: float, muon_weight_decay: float):
        muon_params, adamw_params = list(muon_params), list(adamw_params)
        self.muon = (
            BatchedMuon(muon_params, lr=lr, weight_decay=muon_weight_decay, adjust_lr_fn="match_rms_adamw")
            if muon_params
            else None
        )
        self.adamw = make_adamw(adamw_params, lr=lr, betas=betas, weight_decay=weight_decay) if adamw_params else None
        inner = self._inner()
        if not inner:
            raise ValueError("MuonAdamW: no trainable parameter")
        super().__init__([p for o in inner for g in o.param_groups for p in g["params"]], {"lr": lr})
        self.param_groups = [g for o in inner for g in o.param_groups]

    def _inner(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.muon, self.adamw) if o is not None]

    @torch.no_grad()
    def prepare(self) -> None:
        """BatchedMuon.prepare for the Muon part (AdamW's fused step has nothing to prepare)."""
        if self.muon is not None:
            self.muon.prepare()

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for o in self._inner():
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self._inner():
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {
            "muon": None if self.muon is None else self.muon.state_dict(),
            "adamw": None if self.adamw is None else self.adamw.state_dict(),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        if not isinstance(state_dict, dict) or set(state_dict) != {"muon", "adamw"}:
            raise ValueError("the optimizer state is not --optimizer muon's (keys muon and adamw)")
        for name, o in (("muon", self.muon), ("adamw", self.adamw)):
            if (o is None) != (state_dict[name] is None):
                raise ValueError(f"the optimizer state's {name} part does not match this model's parameters")
            if o is not None:
                o.load_state_dict(state_dict[name])
        # torch's load_state_dict gives each optimizer new group dicts: share those again
        self.param_groups = [g for o in self._inner() for g in o.param_groups]


def make_optimizer(named_params, s: TrainSettings) -> torch.optim.Optimizer:
    """The run's optimizer (--optimizer): AdamW over every trainable parameter, or MuonAdamW."""
    named_params = list(named_params)
    betas = (s.adam_beta1, s.adam_beta2)
    if s.optimizer == "muon":
        muon, adamw = muon_split(named_params)
        return MuonAdamW(
            muon, adamw, lr=s.lr, betas=betas, weight_decay=s.weight_decay, muon_weight_decay=s.muon_weight_decay
        )
    params = [p for _, p in named_params if p.requires_grad]
    return make_adamw(params, lr=s.lr, betas=betas, weight_decay=s.weight_decay)


def lr_lambda(s: TrainSettings, clock=None, progress: float = 0.0):
    """The learning-rate factor of a step: a linear warmup over `warmup_steps`, then the schedule's
    shape over progress t in [0, 1], t = the step's share of the steps after warmup. With
    `s.time_schedule`, t is also `clock()`, the share of the time budget's training time spent
    (train/loop.py: from the first step to the end of --max-minutes), whichever is further, and
    never below `progress` nor below any t it has returned: a run that the time budget stops
    ends with its rate decayed however fast its steps turn out, and a resumed run goes on from
    the progress it had. `f.progress()` is that t."""
    state = {"t": float(progress)}

    def f(step: int) -> float:
        if s.warmup_steps and step < s.warmup_steps:
            return (step + 1) / s.warmup_steps
        if s.schedule == "constant":
            return 1.0
        span = max(1, s.max_steps - s.warmup_steps)
        t = min(1.0, (step - s.warmup_steps) / span)
        if s.time_schedule and clock is not None:
            t = max(t, min(1.0, clock()), state["t"])
            state["t"] = t
        shape = 0.5 * (1 + math.cos(math.pi * t)) if s.schedule == "cosine" else 1.0 - t
        return s.min_lr_ratio + (1 - s.min_lr_ratio) * shape

    f.progress = lambda: state["t"]
    return f
