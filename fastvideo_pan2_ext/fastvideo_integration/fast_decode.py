"""The fast decoder inside FastVideo: every Wan VAE whose config says `decode_kernel=True` decodes through
`vae_kernel.WanVAEDecoder` (docs/design/fastvideo-integration.md, "The fast decoder in FastVideo").

FastVideo's `WanVAEConfig` gets the switch `decode_kernel: bool = False` (decode with the fast decoder) and one field
`decode_<name>` per decoder option (`vae_kernel.options.OPTIONS`: decode_frames_per_pass, decode_tile_rows,
decode_max_memory, decode_backend, decode_conv_algorithm), added by `wan_vae.add_config_fields` in every process that
loads this plugin, off by default, set like any of its fields (Python: `pipeline_config.vae_config.decode_kernel =
True`; CLI: `--generator.pipeline.experimental.pipeline_config.vae_config.decode_kernel true`).

FastVideo's `AutoencoderKLWan.decode(z)` (z de-normalized, as FastVideo's decoding stage hands it over) is routed here
when the switch is on (`wan_vae.route`); everything else about the pipeline is FastVideo's. When the
request runs on several ranks (FastVideo runs every stage on every rank, with the same latents), the ranks decode row
bands of one video together (exact halos) and rank 0's video is the request's; the others hand FastVideo a
placeholder of the same shape, whose values are never used (FastVideo returns rank 0's output). What it cannot serve
(`cannot_serve`) runs FastVideo's own decode, after one warning line per VAE and reason (the one fallback policy:
`vae_kernel.fallback`).
"""

from __future__ import annotations

import json
import logging
import os
import weakref

import torch

from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder
from fastvideo_pan2_ext.vae_kernel import options as decoder_options
from fastvideo_pan2_ext.vae_kernel.backends import check_gpu_for, select_ops
from fastvideo_pan2_ext.vae_kernel.definitions.architecture import latent_frames, video_shape
from fastvideo_pan2_ext.vae_kernel.errors import first_line
from fastvideo_pan2_ext.vae_kernel.fallback import Fallback
from fastvideo_pan2_ext.vae_kernel.planning import memory
from fastvideo_pan2_ext.vae_kernel.portable import weights as weights_mod
from fastvideo_pan2_ext.vae_kernel.portable.winograd import winograd_conv

from . import compat

logger = logging.getLogger(__name__)

SWITCH = decoder_options.config_field("decode", "kernel")
CONFIG_FIELDS = decoder_options.config_fields("decode")  # the fields added to FastVideo's WanVAEConfig


def options(vae_config, prefix: str = "vae_config.") -> decoder_options.DecoderOptions | None:
    """`options.switched_on` for the decoder, which refuses a light VAE."""
    opts = decoder_options.switched_on(vae_config, "decode", prefix)
    if opts is not None and getattr(vae_config, "use_light_vae", False):
        raise ValueError(f"{prefix}{SWITCH}=True cannot decode a light VAE (vae_config.use_light_vae=True, a pruned "
                         "Wan VAE the fast decoder does not implement); turn one of them off")
    return opts


# --------------------------------------------------------------------------------------------------- layouts


def unsupported_layout(vae_json: dict) -> str | None:
    """Why a checkpoint's vae/config.json is a VAE the fast decoder cannot decode, or None when it can: the Wan2.2
    layout (residual, patch size 2) and the Wan2.1 layout (plain, no patchify)."""
    if vae_json.get("_class_name", "AutoencoderKLWan") != "AutoencoderKLWan":
        return f"its VAE is {vae_json.get('_class_name')!r}, not a Wan VAE (AutoencoderKLWan)"
    residual, patch = vae_json.get("is_residual", False), vae_json.get("patch_size")
    if (residual, patch) not in ((True, 2), (False, None), (False, 1)):
        return f"its Wan VAE layout (is_residual {residual!r}, patch_size {patch!r}) is neither Wan2.2's nor Wan2.1's"
    return None


def check_fastvideo_args(args) -> None:
    """At FastVideoArgs creation, in the process that starts the workers: bad options, or a local checkpoint whose
    VAE the fast decoder cannot decode, are one clear error before any model loads."""
    vae_config = getattr(args.pipeline_config, "vae_config", None)
    if options(vae_config) is None:
        return
    vae_json_path = os.path.join(str(args.model_path), "vae", "config.json")
    if os.path.isfile(vae_json_path):  # a hub id is checked when its weights load (WanVAEDecoder)
        with open(vae_json_path, encoding="utf-8") as f:
            reason = unsupported_layout(json.load(f))
        if reason:
            raise ValueError(f"vae_config.decode_kernel=True cannot decode {args.model_path!r}: {reason}")


def meta_vae(model_path) -> torch.nn.Module | None:
    """diffusers' AutoencoderKLWan of a local checkpoint's vae/config.json on the meta device (its layers' shapes, no
    weights: what a plan reads, before any model loads); None for a hub id or a folder without one."""
    vae_json_path = os.path.join(str(model_path), "vae", "config.json")
    if not os.path.isfile(vae_json_path):
        return None
    from diffusers import AutoencoderKLWan

    with open(vae_json_path, encoding="utf-8") as f:
        vae_json = json.load(f)
    with torch.device("meta"):
        return AutoencoderKLWan.from_config(vae_json)


def planning_device() -> torch.device:
    """Where this machine's workers will decode (encode): a GPU where torch sees one."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check_runs_here(vae_config, vae: torch.nn.Module | None, shape, prefix: str = "vae_config.") -> None:
    """Before any model loads, on the machine that will decode (the command line): ValueError, naming the field as
    `prefix` + its name, when the switched-on decoder's options cannot decode a video of `shape` ([B, 3, F, H, W])
    here: backend 'cuda' where torch sees no GPU, or a max_memory below what decoding its latents needs in
    one-row tiles, planned from `vae` (the checkpoint's VAE on the meta device, `meta_vae`; None: not planned) for
    the decode streamed or not, whichever the request takes."""
    opts = options(vae_config, prefix)
    if opts is None:
        return
    check_gpu_for(opts.backend, prefix + config_field("backend"))
    if opts.max_memory is None or vae is None:
        return
    device = planning_device()
    config, prepared = weights_mod.meta_prepared(vae, device)
    portable = select_ops("torch", device, opts.conv_algorithm)  # the worker's Winograd layers, nothing built
    planner = memory.MemoryPlanner(prepared, config, device, winograd_conv(portable))
    budget = memory.parse_bytes(opts.max_memory)
    b, _, frames, height, width = shape
    s = config.spatial_scale
    latents = (b, config.z_dim, latent_frames(frames), height // s, width // s)
    for stream in (True, False):
        try:
            memory.choose_plan(planner, latents, opts.frames_per_pass, None, stream, budget)
            return
        except ValueError as exc:
            error = exc
    raise ValueError(f"{prefix}{config_field('max_memory')}={opts.max_memory!r} cannot decode this request on "
                     f"{device.type}: {first_line(error)}")


def config_field(option: str) -> str:
    return decoder_options.config_field("decode", option)


# --------------------------------------------------------------------------------------------------- decoding


class Workers(weakref.WeakKeyDictionary):
    """The fast workers of FastVideo's Wan VAE modules, one per VAE (VAE module -> (key, worker): `WanVAEDecoder`
    here, `WanVAEEncoder` in `fast_encode`), each following its VAE the same way."""

    def get_or_make(self, vae, key, make):
        """The worker held for `vae` under `key`, else `make()`'s, held from then on (the old one and its prepared
        weights go before the new one is made)."""
        cached = self.get(vae)
        if cached is None or cached[0] != key:
            self.pop(vae, None)
            cached = self[vae] = (key, make())
        return cached[1]

    def worker(self, vae):
        """The worker held for `vae`, or None."""
        cached = self.get(vae)
        return None if cached is None else cached[1]

    def vae_moved(self, vae) -> None:
        """After FastVideo's Wan VAE `vae` moved (`.to()`; `wan_vae.after_moves`): its worker's prepared
        weights leave a device the VAE left (`Worker.follow_vae`: FastVideo's `vae_cpu_offload`, its encoding stages
        moving the VAE to the CPU after an encode); the worker stays and prepares them again at its next call."""
        worker = self.worker(vae)
        if worker is not None:
            worker.follow_vae()


_decoders = Workers()  # VAE module -> (key, WanVAEDecoder)


def vae_moved(vae) -> None:
    """`Workers.vae_moved` of the decoders (`wan_vae.after_moves`)."""
    _decoders.vae_moved(vae)


def ranks_of(opts):
    """The process group a worker with options `opts` splits its rows over (`WanVAEDecoder`'s and `WanVAEEncoder`'s
    `pg`), None for this rank alone: exact tiles are a single-rank decode (encode), and only the ranks of a request
    hold the same input (`compat.executor.request_group`)."""
    return None if opts.tiled else compat.executor.request_group()


def ranks_described(group) -> str:
    """How a worker made for `group` (`ranks_of`) runs, as its log line says it."""
    return "one rank" if group is None else "rows split over the ranks"


def decoder_for(vae, device: torch.device) -> WanVAEDecoder:
    """The fast decoder of FastVideo's Wan VAE module `vae` on `device`, made once per VAE, device, options and rank
    group: inside a request on several ranks they split the rows (`compat.executor.request_group`), elsewhere (exact
    tiles; a training loop's call) this rank decodes alone. Its weights are prepared from the module's own and follow
    them: every decode first takes any change of the module's weights (`WanVAEDecoder.sync_weights`), and they leave
    the device when the module does (`Workers.vae_moved`)."""
    opts = options(vae.config) or decoder_options.DecoderOptions()
    group = ranks_of(opts)

    def make() -> WanVAEDecoder:
        decoder = WanVAEDecoder(vae, device=device, pg=group, local=group is None, **decoder_options.as_kwargs(opts))
        logger.info("fast VAE decoder: backend %s, frames_per_pass %s, tile_rows %s, max_memory %s, %s on %s",
                    decoder.backend, opts.frames_per_pass, opts.tile_rows, opts.max_memory,
                    ranks_described(group), device)
        return decoder

    return _decoders.get_or_make(vae, (str(device), opts, id(group)), make)


def _log_plan(decoder: WanVAEDecoder, z: torch.Tensor) -> None:
    plan = decoder.last_plan
    logger.info("fast VAE decoder: latents %s: %d latent frame(s) per pass, %s", list(z.shape), plan.frames_per_pass,
                "untiled" if plan.tile_rows is None else f"in tiles of {plan.tile_rows} latent rows")


# The one fallback policy (vae_kernel.fallback): one warning line per VAE and reason, the decoder's weights off the
# device while FastVideo's decode runs.
_fallback = Fallback("fast VAE decoder", "decoding", "FastVideo's own decode", logger.warning)


def _weights_refused(why) -> tuple[str, str]:
    return "weights", f"the fast decoder cannot take this VAE's decoder weights ({why})"


def cannot_serve(vae, z) -> tuple[str, str] | None:
    """(kind, why) when the fast decoder cannot serve `vae.decode(z)`, which FastVideo's own decode then runs; None
    when it can. Read at every decode (the same on every rank: the VAE and the latents' shape are)."""
    if not isinstance(z, torch.Tensor):
        return "input", f"the latents are a {type(z).__name__}, not a tensor"
    try:  # the architecture and every tensor's shape; the values are checked as the decoder takes them (`decode`)
        weights_mod.architecture(vae)
    except ValueError as exc:
        return _weights_refused(exc)
    layer = getattr(vae.post_quant_conv, "base_layer", vae.post_quant_conv)  # PEFT's wrapper
    if layer.weight.device.type == "meta":
        return _weights_refused("they are on the meta device: not loaded, e.g. offloaded layer by layer")
    return None


@torch.no_grad()
def decode(vae, z: torch.Tensor, fastvideo_decode) -> torch.Tensor:
    """What `AutoencoderKLWan.decode(z)` returns, from the fast decoder: fp32 video in [-1, 1] (bf16 arithmetic with
    fp32 statistics inside; FastVideo's autocast does not reach it); FastVideo's own decode (`fastvideo_decode(vae,
    z)`) where it cannot serve the call."""
    reason = cannot_serve(vae, z)
    if reason is not None:
        _fallback(vae, *reason, _decoders.worker(vae))
        return fastvideo_decode(vae, z)
    try:  # the decoder reads the weights' values as it takes any change, before it computes
        decoder = decoder_for(vae, z.device)
        video = decoder.decode(z)
    except weights_mod.WeightValuesError as exc:
        _fallback(vae, *_weights_refused(exc), _decoders.worker(vae))
        return fastvideo_decode(vae, z)
    _log_plan(decoder, z)
    if video is None:  # a rank other than 0: FastVideo returns rank 0's video, so values here are never used
        return torch.zeros((), device=z.device).expand(video_shape(decoder.config, z.shape))
    return video.float()


def iter_decode(vae, z: torch.Tensor):
    """`WanVAEDecoder.decode_iter` of the fast decoder of `vae` (chunks on rank 0, None elsewhere)."""
    decoder = decoder_for(vae, z.device)
    chunks = decoder.decode_iter(z)
    _log_plan(decoder, z)
    return chunks
