"""FastVideo's configuration classes (fastvideo.configs, fastvideo.api): the classes PAN2's pipeline, DiT, text
encoder, sampling defaults and preset are built on (`fastvideo_pan2_ext.configs`, `fastvideo_pan2_ext.model`), reached
through `compat.symbol(name)`."""

from __future__ import annotations

from .seams import Seam

SEAMS = (
    Seam("fastvideo.configs.pipelines.base", "PipelineConfig", "PAN2's pipeline config is one", name="PipelineConfig"),
    Seam("fastvideo.configs.models.dits.base", "DiTConfig", "the pipeline config's DiT field", name="DiTConfig"),
    Seam("fastvideo.configs.models.vaes.base", "VAEConfig", "the pipeline config's VAE field", name="VAEConfig"),
    Seam("fastvideo.configs.models.vaes", "WanVAEConfig", "PAN2's VAE is the Wan2.2 VAE", name="WanVAEConfig"),
    Seam("fastvideo.configs.models.encoders.base", "TextEncoderConfig", "PAN2's Qwen3.5 text encoder config",
         name="TextEncoderConfig"),
    Seam("fastvideo.configs.models.encoders.base", "TextEncoderArchConfig", "... and its architecture fields",
         name="TextEncoderArchConfig"),
    Seam("fastvideo.configs.pipelines.base", "PipelineConfig.update_pipeline_config", "a pipeline config file sets "
         "dataclass fields only: PAN2's config extends it to its switches (views of vae_config)",
         mentions="fields(self)"),
    Seam("fastvideo.api.sampling_param", "SamplingParam", "PAN2's sampling defaults", name="SamplingParam"),
    Seam("fastvideo.api.presets", "InferencePreset", "the pan2 preset", name="InferencePreset"),
    Seam("fastvideo.api.presets", "PresetStageSpec", "the pan2 preset's denoising stage", name="PresetStageSpec"),
    Seam("fastvideo.configs.models.dits.base", "DiTArchConfig", "PAN2's DiT architecture config is one",
         name="DiTArchConfig"),
)
