"""FastVideo's compat package (`fastvideo_integration.compat`): it alone names FastVideo's modules, every FastVideo
name it imports is a seam of its table, and a FastVideo that lacks a seam is a single error line at `register()`
(docs/design/fastvideo-integration.md, "FastVideo facts relied on")."""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest

from _pan2_helpers import run_python

COMPAT = Path(__file__).resolve().parents[2] / "fastvideo_pan2_ext" / "fastvideo_integration" / "compat"


def test_every_seam_exists_in_the_installed_fastvideo():
    from fastvideo_pan2_ext.fastvideo_integration import compat

    compat.check()
    compat.check_serving()
    seams = compat.SEAMS + compat.SERVE_SEAMS
    assert any(seam.replaced for seam in seams) and all(seam.why for seam in seams)


WITHOUT_THE_WEB_STACK = textwrap.dedent("""
    import sys
    for name in ("uvicorn", "aiofiles", "multipart", "python_multipart"):  # only FastVideo's HTTP server needs these
        sys.modules[name] = None
    import fastvideo
    from fastvideo_pan2_ext import register
    from fastvideo_pan2_ext.fastvideo_integration import compat
    register()
    try:
        compat.check_serving()
    except compat.IncompatibleFastVideo as exc:
        print("serving:", exc)
""")


@pytest.mark.slow
def test_pan2_registers_without_fastvideos_web_stack_and_only_its_server_needs_it():
    run = run_python(WITHOUT_THE_WEB_STACK)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "failed to load" not in run.stderr
    line = run.stdout.strip().splitlines()[-1]
    assert line.startswith("serving: fastvideo_pan2_ext needs fastvideo.entrypoints.openai."), line


REMOVED = textwrap.dedent("""
    import fastvideo, fastvideo.registry as registry
    del registry._CONFIG_REGISTRY  # what a FastVideo that renamed it looks like
    import fastvideo_pan2_ext.plugin_loader as loader
    loader._plugins_loaded = False
    loader.load_plugins(environ={})  # the entry point, as the plugin hook runs it
    print("imported and carried on")
""")


@pytest.mark.slow
def test_a_fastvideo_without_a_seam_is_one_error_line_at_register():
    proc = run_python(REMOVED, env_extra={"FASTVIDEO_PLUGINS": ""})  # the hook loads nothing; the script does
    assert proc.returncode == 0 and "imported and carried on" in proc.stdout, proc.stderr[-2000:]
    output = proc.stdout + proc.stderr  # FastVideo's logging setup decides the stream
    lines = [line for line in output.splitlines() if "fastvideo_pan2_ext needs" in line]
    assert len(lines) == 1, output[-3000:]
    assert re.search(r"needs fastvideo\.registry\._CONFIG_REGISTRY \(FastVideo 0\.2\.1; .*\), which FastVideo "
                     r"0\.2\.1 does not have", lines[0]), lines[0]
    assert "Traceback" not in output


def test_a_seam_the_installed_fastvideo_lacks_is_one_line():
    """Only FastVideo 0.2.1 is tested, so a seam names its spelling; another release without it is one line."""
    from fastvideo.pipelines.stages import DecodingStage

    from fastvideo_pan2_ext.fastvideo_integration import compat

    assert compat.lookup(compat.Seam("fastvideo.pipelines.stages", "DecodingStage", "a name")) is DecodingStage
    gone = compat.Seam("fastvideo.pipelines.stages", "DecodingStageV2", "a later release's name")
    with pytest.raises(compat.IncompatibleFastVideo, match=r"needs fastvideo\.pipelines\.stages\.DecodingStageV2 "
                       r"\(FastVideo 0\.2\.1; a later release's name\), which FastVideo 0\.2\.1 does not have"):
        compat.lookup(gone)


def _imported_fastvideo_names(path: Path) -> set[tuple[str, str]]:
    """(module, name) for each `from fastvideo.x import name`, (module, "") for each `import fastvideo.x`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("fastvideo."):
            found |= {(node.module, alias.name) for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {(alias.name, "") for alias in node.names if alias.name.startswith("fastvideo.")}
    return found


def test_every_fastvideo_name_the_compat_package_imports_is_a_seam():
    """What a module of the compat package imports from FastVideo is in the seam table (so `check()` names it in one
    line where it is missing), and every area's seams are in the table `check()` reads."""
    from fastvideo_pan2_ext.fastvideo_integration import compat

    seams = compat.SEAMS + compat.SERVE_SEAMS
    assert {s for area in compat.AREAS for s in area.SEAMS} | set(compat.http_server.SEAMS) == set(seams)

    def covered(module: str, name: str) -> bool:  # a seam in that module, on that name, or in that submodule
        return any(s.module == module and (not name or s.attribute.split(".")[0] == name) or
                   name and s.module == f"{module}.{name}" for s in seams)

    imported = {(path.name, *each) for path in sorted(COMPAT.glob("*.py")) for each in _imported_fastvideo_names(path)}
    assert len(imported) > 30
    assert [each for each in imported if not covered(*each[1:])] == []
