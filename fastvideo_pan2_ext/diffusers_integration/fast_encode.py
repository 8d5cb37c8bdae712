"""The fast encoder for diffusers' Wan VAE: `enable_fast_encode(target, **options)` / `disable_fast_encode(target)`
(docs/design/diffusers-integration.md, "The fast decoder and encoder in diffusers").

`target` is a diffusers `AutoencoderKLWan` or a pipeline whose `.vae` is one (`WanImageToVideoPipeline`, Wan2.1 I2V
and Wan2.2 TI2V; `WanVideoToVideoPipeline`; `WanVACEPipeline`; ...). After `enable_fast_encode`, the VAE's
`encode(x, return_dict=True)` returns what diffusers' returns, an `AutoencoderKLOutput(latent_dist=...)` or a 1-tuple,
whose `DiagonalGaussianDistribution` is diffusers' own, made from moments `vae_kernel.WanVAEEncoder` computes from the
VAE's weights in the VAE's dtype: so `.mode()`, `.mean`, `.logvar` (clamped) and `.sample(generator)` are diffusers'
arithmetic on those moments (the same draw for the same generator). The precision is diffusers': an fp32 VAE is
encoded in fp32 (TF32 where torch's own settings would use it), a bf16 one in bf16, unless `precision` says otherwise.
What stays diffusers':

- autograd: when grad is enabled and the video or the encoder's parameters require grad, diffusers' own encode runs,
  so gradients flow (`forward()` too: it calls `encode`);
- a VAE outside the fast encoder's architecture: diffusers' encode, with one warning;
- the decode: `enable_fast_encode` routes `encode` only (`enable_fast_decode` routes `decode` only).

diffusers' switches keep their meaning: `enable_slicing()` encodes the batch one element after another (the same
moments); `enable_tiling()` encodes in exact two-phase tiles of diffusers' encode tile height in latent rows
(`tile_sample_min_height` patchified rows: `route.tile_rows_of`) where diffusers would tile (the same
moments as untiled, no seams), unless the options set `tile_rows` or `max_memory`, which always apply. With `pg` (a
process group of several ranks, every rank calling the pipeline with the same video) the ranks split the rows of each
encode and every rank gets the moments (`WanVAEEncoder`'s bands), so every rank samples the same latents from the same
generator. Copies keep the switch as the decoder's do (`route.Route`).
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from diffusers.models.modeling_outputs import AutoencoderKLOutput

from fastvideo_pan2_ext.diffusers_integration import route
from fastvideo_pan2_ext.diffusers_integration.route import tile_rows_of, wan_vae_of
from fastvideo_pan2_ext.vae_kernel import options as options_mod
from fastvideo_pan2_ext.vae_kernel.encoder import WanVAEEncoder
from fastvideo_pan2_ext.vae_kernel.portable import weights

__all__ = ["enable_fast_encode", "disable_fast_encode", "is_fast_encode_enabled", "unsupported_reason"]


def _diffusers_would_tile(vae: AutoencoderKLWan, video: torch.Tensor) -> bool:
    """diffusers' own condition in `_encode`: a side of the patchified video larger than its tile's."""
    patch = vae.config.patch_size or 1
    return video.shape[-1] // patch > vae.tile_sample_min_width or video.shape[-2] // patch > \
        vae.tile_sample_min_height


class FastEncode(route.Route):
    """The VAE's `encode` by `WanVAEEncoder` (made from the VAE, it takes any change of the VAE's weights at each
    encode; its prepared weights follow the VAE's as the decoder's do: `Route.vae_moved`)."""

    method, attribute, worker_name, input_name, verb = "encode", "_pan2_fast_encode", "encoder", "video", "encoding"
    submodules = ("encoder", "quant_conv")

    @classmethod
    def architecture(cls, vae: AutoencoderKLWan):
        return weights.architecture(vae, weights.encoder_part(torch.float32))

    def make(self, vae: AutoencoderKLWan) -> WanVAEEncoder:
        options = {name: getattr(self.options, name) for name in options_mod.ENCODE_NAMES}
        return WanVAEEncoder(vae, device=vae.device, pg=self.pg, local=self.pg is None, **options)

    def smallest_input(self, encoder: WanVAEEncoder) -> tuple[int, ...]:
        side = encoder.config.spatial_scale
        return (1, 3, 1, side, side)

    def prepare(self, encoder: WanVAEEncoder, vae: AutoencoderKLWan, video: torch.Tensor) -> None:
        """The options' tiling (given the encoder when it was made) always; else diffusers' enable_tiling() as exact
        tiles of its tile height in latent rows."""
        if not self.options.tiled:
            would = vae.use_tiling and _diffusers_would_tile(vae, video)
            if would and encoder.pg is not None:
                self.warn_once("tiling", "the ranks of the process group split each encode's rows; "
                                         "vae.enable_tiling() is not applied on top of that")
                would = False
            encoder.tile_rows = tile_rows_of(vae, encode=True) if would else None

    def run(self, encoder: WanVAEEncoder, video: torch.Tensor) -> torch.Tensor:
        return encoder.encode(video)

    def output(self, vae: AutoencoderKLWan, moments: torch.Tensor, return_dict: bool):
        posterior = DiagonalGaussianDistribution(moments)
        return AutoencoderKLOutput(latent_dist=posterior) if return_dict else (posterior,)


def enable_fast_encode(target, *, pg=None, **options) -> None:
    """Encode with `target`'s Wan VAE (an AutoencoderKLWan, or a pipeline's `.vae`) by the fast encoder; `options` are
    `WanVAEEncoder`'s (`vae_kernel.options.ENCODE_OPTIONS`: frames_per_pass, tile_rows, max_memory, backend,
    precision, reuse_steady; a ValueError names a bad one), `pg` a process group whose ranks split each encode's
    rows. Calling it again replaces the options."""
    wan_vae_of(target)
    route.enable(target, FastEncode, route.check_group(options_mod.check(options, part="encode"),
                                                                          pg, "encode"), pg)


def disable_fast_encode(target) -> None:
    """Restore diffusers' own encode on `target`'s Wan VAE (nothing to do when the fast encoder is not enabled)."""
    route.disable(target, FastEncode)


def is_fast_encode_enabled(target) -> bool:
    return route.is_enabled(target, FastEncode)


unsupported_reason = FastEncode.unsupported_reason  # why the fast encoder cannot encode a VAE, or None
