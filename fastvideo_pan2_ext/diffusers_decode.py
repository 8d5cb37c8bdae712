"""The fast decoder for diffusers' Wan VAE: `enable_fast_decode(target, **options)` / `disable_fast_decode(target)`
(docs/design.md, "The fast decoder in diffusers").

`target` is a diffusers `AutoencoderKLWan` or a pipeline whose `.vae` is one (`WanPipeline`,
`WanImageToVideoPipeline`, `WanVideoToVideoPipeline`, ...). After `enable_fast_decode`, the VAE's `decode(z,
return_dict=True)` returns what diffusers' returns (a `DecoderOutput`, or a 1-tuple), cast to the VAE's dtype,
computed by `vae_kernel.WanVAEDecoder` from the VAE's own weights: in bf16 products with fp32 accumulation on GPUs
and AMX-BF16 CPUs, in fp32 on other CPUs, whatever the VAE's dtype (an fp32 VAE does not get an fp32 decode; the
difference from one is within the allowance, docs/design.md, "Definitions"). What stays diffusers':

- autograd: when grad is enabled and the latents or the decoder's parameters require grad (a training step), the call
  runs diffusers' own decode, so gradients flow (`forward()` too: it calls `decode`);
- a VAE outside the fast decoder's architecture (`unsupported_reason`): diffusers' decode, with one warning.

diffusers' switches keep their meaning: `enable_slicing()` decodes the batch one element after another;
`enable_tiling()` decodes in exact tiles of `tile_sample_min_height // spatial_compression_ratio` latent rows (the
whole width: the same video as untiled, no seams), unless the options set `tile_rows` or `max_memory`, which always
apply. With `pg` (a process group of several ranks, every rank calling the pipeline with the same latents) the ranks
split the rows of each decode and every rank gets the video (a broadcast from the group's rank 0), so diffusers'
post-processing and a script that saves on every rank see the same video as on one GPU.

A copy of the VAE (`copy.deepcopy`, `torch.save`/`torch.load`) keeps the fast decoder with its options and builds its
own decoder from its own weights; a pickled one decodes on one rank (docs/diffusers.md,
"Inference mode, copies and saved VAEs").
"""

from __future__ import annotations

import functools
import warnings
import weakref

import torch
import torch.distributed as dist
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.vae import DecoderOutput

from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder
from fastvideo_pan2_ext.vae_kernel.definitions.architecture import infer_config
from fastvideo_pan2_ext.vae_kernel.distributed.bands import comm_device
from fastvideo_pan2_ext.vae_kernel.portable.weights import state_dict_of
from fastvideo_pan2_ext.vae_kernel import options as decoder_options
from fastvideo_pan2_ext.vae_kernel.portable import passes
from fastvideo_pan2_ext.vae_kernel.portable.ops import Ops

__all__ = ["enable_fast_decode", "disable_fast_decode", "is_fast_decode_enabled", "unsupported_reason"]

_STATE = "_pan2_fast_decode"  # the VAE's instance attribute holding its _FastDecode
def check_options(options: dict, pg=None) -> decoder_options.DecoderOptions:
    """The options, checked by the decoder's own rules (`vae_kernel.options`), and `pg`: a group of several ranks
    never tiles (ValueError naming the first bad one)."""
    checked = decoder_options.check(options)
    if pg is not None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("pg was given but torch.distributed is not initialized (call init_process_group first)")
        if not isinstance(pg, dist.ProcessGroup):
            raise ValueError(f"pg must be a torch.distributed process group or None; got {type(pg).__name__}")
        ranks = dist.get_world_size(pg)
        if ranks > 1 and checked.tiled:
            raise ValueError("tile_rows / max_memory tile a decode on one rank; with a process group of "
                             f"{ranks} ranks the ranks split the rows instead: pass one or the other")
    return checked


def wan_vae_of(target) -> AutoencoderKLWan:
    """The diffusers AutoencoderKLWan that `target` is or holds as `.vae` (ValueError otherwise)."""
    vae = target if isinstance(target, AutoencoderKLWan) else getattr(target, "vae", None)
    if not isinstance(vae, AutoencoderKLWan):
        what = type(target).__name__ if vae is None else f"{type(target).__name__} whose .vae is {type(vae).__name__}"
        raise ValueError("target must be a diffusers AutoencoderKLWan or a pipeline whose .vae is one; got " + what)
    return vae


def unsupported_reason(vae: AutoencoderKLWan) -> str | None:
    """Why the fast decoder cannot decode this VAE (diffusers then decodes it), or None when it can."""
    try:
        config = infer_config(state_dict_of(vae))
    except ValueError as exc:
        return str(exc)
    patch_size = vae.config.patch_size or 1
    if config.patch_size != patch_size:
        return (f"its decoder's conv_out has {config.out_channels} channels but its config says patch_size "
                f"{vae.config.patch_size!r} (the fast decoder unpatchifies 3 x p x p channels)")
    return None


def _decoder_parameters(vae: AutoencoderKLWan) -> list[torch.nn.Parameter]:
    return [*vae.post_quant_conv.parameters(), *vae.decoder.parameters()]


def _offloaded_layer_by_layer(vae: AutoencoderKLWan) -> bool:
    """accelerate's sequential offload (`enable_sequential_cpu_offload`): the weights wait on the meta device and
    each layer's are loaded just for its forward."""
    return any(p.device.type == "meta" for p in _decoder_parameters(vae))


class _FastDecode:
    """One VAE's fast decode: its options, its decoder (made from the VAE on first use, on the VAE's device; its
    prepared weights follow the VAE's: `WanVAEDecoder.sync_weights`, `follow_vae`), and the warnings it has
    given."""

    def __init__(self, options: decoder_options.DecoderOptions, pg, pipeline=None) -> None:
        self.options, self.pg = options, pg
        # The pipeline it was enabled on (weakly: the pipeline holds the VAE): its progress_bar shows the decode's.
        self.pipeline = weakref.ref(pipeline) if pipeline is not None else lambda: None
        self._decoder: WanVAEDecoder | None = None
        self._warned: set[str] = set()

    def __deepcopy__(self, memo) -> _FastDecode:
        """A copied VAE's: the same options and process group; its decoder is built from the copy's weights."""
        return _FastDecode(self.options, self.pg)

    def __reduce__(self):
        """Pickled (torch.save) as its options: the loaded VAE builds its decoder from its own weights, on one rank
        (a process group belongs to the job that made it)."""
        backend = self.options.backend
        if isinstance(backend, Ops):
            raise TypeError(f"cannot pickle a VAE whose fast decoder runs a given op table (the {backend.name!r} Ops, "
                            "functions of this process): enable it with backend 'auto', 'cuda' or 'torch' to save it")
        return _FastDecode, (self.options, None)

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=4)

    def decoder(self, vae: AutoencoderKLWan) -> WanVAEDecoder | None:
        """The decoder of `vae`, or None (after one warning) when diffusers decodes it: outside the architecture, or
        offloaded layer by layer."""
        if _offloaded_layer_by_layer(vae):
            self.warn_once("sequential", "enable_fast_decode: this AutoencoderKLWan is offloaded layer by layer "
                                         "(enable_sequential_cpu_offload), so its weights are never on the GPU at "
                                         "once; decoding with diffusers' decode")
            self._decoder = None  # diffusers decodes: nothing of ours stays on the device
            return None
        reason = unsupported_reason(vae)
        if reason is not None:
            self.warn_once("unsupported", f"enable_fast_decode: this AutoencoderKLWan is outside the fast "
                                          f"decoder's architecture ({reason}); decoding with diffusers' decode")
            self._decoder = None
            return None
        if self._decoder is None or self._decoder.device != vae.device:
            opts = self.options
            self._decoder = WanVAEDecoder(vae, device=vae.device, pg=self.pg, local=self.pg is None,
                                          frames_per_pass=opts.frames_per_pass, backend=opts.backend,
                                          conv_algorithm=opts.conv_algorithm)
        return self._decoder

    def vae_moved(self) -> None:
        if self._decoder is not None:
            self._decoder.follow_vae()


def _autograd_records(vae: AutoencoderKLWan, z) -> bool:
    if not torch.is_grad_enabled():
        return False
    return (isinstance(z, torch.Tensor) and z.requires_grad) or any(p.requires_grad for p in _decoder_parameters(vae))


def _set_tiling(decoder: WanVAEDecoder, vae: AutoencoderKLWan, options: decoder_options.DecoderOptions,
                z: torch.Tensor, state: _FastDecode) -> None:
    """The options' tiling, else diffusers' enable_tiling() as exact tiles of its tile height in latent rows."""
    if options.tile_rows is not None:
        decoder.enable_tiling(options.tile_rows)
    elif options.max_memory is not None:
        decoder.set_max_memory(options.max_memory)
    elif vae.use_tiling and _diffusers_would_tile(vae, z):
        if decoder.pg is not None:
            state.warn_once("tiling", "enable_fast_decode: the ranks of the process group split each decode's rows; "
                                      "vae.enable_tiling() is not applied on top of that")
            return
        decoder.enable_tiling(tile_rows_of(vae))
    else:
        decoder.disable_tiling()


def tile_rows_of(vae: AutoencoderKLWan) -> int:
    """diffusers' tile height in latent rows (its `tile_latent_min_height`), at least 1."""
    return max(1, vae.tile_sample_min_height // vae.spatial_compression_ratio)


def _diffusers_would_tile(vae: AutoencoderKLWan, z: torch.Tensor) -> bool:
    """diffusers' own condition in `_decode`: a latent side larger than its tile's."""
    ratio = vae.spatial_compression_ratio
    return z.shape[-1] > vae.tile_sample_min_width // ratio or z.shape[-2] > vae.tile_sample_min_height // ratio


def _decode_video(decoder: WanVAEDecoder, z: torch.Tensor) -> torch.Tensor:
    """The bf16 video on every rank: rank 0's decode, broadcast over the group when there are several ranks."""
    video = decoder.decode(z)
    if decoder.pg is None:
        return video
    where = comm_device(decoder.pg, z.device)
    buffer = video.to(where) if video is not None else \
        torch.empty(decoder.output_shape(z), dtype=torch.bfloat16, device=where)
    dist.broadcast(buffer, src=dist.get_global_rank(decoder.pg, 0), group=decoder.pg)
    return buffer.to(z.device)


def _progress_bars_of(pipeline):
    """The pipeline's own progress bars (diffusers' `progress_bar`, honouring `set_progress_bar_config`), or None."""
    if not callable(getattr(pipeline, "progress_bar", None)):
        return None

    def bar(total: int):
        progress = pipeline.progress_bar(total=total)
        if not getattr(progress, "desc", ""):  # a disabled tqdm has none
            progress.set_description("VAE decode", refresh=False)
        return progress

    return bar


def _decode(vae: AutoencoderKLWan, z: torch.Tensor, return_dict: bool = True):
    """The VAE's `decode` while the fast decoder is enabled (the signature and return types of diffusers')."""
    state: _FastDecode = vae.__dict__[_STATE]
    if _autograd_records(vae, z):
        state.warn_once("autograd", "enable_fast_decode: autograd is recording through this decode (grad enabled "
                                    "and the latents or the VAE's parameters require grad): decoding with "
                                    "diffusers' decode so gradients flow; for the fast decoder run it under "
                                    "torch.no_grad() or call vae.requires_grad_(False)")
        return type(vae).decode(vae, z, return_dict=return_dict)
    hook = getattr(vae, "_hf_hook", None)  # diffusers' apply_forward_hook: an offloaded VAE moves to its device
    if hook is not None and hasattr(hook, "pre_forward"):
        hook.pre_forward(vae)
    decoder = state.decoder(vae)
    if decoder is None:
        return type(vae).decode(vae, z, return_dict=return_dict)
    _set_tiling(decoder, vae, state.options, z, state)
    bars = passes.progress_bars.set(_progress_bars_of(state.pipeline()))
    try:
        if vae.use_slicing and z.shape[0] > 1:
            video = torch.cat([_decode_video(decoder, one) for one in z.split(1)])
        else:
            video = _decode_video(decoder, z)
    finally:
        passes.progress_bars.reset(bars)
    video = video.to(vae.dtype)
    return DecoderOutput(sample=video) if return_dict else (video,)


def _check_budget(decoder: WanVAEDecoder | None, max_memory) -> None:
    """ValueError when `max_memory` cannot decode even the smallest latents (one frame, one latent pixel)."""
    if decoder is None:
        return
    decoder.set_max_memory(max_memory)
    try:
        decoder.plan((1, decoder.config.z_dim, 1, 1, 1))
    except ValueError as exc:
        raise ValueError(f"max_memory={max_memory!r} is below what any decode needs: {exc}") from None


def _apply(vae: AutoencoderKLWan, *args, **kwargs):
    """The VAE's `_apply` (what `.to()`, `.cpu()`, `.cuda()`, casts and accelerate's offload hooks run) while the
    fast decoder is enabled: diffusers', then the decoder's prepared weights leave a device the VAE left."""
    result = type(vae)._apply(vae, *args, **kwargs)
    state = vae.__dict__.get(_STATE)
    if state is not None:
        state.vae_moved()
    return result


def enable_fast_decode(target, *, pg=None, **options) -> None:
    """Decode `target`'s Wan VAE (an AutoencoderKLWan, or a pipeline's `.vae`) with the fast decoder; `options` are
    `WanVAEDecoder`'s (`vae_kernel.options.OPTIONS`: frames_per_pass, tile_rows, max_memory, backend,
    conv_algorithm; a ValueError names a bad one), `pg` a process group whose ranks split each decode's rows. Calling
    it again replaces the options."""
    vae = wan_vae_of(target)
    checked = check_options(options, pg)
    # Refused now, not after the denoise. A VAE on the CPU may still decode on a GPU (moved there later, or by
    # model offload's hook): what is known now is whether there is a GPU, and the budget where it decodes already.
    if checked.backend == "cuda" and not torch.cuda.is_available():
        raise ValueError("backend='cuda' runs the compiled kernels on a GPU, but torch sees none here "
                         "(torch.cuda.is_available() is False): pass backend='auto' or 'torch'")
    state = _FastDecode(checked, pg, None if target is vae else target)
    if checked.max_memory is not None and (vae.device.type == "cuda" or not torch.cuda.is_available()):
        _check_budget(state.decoder(vae), checked.max_memory)  # else the decode checks it before any work
    vae.__dict__[_STATE] = state
    # An instance attribute (deleting it restores diffusers'); a partial, not a bound method, so that a copy or a
    # pickled VAE gets it bound to itself (a bound method pickles by its name, which is diffusers' private `_decode`).
    vae.__dict__["decode"] = functools.partial(_decode, vae)
    vae.__dict__["_apply"] = functools.partial(_apply, vae)


def disable_fast_decode(target) -> None:
    """Restore diffusers' own decode on `target`'s Wan VAE (nothing to do when the fast decoder is not enabled)."""
    vae = wan_vae_of(target)
    vae.__dict__.pop(_STATE, None)
    vae.__dict__.pop("decode", None)
    vae.__dict__.pop("_apply", None)


def is_fast_decode_enabled(target) -> bool:
    return _STATE in wan_vae_of(target).__dict__
