"""Generation for many prompts at once over a preallocated KV cache: the engine of `peagle
datagen` (peagle_ext.data.datagen).

transformers' generate() keeps a dynamic cache that appends every step's K/V by concatenation,
which copies each layer's whole cache every step, and it expands grouped K/V heads for attention
when rows are padded. At the batch sizes datagen runs (thousands of rows) those copies, not the
model's arithmetic, decide the step time. Here each layer's K and V live in one [rows, kv heads,
capacity, D] tensor written in place, a decode step reads each cached entry once, and rows that
have stopped leave the batch as they accumulate (the live rows move to the front of the same
buffers).

Layout: prompts are right-padded, each row's tokens at positions 0..len-1, so its first new token
sits at position len. Attention is causal by position alone. The K/V a short prompt's padding
writes at positions len..width-1 are overwritten by that row's own new tokens before any query
reads them, since a query at position p reads positions <= p only.

Attention of a decode step (serving/cache_attention.py, chosen once per generator): "flash" reads
each row's positions 0..p only, "sdpa" the whole capacity under the position mask; "auto" takes
flash where it runs (CUDA, bf16/fp16) and agrees with sdpa on a probe: under the per-row mask
cuDNN walks every row's whole capacity in a prefill-sized tile, most of a datagen step's time.

Modes of the decode step:
- eager: attention over the positions filled so far (the shapes grow every step);
- fixed: attention over the whole capacity under the position mask, so that every step of a batch
  has the same shapes and reads only device tensors (what a CUDA graph captures);
- graphs: the fixed step captured as a CUDA graph and replayed (CUDA only). A step costs some
  fifty small kernels a layer; eagerly the host's per-op cost, not the GPU, sets its time for a
  model this small. A graph serves the batch until a compaction changes its row count; rows are
  dropped only when half of them have stopped, so a group of n rows captures at most log2(n) + 1
  graphs, each in a pool of its own (a dropped graph's pool can be pinned by blocks it does not
  free, such as cuBLAS's workspace for the capture stream, and a pool is not recaptured into once
  its last graph is gone). Where a capture fails (other than for memory) the rest of that
  generate() call runs the same fixed step eagerly, with a warning.
- auto: graphs on a CUDA device, eager elsewhere.

The model's own modules run through StaticVerifier's layer math (`qkv`, `layer_out`), so the
model families are StaticVerifier's (`static_verifier_support`).
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

from .cache_attention import attend_rows_flash, attend_rows_sdpa, choose_impl, rows_offsets
from .static_verifier import StaticVerifier

# a stop check syncs with the device; between checks the host runs ahead of the GPU
STOP_CHECK_EVERY = 8
# with fixed shapes a compaction costs a capture: worth it only with this many steps left
MIN_STEPS_AFTER_COMPACTION = 16
MODES = ("auto", "eager", "fixed", "graphs")


class BatchGenerator:
    """Greedy or sampled generation of a batch of prompts (module docstring)."""

    def __init__(self, model, mode: str = "auto", attention: str = "auto"):
        """mode: MODES (module docstring); attention: "auto", "sdpa" or "flash" (the choice is
        self.attention). ValueError naming what it does not run."""
        # StaticVerifier's layer math only: the verifier's own cache attention is not used here
        self.sv = sv = StaticVerifier(model, attention="sdpa")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        on_cuda = sv.device.type == "cuda"
        if mode == "graphs" and not on_cuda:
            raise ValueError("mode 'graphs' needs the model on a CUDA device")
        self.attention = choose_impl(attention, sv.device, sv.dtype, sv.num_heads, sv.kv_heads, sv.head_dim, rows=True)
        self.mode = ("graphs" if on_cuda else "eager") if mode == "auto" else mode
        self.graphs_captured = 0
        self.failed_captures = 0  # each left the rest of its generate() call on eager fixed steps

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        eos,
        temperature: float = 0.0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> list[tuple[list[int], bool]]:
        """[(new token ids without the stop token, hit max_new_tokens)] per prompt. A row stops at
        its first token in `eos`. temperature 0 = greedy; else softmax(logits / temperature),
        restricted to the smallest set of most likely tokens whose mass reaches top_p, sampled
        with `generator` (a generator on the model's device, or None for torch's default)."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        sv = self.sv
        dev = sv.device
        lens = [len(p) for p in prompts]
        n, width = len(prompts), max(lens)
        capacity = width + max_new_tokens - 1  # the last new token is never run through the model
        if sv.max_positions and capacity > sv.max_positions:
            raise ValueError(
                f"a prompt of {width} tokens plus {max_new_tokens} new ones exceeds the model's "
                f"{sv.max_positions} positions"
            )
        eos_t = torch.tensor(sorted({int(e) for e in eos}), dtype=torch.long, device=dev)
        ids = torch.zeros((n, width), dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        shape = (n, sv.kv_heads, capacity, sv.head_dim)
        # zeros, not empty: a masked position's weight is 0, and 0 x a garbage NaN is NaN
        ks = [torch.zeros(shape, device=dev, dtype=sv.dtype) for _ in range(sv.num_layers)]
        vs = [torch.zeros(shape, device=dev, dtype=sv.dtype) for _ in range(sv.num_layers)]
        len_t = torch.tensor(lens, dtype=torch.long, device=dev)

        greedy = temperature == 0
        x = self._prefill(ids.to(dev), ks, vs)
        tok = self._choose(self._logits(x[torch.arange(n, device=dev), len_t - 1]), temperature, top_p, generator)
        out = torch.empty((n, max_new_tokens), dtype=torch.long, device=dev)
        out[:, 0] = tok
        # the batch: its first b rows of these buffers are live (compaction moves rows forward)
        tok_in = tok.clone()  # each row's newest token
        pos_in = len_t.clone()  # its position
        rows = torch.arange(n, device=dev)  # the prompt it generates for
        stopped = torch.isin(tok, eos_t)
        live_lens = list(lens)  # prompt lengths of the batch rows, on the host
        b = n
        fixed = self.mode != "eager"
        # the fixed step's output buffer: next tokens (greedy) or logits
        result = None
        if fixed:
            vocab = () if greedy else (getattr(sv._head, "out_features", sv.vocab_size),)
            result = torch.empty((n, *vocab), device=dev, dtype=torch.long if greedy else sv.dtype)
        graph = None
        capture = self.mode == "graphs"  # until a capture fails
        for step in range(1, max_new_tokens):
            if step % STOP_CHECK_EVERY == 0:
                keep = (~stopped[:b]).nonzero().squeeze(1)
                m = keep.numel()
                if m == 0:
                    break
                if fixed:
                    worth = 2 * m <= b and max_new_tokens - step >= MIN_STEPS_AFTER_COMPACTION
                else:
                    worth = 4 * m <= 3 * b
                if m < b and worth:
                    for buf in (*ks, *vs, tok_in, pos_in, rows, stopped):
                        buf[:m] = buf[keep]
                    live_lens = [live_lens[i] for i in keep.tolist()]
                    b, graph = m, None
            if not fixed:
                keys = max(live_lens) + step  # positions 0..keys-1 hold every live row's context
                logits = self._logits(self._decode(tok_in[:b], pos_in[:b], ks, vs, b, keys))
                tok = self._choose(logits, temperature, top_p, generator)
            else:
                if graph is not None:
                    graph.replay()
                else:
                    run = functools.partial(self._fixed_step, tok_in, pos_in, ks, vs, b, capacity, result)
                    if capture:
                        graph = self._capture(run)  # its warm-up run is this step
                        capture = graph is not None
                    if graph is None:  # eager fixed steps, also right after a failed capture
                        run()
                tok = result[:b].clone() if greedy else self._choose(result[:b], temperature, top_p, generator)
            out[rows[:b], step] = tok
            stopped[:b] |= torch.isin(tok, eos_t)
            tok_in[:b] = tok
            pos_in[:b] += 1
        res = []
        eos_set = set(eos_t.tolist())
        for row in out.tolist():
            stop = next((i for i, t in enumerate(row) if t in eos_set), None)
            res.append((row if stop is None else row[:stop], stop is None))
        return res

    def _capture(self, fn):
        """A CUDA graph of fn() after its warm-up runs (fn is idempotent: its inputs do not change
        until it has run; two warm-ups for the generator's first graph, which also meets the lazy
        initialisations, one after), or None with a warning where capturing fails for a reason
        other than memory; the generation then runs fn() eagerly."""
        from .graphs import _capture

        try:
            g = _capture(fn, self.sv.device, None, warmups=1 if self.graphs_captured else 2)
        except torch.cuda.OutOfMemoryError:
            raise
        except RuntimeError as e:
            self.failed_captures += 1
            warnings.warn(
                f"batched generation runs its steps eagerly: CUDA graph capture failed ({e})",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        self.graphs_captured += 1
        return g

    def _fixed_step(self, tok_in, pos_in, ks, vs, b: int, capacity: int, result):
        """One decode step of the first b rows over the whole capacity into result[:b]: the next
        tokens (a long buffer: greedy) or the logits."""
        logits = self._logits(self._decode(tok_in[:b], pos_in[:b], ks, vs, b, capacity))
        result[:b] = logits.argmax(-1) if result.dtype == torch.long else logits

    def _prefill(self, ids, ks, vs):
        """Hidden states [rows, width, H] of the right-padded prompts; writes their K/V."""
        sv = self.sv
        width = ids.shape[1]
        x = sv._embed(ids)
        rope = sv.rope(torch.arange(width, device=ids.device))
        for li, layer in enumerate(sv._layers):
            q, k, v = sv.qkv(layer, x, rope)
            ks[li][:, :, :width] = k
            vs[li][:, :, :width] = v
            o = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=sv.scale, enable_gqa=sv.num_heads != sv.kv_heads
            )
            x = sv.layer_out(layer, x, o)
        return x

    def _decode(self, tok, pos, ks, vs, b: int, keys: int):
        """Hidden states [b, H] of one token per row for the first b rows of the cache, `tok` at
        positions `pos`; writes its K/V and attends each row's positions up to its own (sdpa:
        under the mask over positions 0..keys-1). No shape or control flow depends on tensor
        values (a CUDA graph captures it)."""
        sv = self.sv
        x = sv._embed(tok)[:, None]  # [b, 1, H]
        rope = sv.rope(pos[:, None])  # tables [b, 1, heads, D]
        ar = torch.arange(b, device=tok.device)
        flash = self.attention == "flash"
        if flash:  # computed once, shared by every layer
            offsets = rows_offsets(b, sv.kv_heads, ks[0].shape[2], tok.device)
            used = (pos + 1).to(torch.int32)
        else:
            allowed = torch.arange(keys, device=tok.device)[None, :] <= pos[:, None]
        for li, layer in enumerate(sv._layers):
            q, k, v = sv.qkv(layer, x, rope)  # q [b, heads, 1, D], k/v [b, kv heads, 1, D]
            kc, vc = ks[li][:b], vs[li][:b]
            kc[ar, :, pos] = k[:, :, 0]
            vc[ar, :, pos] = v[:, :, 0]
            if flash:
                o = attend_rows_flash(q[:, :, 0], kc, vc, offsets, used, sv.scale)
            else:
                o = attend_rows_sdpa(q[:, :, 0], kc[:, :, :keys], vc[:, :, :keys], allowed, sv.scale)
            x = sv.layer_out(layer, x, o[:, :, None])
        return x[:, 0]

    def _logits(self, x):
        return self.sv._head(self.sv._norm(x))

    @staticmethod
    def _choose(logits, temperature: float, top_p: float, generator):
        if temperature == 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        if top_p >= 1:
            return torch.multinomial(probs, 1, generator=generator)[:, 0]
        sp, si = probs.sort(dim=-1, descending=True)
        # keep a token while the mass before it is below top_p (so at least the first)
        sp = sp.masked_fill(sp.cumsum(-1) - sp >= top_p, 0.0)
        return si.gather(-1, torch.multinomial(sp, 1, generator=generator))[:, 0]
