"""FastVideo's pipelines (fastvideo.pipelines, its forward context, the noise): the base class and stages PAN2Pipeline
is made of (`fastvideo_integration.pipeline`, `fastvideo_integration.stages`), reached through `compat.symbol(name)`,
and the de-normalization FastVideo's decode applies."""

from __future__ import annotations

from .seams import Seam

SEAMS = (
    Seam("fastvideo.pipelines.composed_pipeline_base", "ComposedPipelineBase", "PAN2Pipeline is one",
         name="ComposedPipelineBase"),
    Seam("fastvideo.pipelines.composed_pipeline_base", "ComposedPipelineBase.load_modules", "a Modular Diffusers "
         "manifest is rewritten into [library, class] entries, which this reads", mentions="module_spec[0]"),
    Seam("fastvideo.pipelines.stages.base", "PipelineStage", "PAN2's own stages", name="PipelineStage"),
    Seam("fastvideo.forward_context", "set_forward_context", "FastVideo's attention reads the forward context",
         name="set_forward_context"),
    Seam("diffusers.utils.torch_utils", "randn_tensor", "the noise drawn as FastVideo's latent stage draws it",
         name="randn_tensor"),
    Seam("fastvideo.pipelines.stages", "InputValidationStage", "PAN2's first-frame stage extends it",
         name="InputValidationStage"),
    Seam("fastvideo.pipelines.stages", "DecodingStage", "PAN2's decoding stage extends it", name="DecodingStage"),
    Seam("fastvideo.utils", "PRECISION_TO_TYPE", "a precision name (\"bf16\") as the dtype FastVideo's loaders use",
         name="PRECISION_TO_TYPE"),
    Seam("fastvideo.pipelines.stages", "DecodingStage._denormalize_latents", "the fast decoder takes latents "
         "de-normalized exactly as FastVideo's decode does"),
)


def denormalize_latents(stage, latents, fastvideo_args):
    """Latents as FastVideo's decode hands them to the VAE (`z * std + mean` for a Wan VAE)."""
    return stage._denormalize_latents(latents, fastvideo_args)
