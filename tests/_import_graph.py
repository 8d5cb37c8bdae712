"""The package's import graph, read from its source (imports inside functions included; nothing is imported): the
graph tests/repo/test_architecture.py checks the import rules on, and
tests/diffusers_integration/test_diffusers_decode.py the diffusers room's imports."""

from __future__ import annotations

import ast
import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "fastvideo_pan2_ext"
NAME = "fastvideo_pan2_ext"


def _modules() -> dict[str, Path]:
    """Module name -> file, through the package's links to the top-level rooms."""
    modules = {}
    files = [Path(root) / f for root, _, names in os.walk(PACKAGE_DIR, followlinks=True) for f in names]
    for path in (f for f in files if f.suffix == ".py"):
        parts = path.relative_to(PACKAGE_DIR).with_suffix("").parts
        name = ".".join((NAME, *parts[:-1])) if parts[-1] == "__init__" else ".".join((NAME, *parts))
        modules[name] = path
    return modules


def _lazy_exports(tree: ast.Module) -> dict[str, str]:
    """A package's `_EXPORTS = {name: submodule}` (names it imports on first use)."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_EXPORTS" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    trees = {name: ast.parse(path.read_text()) for name, path in modules.items()}
    exports = {name: _lazy_exports(tree) for name, tree in trees.items()}
    graph: dict[str, set[str]] = {name: set() for name in modules}

    def add(source: str, target: str) -> None:
        # The module an import statement names (a package's own __init__ running before its children is the
        # package structure, not an import of the code).
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != source:
            graph[source].add(target)

    for name, tree in trees.items():
        package = name if modules[name].name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(name, alias.name)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base
                                                                                                   else []))
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    if target in modules:
                        add(name, target)
                    elif alias.name in exports.get(base, {}):
                        add(name, f"{base}.{exports[base][alias.name]}")
                    else:
                        add(name, base)
    return graph
