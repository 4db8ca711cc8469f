"""peagle_ext: fast, memory-lean training and serving of P-EAGLE parallel drafters.

`import peagle_ext` loads the native ops (torch.ops.peagle.*). Submodules (imported on first
use, so `peagle_ext.loss` works without its own import): cod (COD sampling), reference
(plain-PyTorch semantics), attention, loss, model, data, train, decode, vllm, cli.
"""
import importlib

from ._native import build_info, has_cuda_kernels, ops  # noqa: F401
from .cod import CodLayout, cod_sample  # noqa: F401

__version__ = "0.1.0"

_SUBMODULES = {"cod", "reference", "attention", "loss", "model", "data", "train", "decode", "vllm", "cli"}


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'peagle_ext' has no attribute {name!r}")
