"""Public import path of the fused linear-KL loss; the op lives in peagle_ext.ops.loss."""

from .ops.loss import AUTO_CHUNK_BYTES, ChunkPlan, chunk_plan, fused_linear_kl

__all__ = ["AUTO_CHUNK_BYTES", "ChunkPlan", "chunk_plan", "fused_linear_kl"]
