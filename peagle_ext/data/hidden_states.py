"""Verifier hidden states of packed rows: the aux layers' inputs and the last layer's output,
per document (documents never attend each other)."""

from __future__ import annotations

import contextlib

import torch

from .records import PackedSequence
from .verifier import check_aux_layer_ids, decoder_parts

# Batched passes on a GPU (the trainer's cache warm-up, HiddenStateCache.generate): a pass's rows
# hold about PASS_STATE_BYTES of states (on the device about three times over: the states, their
# shifted copies, one field on its way to the host); its documents, grouped by length, go through
# the verifier in forwards of at most PASS_TOKENS padded tokens. Many rows a pass let the grouping
# put documents of near-equal length together: on SmolLM2 rows of regenerated ShareGPT, 16 rows a
# pass padded the documents by 64%, 113 rows (1 GiB) by 14%, in 40% fewer forwards.
PASS_STATE_BYTES = 1 << 30
PASS_TOKENS = 32768

# cuDNN's SDPA builds an execution plan for each new (documents, longest) shape, tens of ms of host
# time, and grouping documents by length gives nearly every forward here a new shape; flash and
# memory-efficient attention plan nothing. True: the forwards here leave cuDNN out.
PASS_WITHOUT_CUDNN_ATTENTION = True


def _pass_attention(device: torch.device):
    """The SDPA backends of this module's verifier forwards (PASS_WITHOUT_CUDNN_ATTENTION). The
    choice is process-wide while it lasts; another thread's SDPA in that window takes another
    exact kernel, never another result beyond float rounding."""
    if device.type != "cuda" or not PASS_WITHOUT_CUDNN_ATTENTION:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def rows_per_pass(verifier, rows: list, n_aux: int, state_bytes: int | None = None) -> int:
    """How many rows' states (the longest row's positions x (n_aux + last) x hidden x the
    verifier's element size) fill state_bytes (default PASS_STATE_BYTES), at least one: 113 rows
    of 2048 SmolLM2 positions with three aux layers, 16 of an 8B verifier's."""
    if state_bytes is None:
        state_bytes = PASS_STATE_BYTES
    hidden = int(verifier.config.hidden_size)
    item = next(verifier.parameters()).element_size()
    longest = max((len(r) for r in rows), default=1)
    return max(1, int(state_bytes) // (longest * (n_aux + 1) * hidden * item))


def _batches_by_length(spans: list[tuple], token_budget: int) -> list[list[tuple]]:
    """Group documents of similar length so that padding waste stays small: sort by length,
    then cut whenever (count * longest) would exceed the token budget."""
    order = sorted(spans, key=lambda s: s[1] - s[0], reverse=True)
    batches: list[list[tuple]] = []
    cur: list[tuple] = []
    for s in order:
        longest = (cur[0][1] - cur[0][0]) if cur else (s[1] - s[0])
        if cur and (len(cur) + 1) * longest > token_budget:
            batches.append(cur)
            cur = []
        cur.append(s)
    if cur:
        batches.append(cur)
    return batches


@torch.no_grad()
def verifier_hidden_states(
    verifier, packed: PackedSequence, aux_layer_ids, *, token_budget: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verifier hidden states of one packed row: (aux [N, n_aux*H], last [N, H]).

    Which tensors (vLLM / speculators EAGLE-3 convention, so a drafter trained on them is served
    correctly by vLLM):
      aux layer id k  = the residual stream ENTERING decoder layer k, i.e. the output of layer k-1
                        (k = 0: the token embeddings). This is HF's `output_hidden_states` entry
                        `hidden_states[k]` and vLLM's `aux_hidden_states` for layer k (vLLM appends
                        `hidden_states + residual` just before running layer k).
      last            = the output of the LAST decoder layer BEFORE the final norm (the input of
                        `verifier.model.norm`), so that
                        verifier.lm_head(verifier.model.norm(last)) == the verifier's logits.
                        (HF's hidden_states[-1] is AFTER the norm in transformers 5, so it is not used.)
    aux is the concatenation of the aux layers in `aux_layer_ids` order along the feature dim.

    Documents never attend each other: each document of the row is run as its own sequence
    (position ids restart at 0, like at inference), several documents per forward batched with
    right padding and no attention mask: under causal attention a document's tokens never see
    the padding after them, so their outputs are those of the document alone (to float rounding
    across batch shapes), and without a mask transformers runs SDPA's causal kernel instead of
    building and applying a [documents, 1, longest, longest] mask. Padding positions of the row
    are zero. Outputs are in the verifier's dtype on the verifier's device.

    token_budget: max tokens (documents * longest) per forward; default max(len(row), 4096).
    """
    if not isinstance(packed, PackedSequence):
        raise TypeError(f"packed must be a PackedSequence, got {type(packed).__name__}")
    return verifier_hidden_states_many(verifier, [packed], aux_layer_ids, token_budget=token_budget)[0]


@torch.no_grad()
def verifier_hidden_states_many(
    verifier, rows: list[PackedSequence], aux_layer_ids, *, token_budget: int | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """verifier_hidden_states of several rows, their documents batched together: one forward
    serves documents of every row (on a GPU an eager verifier forward costs about the same for
    one document as for a batch of them, so a training step's rows in one pass instead of one
    pass or more per row). token_budget: max tokens (documents * longest) per forward; default
    max(longest row, 4096), which for one row batches exactly as verifier_hidden_states always
    has. The values agree with one row at a time to float rounding (other batch shapes)."""
    for r in rows:
        if not isinstance(r, PackedSequence):
            raise TypeError(f"rows must be PackedSequences, got {type(r).__name__}")
    base, layers, norm = decoder_parts(verifier)
    L = len(layers)
    ids = check_aux_layer_ids(aux_layer_ids, L)
    param = next(verifier.parameters())
    device, dtype = param.device, param.dtype
    H = int(verifier.config.hidden_size)
    outs = [
        (
            torch.zeros(len(r), len(ids) * H, dtype=dtype, device=device),
            torch.zeros(len(r), H, dtype=dtype, device=device),
        )
        for r in rows
    ]
    # (start, end, row): every document of every row; _batches_by_length reads the span's length
    spans = [(s, e, j) for j, r in enumerate(rows) for s, e in r.document_spans()]
    if not spans:
        return outs
    budget = token_budget or max(max(len(r) for r in rows), 4096)

    captured: dict[int, torch.Tensor] = {}

    def capture_input(key):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            captured[key] = x

        return hook

    # Hooks on the INPUTS: layer k's input is aux id k; the final norm's input is id L and `last`.
    wanted = sorted(set(i for i in ids if i < L))
    handles = [layers[k].register_forward_pre_hook(capture_input(k), with_kwargs=True) for k in wanted]
    handles.append(norm.register_forward_pre_hook(capture_input(L), with_kwargs=True))
    input_ids = [r.input_ids.to(device) for r in rows]
    try:
        for batch in _batches_by_length(spans, budget):
            longest = max(e - s for s, e, _ in batch)
            x = torch.zeros(len(batch), longest, dtype=torch.long, device=device)
            for b, (s, e, j) in enumerate(batch):
                x[b, : e - s] = input_ids[j][s:e]
            captured.clear()
            with _pass_attention(device):
                base(input_ids=x, use_cache=False)  # right padding: causal attention needs no mask
            for b, (s, e, j) in enumerate(batch):
                n = e - s
                aux, last = outs[j]
                for jj, k in enumerate(ids):
                    aux[s:e, jj * H : (jj + 1) * H] = captured[k][b, :n]
                last[s:e] = captured[L][b, :n]
    finally:
        for h in handles:
            h.remove()
    return outs
