"""Plain-PyTorch statements of what every op computes (docs/design.md). Slow on purpose: the
kernels are tested against these, and nothing on a fast path calls them.

- `attention`: the dense COD attention mask and SDPA over it.
- `cod`: COD sampling with the documented key draw.
- `parallel_draft`: vLLM's parallel-drafting input step, as a loop and as vLLM-like torch ops.
"""

from .attention import dense_cod_mask, document_starts, reference_cod_attention
from .cod import philox_u32, reference_cod_sample

__all__ = ["dense_cod_mask", "document_starts", "reference_cod_attention", "philox_u32", "reference_cod_sample"]
