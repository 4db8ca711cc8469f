"""Plain-PyTorch references of vLLM's parallel-drafting input step (docs/design.md section 6).

Written from vLLM 0.33's semantics (llm_base_proposer.set_inputs_first_pass with
copy_and_expand_eagle_inputs_kernel, shift_input_ids=True, then the hidden index_put + where,
compute_new_slot_mapping and extend_all_queries_by_N), independently of the op:

- `parallel_draft_loop`: a readable per-request loop; the ground truth of the tests.
- `parallel_draft_torch`: the vLLM-like sequence of vectorised torch ops (the Triton kernel
  emulated by tensor ops, then index_put, where and the slot-mapping ops), sync-free; the
  baseline of bench/bench_vllm.py.

Both start the hidden output from zeros where vLLM reuses a persistent buffer, so the rows
vLLM leaves untouched (rejected rows past the request's input length) are zero, as in the op.
"""

from __future__ import annotations

import torch

from ..ops.parallel_draft import PADDING_SLOT_ID, DraftBatch

PADDING_TOKEN_ID = 0  # vLLM passes padding_token_id=0 for rejected slots


def parallel_draft_loop(
    target_token_ids,
    target_positions,
    next_token_ids,
    query_start_loc,
    num_rejected_tokens,
    target_hidden,
    mask_hidden,
    block_table,
    *,
    num_spec_tokens,
    mask_token_id,
    block_size,
    max_model_len,
) -> DraftBatch:
    """One request at a time, one output slot at a time, as the Triton kernel's program does."""
    K = num_spec_tokens
    qsl = [int(x) for x in query_start_loc.cpu()]
    B = len(qsl) - 1
    t_in = int(target_token_ids.shape[0])
    t_out = t_in + (K - 1) * B
    ids_in = target_token_ids.cpu().tolist()
    pos_in = target_positions.cpu().tolist()
    nxt = next_token_ids.cpu().tolist()
    nrej_all = [0] * B if num_rejected_tokens is None else num_rejected_tokens.cpu().tolist()
    bt = block_table.cpu()

    input_ids = [0] * t_out
    positions = [0] * t_out
    is_rejected = [False] * t_out
    is_masked = [False] * t_out
    sample = [0] * (B * K)
    mapping = [0] * t_in
    for r in range(B):
        qs, qe = qsl[r], qsl[r + 1]
        query_end = qe - 1 - nrej_all[r]  # last accepted input token
        num_valid = query_end - qs  # shifted tokens copied from the input
        num_rejected = qe - query_end - 1
        out_start = qs + r * (K - 1)  # each earlier request grew by K-1 rows
        start_pos = pos_in[qs]
        for j in range(num_valid + K + num_rejected):
            o = out_start + j
            if j < num_valid:
                tok = ids_in[qs + 1 + j]
            elif j == num_valid:
                tok = nxt[r]
            elif j < num_valid + K:
                tok = mask_token_id
                is_masked[o] = True
            else:
                tok = PADDING_TOKEN_ID
                is_rejected[o] = True
            input_ids[o] = tok
            positions[o] = 0 if is_rejected[o] else start_pos + j
            if num_valid <= j < num_valid + K:
                sample[r * K + (j - num_valid)] = o
            if j < qe - qs:
                mapping[qs + j] = o

    dev = target_hidden.device
    out_ids = torch.tensor(input_ids, dtype=torch.int32)
    out_pos = torch.tensor(positions, dtype=torch.int64)
    out_rej = torch.tensor(is_rejected, dtype=torch.bool)
    out_msk = torch.tensor(is_masked, dtype=torch.bool)
    out_map = torch.tensor(mapping, dtype=torch.int32)

    # Hidden: scatter every target row to its mapped row, then mask_hidden into MASK rows.
    hidden = torch.zeros(t_out, target_hidden.shape[1], dtype=target_hidden.dtype)
    th = target_hidden.cpu()
    for i in range(t_in):
        hidden[mapping[i]] = th[i]
    for o in range(t_out):
        if is_masked[o]:
            hidden[o] = mask_hidden.cpu()

    # Slot mapping: block-table lookup at the clamped position; -1 past max_model_len or rejected.
    slots = []
    for r in range(B):
        out_start = qsl[r] + r * (K - 1)
        for o in range(out_start, out_start + (qsl[r + 1] - qsl[r]) + K - 1):
            p = positions[o]
            pc = min(p, max_model_len - 1)
            slot = int(bt[r, pc // block_size]) * block_size + pc % block_size
            if p >= max_model_len or is_rejected[o]:
                slot = PADDING_SLOT_ID
            slots.append(slot)
    new_qsl = [qsl[i] + i * (K - 1) for i in range(B + 1)]
    return DraftBatch(
        out_ids.to(dev),
        out_pos.to(dev),
        hidden.to(dev),
        out_rej.to(dev),
        out_msk.to(dev),
        torch.tensor(sample, dtype=torch.int32, device=dev),
        out_map.to(dev),
        torch.tensor(slots, dtype=torch.int64, device=dev),
        torch.tensor(new_qsl, dtype=torch.int32, device=dev),
    )


def parallel_draft_torch(
    target_token_ids,
    target_positions,
    next_token_ids,
    query_start_loc,
    num_rejected_tokens,
    target_hidden,
    mask_hidden,
    block_table,
    *,
    num_spec_tokens,
    mask_token_id,
    block_size,
    max_model_len,
    hidden_out: torch.Tensor | None = None,
) -> DraftBatch:
    """The same step as vLLM's sequence of device ops, vectorised and without host syncs.

    hidden_out: a persistent [>= T_out, H] buffer as vLLM keeps (rows past a request's input
    length in the rejected tail keep its content); None = a zero-initialised one.
    """
    K = num_spec_tokens
    dev = target_token_ids.device
    t_in = target_token_ids.shape[0]
    B = query_start_loc.shape[0] - 1
    t_out = t_in + (K - 1) * B
    qsl = query_start_loc.long()
    qs = qsl[:-1]
    lens = qsl[1:] - qs
    nrej = torch.zeros_like(lens) if num_rejected_tokens is None else num_rejected_tokens.long()
    num_valid = lens - 1 - nrej
    out_lens = lens + (K - 1)
    req_b = torch.arange(B, device=dev)
    out_start = qs + req_b * (K - 1)

    # "Triton kernel", one element per output slot.
    req = torch.repeat_interleave(req_b, out_lens, output_size=t_out)
    j = torch.arange(t_out, device=dev) - out_start[req]
    nv = num_valid[req]
    is_bonus = j == nv
    is_masked = (j > nv) & (j < nv + K)
    is_rejected = j >= nv + K
    src = torch.clamp(qs[req] + 1 + j, max=max(t_in - 1, 0))
    ids = torch.where(j < nv, target_token_ids[src], PADDING_TOKEN_ID)
    ids = torch.where(is_bonus, next_token_ids[req], ids)
    ids = torch.where(is_masked, torch.full_like(ids, mask_token_id), ids)
    ids = torch.where(is_rejected, torch.zeros_like(ids), ids).to(torch.int32)
    positions = torch.where(is_rejected, 0, target_positions[qs][req] + j)
    is_new = (j >= nv) & (j < nv + K)
    sample_buf = torch.empty(B * K + 1, dtype=torch.int32, device=dev)
    sample_dst = torch.where(is_new, req * K + (j - nv), B * K)  # non-sampled rows -> a dump slot
    sample_buf[sample_dst] = torch.arange(t_out, device=dev, dtype=torch.int32)
    in_req = torch.repeat_interleave(req_b, lens, output_size=t_in)
    mapping = (torch.arange(t_in, device=dev) + in_req * (K - 1)).to(torch.int32)

    # index_put of the hidden states, then where() with mask_hidden.
    hidden = (
        torch.zeros(t_out, target_hidden.shape[1], dtype=target_hidden.dtype, device=dev)
        if hidden_out is None
        else hidden_out[:t_out]
    )
    hidden[mapping.long()] = target_hidden
    torch.where(is_masked.unsqueeze(1), mask_hidden, hidden, out=hidden)

    # compute_new_slot_mapping
    clamped = torch.clamp(positions, max=max_model_len - 1)
    block_nums = block_table[req, clamped // block_size].long()
    slots = block_nums * block_size + clamped % block_size
    slots.masked_fill_(positions >= max_model_len, PADDING_SLOT_ID)
    slots.masked_fill_(is_rejected, PADDING_SLOT_ID)
    new_qsl = (query_start_loc + torch.arange(B + 1, device=dev, dtype=torch.int32) * (K - 1)).to(torch.int32)
    return DraftBatch(ids, positions, hidden, is_rejected, is_masked, sample_buf[: B * K], mapping, slots, new_qsl)
