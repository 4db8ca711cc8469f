"""Import vLLM 0.33's parallel-drafting proposer from its own sources on a CPU machine.

`vllm_on_cpu(src)` puts an import hook in front of sys.path for the `vllm` package:

- REAL_MODULES are executed from vLLM's files (tests/serving/vllm_sources.py fetches them):
  the proposer (`llm_base_proposer`, `eagle`), its input-step helpers (`spec_decode/utils`:
  the Triton kernel's body, compute_new_slot_mapping, extend_all_queries_by_N),
  CommonAttentionMetadata (`v1/attention/backend`) and the version.
- Every other `vllm.*` module is a stub whose attributes are MagicMocks, except the few in
  STUB_ATTRS that the real code calls while importing, constructing the proposer or running
  the step. Those modules import compiled kernels (vllm._C), CUDA/NCCL, pyzmq, msgspec, the
  model zoo and the engine; the proposer's input step uses none of them.
- `vllm.triton_utils` gives `triton.jit` as the identity and `tl` as MiniTL below, so the
  kernel's Python body runs on CPU tensors, one program per grid point, with Triton's block
  semantics for the operations that kernel uses. `triton_kernel_dispatcher_with_warmup` is
  replaced by a launcher that binds the call's arguments to the kernel's by name and runs the
  grid the launcher returns, as vLLM's dispatcher does (its warmup registration is a no-op).

No third-party package beyond torch and numpy is needed. On exit every `vllm` module is
removed from sys.modules again.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import logging
import sys
import types
from pathlib import Path
from unittest import mock

import torch

REAL_MODULES = frozenset(
    {
        "vllm.version",
        "vllm._version",
        "vllm.v1.spec_decode",
        "vllm.v1.spec_decode.eagle",
        "vllm.v1.spec_decode.llm_base_proposer",
        "vllm.v1.spec_decode.utils",
        "vllm.v1.attention.backend",
    }
)
_REAL_PACKAGES = frozenset({"vllm.v1.spec_decode"})


# ----------------------------------------------------------------------------------------
# a block-level Triton emulator, enough for copy_and_expand_eagle_inputs_kernel
# ----------------------------------------------------------------------------------------
class Ptr:
    """A kernel pointer argument: a flat tensor plus element offsets (a scalar or a block)."""

    def __init__(self, tensor: torch.Tensor, offsets=0):
        self.tensor = tensor
        self.offsets = offsets

    def __add__(self, offsets):
        return Ptr(self.tensor, self.offsets + offsets)

    __radd__ = __add__


def _block(x):
    return x if isinstance(x, torch.Tensor) else torch.tensor(x)


class MiniTL(types.ModuleType):
    """triton.language: program_id, arange, load, store, where, minimum, constexpr."""

    constexpr = object

    def __init__(self):
        super().__init__("triton.language")
        self.pid = (0, 0, 0)

    def program_id(self, axis):
        return self.pid[axis]

    @staticmethod
    def arange(start, end):
        return torch.arange(start, end, dtype=torch.int32)

    @staticmethod
    def minimum(a, b):
        return torch.minimum(_block(a), _block(b))

    @staticmethod
    def where(cond, a, b):
        return torch.where(_block(cond), _block(a), _block(b))

    @staticmethod
    def _checked(ptr: Ptr, mask):
        flat = ptr.tensor.view(-1)
        offs = _block(ptr.offsets).to(torch.int64)
        live = torch.ones_like(offs, dtype=torch.bool) if mask is None else _block(mask).expand_as(offs)
        bad = live & ((offs < 0) | (offs >= flat.numel()))
        if bool(bad.any()):  # Triton would read or write out of bounds
            raise IndexError(f"unmasked access out of bounds: {offs[bad].tolist()} (numel {flat.numel()})")
        return flat, offs, live

    def load(self, ptr: Ptr, mask=None, other=0):
        flat, offs, live = self._checked(ptr, mask)
        vals = flat[torch.where(live, offs, 0)]
        return torch.where(live, vals, torch.tensor(other, dtype=flat.dtype))

    def store(self, ptr: Ptr, value, mask=None):
        flat, offs, live = self._checked(ptr, mask)
        value = _block(value).to(flat.dtype).expand_as(offs)
        flat[offs[live]] = value[live]


class MiniTriton(types.ModuleType):
    def __init__(self):
        super().__init__("triton")

    @staticmethod
    def jit(fn=None, **_):
        return fn if fn is not None else (lambda f: f)

    @staticmethod
    def cdiv(a, b):
        return -(-a // b)

    @staticmethod
    def next_power_of_2(n):
        return 1 << max(0, int(n) - 1).bit_length()


TL = MiniTL()


def run_grid(kernel, grid, kwargs):
    """Run a @triton.jit function (a plain function here) once per program id of grid."""
    args = {k: Ptr(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    grid = tuple(grid) + (1,) * (3 - len(grid))
    for x in range(grid[0]):
        for y in range(grid[1]):
            for z in range(grid[2]):
                TL.pid = (x, y, z)
                kernel(**args)


def triton_kernel_dispatcher_with_warmup(*, kernel, warmup_inputs):
    """vLLM's decorator: the decorated launcher returns (grid, extra kwargs); the call's
    arguments bind to the kernel's parameters of the same name (or the name + '_ptr')."""
    kparams = tuple(inspect.signature(kernel).parameters)

    def deco(launcher):
        sig = inspect.signature(launcher)

        @functools.wraps(launcher)
        def launch(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            grid, extra = launcher(*args, **kwargs)[:2]
            kw = {}
            for name, value in bound.arguments.items():
                for target in (name, f"{name}_ptr"):
                    if target in kparams:
                        kw[target] = value
            kw.update(extra)
            missing = [p for p in kparams if p not in kw]
            if missing:
                raise TypeError(f"{kernel.__name__}: no value for {missing}")
            run_grid(kernel, grid, kw)

        launch.register_warmup = lambda **_: None
        return launch

    return deco


# ----------------------------------------------------------------------------------------
# stubs and the import hook
# ----------------------------------------------------------------------------------------
class _Platform:
    """The attributes of vllm.platforms.current_platform that the real modules read."""

    device_type = "cpu"
    simple_compile_backend = "eager"

    @staticmethod
    def is_rocm():
        return False


def _stub_attrs():
    return {
        "vllm.triton_utils": {"triton": MiniTriton(), "tl": TL, "HAS_TRITON": False},
        "vllm.model_executor.warmup.jit_warmup_triton_helper": {
            "triton_kernel_dispatcher_with_warmup": triton_kernel_dispatcher_with_warmup
        },
        "vllm.platforms": {"current_platform": _Platform()},
        "vllm.logger": {"init_logger": logging.getLogger},
        # DeepSeek-V4 detection in the proposer's __init__: no compressed attention here
        "vllm.transformers_utils.deepseek_v4_utils": {"get_compress_ratios": lambda cfg: None},
    }


class _StubModule(types.ModuleType):
    """A stubbed vLLM module: unknown attributes are MagicMocks (classes to annotate with,
    functions the step never calls); a name that is a real submodule imports it."""

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        if full in REAL_MODULES or any(m.startswith(full + ".") for m in REAL_MODULES):
            return importlib.import_module(full)
        value = mock.MagicMock(name=full)
        setattr(self, name, value)
        return value


class _VllmFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, src: Path):
        self.src = src
        self.stub_attrs = _stub_attrs()
        self.stubbed: list[str] = []

    def find_spec(self, name, path=None, target=None):
        if name != "vllm" and not name.startswith("vllm."):
            return None
        if name in REAL_MODULES:
            rel = Path(*name.split("."))
            pkg = name in _REAL_PACKAGES
            file = self.src / rel / "__init__.py" if pkg else self.src / rel.with_suffix(".py")
            return importlib.util.spec_from_file_location(
                name, file, submodule_search_locations=[str(file.parent)] if pkg else None
            )
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        m.__dict__.update(self.stub_attrs.get(spec.name, {}))
        self.stubbed.append(spec.name)
        return m

    def exec_module(self, module):
        if module.__name__ == "vllm":
            module.__version__ = importlib.import_module("vllm.version").__version__


def _drop_vllm_modules():
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]


@contextlib.contextmanager
def vllm_on_cpu(src: Path):
    """Make `import vllm...` resolve as the module docstring says; yields the finder
    (finder.stubbed lists the stubbed modules that were imported)."""
    if any(n == "vllm" or n.startswith("vllm.") for n in sys.modules):
        raise RuntimeError("a vllm package is already imported in this process")
    finder = _VllmFinder(Path(src))
    sys.meta_path.insert(0, finder)
    try:
        yield finder
    finally:
        sys.meta_path.remove(finder)
        _drop_vllm_modules()
