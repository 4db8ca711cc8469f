"""peagle_ext: fast, memory-lean training and serving of P-EAGLE parallel drafters.

`import peagle_ext` loads the native ops (torch.ops.peagle.*). Subpackages, imported on first use:

- `ops`: the four native ops (COD sampling, COD attention, the fused loss, the parallel-drafting
  step); `cod`, `attention`, `loss` and `vllm` are their public import paths.
- `reference`: plain-PyTorch statements of what each op computes.
- `model`: the P-EAGLE drafter and its checkpoint format.
- `data`: verifier, conversations, tokenization, packing, hidden states.
- `train`: `peagle train` (loop, checkpoints, distributed), `export`.
- `serving`: speculative decoding with a transformers verifier, and the vLLM plugin.
- `eval`: `peagle eval`'s measurements; `cli`: the `peagle` command.
- `testing`: tiny random verifiers and synthetic data for tests and benchmarks.
"""

import importlib

from ._native import build_info, has_cuda_kernels  # noqa: F401
from .ops.cod import CodLayout, cod_sample  # noqa: F401

__version__ = "0.1.0"

_SUBMODULES = {
    "ops",
    "cod",
    "reference",
    "attention",
    "loss",
    "model",
    "data",
    "train",
    "serving",
    "vllm",
    "eval",
    "cli",
    "testing",
    "integrations",
}


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'peagle_ext' has no attribute {name!r}")
