"""FastVideo's registries (fastvideo.registry, fastvideo.api.presets, fastvideo.pipelines.pipeline_registry,
fastvideo.models.registry) and the making of FastVideoArgs: where PAN2's config, preset, pipeline class and models are
registered, and the hooks on every FastVideoArgs made."""

from __future__ import annotations

import functools
from typing import Callable

from .seams import Seam, replace_once

SEAMS = (
    Seam("fastvideo.registry", "register_configs", "PAN2's pipeline config, sampling defaults and checkpoint detector "
         "are registered as FastVideo's own are"),
    Seam("fastvideo.api.presets", "register_preset", "the pan2 preset is registered as FastVideo's own are"),
    Seam("fastvideo.models.registry", "ModelRegistry", "PAN2's DiT and text encoder are found by their checkpoint "
         "class names", name="ModelRegistry"),
    Seam("fastvideo.fastvideo_args", "WorkloadType", "PAN2 registers for text- and image-to-video",
         name="WorkloadType"),
    Seam("fastvideo.registry", "_CONFIG_REGISTRY", "register PAN2's config once per process: look for it first"),
    Seam("fastvideo.registry", "_MODEL_NAME_DETECTORS", "FastVideo takes the first matching checkpoint detector in "
         "registration order; PAN2's must come before the Wan ones, which also match a PAN2 checkpoint"),
    Seam("fastvideo.registry", "get_model_info.cache_clear", "the detector order changed after a lookup was cached"),
    Seam("fastvideo.registry", "get_pipeline_config_cls_from_name", "a plain serve config on a PAN2 checkpoint is "
         "served with PAN2's rules: the config FastVideo picks for it says so"),
    Seam("fastvideo.api.presets", "_PRESET_REGISTRY", "register the pan2 preset once per process"),
    Seam("fastvideo.pipelines.pipeline_registry", "_import_pipeline_classes_cached", "pipeline classes come from a "
         "cached scan of fastvideo.pipelines.basic.*, which cannot see a plugin's class: wrapped to add it",
         replaced=True),
    Seam("fastvideo.fastvideo_args", "FastVideoArgs.__post_init__", "FastVideo picks the pipeline class from the "
         "checkpoint, not the config: a PAN2 config must select PAN2Pipeline (and, on CPU, turn offloads off)",
         replaced=True),
    Seam("fastvideo.models.registry", "_LazyRegisteredModel", "PAN2's DiT is registered lazily (by module and class "
         "name); FastVideo 0.2.1's register_model(arch, 'module:Class') builds this with two of its three fields",
         name="LazyRegisteredModel"),
    Seam("fastvideo.models.registry", "ModelRegistry.models", "... so the entry is stored here (and looked up, for "
         "idempotence)"),
)


def register_pipeline_config(*, pipeline_config_cls, sampling_param_cls, workload_types, detector, model_family,
                             default_preset, pipeline_cls_name, hf_model_paths=()) -> None:
    """Register a pipeline config with a checkpoint detector that goes before FastVideo's own (idempotent)."""
    import fastvideo.registry as registry

    if any(info.pipeline_config_cls is pipeline_config_cls for info in registry._CONFIG_REGISTRY.values()):
        return
    registry.register_configs(sampling_param_cls=sampling_param_cls, pipeline_config_cls=pipeline_config_cls,
                              workload_types=workload_types, model_detectors=[detector], model_family=model_family,
                              default_preset=default_preset, pipeline_cls_name=pipeline_cls_name,
                              hf_model_paths=list(hf_model_paths) or None)
    registry._MODEL_NAME_DETECTORS.sort(key=lambda entry: entry[1] is not detector)  # stable: others keep order
    registry.get_model_info.cache_clear()


def register_preset(preset) -> None:
    """Register an InferencePreset (idempotent)."""
    from fastvideo.api import presets

    if (preset.model_family, preset.name, preset.version) not in presets._PRESET_REGISTRY:
        presets.register_preset(preset)


def add_pipeline_class(pipeline_type: str, name: str, load_class: Callable[[], type]) -> None:
    """Make FastVideo's pipeline registry list `load_class()` as `name` among its `pipeline_type` pipelines (the class
    is imported only when FastVideo scans for pipelines)."""
    import fastvideo.pipelines.pipeline_registry as pipeline_registry

    def make(scan):
        @functools.lru_cache
        def import_pipeline_classes(pipeline_types=None):
            classes = scan(pipeline_types)
            if pipeline_type in classes:
                classes[pipeline_type].setdefault(name, load_class())
            return classes

        return import_pipeline_classes

    replace_once(pipeline_registry, "_import_pipeline_classes_cached", make)


_args_hooks: dict[str, list[Callable]] = {"before": [], "after": []}


def on_fastvideo_args(hook: Callable, when: str) -> None:
    """Run `hook(args)` on every FastVideoArgs made in this process, before or after FastVideo's own __post_init__
    (each hook once, in registration order)."""
    from fastvideo.fastvideo_args import FastVideoArgs

    if hook not in _args_hooks[when]:
        _args_hooks[when].append(hook)

    def make(original):
        def __post_init__(self) -> None:
            for before in _args_hooks["before"]:
                before(self)
            original(self)
            for after in _args_hooks["after"]:
                after(self)

        return __post_init__

    replace_once(FastVideoArgs, "__post_init__", make)


def pipeline_config_class(model_path: str):
    """The pipeline config class FastVideo's registry picks for `model_path` (by a registered hub id or name, or the
    checkpoint's manifest), or None where it finds none (or cannot look: a hub id offline)."""
    from fastvideo.registry import get_pipeline_config_cls_from_name

    try:
        return get_pipeline_config_cls_from_name(model_path)
    except Exception:  # noqa: BLE001 - any failure to look is "not known": FastVideo reports its own later
        return None
