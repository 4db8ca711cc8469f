"""The entry points pyproject.toml declares resolve: vLLM's general plugin and the `peagle`
command. They are strings an installer copies, so a module move breaks them silently."""

import importlib

import pytest

from tests.helpers import ROOT

tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def _resolve(target: str):
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def test_declared_entry_points_resolve():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    plugin = _resolve(project["entry-points"]["vllm.general_plugins"]["peagle_ext"])
    assert callable(plugin) and plugin() is False  # without vLLM it only logs
    assert callable(_resolve(project["scripts"]["peagle"]))
