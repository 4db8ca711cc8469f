"""Import speculators' P-EAGLE model without its data-pipeline dependencies.

speculators 0.9.0 imports `openai`, `datasets` and `hs_connectors` at module level (through
speculators.train.data, which models/eagle3/data.py imports for a type alias), but the model
path (PEagleDraftModel.forward) never calls them. We install it with --no-deps, so these three
packages are absent; `install_stubs()` puts STUB modules in sys.modules (only for names that are
not importable for real). Every stub object raises if it is ever *used*, so a stub can never
silently stand in for real behaviour: it only lets `import` statements and annotations resolve.
"""
from __future__ import annotations

import importlib.util
import sys
import types

# the modules speculators 0.9.0 imports at module level on the way to its model classes
_STUBS = ["openai", "openai.types", "openai.types.chat", "openai.types.completion",
          "datasets", "hs_connectors"]


def _unusable(modname: str, attr: str):
    def fail(*_a, **_k):
        raise RuntimeError(f"{modname}.{attr} is a STUB installed by bench/_speculators_shim.py "
                           "(the P-EAGLE model path must never use it)")

    # a class, so `X | None` annotations and isinstance() evaluate; using it raises
    return type(attr, (), {"__new__": fail, "__call__": fail, "registry": {},
                           "__doc__": f"STUB for {modname}.{attr}"})


def _make_getattr(mod, modname: str):
    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        obj = _unusable(modname, attr)
        setattr(mod, attr, obj)
        return obj
    return __getattr__


def install_stubs() -> list[str]:
    """Install stubs for the missing modules; returns the names stubbed."""
    stubbed = []
    for name in _STUBS:
        root = name.split(".")[0]
        if root not in stubbed and importlib.util.find_spec(root) is not None:
            continue  # the real package is installed: use it
        mod = types.ModuleType(name, f"STUB module (bench/_speculators_shim.py) for {name}")
        mod.__path__ = []  # importable as a package, so submodules resolve to our stubs
        mod.__spec__ = importlib.util.spec_from_loader(name, loader=None, is_package=True)
        mod.__stub__ = True
        # any attribute (`from openai import AsyncClient`, `openai.types.X` in an annotation)
        # resolves to an unusable class, made on first access
        mod.__getattr__ = _make_getattr(mod, name)
        sys.modules[name] = mod
        if "." in name:
            setattr(sys.modules[name.rsplit(".", 1)[0]], name.rsplit(".", 1)[1], mod)
        if root not in stubbed:
            stubbed.append(root)
    return stubbed


def import_speculators_peagle():
    """(PEagleDraftModel, PEagleSpeculatorConfig, module `speculators.models.peagle.core`, stubs)."""
    stubs = install_stubs()
    import speculators.models.peagle.core as core
    from speculators.models.peagle.config import PEagleSpeculatorConfig
    return core.PEagleDraftModel, PEagleSpeculatorConfig, core, stubs
