"""PAN2's models in FastVideo's model registry, under their checkpoint class names: the DiT (`TransformerLoader`
resolves `transformer/config.json`'s `_class_name`) and the text encoder (`TextEncoderLoader` resolves
`text_encoder/config.json`'s `architectures`). Registered lazily, by module and class name, so registering imports
neither torch nor FastVideo's model code."""

from __future__ import annotations

from fastvideo_pan2_ext.fastvideo_integration import compat
from fastvideo_pan2_ext.model.architecture import TEXT_ENCODER_CLASS_NAME, TRANSFORMER_CLASS_NAME

# checkpoint class name -> (module, FastVideo's component kind, class)
MODELS = {
    TRANSFORMER_CLASS_NAME: ("fastvideo_pan2_ext.model.transformer", "dits", "PAN2Transformer3DModel"),
    TEXT_ENCODER_CLASS_NAME: ("fastvideo_pan2_ext.model.text_encoder", "encoders", "PAN2Qwen3_5TextEncoder"),
}


def register_models() -> None:
    """Register every model of `MODELS`. Idempotent."""
    registry = compat.symbol("ModelRegistry")
    for architecture, (module, component, class_name) in MODELS.items():
        entry = registry.models.get(architecture)
        if (getattr(entry, "module_name", None), getattr(entry, "class_name", None)) == (module, class_name):
            continue
        # FastVideo 0.2.1's documented form, register_model(arch, "module:Class"), fails: it builds its lazy entry
        # with two of the three fields that entry needs (TypeError). The entry is made here, with FastVideo's class.
        registry.models[architecture] = compat.symbol("LazyRegisteredModel")(
            module_name=module, component_name=component, class_name=class_name)
