"""The fast encoder inside FastVideo: every Wan VAE whose config says `encode_kernel=True` encodes through
`vae_kernel.WanVAEEncoder` (docs/design/fastvideo-integration.md, "The fast encoder in FastVideo").

FastVideo's `WanVAEConfig` gets the switch `encode_kernel: bool = False` and one field `encode_<name>` per encoder
option (`vae_kernel.options.ENCODE_OPTIONS`: encode_frames_per_pass, encode_tile_rows, encode_max_memory,
encode_backend, encode_precision, encode_reuse_steady), added by `wan_vae.add_config_fields` beside the decoder's, off
by default, set like any of its fields (Python: `pipeline_config.vae_config.encode_kernel = True`; CLI:
`--generator.pipeline.experimental.pipeline_config.vae_config.encode_kernel true`; PAN2: `vae_encode_kernel`).

FastVideo's `AutoencoderKLWan.encode(x)` is routed here when the switch is on (`wan_vae.route`): every
Wan encode FastVideo makes (image-to-video's conditioning video, TI2V's first frame, video-to-video, the
preprocessing pipelines). It returns FastVideo's own `DiagonalGaussianDistribution` of the moments, in the VAE's
dtype on its device, so `.mean`, `.mode()` and `.sample(generator)` draw as FastVideo's would. As the decode, it
splits bands of rows over the ranks of a request that FastVideo's executor handed every worker (they encode the same
first frame or clip: `compat.executor.request_group`), and runs on the calling rank alone elsewhere (preprocessing
and training ranks hold different clips). What it cannot serve (`cannot_serve`) runs FastVideo's own encode, after
one warning line per VAE and reason (the one fallback policy: `vae_kernel.fallback`).
"""

from __future__ import annotations

import logging

import torch

from fastvideo_pan2_ext.vae_kernel import options as encoder_options
from fastvideo_pan2_ext.vae_kernel.backends import check_gpu_for
from fastvideo_pan2_ext.vae_kernel.definitions.architecture import check_video, encoded_shape
from fastvideo_pan2_ext.vae_kernel.encoder import WanVAEEncoder
from fastvideo_pan2_ext.vae_kernel.errors import first_line
from fastvideo_pan2_ext.vae_kernel.fallback import Fallback
from fastvideo_pan2_ext.vae_kernel.planning import memory
from fastvideo_pan2_ext.vae_kernel.portable import weights as weights_mod
from fastvideo_pan2_ext.vae_kernel.portable.ops import TORCH_OPS

from . import compat, fast_decode

logger = logging.getLogger(__name__)

SWITCH = encoder_options.config_field("encode", "kernel")
CONFIG_FIELDS = encoder_options.config_fields("encode")  # the fields added to FastVideo's WanVAEConfig


def options(vae_config, prefix: str = "vae_config.") -> encoder_options.EncoderOptions | None:
    """`options.switched_on` for the encoder."""
    return encoder_options.switched_on(vae_config, "encode", prefix)


def config_field(option: str) -> str:
    return encoder_options.config_field("encode", option)


def _vae_precision(pipeline_config) -> str:
    return getattr(pipeline_config, "vae_precision", "fp32") or "bf16"  # FastVideo's loader: unset is bf16


def _computes_in(opts, pipeline_config) -> torch.dtype:
    """The dtype the encode computes in: `precision`, or for "auto" the VAE's (FastVideo loads it in
    `vae_precision`)."""
    bf16 = opts.precision == "bf16" or opts.precision == "auto" and _vae_precision(pipeline_config) == "bf16"
    return torch.bfloat16 if bf16 else torch.float32


def _check_options(opts, pipeline_config, prefix: str) -> None:
    """`encode_backend="cuda"` (the compiled bf16 kernels) where the encode computes in fp32 (a ValueError naming
    the fields as `prefix` + their names)."""
    if opts.backend == "cuda" and _computes_in(opts, pipeline_config) == torch.float32:
        vae_precision = _vae_precision(pipeline_config)
        raise ValueError(f"{prefix}{config_field('backend')}='cuda' runs the compiled bf16 kernels, and this encode "
                         f"computes in fp32 (vae_precision {vae_precision!r}, {prefix}{config_field('precision')} "
                         f"{opts.precision!r}): set {prefix}{config_field('precision')} to 'bf16' or "
                         f"{prefix}{config_field('backend')} to 'auto'")


def check_fastvideo_args(args) -> None:
    """At FastVideoArgs creation, in the process that starts the workers: a bad option is one error before any model
    loads, and so is `encode_backend="cuda"` (the compiled bf16 kernels) where the encode computes in fp32."""
    opts = options(getattr(args.pipeline_config, "vae_config", None))
    if opts is not None:
        _check_options(opts, args.pipeline_config, "vae_config.")


def check_runs_here(pipeline_config, vae: torch.nn.Module | None, video_shape, prefix: str = "vae_config.") -> None:
    """Before any model loads, on the machine that will encode (the command line): ValueError, naming each field as
    `prefix` + its name, when the switched-on encoder's options cannot encode a video of `video_shape` here: backend
    'cuda' where torch sees no GPU or where the encode computes in fp32, or a max_memory below what the encode needs
    in one-row tiles, planned from `vae` (the checkpoint's VAE on the meta device, `fast_decode.meta_vae`; None: not
    planned)."""
    opts = options(pipeline_config.vae_config, prefix)
    if opts is None:
        return
    check_gpu_for(opts.backend, prefix + config_field("backend"))
    _check_options(opts, pipeline_config, prefix)
    if opts.max_memory is None or vae is None:
        return
    device, dtype = fast_decode.planning_device(), _computes_in(opts, pipeline_config)
    config, prepared = weights_mod.meta_prepared(vae, device, TORCH_OPS.cpu_compute_layout,
                                                 weights_mod.encoder_part(dtype))
    s = config.spatial_scale
    planner = memory.EncoderPlanner(prepared, config, device, dtype, (video_shape[3] % s, video_shape[4] % s),
                                    opts.reuse_steady)
    try:
        memory.choose_plan(planner, encoded_shape(config, tuple(video_shape)), opts.frames_per_pass, None, False,
                           memory.parse_bytes(opts.max_memory))
    except ValueError as exc:
        raise ValueError(f"{prefix}{config_field('max_memory')}={opts.max_memory!r} cannot encode this request on "
                         f"{device.type}: {first_line(exc)}") from None


# --------------------------------------------------------------------------------------------------- what it serves


_PART = weights_mod.encoder_part(torch.float32)  # the encoder's tensors (read here, not prepared)


def _encoder_layer(vae):
    layer = vae.quant_conv
    return getattr(layer, "base_layer", layer)  # PEFT's wrapper


def vae_device(vae) -> torch.device:
    """Where the VAE's encoder weights are now."""
    return _encoder_layer(vae).weight.device


def _weights_refused(why) -> tuple[str, str]:
    """The reason and line for weights the fast encoder cannot take (`why`: what is wrong with them)."""
    return "weights", f"the fast encoder cannot take this VAE's encoder weights ({why})"


def cannot_serve(vae, x) -> tuple[str, str] | None:
    """(kind, why) when the fast encoder cannot serve `vae.encode(x)`, which FastVideo's own encode then runs; None
    when it can. Read at every encode: a VAE's mode, weights and place change between calls."""
    if not getattr(vae, "use_feature_cache", True):
        return "feature_cache", ("vae_config.use_feature_cache is False (FastVideo's tiled encode paths, which the "
                                 "fast encoder does not compute)")
    if not isinstance(x, torch.Tensor):
        return "input", f"the input is a {type(x).__name__}, not a video tensor"
    try:  # the architecture and every tensor's shape; the encoder checks the values as it takes them (`encode`)
        config = weights_mod.architecture(vae, _PART)
    except ValueError as exc:
        return _weights_refused(exc)
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in vae.encoder.parameters())):
        return "autograd", ("autograd is recording through this encode (grad enabled and the video or the encoder's "
                            "parameters require grad), so gradients flow through FastVideo's; for the fast encoder "
                            "run it under torch.no_grad()")
    if (getattr(vae.config, "patch_size", None) or 1) != config.patch_size:
        return "weights", (f"the VAE's config says patch_size {vae.config.patch_size!r} but its encoder takes "
                           f"{config.in_channels} channels (3 x p x p with p = {config.patch_size})")
    where = vae_device(vae)
    if where.type == "meta":
        return _weights_refused("they are on the meta device: not loaded, e.g. offloaded layer by layer")
    if x.device != where:
        return "device", f"the video is on {x.device} and the VAE's encoder weights on {where}"
    try:
        check_video(x, config)
    except ValueError as exc:
        return "video", str(exc)
    return None


# The one fallback policy (vae_kernel.fallback): one warning line per VAE and reason, the encoder's weights off the
# device while FastVideo's encode runs.
_fallback = Fallback("fast VAE encoder", "encoding", "FastVideo's own encode", logger.warning)


# --------------------------------------------------------------------------------------------------- encoding


_encoders = fast_decode.Workers()  # VAE module -> (key, WanVAEEncoder)


def vae_moved(vae) -> None:
    """`Workers.vae_moved` of the encoders (`wan_vae.after_moves`): the encoder follows the VAE as the decoder
    does."""
    _encoders.vae_moved(vae)


def encoder_for(vae, device: torch.device) -> WanVAEEncoder:
    """The fast encoder of FastVideo's Wan VAE module `vae` on `device`, made once per VAE, device, options and rank
    group (`fast_decode.decoder_for`'s rule: inside a request on several ranks, bands of rows split over them). Its
    weights are prepared from the module's own and follow them (the encoder reads and compares them at every
    encode); they leave the device when the module does (`Workers.vae_moved`), and are prepared again at the next
    encode there."""
    opts = options(vae.config) or encoder_options.EncoderOptions()
    group = fast_decode.ranks_of(opts)

    def make() -> WanVAEEncoder:
        encoder = WanVAEEncoder(vae, device=device, pg=group, local=group is None, **encoder_options.as_kwargs(opts))
        logger.info("fast VAE encoder: precision %s (%s), frames_per_pass %s, tile_rows %s, max_memory %s, "
                    "reuse_steady %s, %s on %s", opts.precision, encoder.dtype, opts.frames_per_pass,
                    opts.tile_rows, opts.max_memory, opts.reuse_steady,
                    fast_decode.ranks_described(group), device)
        return encoder

    return _encoders.get_or_make(vae, (str(device), opts, id(group)), make)


def encode(vae, x, fastvideo_encode):
    """What `AutoencoderKLWan.encode(x)` returns (FastVideo's `DiagonalGaussianDistribution` of the moments), from
    the fast encoder; FastVideo's own encode (`fastvideo_encode(vae, x)`) where it cannot serve the call."""
    reason = cannot_serve(vae, x)
    if reason is not None:
        _fallback(vae, *reason, _encoders.worker(vae))
        return fastvideo_encode(vae, x)
    try:  # the encoder reads the weights' values once per encode, as it takes any change, before it computes
        encoder = encoder_for(vae, x.device)
        moments = encoder.encode(x)
    except weights_mod.WeightValuesError as exc:
        _fallback(vae, *_weights_refused(exc), _encoders.worker(vae))
        return fastvideo_encode(vae, x)
    plan = encoder.last_plan
    logger.debug("fast VAE encoder: video %s: %d latent frame(s) per pass, %s", list(x.shape), plan.frames_per_pass,
                 "untiled" if plan.tile_rows is None else f"in tiles of {plan.tile_rows} latent rows")
    return compat.symbol("DiagonalGaussianDistribution")(moments)
