"""Serving a P-EAGLE drafter: greedy speculative decoding with a transformers verifier (the
evaluation path of `peagle eval`) and the vLLM plugin.

- `verifier`: Verifier, a causal LM run step by step with a KV cache and aux hidden-state capture.
- `drafter`: Drafter (the interface) and PEagleDrafter (a PEagleDraftModel with a draft KV cache).
- `decode`: greedy_generate, speculative_generate and the acceptance statistics.
- `teacher_forced`: drafting rounds at every anchor of a given text (decoding's acceptance on the
  positions and contexts the trainer validates on).
- `static_verifier`: StaticVerifier, the Llama-family verifier over a preallocated KV cache.
- `graphs`: RoundEngine / GreedyEngine, fixed-shape decoding steps (CUDA graphs on a GPU).
- `batch_generation`: BatchGenerator, many prompts generated at once over a preallocated KV
  cache (the engine of `peagle datagen`).
- `vllm_plugin`: routes vLLM's parallel-drafting input step through peagle_ext's op.
"""

from .decode import (
    BLOCK_SIZE,
    PROFILE_PARTS,
    GreedyResult,
    SpecResult,
    acceptance_stats,
    first_mismatch,
    greedy_generate,
    speculative_generate,
)
from .drafter import Drafter, PEagleDrafter
from .teacher_forced import TeacherForcedResult, decoding_rounds, scored_chains_layout, teacher_forced_rounds
from .verifier import Verifier

__all__ = [
    "BLOCK_SIZE",
    "PROFILE_PARTS",
    "GreedyResult",
    "SpecResult",
    "acceptance_stats",
    "first_mismatch",
    "greedy_generate",
    "speculative_generate",
    "Drafter",
    "PEagleDrafter",
    "Verifier",
    "TeacherForcedResult",
    "decoding_rounds",
    "scored_chains_layout",
    "teacher_forced_rounds",
]
