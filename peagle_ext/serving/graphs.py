"""Fixed-shape decoding steps over static buffers, replayed as CUDA graphs on a GPU.

A speculative round after the first has fixed shapes: K+1 verified tokens come in, 2K draft rows
(vLLM's batch for one request) go through the drafter, K+1 tokens go through the verifier. A
RoundEngine holds every tensor the round reads and writes (the round's inputs, the drafter's
batch buffers, both KV caches), and one call of its `round()` does

    fc(aux) -> prepare_parallel_draft_inputs(out=...) -> drafter (all 2K rows) -> argmax
    -> verifier(bonus, d_1..d_K) -> greedy, accepted count a -> next round's inputs

on the device, with no host sync, ending with one packed int tensor [a, verified ids, greedy]
that the host reads (the only device -> host copy of a round). With cuda_graph=True the engine
captures round() once and replays it; otherwise (and on CPU) it runs round() eagerly, which is
the same computation: the CPU tests check it against the general decoding loop token for token.
The first round drafts from the whole prompt. Without padded prefill (below) the decoding loop
runs the prefill and that draft eagerly, and the verify half (`first_verify`: the verifier over
bonus + K drafts, the acceptance, the next inputs) replays a graph of its own.

GreedyEngine is the same for plain greedy decoding (one token per step), so that the baseline
decoding is timed with the same verifier forward and the same graph replay.

With padded prefill (the default with CUDA graphs) the prefill, and for a RoundEngine the whole
first round (prefill, the draft over the prompt, the first verify), runs on the prompt padded to
a bucket length (`prefill_buckets`), one graph per bucket: eagerly, a prefill is some twenty ops
a layer at a host cost per op whatever their size (SmolLM2 on the H200: 60 ms a prefill, 17 ms
the first draft, against 3-4 ms a round), which weighs on both decodings of a short answer.
Padding changes nothing that is read: the verifier's padding rows sit at positions after the
prompt, which decoding overwrites before any query reaches them (the cache's invariant,
static_verifier.py), and the drafter's are rejected rows of the parallel-drafting batch
(num_rejected = bucket - prompt length), which write to the drafter's scratch slot and are never
sampled.
"""

from __future__ import annotations

import torch

from ..ops.parallel_draft import DraftBatch, prepare_parallel_draft_inputs
from .drafter import PEagleDrafter
from .static_verifier import StaticKV, StaticVerifier

BLOCK_SIZE = 16
SMALLEST_BUCKET = 32


def prefill_buckets(capacity: int) -> list[int]:
    """Padded prompt lengths of the prefill graphs: powers of two from SMALLEST_BUCKET below
    `capacity`, then `capacity` itself (a prompt of length n runs at the smallest bucket >= n)."""
    cap = int(capacity)
    out, b = [], SMALLEST_BUCKET
    while b < cap:
        out.append(b)
        b *= 2
    return out + [cap]


def _bucket(buckets: list[int], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"a prompt of {n} tokens exceeds the engine's capacity {buckets[-1]}")


class _PrefillInputs:
    """The padded prompt of one bucket: token ids [B] and the index of the last prompt row."""

    def __init__(self, bucket: int, device):
        self.ids = torch.zeros(bucket, dtype=torch.int64, device=device)
        self.pos = torch.arange(bucket, dtype=torch.int64, device=device)
        self.last = torch.zeros(1, dtype=torch.int64, device=device)

    def load(self, prompt: torch.Tensor):
        n = prompt.shape[0]
        self.ids[:n].copy_(prompt)
        self.ids[n:].zero_()
        self.last.fill_(n - 1)


def _prefill_graphs(buckets: list[int], run, device, before=None) -> dict:
    """{bucket: a CUDA graph of run(bucket), or None where capturing failed}, every graph in one
    memory pool (an engine replays one at a time). before(): called before each capture."""
    pool = torch.cuda.graph_pool_handle()
    graphs = {}
    for b in buckets:
        if before is not None:
            before()
        graphs[b] = _capture_prefill(lambda b=b: run(b), device, b, pool)
    return graphs


def _capture_prefill(fn, device, bucket: int, pool):
    """_capture(fn) for a prefill bucket into the engine's shared pool; where capturing fails
    (other than for memory) the bucket runs the same computation eagerly (slower, the same
    tokens), with a warning, and the engine lists it in eager_prefill_buckets."""
    try:
        return _capture(fn, device, pool)
    except torch.cuda.OutOfMemoryError:
        raise
    except RuntimeError as e:
        import warnings

        msg = f"the prefill of bucket {bucket} runs eagerly: CUDA graph capture failed ({e})"
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        return None


def _capture(fn, device, pool=None, warmups: int = 2):
    """A CUDA graph of fn() after `warmups` runs on a side stream (as torch.cuda.graphs asks).
    pool: a memory pool shared with other graphs that are never replayed at the same time (every
    graph here writes its results into buffers allocated outside it)."""
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.no_grad():
        with torch.cuda.stream(s):
            for _ in range(warmups):
                fn()
        torch.cuda.current_stream(device).wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            fn()
    return g


class RoundEngine:
    """The speculative rounds after the first, for one verifier, drafter, K and capacity."""

    def __init__(
        self,
        verifier: StaticVerifier,
        drafter: PEagleDrafter,
        num_spec_tokens: int,
        capacity: int,
        *,
        cuda_graph: bool,
        padded_prefill: bool | None = None,
    ):
        """padded_prefill (default: cuda_graph): first_round() on prompts padded to a bucket
        (module docstring); else the decoding loop runs the prefill and first draft itself."""
        if not isinstance(verifier, StaticVerifier):
            raise TypeError("RoundEngine needs a StaticVerifier")
        if not isinstance(drafter, PEagleDrafter):
            raise TypeError("RoundEngine needs a PEagleDrafter")
        k = int(num_spec_tokens)
        if not 1 <= k <= drafter.num_depths:
            raise ValueError(f"num_spec_tokens must be in [1, {drafter.num_depths}], got {num_spec_tokens!r}")
        dev = verifier.device
        if cuda_graph and dev.type != "cuda":
            raise ValueError("cuda_graph=True needs the verifier on a CUDA device")
        self.verifier, self.drafter, self.k = verifier, drafter, k
        self.capacity = -(-int(capacity) // BLOCK_SIZE) * BLOCK_SIZE
        self.cache: StaticKV = verifier.new_cache(self.capacity)
        drafter.reset(self.capacity)
        mh = drafter.mask_hidden.to(dev)
        self._mask_hidden = mh
        # the round's inputs: the last verified tokens, their positions and aux states, the bonus
        self.tgt_ids = torch.zeros(k + 1, dtype=torch.int32, device=dev)
        self.tgt_pos = torch.arange(k + 1, dtype=torch.int64, device=dev)
        width = len(verifier.aux_layer_ids) * verifier.hidden_size
        self.aux = torch.zeros(k + 1, width, dtype=verifier.dtype, device=dev)
        self.bonus = torch.zeros(1, dtype=torch.int32, device=dev)
        self.n_rej = torch.zeros(1, dtype=torch.int32, device=dev)
        self.seq_len = torch.full((1,), k + 1, dtype=torch.int64, device=dev)
        self.qsl = torch.tensor([0, k + 1], dtype=torch.int32, device=dev)
        self.block_table = torch.arange(self.capacity // BLOCK_SIZE, dtype=torch.int32, device=dev)[None]
        self.batch = DraftBatch.empty(k + 1, 1, k, mh.shape[-1], dtype=mh.dtype, device=dev)
        for t in self.batch.as_tuple():
            t.zero_()
        self._arange = torch.arange(k + 1, dtype=torch.int64, device=dev)
        self.drafts = torch.zeros(k, dtype=torch.int64, device=dev)
        self.out = torch.zeros(1 + 2 * (k + 1), dtype=torch.int64, device=dev)
        self._draft_cache = drafter.kv_cache_ptr
        self.graph = _capture(self.round, dev) if cuda_graph else None
        # the first round drafts from the whole prompt (a shape of its own, run eagerly); its verify
        # forward has the fixed K + 1 tokens of every round and replays a graph of its own
        # (its warm-up runs start again from position K + 1: the two captures' warm-ups together
        # would run past a small capacity)
        self.seq_len.fill_(k + 1)
        self.verify_graph = _capture(self.verify, dev) if cuda_graph else None
        # the first round on a prompt padded to a bucket: its inputs, draft batch and graph
        self.padded_prefill = cuda_graph if padded_prefill is None else bool(padded_prefill)
        self.buckets = prefill_buckets(self.capacity) if self.padded_prefill else []
        self._prefill = {}
        for b in self.buckets:
            qsl = torch.tensor([0, b], dtype=torch.int32, device=dev)
            n_rej = torch.zeros(1, dtype=torch.int32, device=dev)
            batch = DraftBatch.empty(b, 1, k, mh.shape[-1], dtype=mh.dtype, device=dev)
            for t in batch.as_tuple():
                t.zero_()
            self._prefill[b] = (_PrefillInputs(b, dev), qsl, n_rej, batch)
        # the capture's warm-up runs verify from position 0 on (a prompt of b tokens could leave
        # no room for K + 1 more); the cache's contents do not matter yet
        self._prefill_graph = (
            _prefill_graphs(self.buckets, self._first_round, dev, before=lambda: self.seq_len.fill_(0))
            if cuda_graph
            else {}
        )
        self.eager_prefill_buckets = [b for b, g in self._prefill_graph.items() if g is None]

    def check(self):
        """The drafter's KV cache must be the one this engine was built on (a larger reset()
        reallocates it, which a captured graph would not see)."""
        if self.drafter.kv_cache_ptr != self._draft_cache:
            raise ValueError(
                "the drafter's KV cache was reallocated after this engine was built: build every engine "
                "after drafter.reset(the largest capacity)"
            )

    def round(self):
        """One round on the engine's buffers (module docstring)."""
        self._draft_and_verify(self.tgt_ids, self.tgt_pos, self.qsl, self.n_rej, self.aux, self.batch)

    def _draft_and_verify(self, tgt_ids, tgt_pos, qsl, n_rej, aux, batch: DraftBatch):
        """The parallel-drafting batch of the target rows (int32 ids, positions, verifier aux
        states; the last n_rej rows rejected) and self.bonus, written into `batch`; the drafter
        over it; then verify()."""
        k, dr = self.k, self.drafter
        hidden = dr.combine_hidden(aux).to(self._mask_hidden.dtype)
        batch = prepare_parallel_draft_inputs(
            tgt_ids,
            tgt_pos,
            self.bonus,
            qsl,
            n_rej,
            hidden,
            self._mask_hidden,
            self.block_table,
            num_spec_tokens=k,
            mask_token_id=dr.mask_token_id,
            block_size=BLOCK_SIZE,
            max_model_len=self.capacity,
            out=batch,
        )
        self.drafts.copy_(dr.propose_static(batch, k))
        self.verify()

    def verify(self):
        """The verifier half of a round: bonus + self.drafts through the verifier at seq_len, the
        accepted count, and the next round's inputs."""
        k, v = self.k, self.verifier
        drafts = self.drafts
        verify_ids = torch.cat([self.bonus.long(), drafts])
        pos = self.seq_len + self._arange
        logits, aux = v.forward_static(verify_ids, pos, self.cache)
        greedy = logits.argmax(-1)
        a = torch.cumprod((drafts == greedy[:k]).long(), 0).sum().reshape(1)
        self.out.copy_(torch.cat([a, verify_ids, greedy]))
        self.tgt_ids.copy_(verify_ids)
        self.tgt_pos.copy_(pos)
        self.aux.copy_(aux)
        self.bonus.copy_(greedy.gather(0, a))
        self.n_rej.copy_(k - a)
        self.seq_len.add_(1 + a)

    def _first_round(self, b: int):
        """The first round over the padded prompt of bucket b: prefill (the bonus token and the
        prompt's aux states), the draft over every prompt row, the verify (self.seq_len holds
        the prompt length)."""
        inp, qsl, n_rej, batch = self._prefill[b]
        logits, aux = self.verifier.forward_static(inp.ids, inp.pos, self.cache, logit_rows=inp.last)
        self.bonus.copy_(logits.argmax(-1))
        self._draft_and_verify(inp.ids.to(torch.int32), inp.pos, qsl, n_rej, aux, batch)

    def first_round(self, prompt: torch.Tensor) -> list[int]:
        """Prefill and first round of `prompt` (int64 [n] on the device) as one step on its
        bucket; returns what step() returns, whose verified ids start with the prefill's greedy
        token. Leaves the engine ready for step()."""
        if not self.padded_prefill:
            raise ValueError("this RoundEngine was built with padded_prefill=False")
        n = int(prompt.shape[0])
        if n + self.k + 1 > self.capacity:
            raise ValueError(f"a prompt of {n} tokens and K + 1 more exceed the engine's capacity {self.capacity}")
        b = _bucket(self.buckets, n)
        inp, _, n_rej, _ = self._prefill[b]
        graph = self._prefill_graph.get(b)
        inp.load(prompt)
        n_rej.fill_(b - n)  # the padding rows are the batch's rejected rows
        self.seq_len.fill_(n)
        if graph is not None:
            graph.replay()
        else:
            self._first_round(b)
        return self.out.tolist()

    def begin(self, verify_ids, seq_len: int, aux, bonus, n_rej: int):
        """Load the state after an eagerly run round: the tokens it verified (at positions
        seq_len..seq_len+K), their aux states, the new bonus token and the rejected count."""
        self.tgt_ids.copy_(verify_ids.reshape(-1))
        self.tgt_pos.copy_(seq_len + self._arange)
        self.aux.copy_(aux)
        self.bonus.copy_(bonus.reshape(1))
        self.n_rej.fill_(int(n_rej))
        self.seq_len.fill_(int(seq_len) + self.k + 1 - int(n_rej))

    def first_verify(self, drafts, bonus, seq_len: int) -> list[int]:
        """The verify half of the first round, whose drafts came from the eager draft forward over
        the prompt: bonus at position seq_len, then the K drafts. Leaves the engine ready for
        step(); returns what step() returns."""
        self.drafts.copy_(drafts.reshape(-1))
        self.bonus.copy_(bonus.reshape(1))
        self.seq_len.fill_(int(seq_len))
        if self.verify_graph is not None:
            self.verify_graph.replay()
        else:
            self.verify()
        return self.out.tolist()

    def step(self) -> list[int]:
        """Run one round; [accepted, verified ids (K+1), greedy ids (K+1)] on the host."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self.round()
        return self.out.tolist()


class GreedyEngine:
    """Plain greedy decoding steps (one token per verifier forward) on static buffers."""

    def __init__(
        self, verifier: StaticVerifier, capacity: int, *, cuda_graph: bool, padded_prefill: bool | None = None
    ):
        """padded_prefill (default: cuda_graph): prefill() on prompts padded to a bucket."""
        if not isinstance(verifier, StaticVerifier):
            raise TypeError("GreedyEngine needs a StaticVerifier")
        dev = verifier.device
        if cuda_graph and dev.type != "cuda":
            raise ValueError("cuda_graph=True needs the verifier on a CUDA device")
        self.verifier = verifier
        self.capacity = int(capacity)
        self.cache = verifier.new_cache(self.capacity)
        self.tok = torch.zeros(1, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(1, dtype=torch.int64, device=dev)
        self.graph = _capture(self.round, dev) if cuda_graph else None
        self.padded_prefill = cuda_graph if padded_prefill is None else bool(padded_prefill)
        self.buckets = prefill_buckets(self.capacity) if self.padded_prefill else []
        self._prefill = {b: _PrefillInputs(b, dev) for b in self.buckets}
        self._prefill_graph = _prefill_graphs(self.buckets, self._prefill_step, dev) if cuda_graph else {}
        self.eager_prefill_buckets = [b for b, g in self._prefill_graph.items() if g is None]

    def _prefill_step(self, b: int):
        inp = self._prefill[b]
        logits, _ = self.verifier.forward_static(inp.ids, inp.pos, self.cache, with_aux=False, logit_rows=inp.last)
        self.tok.copy_(logits.argmax(-1))

    def prefill(self, prompt: torch.Tensor) -> int:
        """The prefill of `prompt` (int64 [n] on the device) on its bucket: the first greedy
        token. Leaves the engine ready for step()."""
        if not self.padded_prefill:
            raise ValueError("this GreedyEngine was built with padded_prefill=False")
        n = int(prompt.shape[0])
        if n >= self.capacity:
            raise ValueError(f"a prompt of {n} tokens and one more exceed the engine's capacity {self.capacity}")
        b = _bucket(self.buckets, n)
        inp, graph = self._prefill[b], self._prefill_graph.get(b)
        inp.load(prompt)
        if graph is not None:
            graph.replay()
        else:
            self._prefill_step(b)
        self.pos.fill_(n)
        return int(self.tok)

    def round(self):
        logits, _ = self.verifier.forward_static(self.tok, self.pos, self.cache, with_aux=False)
        self.tok.copy_(logits.argmax(-1))
        self.pos.add_(1)

    def begin(self, tok: int, pos: int):
        self.tok.fill_(int(tok))
        self.pos.fill_(int(pos))

    def step(self) -> int:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.round()
        return int(self.tok)
