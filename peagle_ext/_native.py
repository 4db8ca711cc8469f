"""Loads the native module peagle_ext._C with a readable error when it cannot be used.

The guard compares the torch this process imports with the torch the extension was built
against (written to _build_info.json by CMake), because a mismatch otherwise surfaces as an
"undefined symbol" trace from the dynamic loader.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
_REBUILD = "rebuild it with: pip install --no-build-isolation -e .  (or `pip install --no-build-isolation .`)"


def _load():
    info_path = _HERE / "_build_info.json"
    built = None
    if info_path.exists():
        built = json.loads(info_path.read_text())
        if built.get("torch_version") != torch.__version__:
            raise ImportError(
                f"peagle_ext was built against torch {built.get('torch_version')} but this process "
                f"imports torch {torch.__version__}; the compiled ops are not ABI compatible. {_REBUILD}"
            )
    try:
        from . import _C  # noqa: F401  (registers torch.ops.peagle.*)
    except ImportError as e:
        if built is None:
            raise ImportError(f"peagle_ext's native module is not built ({e}). {_REBUILD}") from e
        raise ImportError(
            f"peagle_ext's native module failed to load ({e}); it was built against torch "
            f"{built.get('torch_version')}, this is torch {torch.__version__}. {_REBUILD}"
        ) from e
    return _C


_C = _load()
ops = torch.ops.peagle


def build_info() -> dict:
    """What this build of peagle_ext contains: backends, the CUDA archs it was built for
    (cuda_archs, as PEAGLE_CUDA_ARCHS said them; cuda_sass_archs: the GPUs with machine code, "90a"
    = the Hopper kernels; cuda_ptx_archs: the PTX the driver compiles for newer GPUs),
    torch/CUDA versions."""
    info = dict(_C.build_info())
    info["backends"] = [b for b in info["backends"].split(",") if b]
    for key in ("cuda_archs", "cuda_sass_archs", "cuda_ptx_archs"):
        info[key] = [a for a in info[key].split(",") if a]
    info["torch_runtime"] = torch.__version__
    info["cuda_available"] = torch.cuda.is_available()
    return info


def has_cuda_kernels() -> bool:
    return "cuda" in build_info()["backends"]


def has_hopper_kernels() -> bool:
    """Whether this build holds the sm_90a (Hopper warpgroup MMA) COD attention kernels."""
    return bool(build_info()["hopper_kernels"])


def attention_kernel_choice(cc_major: int, cc_minor: int, head_dim: int, build_has_sm90a: bool, override: str = ""):
    """csrc/attention/attention_dispatch.h's choice for explicit inputs (the CUDA ops ask it with the
    device's compute capability, this build and PEAGLE_ATTN_KERNEL); ValueError for an unknown
    override."""
    return dict(_C.attention_kernel_choice(cc_major, cc_minor, head_dim, build_has_sm90a, override))


def missing_kernel_image_message(cc_major: int, cc_minor: int, sass=None, ptx=None) -> str:
    """The CUDA ops' error for a GPU of that compute capability ('' when this build, or one with
    the given SASS / PTX arch lists, has kernels for it)."""
    info = build_info()
    sass = ",".join(info["cuda_sass_archs"] if sass is None else sass)
    ptx = ",".join(info["cuda_ptx_archs"] if ptx is None else ptx)
    return _C.missing_kernel_image_message(cc_major, cc_minor, sass, ptx)
