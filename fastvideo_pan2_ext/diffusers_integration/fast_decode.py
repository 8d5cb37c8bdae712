"""The fast decoder for diffusers' Wan VAE: `enable_fast_decode(target, **options)` / `disable_fast_decode(target)`
(docs/design/diffusers-integration.md, "The fast decoder and encoder in diffusers").

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

import torch
import torch.distributed as dist
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.vae import DecoderOutput

from fastvideo_pan2_ext.diffusers_integration import route
from fastvideo_pan2_ext.diffusers_integration.route import tile_rows_of, wan_vae_of
from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder
from fastvideo_pan2_ext.vae_kernel import options as decoder_options
from fastvideo_pan2_ext.vae_kernel.distributed.bands import comm_device
from fastvideo_pan2_ext.vae_kernel.portable import weights

__all__ = ["enable_fast_decode", "disable_fast_decode", "is_fast_decode_enabled", "unsupported_reason"]


def _diffusers_would_tile(vae: AutoencoderKLWan, z: torch.Tensor) -> bool:
    """diffusers' own condition in `_decode`: a latent side larger than its tile's."""
    ratio = vae.spatial_compression_ratio
    return z.shape[-1] > vae.tile_sample_min_width // ratio or z.shape[-2] > vae.tile_sample_min_height // ratio


class FastDecode(route.Route):
    """The VAE's `decode` by `WanVAEDecoder` (its prepared weights follow the VAE's: `Route.vae_moved`)."""

    method, attribute, worker_name, input_name, verb = "decode", "_pan2_fast_decode", "decoder", "latents", "decoding"
    submodules = ("post_quant_conv", "decoder")

    @classmethod
    def architecture(cls, vae: AutoencoderKLWan):
        return weights.architecture(vae)

    def make(self, vae: AutoencoderKLWan) -> WanVAEDecoder:
        opts = self.options
        return WanVAEDecoder(vae, device=vae.device, pg=self.pg, local=self.pg is None,
                             frames_per_pass=opts.frames_per_pass, backend=opts.backend,
                             conv_algorithm=opts.conv_algorithm, tile_rows=opts.tile_rows, max_memory=opts.max_memory)

    def smallest_input(self, decoder: WanVAEDecoder) -> tuple[int, ...]:
        return (1, decoder.config.z_dim, 1, 1, 1)

    def prepare(self, decoder: WanVAEDecoder, vae: AutoencoderKLWan, z: torch.Tensor) -> None:
        """The options' tiling (set when the decoder was made) always; else diffusers' enable_tiling() as exact
        tiles of its tile height in latent rows."""
        if self.options.tiled:
            return
        if vae.use_tiling and _diffusers_would_tile(vae, z):
            if decoder.pg is not None:
                self.warn_once("tiling", "the ranks of the process group split each decode's rows; "
                                         "vae.enable_tiling() is not applied on top of that")
                return
            decoder.enable_tiling(tile_rows_of(vae))
        else:
            decoder.disable_tiling()

    def run(self, decoder: WanVAEDecoder, z: torch.Tensor) -> torch.Tensor:
        """The bf16 video on every rank: rank 0's decode, broadcast over the group when there are several ranks."""
        video = decoder.decode(z)
        if decoder.pg is None:
            return video
        where = comm_device(decoder.pg, z.device)
        buffer = video.to(where) if video is not None else \
            torch.empty(decoder.output_shape(z), dtype=torch.bfloat16, device=where)
        dist.broadcast(buffer, src=dist.get_global_rank(decoder.pg, 0), group=decoder.pg)
        return buffer.to(z.device)

    def output(self, vae: AutoencoderKLWan, video: torch.Tensor, return_dict: bool):
        video = video.to(vae.dtype)
        return DecoderOutput(sample=video) if return_dict else (video,)


def enable_fast_decode(target, *, pg=None, **options) -> None:
    """Decode `target`'s Wan VAE (an AutoencoderKLWan, or a pipeline's `.vae`) with the fast decoder; `options` are
    `WanVAEDecoder`'s (`vae_kernel.options.OPTIONS`: frames_per_pass, tile_rows, max_memory, backend,
    conv_algorithm; a ValueError names a bad one), `pg` a process group whose ranks split each decode's rows. Calling
    it again replaces the options."""
    wan_vae_of(target)
    route.enable(target, FastDecode, route.check_group(decoder_options.check(options), pg,
                                                                          "decode"), pg)


def disable_fast_decode(target) -> None:
    """Restore diffusers' own decode on `target`'s Wan VAE (nothing to do when the fast decoder is not enabled)."""
    route.disable(target, FastDecode)


def is_fast_decode_enabled(target) -> bool:
    return route.is_enabled(target, FastDecode)


unsupported_reason = FastDecode.unsupported_reason  # why the fast decoder cannot decode a VAE, or None
