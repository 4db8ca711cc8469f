"""Teacher-forced drafting rounds over a given text: decoding's per-position acceptance measured
on the positions and contexts that training validates on.

For a text x_0..x_{n-1}, one verifier forward gives the aux hidden states and the greedy
prediction g_p = argmax logits(x_0..x_p) for every position. Then a drafting round runs at every
anchor a of `anchors`, in increasing order, exactly as speculative decoding runs one when x_0..x_a
are in the verifier's cache and x_{a+1} is the bonus token: the batch of
prepare_parallel_draft_inputs carries the depth-0 rows of the positions since the previous round
(token p+1, hidden p) and K-1 MASK rows, and the drafter proposes d_1..d_K. Draft k is scored
against g_{a+k}, the verifier's choice for x_{a+k+1} given the text before it.

This is the quantity the trainer's validation accuracy at depth k-1 measures for the chain
anchored at a (docs/design.md section 1: index a holds token a+1 and hidden a; depth k-1 sits at
position a+k-1 and its target is the verifier's prediction after x_{a+k}). On a text that is the
verifier's own greedy output, x_{p+1} = g_p, and a round at anchor a is exactly the round
speculative decoding runs after accepting x_0..x_{a+1}: then the conditional acceptance of these
rounds is decoding's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..ops.parallel_draft import prepare_parallel_draft_inputs
from .drafter import Drafter
from .verifier import Verifier

BLOCK_SIZE = 16


@dataclass
class TeacherForcedResult:
    num_spec_tokens: int
    correct: list[int]  # per position k (draft k+1): rounds where that draft equals the verifier's choice
    total: list[int]  # per position: rounds that scored it
    accepted: list[int] = field(default_factory=list)  # per round: leading correct drafts (0..K)

    @property
    def accuracy(self) -> list[float | None]:
        return [c / t if t else None for c, t in zip(self.correct, self.total)]

    def merge(self, other: TeacherForcedResult) -> TeacherForcedResult:
        return TeacherForcedResult(
            self.num_spec_tokens,
            [a + b for a, b in zip(self.correct, other.correct)],
            [a + b for a, b in zip(self.total, other.total)],
            self.accepted + other.accepted,
        )


@torch.inference_mode()
def teacher_forced_rounds(
    verifier: Verifier, drafter: Drafter, token_ids, num_spec_tokens: int, *, scored=None
) -> TeacherForcedResult:
    """Drafting rounds at every anchor of the text `token_ids` (module docstring).

    scored: bool [n], the positions whose tokens count as generated (e.g. the assistant tokens);
    default all. A round runs at anchor a when x_{a+1} is scored, and draft k of it is scored when
    x_{a+1}..x_{a+k} are all scored and a+k < n (the verifier's choice g_{a+k} exists): the
    chains the trainer's COD layouts draw. accepted[r] counts the leading correct drafts among the
    scored ones of round r."""
    k = int(num_spec_tokens)
    if k < 1 or k > drafter.num_depths:
        raise ValueError(f"num_spec_tokens must be in [1, {drafter.num_depths}], got {num_spec_tokens!r}")
    dev = verifier.device
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().to(dev)
    n = ids.numel()
    if n < 2:
        raise ValueError("token_ids needs at least 2 tokens (a context and a bonus token)")
    sc = torch.ones(n, dtype=torch.bool) if scored is None else torch.as_tensor(scored, dtype=torch.bool).flatten()
    if sc.numel() != n:
        raise ValueError(f"scored has {sc.numel()} entries, token_ids {n}")
    sc = sc.cpu().tolist()
    with verifier.capturing():
        logits, aux = verifier.forward(ids, verifier.new_cache(), 0)
    greedy = logits.argmax(-1).tolist()
    hidden = drafter.combine_hidden(aux)
    mask_hidden = drafter.mask_hidden.to(dev)
    capacity = -(-(n + k) // BLOCK_SIZE) * BLOCK_SIZE
    block_table = torch.arange(capacity // BLOCK_SIZE, dtype=torch.int32, device=dev)[None]
    drafter.reset(capacity)
    res = TeacherForcedResult(k, [0] * k, [0] * k, [])
    prev = -1  # the last position whose depth-0 row is in the draft cache
    for a in range(n - 1):
        if not sc[a + 1]:
            continue
        depth = 0  # drafts of this round that are scored: x_{a+1}..x_{a+depth} scored, a+depth < n
        while depth < k and a + depth + 1 < n and sc[a + depth + 1]:
            depth += 1
        if depth == 0:
            continue
        rows = torch.arange(prev + 1, a + 1, device=dev)
        batch = prepare_parallel_draft_inputs(
            ids[rows].to(torch.int32),
            rows,
            ids[a + 1 : a + 2].to(torch.int32),
            torch.tensor([0, rows.numel()], dtype=torch.int32, device=dev),
            torch.zeros(1, dtype=torch.int32, device=dev),
            hidden[rows].to(mask_hidden.dtype).contiguous(),
            mask_hidden,
            block_table,
            num_spec_tokens=k,
            mask_token_id=drafter.mask_token_id,
            block_size=BLOCK_SIZE,
            max_model_len=capacity,
        )
        drafts = drafter.propose(batch, k, rows.numel() + k - 1, a + k).tolist()
        prev = a
        run = True
        lead = 0
        for j in range(depth):
            ok = drafts[j] == greedy[a + j + 1]
            res.correct[j] += ok
            res.total[j] += 1
            run = run and ok
            lead += run
        res.accepted.append(lead)
    return res


def decoding_rounds(accepted: list[int]) -> list[int]:
    """The rounds greedy speculative decoding runs to generate a text, taken from the
    teacher-forced rounds `accepted` of teacher_forced_rounds over prompt + the verifier's greedy
    continuation, the continuation scored (one round per anchor, the first at the prompt's last
    token, the last where the bonus token is the text's last): the first round at the first
    anchor, each next one past the accepted drafts and the bonus token, none at the last anchor
    (its drafts lie past the text, and decoding has the whole text by then). Teacher-forced
    rounds run at every anchor, decoding only where a round ends, and a round tends to end where
    drafting is hard, so the two conditional acceptances differ by this selection alone; these
    rounds are decoding's, without the numerics of its cached forwards."""
    out, i = [], 0
    while i < len(accepted) - 1:
        out.append(int(accepted[i]))
        i += int(accepted[i]) + 1
    return out


def scored_chains_layout(example, num_depths: int):
    """The CodLayout of exactly the chains teacher_forced_rounds scores on a shifted one-document
    example (peagle_ext.data.eagle_shift): depth 0 at every position (the symmetric-mode stream),
    and depth d >= 1 at anchor a iff loss_mask[a..a+d] are all set. The training forward over it
    gives the validation accuracy of every scored (anchor, depth) pair instead of a COD sample."""
    from ..ops.cod import CodLayout

    lm = example.loss_mask.cpu().bool()
    n = lm.numel()
    anchors = [torch.arange(n)]
    ok = lm.clone()  # ok[a]: loss_mask[a..a+d] all set
    for d in range(1, num_depths):
        nxt = torch.zeros(n, dtype=torch.bool)
        nxt[: n - d] = ok[: n - d] & lm[d:]
        ok = nxt
        anchors.append(torch.nonzero(ok).flatten())
    sizes = [int(a.numel()) for a in anchors]
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + s)
    anchor = torch.cat(anchors).to(torch.int32)
    depth = torch.cat([torch.full((s,), d, dtype=torch.int32) for d, s in enumerate(sizes)])
    dev = example.document_ids.device
    return CodLayout(anchor.to(dev), depth.to(dev), offsets, example.document_ids.to(torch.int32), True)
