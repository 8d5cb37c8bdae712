"""The package installs under one namespace (docs/design.md, "Rooms"), from a wheel and editable alike.

A wheel is built offline (`pip wheel --no-deps --no-build-isolation`) from a copy of the working tree (the files git
tracks or would track), so concurrent builds never share a `build/` folder. Its file list must be exactly the
`fastvideo_pan2_ext` namespace (the card's top-level folders mapped into it), its dist-info, and the plugin hook's
`.pth` file; then it is installed with `pip install --no-deps --target` and imported by a fresh interpreter outside
the repository. The venv's editable install is checked the same way.
"""

from __future__ import annotations

import configparser
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from _source_tree import REPO, copy_source_tree, source_files

pytestmark = pytest.mark.slow  # builds a wheel

NAMESPACE = "fastvideo_pan2_ext"
# Top-level folder of the design card -> where it is installed.
ROOMS = {
    "fastvideo_pan2_ext": NAMESPACE,
    "configs": f"{NAMESPACE}/configs",
    "attention": f"{NAMESPACE}/attention",
    "vae_kernel": f"{NAMESPACE}/vae_kernel",
}
MODULES = [NAMESPACE, f"{NAMESPACE}.reference", f"{NAMESPACE}.configs", f"{NAMESPACE}.attention",
           f"{NAMESPACE}.vae_kernel"]
GENERIC_NAMES = ["attention", "configs", "reference", "vae_kernel"]
PLUGIN_HOOK_PTH = "fastvideo_pan2_ext-plugins.pth"


def _expected_wheel_files(sources: list[str]) -> set[str]:
    """Every module, kernel source and asset of the four rooms, at its installed path."""
    expected = {f"{NAMESPACE}/reference.py"}
    for source in sources:
        room, _, rest = source.partition("/")
        if room not in ROOMS or not rest or "__pycache__" in rest:
            continue
        if source.endswith(".py") or rest.startswith(("csrc/", "assets/")):
            expected.add(f"{ROOMS[room]}/{rest}")
    return expected


@pytest.fixture(scope="module")
def wheel_build(tmp_path_factory) -> tuple[Path, str]:
    """(the wheel, pip's output while building it)."""
    tree = copy_source_tree(tmp_path_factory.mktemp("tree"))
    out = tmp_path_factory.mktemp("wheelhouse")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "--wheel-dir", str(out), str(tree)], cwd=tree, timeout=300, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    wheels = list(out.glob("fastvideo_pan2_ext-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0], build.stdout + build.stderr


@pytest.fixture(scope="module")
def wheel(wheel_build) -> Path:
    return wheel_build[0]


def test_building_the_package_prints_no_setuptools_warning(wheel_build):
    log = wheel_build[1]
    assert "BuildBackendWarning" not in log and "SetuptoolsDeprecationWarning" not in log, log[-3000:]


def _wheel_names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


def _run_python(code: str, cwd: Path, env_extra: dict[str, str] | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(env_extra or {})
    result = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


IMPORT_PROBE = f"""
import importlib, importlib.util, json
modules = {MODULES!r}
files = {{name: importlib.import_module(name).__file__ for name in modules}}
top_level = {{name: importlib.util.find_spec(name) is not None for name in {GENERIC_NAMES!r}}}
print(json.dumps({{"files": files, "top_level": top_level}}))
"""


# --- the wheel ------------------------------------------------------------------------------------------------------


def test_wheel_holds_every_module_of_the_four_rooms_under_the_namespace(wheel):
    names = set(_wheel_names(wheel))
    missing = _expected_wheel_files(source_files()) - names
    assert not missing, f"not in the wheel: {sorted(missing)}"
    for room in ("configs", "attention", "vae_kernel"):
        assert f"{NAMESPACE}/{room}/__init__.py" in names
    csrc = [f for f in source_files() if f.startswith("vae_kernel/compiled/csrc/")]
    assert all(f"{NAMESPACE}/{f}" in names for f in csrc)


def test_wheel_installs_nothing_generic_at_the_top_level(wheel):
    top_level = {name.split("/")[0] for name in _wheel_names(wheel)}
    dist_info = {t for t in top_level if t.endswith(".dist-info")}
    assert len(dist_info) == 1 and next(iter(dist_info)).startswith("fastvideo_pan2_ext-")
    assert top_level - dist_info == {NAMESPACE, PLUGIN_HOOK_PTH}
    assert not any(name.split("/")[0] in GENERIC_NAMES or name.split("/")[0] == "reference.py"
                   for name in _wheel_names(wheel))


def test_wheel_reference_module_is_the_repositorys_reference_py(wheel):
    with zipfile.ZipFile(wheel) as zf:
        assert zf.read(f"{NAMESPACE}/reference.py") == (REPO / "reference.py").read_bytes()


def test_wheel_declares_the_fastvideo_plugin_entry_point(wheel):
    with zipfile.ZipFile(wheel) as zf:
        [entry_points] = [n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt")]
        parser = configparser.ConfigParser()
        parser.read_string(zf.read(entry_points).decode())
    assert parser.has_section("fastvideo.plugins")
    assert dict(parser["fastvideo.plugins"]) == {"pan2": "fastvideo_pan2_ext:register"}


def test_wheel_installed_with_target_imports_from_outside_the_repo(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", "--target",
                    str(target), str(wheel)], check=True, timeout=300)
    installed = {p.name for p in target.iterdir()}
    assert not installed & set(GENERIC_NAMES) and "reference.py" not in installed

    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    probe = _run_python(IMPORT_PROBE, cwd=workdir, env_extra={"PYTHONPATH": str(target)})
    for name, file in probe["files"].items():
        assert Path(file).resolve().is_relative_to(target.resolve()), f"{name} imported from {file}"
    assert not any(probe["top_level"].values()), probe["top_level"]


# --- the editable install in the venv -------------------------------------------------------------------------------


def test_editable_install_imports_the_namespace_and_nothing_generic(tmp_path):
    probe = _run_python(IMPORT_PROBE, cwd=tmp_path)
    for name, file in probe["files"].items():
        assert Path(file).resolve().is_relative_to(REPO), f"{name} imported from {file}, not this checkout"
    assert Path(probe["files"][f"{NAMESPACE}.reference"]).resolve() == REPO / "reference.py"
    assert not any(probe["top_level"].values()), probe["top_level"]


def test_editable_install_declares_the_fastvideo_plugin_entry_point(tmp_path):
    code = (
        "import importlib.metadata, json\n"
        "eps = importlib.metadata.entry_points(group='fastvideo.plugins')\n"
        "print(json.dumps({ep.name: ep.value for ep in eps}))\n"
    )
    assert _run_python(code, cwd=tmp_path).get("pan2") == "fastvideo_pan2_ext:register"
