"""`pip install .` and `pip install -e .` both put the plugin hook's .pth at the top of site-packages.

The wheels are built from this checkout with the real build backend (setuptools, PEP 517 / PEP 660 hooks), unpacked
into a fresh site directory the way an installer lays them out, and a fresh interpreter (`-S`: no other site
packages processed) is started on that directory alone.
"""

from __future__ import annotations

import sys
import sysconfig
import textwrap
import zipfile

import pytest
from pathlib import Path

from _pan2_helpers import REPO, last_json_line, run

pytestmark = pytest.mark.slow  # builds and installs wheels

PTH = "fastvideo_pan2_ext-plugins.pth"


def _build(kind: str, out: Path) -> Path:
    hook = {"wheel": "build_wheel", "editable": "build_editable"}[kind]
    out.mkdir(parents=True, exist_ok=True)
    proc = run([sys.executable, "-c", f"import sys; from setuptools import build_meta; "
                f"print(build_meta.{hook}(sys.argv[1]))", str(out)], cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / proc.stdout.strip().splitlines()[-1]


def _unpack(wheel: Path, site: Path) -> dict[str, str]:
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
        return {name: zf.read(name).decode() for name in zf.namelist() if "/" not in name}


STARTUP_FACTS = textwrap.dedent("""
    import json, site, sys
    site.addsitedir(sys.argv[1])
    import fastvideo_pan2_ext
    from importlib.metadata import entry_points
    print(json.dumps({
        "hook_installed": [type(f).__name__ for f in sys.meta_path].count("FastVideoImportHook"),
        "package": fastvideo_pan2_ext.__file__,
        "entry_points": sorted(f"{ep.name}={ep.value}" for ep in entry_points(group="fastvideo.plugins")),
        "heavy": [m for m in ("torch", "fastvideo", "numpy") if m in sys.modules],
    }))
""")


REGISTRATION_FACTS = textwrap.dedent("""
    # The config first: its own `import fastvideo` runs the plugin while the config module is half-imported.
    from fastvideo_pan2_ext import PAN2PipelineConfig
    import fastvideo, fastvideo_pan2_ext.configs as configs
    import fastvideo.registry as registry
    from fastvideo.api import presets
    from fastvideo.entrypoints.cli.generate import GenerateSubcommand
    from fastvideo_pan2_ext import register
    from fastvideo_pan2_ext.fastvideo_integration import registration
    registered_by_import = registration._registered
    register(); register()  # idempotent
    info = registry._get_config_info(CHECKPOINT)
    print(json.dumps({
        "registered": registered_by_import,
        "from": registration.__file__,
        "same_class": PAN2PipelineConfig is configs.PAN2PipelineConfig,
        "hook_left": [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "FastVideoImportHook"],
        "pan2_configs": sum(i.pipeline_config_cls is PAN2PipelineConfig for i in registry._CONFIG_REGISTRY.values()),
        "first_detector": registry._MODEL_NAME_DETECTORS[0][1].__qualname__,
        "config_for_checkpoint": registry.get_pipeline_config_cls_from_name(CHECKPOINT).__name__,
        "pipeline_for_checkpoint": info.pipeline_cls_name,
        "sampling_for_checkpoint": info.sampling_param_cls.__name__,
        "preset": presets.get_preset("pan2", "pan2").defaults,
        "cli_patched": getattr(GenerateSubcommand.validate, "_pan2_replacement", False),
    }))
""")


def test_wheel_installs_the_hook_and_fastvideo_then_registers_the_plugin(tmp_path, tiny_ckpt):
    wheel = _build("wheel", tmp_path / "dist")
    top_level = _unpack(wheel, tmp_path / "site")
    assert PTH in top_level and "fastvideo_pan2_ext.plugin_loader.import_hook import spec_for" in top_level[PTH]
    proc = run([sys.executable, "-S", "-c", STARTUP_FACTS, str(tmp_path / "site")], cwd=tmp_path)
    facts = last_json_line(proc.stdout)
    assert facts == {"hook_installed": 1, "package": str(tmp_path / "site" / "fastvideo_pan2_ext" / "__init__.py"),
                     "entry_points": ["pan2=fastvideo_pan2_ext:register"], "heavy": []}

    # With FastVideo importable (the venv's packages appended, their .pth files not run), importing it runs the
    # plugin installed from the wheel, which registers PAN2 everywhere FastVideo looks.
    venv_site = sysconfig.get_paths()["purelib"]
    code = (STARTUP_FACTS.split("import fastvideo_pan2_ext")[0] + f"sys.path.append({venv_site!r})\n"
            + REGISTRATION_FACTS.replace("CHECKPOINT", repr(str(tiny_ckpt))))
    proc = run([sys.executable, "-S", "-c", code, str(tmp_path / "site")], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert last_json_line(proc.stdout) == {
        "registered": True,
        "from": str(tmp_path / "site" / "fastvideo_pan2_ext" / "fastvideo_integration" / "registration.py"),
        "same_class": True, "hook_left": [], "pan2_configs": 1,
        "first_detector": "looks_like_pan2", "config_for_checkpoint": "PAN2PipelineConfig",
        "pipeline_for_checkpoint": "PAN2Pipeline", "sampling_for_checkpoint": "PAN2SamplingParam",
        "preset": {"height": 704, "width": 1248, "num_frames": 241, "fps": 24, "guidance_scale": 2.5,
                   "num_inference_steps": 50, "seed": 123},
        "cli_patched": True,
    }


def test_editable_install_installs_the_hook_after_the_editable_finder(tmp_path):
    wheel = _build("editable", tmp_path / "dist")
    top_level = _unpack(wheel, tmp_path / "site")
    assert PTH in top_level
    editable_pth = [name for name in top_level if name.startswith("__editable__") and name.endswith(".pth")]
    assert editable_pth and sorted([*editable_pth, PTH])[-1] == PTH  # site runs .pth files in name order
    proc = run([sys.executable, "-S", "-c", STARTUP_FACTS, str(tmp_path / "site")], cwd=tmp_path)
    facts = last_json_line(proc.stdout)
    assert facts == {"hook_installed": 1, "package": str(REPO / "fastvideo_pan2_ext" / "__init__.py"),
                     "entry_points": ["pan2=fastvideo_pan2_ext:register"], "heavy": []}
