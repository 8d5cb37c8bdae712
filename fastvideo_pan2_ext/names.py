"""PAN2's names in FastVideo, one definition each, importable without FastVideo (checkpoint files carry them too)."""

PIPELINE_CLASS_NAME = "PAN2Pipeline"  # the pipeline class, and a PAN2 checkpoint's model_index.json `_class_name`
MODEL_FAMILY = "pan2"  # FastVideo's config registry
PRESET_NAME = "pan2"  # FastVideo's preset registry, and `fastvideo generate --pipeline pan2`
DECODE_COMMAND = "python -m fastvideo_pan2_ext.decode"  # the decode command, as its messages and hints name it
