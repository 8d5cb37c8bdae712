"""The one seam to FastVideo (`fastvideo_integration.adapter`): it alone names FastVideo's private symbols, and a FastVideo that
lacks one is a single error line at `register()` (docs/design.md, "FastVideo facts relied on")."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from _pan2_helpers import run_python

PACKAGE = Path(__file__).resolve().parents[1]
ROOMS = ["fastvideo_pan2_ext", "configs", "attention", "vae_kernel", "reference.py"]
ADAPTER = PACKAGE / "fastvideo_pan2_ext" / "integration" / "adapter.py"


def _package_sources() -> list[Path]:
    files = []
    for room in ROOMS:
        path = PACKAGE / room
        files += [path] if path.is_file() else [p for p in path.rglob("*.py") if p.resolve().parent.name != "csrc"]
    return sorted({p.resolve() for p in files} - {ADAPTER.resolve()})


def test_every_seam_exists_in_the_installed_fastvideo():
    from fastvideo_pan2_ext.fastvideo_integration import adapter

    adapter.check()
    adapter.check_serving()
    seams = adapter.SEAMS + adapter.SERVE_SEAMS
    assert any(seam.replaced for seam in seams) and all(seam.why for seam in seams)


WITHOUT_THE_WEB_STACK = textwrap.dedent("""
    import sys
    for name in ("uvicorn", "aiofiles", "multipart", "python_multipart"):  # only FastVideo's HTTP server needs these
        sys.modules[name] = None
    import fastvideo
    from fastvideo_pan2_ext import register
    from fastvideo_pan2_ext.fastvideo_integration import adapter
    register()
    try:
        adapter.check_serving()
    except adapter.IncompatibleFastVideo as exc:
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


def test_a_seam_takes_the_first_spelling_the_installed_fastvideo_has():
    """A seam lists the spellings of several FastVideo releases; a missing one is passed over, none is one line."""
    import pytest

    from fastvideo_pan2_ext.fastvideo_integration import adapter

    renamed = adapter.Seam("fastvideo.pipelines.stages", "DecodingStageV2", "a later release's name",
                           alternatives=(("fastvideo.pipelines.stages", "DecodingStage"), ))
    from fastvideo.pipelines.stages import DecodingStage

    assert adapter._lookup(renamed) is DecodingStage
    gone = adapter.Seam("fastvideo.pipelines.stages", "DecodingStageV2", "a later release's name")
    with pytest.raises(adapter.IncompatibleFastVideo, match=r"needs fastvideo\.pipelines\.stages\.DecodingStageV2 "
                       r"\(FastVideo 0\.2\.1; a later release's name\), which FastVideo 0\.2\.1 does not have"):
        adapter._lookup(gone)
