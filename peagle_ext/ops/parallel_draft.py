"""vLLM's parallel-drafting batch step as one op (docs/design.md section 6).

`prepare_parallel_draft_inputs` builds the first (and, with parallel drafting, only) draft
forward's inputs from the verifier's batch in ONE op (one CUDA launch), doing what vLLM 0.33's
`SpecDecodeBaseProposer.set_inputs_first_pass` does for P-EAGLE (method "eagle3" +
parallel_drafting) with a Triton kernel (`copy_and_expand_eagle_inputs_kernel`,
shift_input_ids=True), an index_put of the hidden states, a torch.where with mask_hidden and
the ops of `compute_new_slot_mapping` + `extend_all_queries_by_N`'s query_start_loc.

The vLLM plugin that routes vLLM's proposer through this op is peagle_ext.serving.vllm_plugin.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .._checks import check_int, check_tensor
from .._native import ops

PADDING_SLOT_ID = -1
"""vLLM's PADDING_SLOT_ID: slot_mapping value of slots that must not be written to the KV cache."""

HIDDEN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1


@dataclass
class DraftBatch:
    """Inputs of the draft forward, T_out = T_in + (K-1)*B rows (request r's rows are
    query_start_loc[r] .. query_start_loc[r+1]-1 of the new query_start_loc).

    input_ids int32[T_out], positions int64[T_out], hidden [T_out, H] (dtype of target_hidden),
    is_rejected bool[T_out], is_masked bool[T_out], token_indices_to_sample int32[B*K] (rows
    whose logits give draft tokens 1..K of each request, request-major), hidden_state_mapping
    int32[T_in] (target row i went to hidden row mapping[i]), slot_mapping int64[T_out]
    (PADDING_SLOT_ID = -1: do not write the KV cache), query_start_loc int32[B+1].
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    hidden: torch.Tensor
    is_rejected: torch.Tensor
    is_masked: torch.Tensor
    token_indices_to_sample: torch.Tensor
    hidden_state_mapping: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor

    @classmethod
    def empty(
        cls,
        num_input_tokens: int,
        batch_size: int,
        num_spec_tokens: int,
        hidden_size: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device="cpu",
    ) -> DraftBatch:
        """Preallocated (uninitialised) outputs for the out= form, e.g. before CUDA graph capture."""
        t_out = num_input_tokens + (num_spec_tokens - 1) * batch_size
        kw = dict(device=device)
        return cls(
            input_ids=torch.empty(t_out, dtype=torch.int32, **kw),
            positions=torch.empty(t_out, dtype=torch.int64, **kw),
            hidden=torch.empty(t_out, hidden_size, dtype=dtype, **kw),
            is_rejected=torch.empty(t_out, dtype=torch.bool, **kw),
            is_masked=torch.empty(t_out, dtype=torch.bool, **kw),
            token_indices_to_sample=torch.empty(batch_size * num_spec_tokens, dtype=torch.int32, **kw),
            hidden_state_mapping=torch.empty(num_input_tokens, dtype=torch.int32, **kw),
            slot_mapping=torch.empty(t_out, dtype=torch.int64, **kw),
            query_start_loc=torch.empty(batch_size + 1, dtype=torch.int32, **kw),
        )

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


_FIELDS = tuple(f.name for f in fields(DraftBatch))


def prepare_parallel_draft_inputs(
    target_token_ids: torch.Tensor,
    target_positions: torch.Tensor,
    next_token_ids: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_rejected_tokens: torch.Tensor | None,
    target_hidden: torch.Tensor,
    mask_hidden: torch.Tensor,
    block_table: torch.Tensor,
    *,
    num_spec_tokens: int,
    mask_token_id: int,
    block_size: int,
    max_model_len: int,
    out: DraftBatch | None = None,
    validate: bool = False,
) -> DraftBatch:
    """vLLM's parallel-drafting input step (P-EAGLE) in one op.

    Inputs (the verifier's padded batch, as vLLM passes it to the proposer): target_token_ids
    int32[T_in], target_positions int64[T_in], next_token_ids int32[B] (the bonus token sampled
    by the verifier for each request), query_start_loc int32[B+1] (0 = first, T_in = last),
    num_rejected_tokens int32[B] or None (= all 0), target_hidden [T_in, H] (after the drafter's
    combine_hidden_states / fc), mask_hidden [H] (same dtype; vLLM's
    parallel_drafting_hidden_state_tensor), block_table int32[B, max_blocks] (rows beyond B are
    ignored; max_blocks * block_size >= max_model_len). K = num_spec_tokens >= 1.

    For request r with input rows [qs, qe), len = qe - qs, n = num_rejected_tokens[r] in
    [0, len-1] (vLLM: n <= the request's previous draft count, and len = drafts + 1),
    v = len - 1 - n, its output rows are out_start + j, j in [0, len + K - 1), out_start =
    qs + r*(K-1):
      j <  v          input_ids = target_token_ids[qs + 1 + j] (shifted), hidden = target row qs+j
      j == v          bonus: input_ids = next_token_ids[r], hidden = target row qs+j (last accepted)
      v < j < v + K   MASK: input_ids = mask_token_id, hidden = mask_hidden, is_masked
      j >= v + K      rejected (n rows): input_ids = 0 (vLLM's padding_token_id), position 0,
                      slot -1, is_rejected; hidden = target row qs+j when j < len (vLLM's
                      index_put of every target row lands there; those rows are rejected
                      verifier tokens) and ZERO when j >= len (vLLM leaves whatever its
                      persistent buffer held: a don't-care value, since these rows are last in
                      their request, have no KV slot and are never sampled; we write zeros so
                      the result is deterministic).
      positions (non-rejected) = target_positions[qs] + j (not shifted).
      token_indices_to_sample[r*K + (j - v)] = out row, for v <= j < v + K (bonus + MASKs).
      hidden_state_mapping[qs + j] = out row, for j < len (target rows are not shifted).
      slot_mapping = block_table[r, p // block_size] * block_size + p % block_size with
      p = min(position, max_model_len - 1); -1 when rejected or position >= max_model_len.
      query_start_loc (new) = query_start_loc + arange(B+1) * (K-1).

    out: a DraftBatch of preallocated, contiguous tensors (DraftBatch.empty) written in place
    and returned; with it the CUDA path allocates nothing, syncs nothing and can be captured
    in a CUDA graph. On the CPU the op also checks the tensor values (query_start_loc
    monotone, every request >= 1 token, num_rejected_tokens in [0, len-1]); on CUDA that costs a
    host sync, so it happens only with validate=True (the kernel itself never reads or writes
    out of bounds, whatever the values).
    """
    device = _check_inputs(
        target_token_ids,
        target_positions,
        next_token_ids,
        query_start_loc,
        num_rejected_tokens,
        target_hidden,
        mask_hidden,
        block_table,
    )
    check_int("num_spec_tokens", num_spec_tokens, lo=1)
    check_int("mask_token_id", mask_token_id, lo=0, hi=_INT32_MAX)
    # slot = block id (int32) * block_size + offset: past 2^31 it wraps negative
    check_int("block_size", block_size, lo=1, hi=_INT32_MAX)
    check_int("max_model_len", max_model_len, lo=1)
    if block_table.shape[1] * block_size < max_model_len:
        raise ValueError(
            f"block_table has {block_table.shape[1]} blocks per request of block_size {block_size} = "
            f"{block_table.shape[1] * block_size} tokens, fewer than max_model_len = {max_model_len}"
        )
    t_in = int(target_token_ids.shape[0])
    b = int(query_start_loc.shape[0]) - 1
    if b * num_spec_tokens > _INT32_MAX or t_in + (num_spec_tokens - 1) * b > _INT32_MAX:
        raise ValueError("T_out = T_in + (K-1)*B and B*K must fit in int32")
    if validate and device.type != "cpu":
        _validate_values(query_start_loc, num_rejected_tokens, target_positions, t_in, num_spec_tokens)
    args = (
        target_token_ids,
        target_positions,
        next_token_ids,
        query_start_loc,
        num_rejected_tokens,
        target_hidden,
        mask_hidden,
        block_table,
        int(num_spec_tokens),
        int(mask_token_id),
        int(block_size),
        int(max_model_len),
    )
    if out is None:
        return DraftBatch(*ops.prepare_parallel_draft_inputs(*args))
    _check_out(out, t_in, b, num_spec_tokens, target_hidden, device)
    ops.prepare_parallel_draft_inputs_out(*args, **{_OUT_ARG.get(n, n): getattr(out, n) for n in _FIELDS})
    return out


# DraftBatch field -> keyword of the _out schema (which cannot reuse the input's name).
_OUT_ARG = {"query_start_loc": "new_query_start_loc"}


def _check_inputs(
    target_token_ids,
    target_positions,
    next_token_ids,
    query_start_loc,
    num_rejected_tokens,
    target_hidden,
    mask_hidden,
    block_table,
) -> torch.device:
    check_tensor("target_token_ids", target_token_ids, dim=1, dtypes=(torch.int32,))
    device = target_token_ids.device
    t_in = target_token_ids.shape[0]
    check_tensor("query_start_loc", query_start_loc, dim=1, dtypes=(torch.int32,), device=device)
    if query_start_loc.shape[0] < 1:
        raise ValueError("query_start_loc must have shape [B+1] (at least one entry), got (0,)")
    b = query_start_loc.shape[0] - 1
    check_tensor("target_positions", target_positions, dtypes=(torch.int64,), shape=(t_in,), device=device)
    check_tensor("next_token_ids", next_token_ids, dtypes=(torch.int32,), shape=(b,), device=device)
    if num_rejected_tokens is not None:
        check_tensor("num_rejected_tokens", num_rejected_tokens, dtypes=(torch.int32,), shape=(b,), device=device)
    check_tensor("target_hidden", target_hidden, dim=2, dtypes=HIDDEN_DTYPES, device=device)
    if target_hidden.shape[0] != t_in:
        raise ValueError(
            f"target_hidden must have shape (T_in, H) with T_in = {t_in} (len of target_token_ids), "
            f"got {tuple(target_hidden.shape)}"
        )
    h = target_hidden.shape[1]
    if h < 1:
        raise ValueError(f"target_hidden must have H >= 1 columns, got shape {tuple(target_hidden.shape)}")
    check_tensor("mask_hidden", mask_hidden, device=device)
    if mask_hidden.dtype != target_hidden.dtype:
        raise TypeError(
            f"mask_hidden must have the dtype of target_hidden ({target_hidden.dtype}), got {mask_hidden.dtype}"
        )
    if tuple(mask_hidden.shape) != (h,):
        raise ValueError(f"mask_hidden must have shape ({h},) (H of target_hidden), got {tuple(mask_hidden.shape)}")
    check_tensor("block_table", block_table, dim=2, dtypes=(torch.int32,), device=device)
    if block_table.shape[0] < b or block_table.shape[1] < 1:
        raise ValueError(
            f"block_table must have shape (B, max_blocks) with B = {b} rows and max_blocks >= 1, "
            f"got {tuple(block_table.shape)}"
        )
    if block_table.stride(1) != 1:
        raise ValueError(f"block_table rows must be contiguous (stride(1) == 1), got strides {block_table.stride()}")
    for name, t in (
        ("target_token_ids", target_token_ids),
        ("target_positions", target_positions),
        ("next_token_ids", next_token_ids),
        ("query_start_loc", query_start_loc),
        ("num_rejected_tokens", num_rejected_tokens),
        ("target_hidden", target_hidden),
        ("mask_hidden", mask_hidden),
    ):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
    return device


def _check_out(out, t_in, b, k, target_hidden, device):
    if not isinstance(out, DraftBatch):
        raise TypeError(f"out must be a DraftBatch (see DraftBatch.empty), got {type(out).__name__}")
    t_out = t_in + (k - 1) * b
    want = {
        "input_ids": (torch.int32, (t_out,)),
        "positions": (torch.int64, (t_out,)),
        "hidden": (target_hidden.dtype, (t_out, target_hidden.shape[1])),
        "is_rejected": (torch.bool, (t_out,)),
        "is_masked": (torch.bool, (t_out,)),
        "token_indices_to_sample": (torch.int32, (b * k,)),
        "hidden_state_mapping": (torch.int32, (t_in,)),
        "slot_mapping": (torch.int64, (t_out,)),
        "query_start_loc": (torch.int32, (b + 1,)),
    }
    for name, (dtype, shape) in want.items():
        t = getattr(out, name)
        check_tensor(f"out.{name}", t, dtypes=(dtype,), shape=shape, device=device)
        if not t.is_contiguous():
            raise ValueError(f"out.{name} must be contiguous")
    # outputs sharing memory overwrite each other: wrong results without an error
    spans = []
    for name in want:
        t = getattr(out, name)
        if t.numel():
            a = t.data_ptr()
            spans.append((a, a + t.numel() * t.element_size(), name))
    spans.sort()
    for (_a0, a1, an), (b0, _b1, bn) in zip(spans, spans[1:]):
        if b0 < a1:
            raise ValueError(f"out.{an} and out.{bn} overlap: every output needs its own memory")


def _validate_values(query_start_loc, num_rejected_tokens, target_positions, t_in, num_spec_tokens):
    """Device-side checks of the values the layout depends on, with ONE host sync."""
    qsl = query_start_loc.long()
    lens = qsl[1:] - qsl[:-1]
    bad = [qsl[0] != 0, qsl[-1] != t_in, (lens < 1).any()]
    if num_rejected_tokens is not None:
        nrej = num_rejected_tokens.long()
        bad.append(((nrej < 0) | (nrej > lens - 1)).any())
    if lens.numel():
        starts = target_positions[qsl[:-1].clamp(0, max(t_in - 1, 0))]
        bad.append((starts < 0).any())
        bad.append((starts > _INT64_MAX - lens - num_spec_tokens).any())
    if not bool(torch.stack(bad).any()):
        return
    q = qsl.cpu()
    if int(q[0]) != 0:
        raise ValueError(f"query_start_loc[0] must be 0, got {int(q[0])}")
    if int(q[-1]) != t_in:
        raise ValueError(f"query_start_loc[B] must equal T_in = {t_in}, got {int(q[-1])}")
    ln = q[1:] - q[:-1]
    if bool((ln < 1).any()):
        r = int((ln < 1).nonzero()[0])
        raise ValueError(f"every request needs at least one input token: request {r} has {int(ln[r])}")
    if num_rejected_tokens is not None:
        n = num_rejected_tokens.long().cpu()
        badr = (n < 0) | (n > ln - 1)
        if bool(badr.any()):
            r = int(badr.nonzero()[0])
            raise ValueError(
                f"num_rejected_tokens[{r}] = {int(n[r])} must be in [0, query_len - 1] = [0, {int(ln[r]) - 1}]"
            )
    raise ValueError(
        "target_positions at the start of every request must be >= 0 and small enough that the draft "
        "positions (start + query_len + K - 2) fit in int64"
    )


@torch.library.register_fake("peagle::prepare_parallel_draft_inputs")
def _prepare_parallel_draft_inputs_fake(
    target_token_ids,
    target_positions,
    next_token_ids,
    query_start_loc,
    num_rejected_tokens,
    target_hidden,
    mask_hidden,
    block_table,
    num_spec_tokens,
    mask_token_id,
    block_size,
    max_model_len,
):
    t_in = target_token_ids.shape[0]
    b = query_start_loc.shape[0] - 1
    t_out = t_in + (num_spec_tokens - 1) * b
    new = target_hidden.new_empty
    return (
        new((t_out,), dtype=torch.int32),
        new((t_out,), dtype=torch.int64),
        new((t_out, target_hidden.shape[1])),
        new((t_out,), dtype=torch.bool),
        new((t_out,), dtype=torch.bool),
        new((b * num_spec_tokens,), dtype=torch.int32),
        new((t_in,), dtype=torch.int32),
        new((t_out,), dtype=torch.int64),
        new((b + 1,), dtype=torch.int32),
    )


@torch.library.register_fake("peagle::prepare_parallel_draft_inputs_out")
def _prepare_parallel_draft_inputs_out_fake(*args, **kwargs):
    return None
