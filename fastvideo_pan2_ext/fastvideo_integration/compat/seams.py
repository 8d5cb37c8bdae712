"""The `Seam` type and its lookup: one FastVideo name this package relies on, with the reason, and the one-line error
when the installed FastVideo lacks it (docs/design/fastvideo-integration.md, "FastVideo facts relied on")."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

TESTED_RELEASE = "0.2.1"  # the FastVideo release this package's tests ran against (pyproject pins the range)


@dataclasses.dataclass(frozen=True)
class Seam:
    module: str
    attribute: str  # dotted within the module; "" for the module itself (found, and read, without importing it)
    why: str
    replaced: bool = False  # this package replaces it at run time (else it only reads or calls it)
    mentions: str = ""  # a name the attribute's source must contain (a convention no lookup can check)
    name: str = ""  # the name other modules ask `compat.symbol()` for


class IncompatibleFastVideo(RuntimeError):
    """The installed FastVideo lacks a symbol this package relies on (one line: version and symbol)."""


def fastvideo_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fastvideo")
    except PackageNotFoundError:
        return "not installed"


def _find(seam: Seam) -> Any:
    import importlib.util
    import inspect

    if not seam.attribute:  # importing it would have effects (the FA4 readers): its spec and source instead
        spec = importlib.util.find_spec(seam.module)
        if spec is None or not spec.origin or (seam.mentions and seam.mentions not in Path(spec.origin).read_text()):
            raise ImportError(seam.module)
        return spec
    value = importlib.import_module(seam.module)
    for part in filter(None, seam.attribute.split(".")):
        value = getattr(value, part)
    if seam.mentions and seam.mentions not in inspect.getsource(value):
        raise AttributeError(seam.mentions)
    return value


def lookup(seam: Seam) -> Any:
    """What `seam` names in the installed FastVideo; IncompatibleFastVideo (one line) if it has no such thing."""
    try:
        return _find(seam)
    except (ImportError, AttributeError, OSError, TypeError):
        pass
    where = f"{seam.module}.{seam.attribute}" if seam.attribute else seam.module
    raise IncompatibleFastVideo(
        f"fastvideo_pan2_ext needs {where} (FastVideo {TESTED_RELEASE}; {seam.why}), which FastVideo "
        f"{fastvideo_version()} does not have")


def replace_once(owner, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace `owner.name` by `make(original)`, once per process (the replacement is marked)."""
    original = getattr(owner, name)
    if getattr(original, "_pan2_replacement", False):
        return
    replacement = make(original)
    replacement._pan2_replacement = True
    setattr(owner, name, replacement)
