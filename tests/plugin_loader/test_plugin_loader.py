"""The plugin loader: a start-up hook that imports nothing heavy, and an entry-point loader that is filtered by
FASTVIDEO_PLUGINS, isolates failures and runs once. Real interpreters, real entry points (a throw-away distribution
on PYTHONPATH for the filter and failure cases). Registration with real FastVideo: test_plugin_install.py."""

from __future__ import annotations

import textwrap

from _pan2_helpers import last_json_line, run_python


def test_startup_installs_only_the_import_hook():
    proc = run_python("import sys, json; print(json.dumps({'modules': sorted(sys.modules), "
                      "'finders': [type(f).__name__ for f in sys.meta_path]}))")
    assert proc.returncode == 0, proc.stderr
    facts = last_json_line(proc.stdout)
    assert facts["finders"][0] == "FastVideoImportHook"
    ours = {m for m in facts["modules"] if m.startswith("fastvideo_pan2_ext")}
    assert ours == set()  # the .pth stub imports nothing, not even this package
    for heavy in ("torch", "fastvideo", "numpy", "PIL", "importlib.metadata", "logging"):
        assert heavy not in facts["modules"], heavy


def _fake_plugins(folder):
    dist = folder / "fakeplug-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fakeplug\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[fastvideo.plugins]\ngood = fakeplug_mod:good\n"
                                           "broken = fakeplug_mod:broken\n")
    (folder / "fakeplug_mod.py").write_text(textwrap.dedent("""
        CALLS = []
        def good():
            CALLS.append("good")
            return "ran"
        def broken():
            raise RuntimeError("this plugin is broken")
    """))
    return folder


LOAD_TWICE = ("import json, fakeplug_mod; from fastvideo_pan2_ext.plugin_loader import load_plugins; "
              "first = load_plugins(); second = load_plugins(); "
              "print(json.dumps({'first': first, 'second': second, 'calls': fakeplug_mod.CALLS}))")


def test_loader_runs_selected_plugins_once_and_survives_a_broken_one(tmp_path):
    proc = run_python(LOAD_TWICE, env_extra={"PYTHONPATH": str(_fake_plugins(tmp_path)),
                                             "FASTVIDEO_PLUGINS": "good,broken"})
    assert proc.returncode == 0, proc.stderr
    facts = last_json_line(proc.stdout)
    assert facts == {"first": {"good": "ran"}, "second": {}, "calls": ["good"]}
    assert "plugin 'broken' (fakeplug_mod:broken) failed to load" in proc.stderr
    assert "RuntimeError: this plugin is broken" in proc.stderr and "Traceback" not in proc.stderr


def test_fastvideo_plugins_env_filters_by_name(tmp_path):
    path = str(_fake_plugins(tmp_path))
    only_broken = run_python(LOAD_TWICE, env_extra={"PYTHONPATH": path, "FASTVIDEO_PLUGINS": "broken"})
    none = run_python(LOAD_TWICE, env_extra={"PYTHONPATH": path, "FASTVIDEO_PLUGINS": ""})
    assert last_json_line(only_broken.stdout) == {"first": {}, "second": {}, "calls": []}
    assert last_json_line(none.stdout) == {"first": {}, "second": {}, "calls": []}
    assert "failed to load" in only_broken.stderr and "failed to load" not in none.stderr


def test_importing_the_package_stays_light():
    proc = run_python("import sys, json, fastvideo_pan2_ext; "
                      "print(json.dumps([m for m in ('torch', 'fastvideo', 'numpy', 'PIL') if m in sys.modules]))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
