"""PAN2's FastVideo pipeline configuration and preset.

FastVideo is imported before the config module: its plugin loader then runs this package's `register()`, which
imports the config module itself, so the config classes exist before registration needs them (no import cycle).
"""

import fastvideo  # noqa: F401  (first: see above)

from fastvideo_pan2_ext.configs.pan2 import (MODEL_FAMILY, PAN2_PRESET, PIPELINE_CLASS_NAME, PRESET_NAME,
                                             PAN2PipelineConfig, PAN2SamplingParam)

__all__ = ["MODEL_FAMILY", "PAN2_PRESET", "PIPELINE_CLASS_NAME", "PRESET_NAME", "PAN2PipelineConfig",
           "PAN2SamplingParam"]
