"""peagle_ext: fast, memory-lean training and serving of P-EAGLE parallel drafters.

`import peagle_ext` loads the native ops (torch.ops.peagle.*). Submodules:
cod (COD sampling), reference (plain-PyTorch semantics), attention, loss, model, data,
train, decode, vllm, cli.
"""
from ._native import build_info, has_cuda_kernels, ops  # noqa: F401
from .cod import CodLayout, cod_sample  # noqa: F401

__version__ = "0.1.0"
