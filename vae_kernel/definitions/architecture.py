"""The Wan VAE decoder's architecture as its weights determine it: the config, every tensor it reads, and the input
contract. One definition, imported by the reference decoder (the oracle) and the fast decoder alike.

Two layouts (diffusers' `WanDecoder3d`): Wan2.2's (`is_residual=True`: up blocks with a DupUp shortcut, upsamplers
that keep the width, a patchified 12-channel output) and Wan2.1's (`is_residual=False`: plain up blocks whose
upsampler halves the width, 3 output channels, no patchify).

The decoder is read from the weights, so narrow random-weight models of the real layout work on CPU in tests.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WanVAEConfig:
    """The decoder's shape, as far as the weights determine it (diffusers' names)."""

    z_dim: int  # latent channels (48 for Wan2.2, 16 for Wan2.1)
    decoder_base_dim: int  # 256 for Wan2.2, 96 for Wan2.1
    dim_mult: tuple[int, ...]  # (1, 2, 4, 4)
    num_res_blocks: int  # 2
    temperal_upsample: tuple[bool, ...]  # (True, True, False): per upsampling level, in the decoder's order
    out_channels: int  # channels before unpatchify (12 = 3 x 2 x 2; 3 for Wan2.1)
    patch_size: int  # 2 for Wan2.2, 1 for Wan2.1
    residual: bool = True  # diffusers' is_residual: True for Wan2.2, False for Wan2.1

    @property
    def dims(self) -> list[int]:
        """diffusers' `dims`: conv_in's width, then each up block's resnets' width."""
        return [self.decoder_base_dim * m for m in (self.dim_mult[-1], *self.dim_mult[::-1])]

    def level_widths(self, i: int) -> tuple[int, int, int]:
        """(input, resnets, output) widths of up block i. Wan2.1's upsamplers halve the width (diffusers' default
        `upsample_out_dim`), so each later block reads half its predecessor's resnet width; the last block has no
        upsampler."""
        cin, cout = self.dims[i], self.dims[i + 1]
        if self.residual:
            return cin, cout, cout
        return (cin if i == 0 else cin // 2), cout, (cout if i == len(self.dim_mult) - 1 else cout // 2)

    def upsampler(self, i: int) -> str:
        """The weight-name prefix of up block i's upsampler."""
        return upsampler_name(i, self.residual)

    @property
    def spatial_scale(self) -> int:
        """Video pixels per latent pixel along each side (2 per upsampling level, times the patch size)."""
        return 2 ** (len(self.dim_mult) - 1) * self.patch_size


# The Wan2.2 TI2V-5B VAE's decoder (PAN2's).
WAN22_CONFIG = WanVAEConfig(z_dim=48, decoder_base_dim=256, dim_mult=(1, 2, 4, 4), num_res_blocks=2,
                            temperal_upsample=(True, True, False), out_channels=12, patch_size=2)
# The Wan2.1 VAE's decoder (diffusers' `AutoencoderKLWan()` defaults): 8x spatial, 4x temporal, plain RGB out.
WAN21_CONFIG = WanVAEConfig(z_dim=16, decoder_base_dim=96, dim_mult=(1, 2, 4, 4), num_res_blocks=2,
                            temperal_upsample=(True, True, False), out_channels=3, patch_size=1, residual=False)


def narrow(layout: "WanVAEConfig", decoder_base_dim: int, z_dim: int | None = None) -> "WanVAEConfig":
    """A decoder of `layout`'s architecture (WAN22_CONFIG, WAN21_CONFIG) at another width: what tests, CPU rehearsals
    and benchmarks decode where the real widths would take too long."""
    return dataclasses.replace(layout, decoder_base_dim=decoder_base_dim, z_dim=layout.z_dim if z_dim is None else z_dim)


def diffusers_arguments(c: WanVAEConfig, encoder_base_dim: int | None = None) -> dict:
    """diffusers' `AutoencoderKLWan(**...)` arguments for a VAE whose decoder is `c` (its encoder `encoder_base_dim`
    wide; default: as wide as the decoder)."""
    return dict(base_dim=encoder_base_dim or c.decoder_base_dim, decoder_base_dim=c.decoder_base_dim, z_dim=c.z_dim,
                dim_mult=list(c.dim_mult), num_res_blocks=c.num_res_blocks,
                temperal_downsample=list(reversed(c.temperal_upsample)), is_residual=c.residual,
                patch_size=c.patch_size if c.patch_size > 1 else None, in_channels=c.out_channels,
                out_channels=c.out_channels)


def upsampler_name(i: int, residual: bool) -> str:
    """Up block i's upsampler as diffusers names it: `upsampler` (Wan2.2) or `upsamplers.0` (Wan2.1)."""
    return f"decoder.up_blocks.{i}." + ("upsampler" if residual else "upsamplers.0")


def video_frames(latent_frames: int) -> int:
    """Video frames decoded from `latent_frames`: the first latent frame gives one, every later one four."""
    return 4 * latent_frames - 3


def latent_frames(video_frames: int) -> int:
    """The latent frames that decode to `video_frames` (ValueError unless it is 4k + 1, naming the nearest two)."""
    if isinstance(video_frames, bool) or not isinstance(video_frames, int) or video_frames < 1 or \
            video_frames % 4 != 1:
        hint = ""
        if isinstance(video_frames, int) and not isinstance(video_frames, bool) and video_frames > 1:
            below = video_frames - (video_frames - 1) % 4
            hint = f": ask for {below} or {below + 4}"
        raise ValueError(f"num_frames must be 4k + 1 (1, 5, 9, ..., 121, ...: one frame from the first latent frame, "
                         f"four from each later one); got {video_frames!r}{hint}")
    return (video_frames - 1) // 4 + 1


def video_shape(config: WanVAEConfig, latents_shape) -> tuple[int, int, int, int, int]:
    """[B, 3, 4T - 3, s*h, s*w] for latents [B, z_dim, T, h, w] (s = `config.spatial_scale`)."""
    b, _, t, h, w = latents_shape
    s = config.spatial_scale
    return (b, 3, video_frames(t), s * h, s * w)


def decoder_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors the decoder reads of a whole `AutoencoderKLWan` state dict (or of one holding only them)."""
    if not isinstance(state_dict, dict):
        raise ValueError(f"state_dict must be a dict of tensors; got {type(state_dict).__name__}")
    keep = {k: v for k, v in state_dict.items() if k.startswith(("decoder.", "post_quant_conv."))}
    for name, value in keep.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"state_dict[{name!r}] must be a tensor; got {type(value).__name__}")
    return keep


def _require_present(sd: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in sd:
        raise ValueError(f"state_dict is missing {name!r}")
    return sd[name]


def infer_config(state_dict: dict[str, torch.Tensor]) -> WanVAEConfig:
    """Read the decoder's architecture from its weights and check every weight the decoder uses (ValueError naming
    the first missing, misshapen or unexpected tensor). Either layout: Wan2.1's names its upsamplers
    `upsamplers.0`, Wan2.2's `upsampler`.
    """
    sd = decoder_state_dict(state_dict)
    if "decoder.conv_in.weight" not in sd:
        raise ValueError("state_dict has no 'decoder.conv_in.weight': not a Wan VAE decoder state dict")
    conv_in = sd["decoder.conv_in.weight"]
    if conv_in.dim() != 5:
        raise ValueError(f"state_dict['decoder.conv_in.weight'] must be 5-D; got shape {list(conv_in.shape)}")
    top, z_dim = conv_in.shape[0], conv_in.shape[1]

    residual = not any(".upsamplers." in k for k in sd)
    levels = sorted({int(k.split(".")[2]) for k in sd if k.startswith("decoder.up_blocks.")})
    if not levels or levels != list(range(len(levels))):
        raise ValueError(f"state_dict has decoder.up_blocks indices {levels}; expected 0..N-1")
    num_res_blocks = len({int(k.split(".")[4]) for k in sd if k.startswith("decoder.up_blocks.0.resnets.")}) - 1

    for i in levels:
        _require_present(sd, f"decoder.up_blocks.{i}.resnets.0.conv1.weight")
    outs = [sd[f"decoder.up_blocks.{i}.resnets.0.conv1.weight"].shape[0] for i in levels]
    base = outs[-1]
    if any(o % base for o in [top, *outs]):
        raise ValueError(f"decoder widths {[top, *outs]} are not multiples of the last level's width {base}")
    dim_mult = tuple(o // base for o in reversed(outs))
    if top != base * dim_mult[-1]:
        raise ValueError(f"decoder.conv_in has {top} output channels; expected {base * dim_mult[-1]}")
    # One entry per upsampling level (all but the last); a level upsamples in time iff it has a time_conv.
    temperal_upsample = tuple(any(k.startswith(f"{upsampler_name(i, residual)}.time_conv.") for k in sd)
                              for i in levels[:-1])
    if sum(temperal_upsample) != 2:
        raise ValueError(f"decoder upsamples in time at {sum(temperal_upsample)} level(s); the Wan VAE's 4x "
                         "temporal compression needs 2: not a Wan VAE's decoder")

    out_channels = _require_present(sd, "decoder.conv_out.weight").shape[0]
    patch_size = math.isqrt(out_channels // 3)
    if patch_size * patch_size * 3 != out_channels:
        raise ValueError(f"decoder.conv_out has {out_channels} output channels; expected 3 x p x p")

    config = WanVAEConfig(z_dim, base, dim_mult, num_res_blocks, temperal_upsample, out_channels, patch_size,
                          residual)
    expected = expected_shapes(config)
    for name, shape in expected.items():
        if name not in sd:
            raise ValueError(f"state_dict is missing {name!r} (expected shape {list(shape)})")
        if tuple(sd[name].shape) != tuple(shape):
            raise ValueError(f"state_dict[{name!r}] has shape {list(sd[name].shape)}; expected {list(shape)}")
    unexpected = sorted(set(sd) - set(expected))
    if unexpected:
        raise ValueError(f"state_dict has decoder tensors this architecture does not use: {unexpected[:5]}")
    return config


def expected_shapes(c: WanVAEConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder reads, in execution order, with its shape."""
    shapes: dict[str, tuple[int, ...]] = {
        "post_quant_conv.weight": (c.z_dim, c.z_dim, 1, 1, 1),
        "post_quant_conv.bias": (c.z_dim,),
    }

    def conv(name, cout, cin, k):
        shapes[f"{name}.weight"] = (cout, cin, *k)
        shapes[f"{name}.bias"] = (cout,)

    def resnet(name, cin, cout):
        shapes[f"{name}.norm1.gamma"] = (cin, 1, 1, 1)
        conv(f"{name}.conv1", cout, cin, (3, 3, 3))
        shapes[f"{name}.norm2.gamma"] = (cout, 1, 1, 1)
        conv(f"{name}.conv2", cout, cout, (3, 3, 3))
        if cin != cout:
            conv(f"{name}.conv_shortcut", cout, cin, (1, 1, 1))

    dims = c.dims
    conv("decoder.conv_in", dims[0], c.z_dim, (3, 3, 3))
    resnet("decoder.mid_block.resnets.0", dims[0], dims[0])
    shapes["decoder.mid_block.attentions.0.norm.gamma"] = (dims[0], 1, 1)
    conv("decoder.mid_block.attentions.0.to_qkv", dims[0] * 3, dims[0], (1, 1))
    conv("decoder.mid_block.attentions.0.proj", dims[0], dims[0], (1, 1))
    resnet("decoder.mid_block.resnets.1", dims[0], dims[0])
    for i in range(len(c.dim_mult)):
        cin, cout, up_out = c.level_widths(i)
        for j in range(c.num_res_blocks + 1):
            resnet(f"decoder.up_blocks.{i}.resnets.{j}", cin if j == 0 else cout, cout)
        if i != len(c.dim_mult) - 1:
            if c.temperal_upsample[i]:
                conv(f"{c.upsampler(i)}.time_conv", cout * 2, cout, (3, 1, 1))
            conv(f"{c.upsampler(i)}.resample.1", up_out, cout, (3, 3))
    shapes["decoder.norm_out.gamma"] = (dims[-1], 1, 1, 1)
    conv("decoder.conv_out", c.out_channels, dims[-1], (3, 3, 3))
    return shapes


def check_latents(z, z_dim: int) -> None:
    """Raise a ValueError naming the problem if `z` is not a [B, z_dim, T, h, w] latent clip."""
    if not isinstance(z, torch.Tensor):
        raise ValueError(f"latents must be a torch.Tensor; got {type(z).__name__}")
    if z.dim() != 5 or z.shape[1] != z_dim:
        raise ValueError(f"latents must be [B, {z_dim}, T, H, W]; got {list(z.shape)}")
    if min(z.shape) < 1:
        raise ValueError(f"latents must have every dimension >= 1; got {list(z.shape)}")
    if not z.is_floating_point():
        raise ValueError(f"latents must be a floating-point tensor; got {z.dtype}")
