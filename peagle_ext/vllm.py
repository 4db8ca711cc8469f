"""Public import path of the vLLM pieces: the parallel-drafting op (peagle_ext.ops.parallel_draft)
and `register`, the plugin entry point (peagle_ext.serving.vllm_plugin)."""

from .ops.parallel_draft import PADDING_SLOT_ID, DraftBatch, prepare_parallel_draft_inputs
from .serving.vllm_plugin import register

__all__ = ["PADDING_SLOT_ID", "DraftBatch", "prepare_parallel_draft_inputs", "register"]
