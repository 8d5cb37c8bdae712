"""PAN2's FastVideo pipeline configuration and preset (imports FastVideo's config classes)."""

from fastvideo_pan2_ext.configs.pan2 import (MODEL_FAMILY, PAN2_PRESET, PIPELINE_CLASS_NAME, PRESET_NAME,
                                             PAN2PipelineConfig, PAN2SamplingParam)

__all__ = ["MODEL_FAMILY", "PAN2_PRESET", "PIPELINE_CLASS_NAME", "PRESET_NAME", "PAN2PipelineConfig",
           "PAN2SamplingParam"]
