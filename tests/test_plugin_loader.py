"""The plugin loader: a start-up hook that imports nothing heavy, and an entry-point loader that is filtered by
FASTVIDEO_PLUGINS, isolates failures and runs once. Real interpreters, real entry points (a throw-away distribution
on PYTHONPATH for the filter and failure cases), real FastVideo for registration."""

from __future__ import annotations

import json
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


LOAD_TWICE = ("import json, fakeplug_mod; from fastvideo_pan2_ext.plugins import load_plugins; "
              "first = load_plugins(); second = load_plugins(); "
              "print(json.dumps({'first': first, 'second': second, 'calls': fakeplug_mod.CALLS}))")


def test_loader_runs_selected_plugins_once_and_survives_a_broken_one(tmp_path):
    proc = run_python(LOAD_TWICE, env_extra={"PYTHONPATH": str(_fake_plugins(tmp_path)),
                                             "FASTVIDEO_PLUGINS": "good,broken"})
    assert proc.returncode == 0, proc.stderr
    facts = last_json_line(proc.stdout)
    assert facts == {"first": {"good": "ran"}, "second": {}, "calls": ["good"]}
    assert "plugin 'broken' (fakeplug_mod:broken) failed to load" in proc.stderr
    assert "RuntimeError: this plugin is broken" in proc.stderr


def test_fastvideo_plugins_env_filters_by_name(tmp_path):
    path = str(_fake_plugins(tmp_path))
    only_broken = run_python(LOAD_TWICE, env_extra={"PYTHONPATH": path, "FASTVIDEO_PLUGINS": "broken"})
    none = run_python(LOAD_TWICE, env_extra={"PYTHONPATH": path, "FASTVIDEO_PLUGINS": ""})
    assert last_json_line(only_broken.stdout) == {"first": {}, "second": {}, "calls": []}
    assert last_json_line(none.stdout) == {"first": {}, "second": {}, "calls": []}
    assert "failed to load" in only_broken.stderr and "failed to load" not in none.stderr


REGISTRATION_FACTS = textwrap.dedent("""
    import json, sys
    # The config first: its own `import fastvideo` runs the plugin while the config module is half-imported.
    from fastvideo_pan2_ext import PAN2PipelineConfig
    import fastvideo, fastvideo_pan2_ext.configs as configs
    import fastvideo.registry as registry
    from fastvideo.api import presets
    from fastvideo.entrypoints.cli.generate import GenerateSubcommand
    from fastvideo_pan2_ext import registration, register
    registered_by_import = registration._registered
    register(); register()  # idempotent
    info = registry._get_config_info(sys.argv[1])
    print(json.dumps({
        "registered": registered_by_import,
        "same_class": PAN2PipelineConfig is configs.PAN2PipelineConfig,
        "hook_left": [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "FastVideoImportHook"],
        "pan2_configs": sum(i.pipeline_config_cls is PAN2PipelineConfig for i in registry._CONFIG_REGISTRY.values()),
        "first_detector": registry._MODEL_NAME_DETECTORS[0][1].__qualname__,
        "config_for_checkpoint": registry.get_pipeline_config_cls_from_name(sys.argv[1]).__name__,
        "pipeline_for_checkpoint": info.pipeline_cls_name,
        "sampling_for_checkpoint": info.sampling_param_cls.__name__,
        "preset": presets.get_preset("pan2", "pan2").defaults,
        "cli_patched": GenerateSubcommand.__dict__.get("_pan2_cli", False),
    }))
""")


def test_import_fastvideo_registers_pan2_even_when_the_config_is_imported_first(tiny_ckpt):
    proc = run_python(REGISTRATION_FACTS.replace("sys.argv[1]", json.dumps(str(tiny_ckpt))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = last_json_line(proc.stdout)
    assert facts == {
        "registered": True, "same_class": True, "hook_left": [], "pan2_configs": 1,
        "first_detector": "looks_like_pan2", "config_for_checkpoint": "PAN2PipelineConfig",
        "pipeline_for_checkpoint": "PAN2Pipeline", "sampling_for_checkpoint": "PAN2SamplingParam",
        "preset": {"height": 704, "width": 1248, "num_frames": 121, "fps": 24, "guidance_scale": 5.0,
                   "num_inference_steps": 50},
        "cli_patched": True,
    }


def test_importing_the_package_stays_light():
    proc = run_python("import sys, json, fastvideo_pan2_ext; "
                      "print(json.dumps([m for m in ('torch', 'fastvideo', 'numpy', 'PIL') if m in sys.modules]))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
