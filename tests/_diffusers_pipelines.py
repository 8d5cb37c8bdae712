"""Real diffusers Wan pipelines built from tiny seeded random-weight components, for CPU tests of the fast decoder
(`fastvideo_pan2_ext.diffusers_integration.fast_decode`). No tokenizer or text encoder: the calls pass `prompt_embeds`.

Layouts: "wan2.1" (WanPipeline, Wan2.1 VAE: 16 latent channels, 8x), "wan2.2-ti2v" (WanPipeline with
`expand_timesteps=True`, the Wan2.2 VAE: residual, patch size 2, 16x), "i2v" (WanImageToVideoPipeline without an image
encoder, as Wan2.2's I2V runs it), "v2v" (WanVideoToVideoPipeline). The pipelines that encode (`ENCODE_LAYOUTS`):
"i2v", "ti2v-image" (WanImageToVideoPipeline with `expand_timesteps=True` and the Wan2.2 VAE: the TI2V-5B model given
an image, whose first latent frame is the image's), "v2v", "vace" (WanVACEPipeline: a video, a mask and a reference
image). Widths are narrow and odd where diffusers' own tests make them so (VAE base_dim 3, dim_mult [1, 1, 1, 1]).
"""

from __future__ import annotations

import torch
from _vae_helpers import randomize_parameters_
from PIL import Image

TEXT_DIM = 32
LAYOUTS = ("wan2.1", "wan2.2-ti2v", "i2v", "v2v")
ENCODE_LAYOUTS = ("i2v", "ti2v-image", "v2v", "vace")


def tiny_vae(layout: str, seed: int = 0):
    from diffusers import AutoencoderKLWan

    if layout in ("wan2.2-ti2v", "ti2v-image"):
        vae = AutoencoderKLWan(base_dim=3, z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
                               latents_mean=[0.0] * 48, latents_std=[1.0] * 48, dim_mult=[1, 1, 1, 1],
                               num_res_blocks=1, scale_factor_spatial=16, scale_factor_temporal=4,
                               temperal_downsample=[False, True, True])
    else:
        vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True])
    return randomize_parameters_(vae, seed).eval()


def _transformer(in_channels: int, out_channels: int, seed: int):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                 in_channels=in_channels, out_channels=out_channels, text_dim=TEXT_DIM, freq_dim=256,
                                 ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                 rope_max_seq_len=32).eval()


def tiny_pipeline(layout: str, seed: int = 0):
    """The pipeline of `layout` (see the module docstring), every weight seeded."""
    from diffusers import (FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler, WanImageToVideoPipeline,
                           WanPipeline, WanVACEPipeline, WanVACETransformer3DModel, WanVideoToVideoPipeline)

    vae = tiny_vae(layout, seed)
    z = vae.config.z_dim
    common = dict(vae=vae, tokenizer=None, text_encoder=None)
    if layout == "wan2.1":
        return WanPipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                           transformer=_transformer(z, z, seed), **common)
    if layout == "wan2.2-ti2v":
        return WanPipeline(scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                             flow_shift=3.0),
                           transformer=_transformer(z, z, seed), expand_timesteps=True, **common)
    if layout == "i2v":  # noise, the 4 mask channels and the condition latents in; no image encoder
        return WanImageToVideoPipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
                                       transformer=_transformer(2 * z + 4, z, seed), image_encoder=None,
                                       image_processor=None, **common)
    if layout == "ti2v-image":  # the condition replaces the first latent frame: no extra input channels
        return WanImageToVideoPipeline(scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction",
                                                                         use_flow_sigmas=True, flow_shift=3.0),
                                       transformer=_transformer(z, z, seed), image_encoder=None, image_processor=None,
                                       expand_timesteps=True, **common)
    if layout == "vace":  # diffusers' own test model: control in 2 z + 8 x 8 mask channels, at layers 0 and 2
        torch.manual_seed(seed)
        transformer = WanVACETransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=z, out_channels=z,
            text_dim=TEXT_DIM, freq_dim=256, ffn_dim=32, num_layers=3, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=32, vace_layers=[0, 2], vace_in_channels=2 * z + 64)
        return WanVACEPipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), transformer=transformer.eval(),
                               **common)
    if layout == "v2v":
        return WanVideoToVideoPipeline(scheduler=UniPCMultistepScheduler(flow_shift=3.0),
                                       transformer=_transformer(z, z, seed), **common)
    raise ValueError(f"layout must be one of {LAYOUTS + ENCODE_LAYOUTS}; got {layout!r}")


def call_kwargs(layout: str, height: int = 64, width: int = 48, num_frames: int = 9, output_type: str = "pt",
                seed: int = 0) -> dict:
    """The keyword arguments of one seeded pipeline call (prompt embeddings instead of a prompt)."""
    embeds = torch.randn(1, 8, TEXT_DIM, generator=torch.Generator().manual_seed(seed + 1))
    kwargs = dict(prompt_embeds=embeds, height=height, width=width, num_inference_steps=2, guidance_scale=1.0,
                  output_type=output_type, generator=torch.Generator().manual_seed(seed))
    pixels = torch.Generator().manual_seed(seed + 2)

    def image(mode="RGB"):
        if mode == "L":  # a mask: half the pixels generated, half kept
            return Image.fromarray(((torch.rand(height, width, generator=pixels) > 0.5) * 255).byte().numpy())
        return Image.fromarray((torch.rand(height, width, 3, generator=pixels) * 255).byte().numpy())

    if layout == "v2v":
        kwargs["video"] = [image() for _ in range(num_frames)]
        kwargs["strength"] = 0.8
    else:
        kwargs["num_frames"] = num_frames
    if layout in ("i2v", "ti2v-image"):
        kwargs["image"] = image()
    if layout == "vace":
        kwargs["video"] = [image() for _ in range(num_frames)]
        kwargs["mask"] = [image("L") for _ in range(num_frames)]
        kwargs["reference_images"] = [image()]
    return kwargs
