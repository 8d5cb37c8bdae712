"""The package's import rules (docs/design.md, "Rooms"), read from the import graph (imports inside functions
included): no cycle; the decoder library and the reference stay below FastVideo; the reference imports only the
definitions; the compiled backend is entered through one module."""

from __future__ import annotations

import ast
from pathlib import Path

from _import_graph import NAME, _graph, _modules


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_package_has_no_import_cycle():
    graph = _graph()
    assert len(graph) > 40 and f"{NAME}.vae_kernel.decoder" in graph[f"{NAME}.fastvideo_integration.fast_decode"]
    assert _cycles(graph) == []


VK = f"{NAME}.vae_kernel"
DEFINITIONS = (f"{VK}.definitions.", f"{NAME}.model.architecture")  # what results are defined over: shapes, names
PACKAGES = {NAME, f"{NAME}.model", VK, f"{VK}.definitions", f"{VK}.portable", f"{VK}.distributed", f"{VK}.planning", f"{VK}.compiled"}


def _own(targets: set[str]) -> set[str]:
    """The package's own modules among `targets`, less the packages themselves (their __init__ is structure)."""
    return {t for t in targets if t.startswith(NAME) and t not in PACKAGES}


def test_the_decoder_library_and_the_oracle_stay_below_fastvideo():
    graph = _graph()
    for name, targets in graph.items():
        if name.startswith((VK, f"{NAME}.reference")):
            above = {t for t in targets if t.startswith((f"{NAME}.fastvideo_integration",
                                                         f"{NAME}.diffusers_integration", f"{NAME}.configs",
                                                         f"{NAME}.demo"))}
            assert not above, (name, above)


def test_the_reference_imports_only_the_definitions():
    graph = _graph()
    reference_imports = _own(graph[f"{NAME}.reference"])
    assert reference_imports and all(t.startswith(DEFINITIONS) for t in reference_imports), reference_imports
    for name, targets in graph.items():
        if name.startswith(DEFINITIONS):
            assert all(t.startswith(DEFINITIONS) for t in _own(targets)), (name, targets)


def test_the_compiled_backend_is_entered_through_one_module():
    """Outside `vae_kernel.compiled`, only `vae_kernel.backends` imports it, and only through the package's door."""
    graph = _graph()
    entering = {name: {t for t in targets if t.startswith(f"{VK}.compiled")} for name, targets in graph.items()
                if not name.startswith(f"{VK}.compiled")}
    entering = {name: targets for name, targets in entering.items() if targets}
    assert entering == {f"{VK}.backends": {f"{VK}.compiled"}}, entering
    door = graph[f"{VK}.compiled"]
    assert door and all(t.startswith(f"{VK}.compiled.") for t in _own(door)), door


COMPAT = f"{NAME}.fastvideo_integration.compat"  # FastVideo's compat package


def _fastvideo_module_exists(dotted: str) -> bool:
    """Whether `dotted` names a module or package of the installed FastVideo (found without importing it)."""
    import importlib.util

    top = Path(importlib.util.find_spec("fastvideo").origin).parent
    path = top.joinpath(*dotted.split(".")[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _fastvideo_names(tree: ast.Module) -> set[str]:
    """FastVideo modules a module imports (beyond the top-level package, whose import runs the plugin loader) or
    names in a string (a module path that exists in the installed FastVideo)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names |= {node.module} if node.module != "fastvideo" else {f"fastvideo.{a.name}" for a in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("fastvideo."):
            if _fastvideo_module_exists(node.value):
                names.add(node.value)
    return {n for n in names if n.startswith("fastvideo.")}


def test_only_the_compat_package_names_fastvideo():
    modules = _modules()
    named = {name: _fastvideo_names(ast.parse(path.read_text())) for name, path in modules.items()}
    assert "fastvideo.attention.layer" in named[f"{COMPAT}.models"]  # the check reads what it should
    offenders = {name: found for name, found in named.items()
                 if found and name != COMPAT and not name.startswith(f"{COMPAT}.")}
    assert offenders == {}, offenders
