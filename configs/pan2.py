"""PAN2's FastVideo configuration: the pipeline config, its sampling defaults and the ``pan2`` preset.

`PAN2PipelineConfig` is a FastVideo `PipelineConfig` for IFM/PAN2's components (its DiT `model.dit_config`, the Wan2.2
VAE, Qwen3.5 `model.text_encoder`) with PAN2's decoder and encoder switches; the sampling defaults are IFM's
reference sampler's (704x1248, 241 frames, 24 fps, 50 steps, guidance 2.5, seed 123; the flow shift is the
scheduler config's, 9 in IFM's checkpoint) and live where FastVideo keeps sampling defaults: a `SamplingParam`
subclass and an `InferencePreset`.
"""

from __future__ import annotations

import functools
import logging
import warnings
from dataclasses import dataclass, field

from fastvideo_pan2_ext.fastvideo_integration import compat, fast_decode, fast_encode
from fastvideo_pan2_ext.model.dit_config import PAN2DiTConfig
from fastvideo_pan2_ext.model.text_encoder import PAN2TextEncoderConfig
from fastvideo_pan2_ext.names import MODEL_FAMILY, PIPELINE_CLASS_NAME, PRESET_NAME  # noqa: F401 (re-exported)
from fastvideo_pan2_ext.vae_kernel.definitions.architecture import latent_frames


DEFAULT_HEIGHT = 704
DEFAULT_WIDTH = 1248
DEFAULT_NUM_FRAMES = 241  # IFM's sampler (10 s at 24 fps); vLLM-Omni's default is 313
DEFAULT_FPS = 24
DEFAULT_GUIDANCE_SCALE = 2.5  # IFM's sampler; vLLM-Omni's and diffusers' modular pipeline's default is 3.0
DEFAULT_NUM_INFERENCE_STEPS = 50
DEFAULT_SEED = 123
DEFAULT_NEGATIVE_PROMPT = ""  # encoded as " ", as in training; IFM's released negative prompt is not public

logger = logging.getLogger(__name__)


@dataclass
class PAN2PipelineConfig(compat.symbol("PipelineConfig")):
    """IFM/PAN2's components in FastVideo, and PAN2's decoder and encoder switches, each a view of its Wan VAE config
    (`PAN2_SWITCHES`):

    vae_decode_kernel (`vae_config.decode_kernel`): decode with `fastvideo_pan2_ext.vae_kernel.WanVAEDecoder` (the
        rows split over the request's ranks) instead of FastVideo's own Wan VAE decode. When a request only saves the
        video, the frames are then written to the mp4 as they are decoded
        (`fastvideo_pan2_ext.fastvideo_integration.streamed_save`).
    vae_decode_<option> (`vae_config.decode_<option>`), one per decoder option (`vae_kernel.options.OPTIONS`):
        vae_decode_frames_per_pass ("auto" by default: `vae_kernel.planning.memory.choose_plan`), vae_decode_tile_rows,
        vae_decode_max_memory, vae_decode_backend, vae_decode_conv_algorithm. `vae_frames_per_pass` is the deprecated
        name of vae_decode_frames_per_pass.
    vae_encode_kernel (`vae_config.encode_kernel`): encode the first frame with
        `fastvideo_pan2_ext.vae_kernel.WanVAEEncoder` (the rows split over the request's ranks) instead of FastVideo's
        own Wan VAE encode (`fastvideo_pan2_ext.fastvideo_integration.fast_encode`); off by default.
    vae_encode_<option> (`vae_config.encode_<option>`), one per encoder option (`vae_kernel.options.ENCODE_OPTIONS`):
        vae_encode_frames_per_pass, vae_encode_tile_rows, vae_encode_max_memory, vae_encode_backend,
        vae_encode_precision ("auto": fp32 for PAN2's fp32 VAE, as FastVideo encodes), vae_encode_reuse_steady.

    Precision: `dit_precision` (bf16; "fp32" runs the DiT and its inputs in fp32), `text_encoder_precisions`
    (("bf16",)), `vae_precision` (fp32: the first frame's encode), `vae_decode_precision` (bf16, FastVideo's Wan
    default). The latents stay fp32 through the sampler whatever these say. `flow_shift` None takes the scheduler
    config's shift.

    FastVideo's own VAE switches are inherited unchanged, and for PAN2 (a Wan2.2 VAE) in FastVideo 0.2.1 they do this
    (measured; `tests/fastvideo_integration/test_pipeline_decode_routes.py`):
    - `vae_tiling` (default False) and `vae_sp` (default False): the decode stage calls the VAE's `enable_tiling()`,
      which FastVideo's Wan VAE ignores while `vae_config.use_feature_cache` is True: same video, same memory. Setting
      `vae_tiling=True` logs a warning saying so.
    - `vae_config.use_feature_cache` (default True): False routes encode and decode through FastVideo's generic tiled
      paths, which do not patchify/unpatchify a Wan2.2 VAE (12-channel frames at the wrong size, or a crash in the
      encoder): refused with a ValueError.
    - The first-frame encode is FastVideo's feature-cache encode of one frame, untiled, in `vae_precision` (fp32),
      unless vae_encode_kernel is on.
    """

    dit_config: compat.symbol("DiTConfig") = field(default_factory=PAN2DiTConfig)
    dit_precision: str = "bf16"
    vae_config: compat.symbol("VAEConfig") = field(default_factory=compat.symbol("WanVAEConfig"))
    vae_precision: str = "fp32"
    vae_decode_precision: str = "bf16"
    vae_tiling: bool = False
    vae_sp: bool = False
    text_encoder_configs: tuple = field(default_factory=lambda: (PAN2TextEncoderConfig(), ))
    text_encoder_precisions: tuple[str, ...] = field(default_factory=lambda: ("bf16", ))
    flow_shift: float | None = None

    def __post_init__(self) -> None:
        self.vae_config.load_encoder = True  # the first frame of image-to-video
        self.vae_config.load_decoder = True
        for name, value in self.__dict__.pop("_switches_at_init", {}).items():
            setattr(self, name, value)  # the views: into vae_config
        self.check_vae_options()
        if self.vae_tiling:
            logger.warning("vae_tiling=True changes nothing for PAN2 in FastVideo 0.2.1: its Wan VAE ignores tiling "
                           "while vae_config.use_feature_cache is True (the only mode that decodes a Wan2.2 VAE "
                           "correctly). For bounded decode memory use vae_decode_kernel=True with "
                           "vae_decode_max_memory or vae_decode_tile_rows (exact tiles).")

    def update_pipeline_config(self, source_pipeline_dict: dict) -> None:
        """FastVideo's update from a pipeline config file (`pipeline_config_path`), which sets dataclass fields only:
        PAN2's switches (views, not fields) too."""
        switches = {name: source_pipeline_dict[name] for name in PAN2_FIELDS if name in source_pipeline_dict}
        super().update_pipeline_config({k: v for k, v in source_pipeline_dict.items() if k not in switches})
        for name, value in switches.items():
            setattr(self, name, value)
        self.check_vae_options()

    def check_vae_options(self) -> None:
        """ValueError naming the first bad decoder or encoder switch (as PAN2 calls it), or a Wan VAE mode PAN2
        cannot use. Run at construction, by the parent before a request and by the decoding stage: FastVideo may set
        fields after construction."""
        fast_decode.options(self.vae_config, prefix="vae_")
        fast_encode.options(self.vae_config, prefix="vae_")
        if not getattr(self.vae_config, "use_feature_cache", True):
            raise ValueError("vae_config.use_feature_cache=False is not supported for PAN2: FastVideo 0.2.1's tiled "
                             "Wan VAE paths do not patchify/unpatchify a Wan2.2 VAE (wrong video or a crash). For "
                             "bounded decode memory use vae_decode_kernel=True with vae_decode_max_memory.")


# PAN2's switches (beyond FastVideo's Wan2.2-TI2V config), e.g. for the CLI's dotted overrides: name -> the Wan VAE
# config field it is a view of.
PAN2_SWITCHES = {f"vae_{field}": field for field in (*fast_decode.CONFIG_FIELDS, *fast_encode.CONFIG_FIELDS)}
DEPRECATED_SWITCHES = {"vae_frames_per_pass": "vae_decode_frames_per_pass"}
PAN2_FIELDS = (*PAN2_SWITCHES, *DEPRECATED_SWITCHES)


def _switch_view(name: str) -> property:
    field = PAN2_SWITCHES[DEPRECATED_SWITCHES.get(name, name)]

    def get(self):
        return getattr(self.vae_config, field)

    def set_(self, value):
        if name in DEPRECATED_SWITCHES:
            warnings.warn(f"{name} is deprecated: use {DEPRECATED_SWITCHES[name]}", DeprecationWarning, stacklevel=2)
        setattr(self.vae_config, field, value)

    return property(get, set_, doc=f"A view of vae_config.{field}.")


def _switches_at_construction(init):
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        switches = {name: kwargs.pop(name) for name in list(kwargs) if name in PAN2_FIELDS}
        self._switches_at_init = switches  # set by __post_init__, before its checks
        init(self, *args, **kwargs)

    return __init__


for _name in PAN2_FIELDS:
    setattr(PAN2PipelineConfig, _name, _switch_view(_name))
PAN2PipelineConfig.__init__ = _switches_at_construction(PAN2PipelineConfig.__init__)


def check_frame_count(num_frames) -> None:
    """PAN2 makes 4k + 1 frames (`architecture.latent_frames`); FastVideo would silently make the next smaller such
    count: say so before any work starts instead."""
    latent_frames(num_frames)


def check_videos_per_request(num_videos_per_prompt) -> None:
    """FastVideo 0.2.1's denoising stage asserts batch size 1: say so before any work starts."""
    if num_videos_per_prompt != 1:
        raise ValueError(f"PAN2 makes one video per request in FastVideo 0.2.1 (its denoising stage takes batch "
                         f"size 1); got num_videos_per_prompt={num_videos_per_prompt!r}: make one request per video "
                         f"(with different seeds)")


@dataclass
class PAN2SamplingParam(compat.symbol("SamplingParam")):
    """PAN2's sampling defaults (the same values as the ``pan2`` preset)."""

    height: int = DEFAULT_HEIGHT
    width: int = DEFAULT_WIDTH
    num_frames: int = DEFAULT_NUM_FRAMES
    fps: int = DEFAULT_FPS
    guidance_scale: float = DEFAULT_GUIDANCE_SCALE
    num_inference_steps: int = DEFAULT_NUM_INFERENCE_STEPS
    seed: int = DEFAULT_SEED
    negative_prompt: str = DEFAULT_NEGATIVE_PROMPT


PAN2_PRESET = compat.symbol("InferencePreset")(
    name=PRESET_NAME,
    version=1,
    model_family=MODEL_FAMILY,
    description="PAN2 text- and image-to-video (IFM/PAN2), 704x1248 @ 24 fps, 241 frames",
    stage_schemas=(compat.symbol("PresetStageSpec")(name="denoise", kind="denoising", description="PAN2 denoising",
                                   allowed_overrides=frozenset({"num_inference_steps", "guidance_scale"})), ),
    defaults={
        "height": DEFAULT_HEIGHT,
        "width": DEFAULT_WIDTH,
        "num_frames": DEFAULT_NUM_FRAMES,
        "fps": DEFAULT_FPS,
        "guidance_scale": DEFAULT_GUIDANCE_SCALE,
        "num_inference_steps": DEFAULT_NUM_INFERENCE_STEPS,
        "seed": DEFAULT_SEED,
    },
)
