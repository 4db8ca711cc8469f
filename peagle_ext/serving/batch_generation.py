"""Generation for many prompts at once over a preallocated KV cache: the engine of `peagle
datagen` (peagle_ext.data.datagen).

transformers' generate() keeps a dynamic cache that appends every step's K/V by concatenation,
which copies each layer's whole cache every step, and it expands grouped K/V heads for attention
when rows are padded. At the batch sizes datagen runs (thousands of rows) those copies, not the
model's arithmetic, decide the step time. Here each layer's K and V live in one [rows, kv heads,
capacity, D] tensor written in place, a decode step reads each cached entry once, and rows that
have stopped leave the batch as they accumulate.

Layout: prompts are right-padded, each row's tokens at positions 0..len-1, so its first new token
sits at position len. Attention is causal by position alone. The K/V a short prompt's padding
writes at positions len..width-1 are overwritten by that row's own new tokens before any query
reads them, since a query at position p reads positions <= p only. A decode step's query heads
that share one K/V head enter attention as that head's query rows: all of them sit at the same
position, so one mask serves them and no K/V head is repeated.

The model's own modules run through StaticVerifier's layer math (`qkv`, `layer_out`), so the
model families are StaticVerifier's (`static_verifier_support`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .static_verifier import StaticVerifier

# a stop check syncs with the device; between checks the host runs ahead of the GPU
STOP_CHECK_EVERY = 8


class BatchGenerator:
    """Greedy or sampled generation of a batch of prompts (module docstring)."""

    def __init__(self, model):
        self.sv = StaticVerifier(model)  # ValueError naming what it does not run

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

        x = self._prefill(ids.to(dev), ks, vs)
        tok = self._choose(self._logits(x[torch.arange(n, device=dev), len_t - 1]), temperature, top_p, generator)
        out = torch.empty((n, max_new_tokens), dtype=torch.long, device=dev)
        out[:, 0] = tok
        stopped = torch.isin(tok, eos_t)
        rows = torch.arange(n, device=dev)  # the prompt each batch row generates for
        pos = len_t.clone()  # the position of each row's `tok`
        live = list(range(n))  # rows on the host, for the attention length
        for step in range(1, max_new_tokens):
            if step % STOP_CHECK_EVERY == 0:
                keep = (~stopped).nonzero().squeeze(1)
                if keep.numel() == 0:
                    break
                if 4 * (len(live) - keep.numel()) >= len(live):  # a quarter stopped: drop them
                    ks = [k.index_select(0, keep) for k in ks]
                    vs = [v.index_select(0, keep) for v in vs]
                    tok, rows, pos, stopped = tok[keep], rows[keep], pos[keep], stopped[keep]
                    live = [live[i] for i in keep.tolist()]
            ctx = max(lens[r] for r in live) + step  # positions 0..ctx-1 hold every live row's context
            x = self._decode(tok, pos, ks, vs, ctx)
            tok = self._choose(self._logits(x), temperature, top_p, generator)
            out[rows, step] = tok
            stopped |= torch.isin(tok, eos_t)
            pos += 1
        res = []
        eos_set = set(eos_t.tolist())
        for row in out.tolist():
            stop = next((i for i, t in enumerate(row) if t in eos_set), None)
            res.append((row if stop is None else row[:stop], stop is None))
        return res

    def _prefill(self, ids, ks, vs):
        """Hidden states [rows, width, H] of the right-padded prompts; writes their K/V."""
        sv = self.sv
        width = ids.shape[1]
        x = sv._embed(ids)
        cos, sin = sv.rope(torch.arange(width, device=ids.device))
        for li, layer in enumerate(sv._layers):
            q, k, v = sv.qkv(layer, x, cos, sin)
            ks[li][:, :, :width] = k
            vs[li][:, :, :width] = v
            o = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=sv.scale, enable_gqa=sv.num_heads != sv.kv_heads
            )
            x = sv.layer_out(layer, x, o)
        return x

    def _decode(self, tok, pos, ks, vs, ctx: int):
        """Hidden states [rows, H] of one token per row, `tok` at positions `pos`; writes its K/V
        and attends positions 0..ctx-1 up to each row's own."""
        sv = self.sv
        b = tok.shape[0]
        group = sv.num_heads // sv.kv_heads
        x = sv._embed(tok)[:, None]  # [rows, 1, H]
        cos, sin = sv.rope(pos[:, None])  # [rows, 1, 1, D]
        mask = (torch.arange(ctx, device=tok.device) <= pos[:, None])[:, None, None, :]
        ar = torch.arange(b, device=tok.device)
        for li, layer in enumerate(sv._layers):
            q, k, v = sv.qkv(layer, x, cos, sin)  # q [rows, heads, 1, D], k/v [rows, kv heads, 1, D]
            ks[li][ar, :, pos] = k[:, :, 0]
            vs[li][ar, :, pos] = v[:, :, 0]
            o = F.scaled_dot_product_attention(
                q.reshape(b, sv.kv_heads, group, sv.head_dim),
                ks[li][:, :, :ctx],
                vs[li][:, :, :ctx],
                attn_mask=mask,
                scale=sv.scale,
            )
            x = sv.layer_out(layer, x, o.reshape(b, sv.num_heads, 1, sv.head_dim))
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
