"""The EAGLE shift: a packed row plus its verifier hidden states -> the TrainingExample the
drafter trains on (docs/design.md section 1)."""

from __future__ import annotations

import torch

from .._checks import check_tensor
from .records import PackedSequence, TrainingExample


def eagle_shift(packed: PackedSequence, aux: torch.Tensor, last: torch.Tensor) -> TrainingExample:
    """Apply the EAGLE shift (docs/design.md section 1): index p holds token p+1, the aux hidden state of
    p, and the verifier's last hidden state of p+1 (whose logits are the target at p).

    This is speculators' EAGLE-3 `shift_batch` (input_ids[1:], hidden_states[:-1],
    verifier_last_hidden_states[1:], loss_mask[1:]) applied to every document of the row on its
    own, keeping the row length N: where the partner p+1 is past the end of the row or in another
    document (each document's last position) there is nothing to pair, so that position becomes
    PADDING (document_ids -1, input_ids = packed.pad_token_id, loss_mask False, zero hidden
    states) - speculators drops exactly this one position per sample. No token or hidden state
    ever crosses a document boundary.

    loss_mask[p] = packed.loss_mask[p+1] (speculators' convention): the target at p is trained on
    when the token p+1 it is conditioned on is an assistant token.

    Worked example (two documents and one padding slot; g = aux, y = last, l = loss mask):

        p                 0   1   2   3   4   5
        packed ids        a   b   c   d   e   PAD
        packed docs       0   0   0   1   1   -1
        packed l          0   1   1   0   1   0
        ->
        input_ids         b   c   PAD e   PAD PAD
        document_ids      0   0   -1  1   -1  -1
        hidden            g0  g1  0   g3  0   0
        last_hidden       y1  y2  0   y4  0   0
        loss_mask         1   1   0   1   0   0

    aux [N, n_aux*H] and last [N, H] as returned by verifier_hidden_states (any device/dtype;
    the result keeps them). The int tensors are moved to aux's device.
    """
    if not isinstance(packed, PackedSequence):
        raise TypeError(f"packed must be a PackedSequence, got {type(packed).__name__}")
    N = len(packed)
    check_tensor("aux", aux, dim=2, shape=(N, None))
    check_tensor("last", last, dim=2, shape=(N, None))
    dev = aux.device
    if last.device != dev:
        raise ValueError(f"aux and last must be on one device, got {aux.device} and {last.device}")
    x = packed.input_ids.to(dev)
    doc = packed.document_ids.to(dev)
    lm = packed.loss_mask.to(device=dev, dtype=torch.bool)

    valid = torch.zeros(N, dtype=torch.bool, device=dev)
    if N > 1:
        valid[:-1] = (doc[:-1] >= 0) & (doc[:-1] == doc[1:])
    nxt = torch.arange(N, device=dev).add_(1).clamp_(max=N - 1)  # p+1, clamped; masked by valid

    input_ids = torch.where(valid, x[nxt], torch.full_like(x, packed.pad_token_id))
    document_ids = torch.where(valid, doc, torch.full_like(doc, -1))
    loss_mask = valid & lm[nxt]
    keep = valid.unsqueeze(1)
    hidden = torch.where(keep, aux, torch.zeros((), dtype=aux.dtype, device=dev))
    last_hidden = torch.where(keep, last[nxt], torch.zeros((), dtype=last.dtype, device=dev))
    return TrainingExample(
        input_ids=input_ids,
        document_ids=document_ids.to(torch.int32),
        loss_mask=loss_mask,
        hidden=hidden,
        last_hidden=last_hidden,
    )
