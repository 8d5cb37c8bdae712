"""`register()`: what the ``fastvideo.plugins`` entry point does in every FastVideo process. Idempotent.

1. On a GPU-less machine, lets FastVideo run on CPU (`cpu_support`; nothing happens where a GPU exists).
2. Registers `PAN2PipelineConfig` + `PAN2SamplingParam` with FastVideo's config registry, with a model detector for
   PAN2 checkpoints (`checkpoint.looks_like_pan2`) placed ahead of FastVideo's own detectors (which would otherwise
   claim any Wan-style checkpoint first) and pinned to the `PAN2Pipeline` class.
3. Registers the ``pan2`` preset (sampling defaults) with FastVideo's preset registry.
4. Adds `PAN2Pipeline` to FastVideo's pipeline registry. That registry is a cached scan of
   ``fastvideo.pipelines.<type>.*`` (`EntryClass`), so the scan function is wrapped to add PAN2 to the ``basic``
   pipelines whenever it runs: nothing heavy is imported until FastVideo builds a pipeline.
5. Makes a `PAN2PipelineConfig` select `PAN2Pipeline`: FastVideo picks the pipeline class from the checkpoint, not
   from the config, so `FastVideoArgs` made with a PAN2 config get ``override_pipeline_cls_name="PAN2Pipeline"``, and
   their checkpoint is checked (`checkpoint.check_pan2_checkpoint`) in the process that makes them.
6. Adds ``--pipeline`` to ``fastvideo generate`` (`cli`).
7. Lets the decoding stage write a PAN2 video as it decodes when the request only saves it (`stream_save`).

If ``import fastvideo`` happens while `fastvideo_pan2_ext.configs` is itself being imported (a user imported the
config first), the config class does not exist yet: registration is deferred and completed by that module.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger(__name__)

_CONFIG_MODULE = "fastvideo_pan2_ext.configs.pan2"
_registered = False
_deferred = False


def _config_module_initializing() -> bool:
    module = sys.modules.get(_CONFIG_MODULE)
    spec = getattr(module, "__spec__", None)
    return module is not None and bool(getattr(spec, "_initializing", False))


def register() -> None:
    global _deferred
    if _registered:
        return
    if _config_module_initializing():
        _deferred = True
        return
    _register()


def finish_deferred() -> None:
    """Called by the config module once its classes exist (it is still importing: hence no check here)."""
    global _deferred
    if _deferred and not _registered and "fastvideo" in sys.modules:
        _deferred = False
        _register()


def _register() -> None:
    global _registered
    from fastvideo_pan2_ext import cpu_support

    cpu_support.install()
    _register_config()
    _register_preset()
    _register_pipeline_class()
    _pan2_config_selects_pan2_pipeline()
    from fastvideo_pan2_ext import cli, stream_save

    cli.install()
    stream_save.install()
    _registered = True
    logger.debug("fastvideo_pan2_ext registered with FastVideo")


def _register_config() -> None:
    import fastvideo.registry as registry
    from fastvideo.fastvideo_args import WorkloadType

    from fastvideo_pan2_ext.checkpoint import looks_like_pan2
    # From the module, not the package: registration may run while the package's __init__ is still importing it.
    from fastvideo_pan2_ext.configs.pan2 import (MODEL_FAMILY, PIPELINE_CLASS_NAME, PRESET_NAME, PAN2PipelineConfig,
                                                 PAN2SamplingParam)

    if any(info.pipeline_config_cls is PAN2PipelineConfig for info in registry._CONFIG_REGISTRY.values()):
        return
    registry.register_configs(
        sampling_param_cls=PAN2SamplingParam,
        pipeline_config_cls=PAN2PipelineConfig,
        workload_types=(WorkloadType.I2V, ),
        model_detectors=[looks_like_pan2],
        model_family=MODEL_FAMILY,
        default_preset=PRESET_NAME,
        pipeline_cls_name=PIPELINE_CLASS_NAME,
    )
    # FastVideo takes the first matching detector in registration order; put PAN2's first.
    detectors = registry._MODEL_NAME_DETECTORS
    detectors.sort(key=lambda entry: entry[1] is not looks_like_pan2)  # stable: the others keep their order
    registry.get_model_info.cache_clear()


def _register_preset() -> None:
    from fastvideo.api import presets

    from fastvideo_pan2_ext.configs.pan2 import PAN2_PRESET

    key = (PAN2_PRESET.model_family, PAN2_PRESET.name, PAN2_PRESET.version)
    if key not in presets._PRESET_REGISTRY:
        presets.register_preset(PAN2_PRESET)


def _register_pipeline_class() -> None:
    import fastvideo.pipelines.pipeline_registry as pipeline_registry

    scan = pipeline_registry._import_pipeline_classes_cached
    if getattr(scan, "_pan2_wrapped", False):
        return

    import functools

    @functools.lru_cache
    def import_pipeline_classes_with_pan2(pipeline_types=None):
        classes = scan(pipeline_types)
        if "basic" in classes:
            from fastvideo_pan2_ext.pipeline import PAN2Pipeline

            classes["basic"].setdefault(PAN2Pipeline.__name__, PAN2Pipeline)
        return classes

    import_pipeline_classes_with_pan2._pan2_wrapped = True
    pipeline_registry._import_pipeline_classes_cached = import_pipeline_classes_with_pan2


def _pan2_config_selects_pan2_pipeline() -> None:
    from fastvideo.fastvideo_args import FastVideoArgs

    if getattr(FastVideoArgs.__post_init__, "_pan2_wrapped", False):
        return
    original = FastVideoArgs.__post_init__

    def __post_init__(self) -> None:
        from fastvideo_pan2_ext.checkpoint import check_pan2_checkpoint
        from fastvideo_pan2_ext.configs.pan2 import PIPELINE_CLASS_NAME, PAN2PipelineConfig

        if isinstance(self.pipeline_config, PAN2PipelineConfig) and self.override_pipeline_cls_name is None:
            check_pan2_checkpoint(self.model_path)
            self.override_pipeline_cls_name = PIPELINE_CLASS_NAME
        original(self)

    __post_init__._pan2_wrapped = True
    FastVideoArgs.__post_init__ = __post_init__
