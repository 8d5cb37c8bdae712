"""pyproject.toml states the requirements the package really has: the Python FastVideo 0.2.1 can be installed on
(its own metadata says >= 3.10, but its Linux dependency fastvideo-kernel 0.3.5 ships cp312 wheels only) and the
torch FastVideo pins, read from the installed FastVideo's own metadata."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

PROJECT = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]


def _ours(name: str) -> Requirement:
    (found,) = [r for r in map(Requirement, PROJECT["dependencies"]) if r.name == name]
    return found


def test_torch_is_the_one_fastvideo_pins():
    fastvideo_torch = [r for r in map(Requirement, importlib.metadata.requires("fastvideo")) if r.name == "torch"]
    assert [str(r.specifier) for r in fastvideo_torch] == [str(_ours("torch").specifier)]
    assert importlib.metadata.version("torch").split("+")[0] in _ours("torch").specifier


def test_python_is_the_one_fastvideos_kernels_ship_for():
    kernel = [r for r in map(Requirement, importlib.metadata.requires("fastvideo")) if r.name == "fastvideo-kernel"]
    assert kernel and all(str(r.specifier) == "==0.3.5" for r in kernel)  # the release whose wheels are cp312 only
    python = SpecifierSet(PROJECT["requires-python"])
    assert "3.12.1" in python and "3.11.9" not in python and "3.13.0" not in python
    assert SpecifierSet(importlib.metadata.metadata("fastvideo")["Requires-Python"]).contains("3.12.0")
