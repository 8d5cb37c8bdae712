"""PAN2's FastVideo configuration: the pipeline config, its sampling defaults and the ``pan2`` preset.

PAN2 is a Wan2.2-TI2V-5B-class image-to-video model, so its config is FastVideo's `Wan2_2_TI2V_5B_Config` with
PAN2's own switches; the sampling defaults (704x1248, 24 fps, 121 frames) live where FastVideo keeps sampling
defaults: a `SamplingParam` subclass and an `InferencePreset`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastvideo.api.presets import InferencePreset, PresetStageSpec
from fastvideo.api.sampling_param import SamplingParam
from fastvideo.configs.pipelines.wan import Wan2_2_TI2V_5B_Config

MODEL_FAMILY = "pan2"
PRESET_NAME = "pan2"
PIPELINE_CLASS_NAME = "PAN2Pipeline"

DEFAULT_HEIGHT = 704
DEFAULT_WIDTH = 1248
DEFAULT_NUM_FRAMES = 121
DEFAULT_FPS = 24
DEFAULT_GUIDANCE_SCALE = 5.0
DEFAULT_NUM_INFERENCE_STEPS = 50


@dataclass
class PAN2PipelineConfig(Wan2_2_TI2V_5B_Config):
    """Wan2.2-TI2V-5B's config plus PAN2's decoder switches.

    vae_decode_kernel: decode with `fastvideo_pan2_ext.vae_kernel.WanVAEDecoder` (on this rank) instead of FastVideo's
        own Wan VAE decode.
    vae_frames_per_pass: latent frames the fast decoder processes per pass (memory vs speed; same video).
    """

    vae_decode_kernel: bool = False
    vae_frames_per_pass: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        # A PAN2 config is made in the process that starts FastVideo's workers: decide FA4 here, so they inherit it
        # before anything of FastVideo's is imported in them.
        from fastvideo_pan2_ext.attention import apply_fa4_policy

        apply_fa4_policy()
        if not isinstance(self.vae_decode_kernel, bool):
            raise ValueError(f"vae_decode_kernel must be a bool; got {self.vae_decode_kernel!r}")
        if (isinstance(self.vae_frames_per_pass, bool) or not isinstance(self.vae_frames_per_pass, int)
                or self.vae_frames_per_pass < 1):
            raise ValueError(f"vae_frames_per_pass must be an int >= 1; got {self.vae_frames_per_pass!r}")


@dataclass
class PAN2SamplingParam(SamplingParam):
    """PAN2's sampling defaults (the same values as the ``pan2`` preset)."""

    height: int = DEFAULT_HEIGHT
    width: int = DEFAULT_WIDTH
    num_frames: int = DEFAULT_NUM_FRAMES
    fps: int = DEFAULT_FPS
    guidance_scale: float = DEFAULT_GUIDANCE_SCALE
    num_inference_steps: int = DEFAULT_NUM_INFERENCE_STEPS


PAN2_PRESET = InferencePreset(
    name=PRESET_NAME,
    version=1,
    model_family=MODEL_FAMILY,
    description="PAN2 image-to-video (Wan2.2-TI2V-5B class), 704x1248 @ 24 fps, 121 frames",
    workload_type="i2v",
    stage_schemas=(PresetStageSpec(name="denoise", kind="denoising", description="PAN2 denoising",
                                   allowed_overrides=frozenset({"num_inference_steps", "guidance_scale"})), ),
    defaults={
        "height": DEFAULT_HEIGHT,
        "width": DEFAULT_WIDTH,
        "num_frames": DEFAULT_NUM_FRAMES,
        "fps": DEFAULT_FPS,
        "guidance_scale": DEFAULT_GUIDANCE_SCALE,
        "num_inference_steps": DEFAULT_NUM_INFERENCE_STEPS,
    },
)

# `import fastvideo` inside this module's imports may have run the plugin's register() before the classes above
# existed; it deferred itself, and finishes now.
from fastvideo_pan2_ext import registration as _registration  # noqa: E402

_registration.finish_deferred()
