"""The five native ops, each a thin wrapper over torch.ops.peagle.* (csrc/<op>/) with argument
checks, autograd (where they train) and a fake (meta) implementation:

- `cod`: COD sampling (`cod_sample` -> `CodLayout`).
- `attention`: COD attention with O(T) metadata (`cod_attention`, `cod_attention_metadata`).
- `loss`: the chunked fused linear-KL / CE loss (`fused_linear_kl`).
- `parallel_draft`: vLLM's parallel-drafting input step (`prepare_parallel_draft_inputs`).
- `decode_attention`: a few query tokens over a KV cache, each reading its own run of key rows
  (`decode_attention`), for decoding.
"""

from .attention import CodAttentionMetadata, cod_attention, cod_attention_metadata
from .cod import CodLayout, cod_sample
from .decode_attention import decode_attention
from .loss import ChunkPlan, chunk_plan, fused_linear_kl
from .parallel_draft import PADDING_SLOT_ID, DraftBatch, prepare_parallel_draft_inputs

__all__ = [
    "CodAttentionMetadata",
    "cod_attention",
    "cod_attention_metadata",
    "CodLayout",
    "cod_sample",
    "decode_attention",
    "ChunkPlan",
    "chunk_plan",
    "fused_linear_kl",
    "PADDING_SLOT_ID",
    "DraftBatch",
    "prepare_parallel_draft_inputs",
]
