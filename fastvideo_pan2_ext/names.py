"""PAN2's names in FastVideo, one definition each, importable without FastVideo (checkpoint files carry them too)."""

PIPELINE_CLASS_NAME = "PAN2Pipeline"  # the pipeline class (FastVideo's and diffusers')
# A PAN2 checkpoint's manifest `_class_name`: IFM publishes a Modular Diffusers repo; a plain diffusers folder names
# the pipeline class.
MODULAR_PIPELINE_CLASS_NAME = "PAN2ModularPipeline"
PIPELINE_CLASS_NAMES = (MODULAR_PIPELINE_CLASS_NAME, PIPELINE_CLASS_NAME)
HUB_ID = "IFM/PAN2"  # the public checkpoint
MODEL_FAMILY = "pan2"  # FastVideo's config registry
PRESET_NAME = "pan2"  # FastVideo's preset registry, and `fastvideo generate --pipeline pan2`
DECODE_COMMAND = "python -m fastvideo_pan2_ext.decode"  # the decode command, as its messages and hints name it
