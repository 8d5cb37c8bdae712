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
from pathlib import Path

from _pan2_helpers import REPO, last_json_line, run

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


def test_wheel_installs_the_hook_and_fastvideo_then_loads_the_plugin(tmp_path):
    wheel = _build("wheel", tmp_path / "dist")
    top_level = _unpack(wheel, tmp_path / "site")
    assert PTH in top_level and "fastvideo_pan2_ext.fastvideo_import_hook import spec_for" in top_level[PTH]
    proc = run([sys.executable, "-S", "-c", STARTUP_FACTS, str(tmp_path / "site")], cwd=tmp_path)
    facts = last_json_line(proc.stdout)
    assert facts == {"hook_installed": 1, "package": str(tmp_path / "site" / "fastvideo_pan2_ext" / "__init__.py"),
                     "entry_points": ["pan2=fastvideo_pan2_ext:register"], "heavy": []}

    # With FastVideo importable (the venv's packages appended, their .pth files not run), importing it runs the
    # plugin installed from the wheel.
    venv_site = sysconfig.get_paths()["purelib"]
    code = STARTUP_FACTS.split("import fastvideo_pan2_ext")[0] + textwrap.dedent(f"""
        sys.path.append({venv_site!r})
        import fastvideo
        from fastvideo_pan2_ext import registration
        print(json.dumps({{"registered": registration._registered, "from": registration.__file__}}))
    """)
    proc = run([sys.executable, "-S", "-c", code, str(tmp_path / "site")], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert last_json_line(proc.stdout) == {"registered": True,
                                           "from": str(tmp_path / "site" / "fastvideo_pan2_ext" / "registration.py")}


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
