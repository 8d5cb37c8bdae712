"""The Wan VAE's architecture as its weights determine it, decoder and encoder: each one's config, every tensor it
reads, and its input contract. One definition, imported by the reference (the oracle) and the fast decoder alike.

Two layouts. The decoder (diffusers' `WanDecoder3d`): Wan2.2's (`is_residual=True`: up blocks with a DupUp shortcut,
upsamplers that keep the width, a patchified 12-channel output) and Wan2.1's (`is_residual=False`: plain up blocks
whose upsampler halves the width, 3 output channels, no patchify). The encoder (`WanEncoder3d`): Wan2.2's (a
patchified 12-channel input, down blocks with an AvgDown3D shortcut, weights grouped per level) and Wan2.1's (RGB in,
plain blocks numbered in one flat list).

Both are read from the weights, so narrow random-weight models of the real layout work on CPU in tests.
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


def _part_state_dict(state_dict, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    if not isinstance(state_dict, dict):
        raise ValueError(f"state_dict must be a dict of tensors; got {type(state_dict).__name__}")
    keep = {k: v for k, v in state_dict.items() if isinstance(k, str) and k.startswith(prefixes)}
    for name, value in keep.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"state_dict[{name!r}] must be a tensor; got {type(value).__name__}")
    return keep


def decoder_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors the decoder reads of a whole `AutoencoderKLWan` state dict (or of one holding only them)."""
    return _part_state_dict(state_dict, ("decoder.", "post_quant_conv."))


def _require_present(sd: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in sd:
        raise ValueError(f"state_dict is missing {name!r}")
    return sd[name]


def _conv_in(sd: dict[str, torch.Tensor], part: str) -> torch.Tensor:
    """`{part}.conv_in.weight`, the tensor that says a state dict holds a Wan VAE's decoder (encoder)."""
    name = f"{part}.conv_in.weight"
    if name not in sd:
        raise ValueError(f"state_dict has no {name!r}: not a Wan VAE {part} state dict")
    if sd[name].dim() != 5:
        raise ValueError(f"state_dict[{name!r}] must be 5-D; got shape {list(sd[name].shape)}")
    return sd[name]


def _patch_size(channels: int, what: str) -> int:
    """p for the 3 x p x p channels of a patchified RGB video (`what` names them, a `{}` for the count)."""
    p = math.isqrt(channels // 3)
    if p < 1 or p * p * 3 != channels:
        raise ValueError(what.format(channels) + "; expected 3 x p x p")
    return p


def infer_config(state_dict: dict[str, torch.Tensor]) -> WanVAEConfig:
    """Read the decoder's architecture from its weights and check every weight the decoder uses (ValueError naming
    the first missing, misshapen or unexpected tensor). Either layout: Wan2.1's names its upsamplers
    `upsamplers.0`, Wan2.2's `upsampler`.
    """
    sd = decoder_state_dict(state_dict)
    top, z_dim = _conv_in(sd, "decoder").shape[:2]

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
    patch_size = _patch_size(out_channels, "decoder.conv_out has {} output channels")

    config = WanVAEConfig(z_dim, base, dim_mult, num_res_blocks, temperal_upsample, out_channels, patch_size,
                          residual)
    _check_tensors(sd, expected_shapes(config), "decoder")
    return config


def _check_tensors(sd: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], part: str) -> None:
    """ValueError naming the first tensor of `expected` missing or misshapen in `sd`, or the ones it does not use."""
    for name, shape in expected.items():
        if name not in sd:
            raise ValueError(f"state_dict is missing {name!r} (expected shape {list(shape)})")
        if tuple(sd[name].shape) != tuple(shape):
            raise ValueError(f"state_dict[{name!r}] has shape {list(sd[name].shape)}; expected {list(shape)}")
    unexpected = sorted(set(sd) - set(expected))
    if unexpected:
        raise ValueError(f"state_dict has {part} tensors this architecture does not use: {unexpected[:5]}")


def expected_shapes(c: WanVAEConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder reads, in execution order, with its shape."""
    shapes: dict[str, tuple[int, ...]] = {}
    _conv_shapes(shapes, "post_quant_conv", c.z_dim, c.z_dim, (1, 1, 1))
    dims = c.dims
    _conv_shapes(shapes, "decoder.conv_in", dims[0], c.z_dim, (3, 3, 3))
    _mid_block_shapes(shapes, "decoder.mid_block", dims[0])
    for i in range(len(c.dim_mult)):
        cin, cout, up_out = c.level_widths(i)
        for j in range(c.num_res_blocks + 1):
            _resnet_shapes(shapes, f"decoder.up_blocks.{i}.resnets.{j}", cin if j == 0 else cout, cout)
        if i != len(c.dim_mult) - 1:
            if c.temperal_upsample[i]:
                _conv_shapes(shapes, f"{c.upsampler(i)}.time_conv", cout * 2, cout, (3, 1, 1))
            _conv_shapes(shapes, f"{c.upsampler(i)}.resample.1", up_out, cout, (3, 3))
    shapes["decoder.norm_out.gamma"] = (dims[-1], 1, 1, 1)
    _conv_shapes(shapes, "decoder.conv_out", c.out_channels, dims[-1], (3, 3, 3))
    return shapes


def _conv_shapes(shapes: dict, name: str, cout: int, cin: int, kernel: tuple[int, ...]) -> None:
    shapes[f"{name}.weight"] = (cout, cin, *kernel)
    shapes[f"{name}.bias"] = (cout,)


def _resnet_shapes(shapes: dict, name: str, cin: int, cout: int) -> None:
    """A residual block's tensors (diffusers' `WanResidualBlock`); its 1x1 shortcut, where the width changes, last."""
    shapes[f"{name}.norm1.gamma"] = (cin, 1, 1, 1)
    _conv_shapes(shapes, f"{name}.conv1", cout, cin, (3, 3, 3))
    shapes[f"{name}.norm2.gamma"] = (cout, 1, 1, 1)
    _conv_shapes(shapes, f"{name}.conv2", cout, cout, (3, 3, 3))
    if cin != cout:
        _conv_shapes(shapes, f"{name}.conv_shortcut", cout, cin, (1, 1, 1))


def _mid_block_shapes(shapes: dict, name: str, dim: int) -> None:
    """The mid block (diffusers' `WanMidBlock`): resnet, single-head attention, resnet, all `dim` wide."""
    _resnet_shapes(shapes, f"{name}.resnets.0", dim, dim)
    shapes[f"{name}.attentions.0.norm.gamma"] = (dim, 1, 1)
    _conv_shapes(shapes, f"{name}.attentions.0.to_qkv", dim * 3, dim, (1, 1))
    _conv_shapes(shapes, f"{name}.attentions.0.proj", dim, dim, (1, 1))
    _resnet_shapes(shapes, f"{name}.resnets.1", dim, dim)


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


# --------------------------------------------------------------------------------------------------------------------
# The encoder (diffusers' `WanEncoder3d` and the `quant_conv` after it)
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WanEncoderConfig:
    """The encoder's shape, as far as the weights determine it (diffusers' names)."""

    z_dim: int  # latent channels; the encoder outputs 2 * z_dim moments (mean | logvar)
    base_dim: int  # 160 for Wan2.2 TI2V-5B, 96 for Wan2.1
    dim_mult: tuple[int, ...]  # (1, 2, 4, 4)
    num_res_blocks: int  # 2
    temperal_downsample: tuple[bool, ...]  # per downsampling level (all but the last): (False, True, True)
    in_channels: int  # conv_in's input channels, after patchify: 12 for Wan2.2, 3 for Wan2.1
    patch_size: int  # 2 for Wan2.2, 1 for Wan2.1
    residual: bool  # diffusers' is_residual: Wan2.2's down blocks with an AvgDown3D shortcut; False for Wan2.1

    @property
    def dims(self) -> list[int]:
        """diffusers' `dims`: conv_in's width, then each down level's output width."""
        return [self.base_dim * m for m in (1, *self.dim_mult)]

    @property
    def levels(self) -> int:
        return len(self.dim_mult)

    def level_widths(self, i: int) -> tuple[int, int]:
        """(input, output) width of down level i; its first resnet changes the width, the rest keep it."""
        return self.dims[i], self.dims[i + 1]

    def resnet(self, i: int, j: int) -> str:
        """The weight-name prefix of down level i's resnet j (Wan2.2 groups a level's blocks; Wan2.1 numbers every
        resnet and downsample in one flat list)."""
        if self.residual:
            return f"encoder.down_blocks.{i}.resnets.{j}"
        return f"encoder.down_blocks.{i * (self.num_res_blocks + 1) + j}"

    def downsampler(self, i: int) -> str:
        """The weight-name prefix of down level i's downsample (i < levels - 1): its stride-2 3x3 conv is
        `{prefix}.resample.1`, its time conv `{prefix}.time_conv`."""
        if self.residual:
            return f"encoder.down_blocks.{i}.downsampler"
        return f"encoder.down_blocks.{i * (self.num_res_blocks + 1) + self.num_res_blocks}"

    @property
    def spatial_scale(self) -> int:
        """Video pixels per latent pixel along each side (2 per downsampling level, times the patch size)."""
        return 2 ** (self.levels - 1) * self.patch_size


# The Wan2.2 TI2V-5B VAE's encoder.
WAN22_ENCODER_CONFIG = WanEncoderConfig(z_dim=48, base_dim=160, dim_mult=(1, 2, 4, 4), num_res_blocks=2,
                                        temperal_downsample=(False, True, True), in_channels=12, patch_size=2,
                                        residual=True)
# The Wan2.1 VAE's encoder (diffusers' `AutoencoderKLWan()` defaults).
WAN21_ENCODER_CONFIG = WanEncoderConfig(z_dim=16, base_dim=96, dim_mult=(1, 2, 4, 4), num_res_blocks=2,
                                        temperal_downsample=(False, True, True), in_channels=3, patch_size=1,
                                        residual=False)


def narrow_encoder(layout: WanEncoderConfig, base_dim: int, z_dim: int | None = None) -> WanEncoderConfig:
    """An encoder of `layout`'s architecture (WAN22_ENCODER_CONFIG, WAN21_ENCODER_CONFIG) at another width."""
    return dataclasses.replace(layout, base_dim=base_dim, z_dim=layout.z_dim if z_dim is None else z_dim)


def diffusers_encoder_arguments(e: WanEncoderConfig, decoder_base_dim: int | None = None) -> dict:
    """diffusers' `AutoencoderKLWan(**...)` arguments for a VAE whose encoder is `e` (its decoder `decoder_base_dim`
    wide; default: as wide as the encoder)."""
    return dict(base_dim=e.base_dim, decoder_base_dim=decoder_base_dim or e.base_dim, z_dim=e.z_dim,
                dim_mult=list(e.dim_mult), num_res_blocks=e.num_res_blocks,
                temperal_downsample=list(e.temperal_downsample), is_residual=e.residual,
                patch_size=e.patch_size if e.patch_size > 1 else None, in_channels=e.in_channels,
                out_channels=e.in_channels)


def encoder_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors the encoder reads of a whole `AutoencoderKLWan` state dict (or of one holding only them)."""
    return _part_state_dict(state_dict, ("encoder.", "quant_conv."))


def _block_index(name: str) -> int:
    index = name.split(".")[2]
    if not index.isdigit():
        raise ValueError(f"state_dict has {name!r}: encoder.down_blocks are numbered 0..N-1")
    return int(index)


def infer_encoder_config(state_dict: dict[str, torch.Tensor]) -> WanEncoderConfig:
    """Read the encoder's architecture from its weights and check every weight the encoder uses (ValueError naming
    the first missing, misshapen or unexpected tensor). Either layout: Wan2.2's groups each level's blocks
    (`down_blocks.{i}.resnets.{j}`, `down_blocks.{i}.downsampler`), Wan2.1's numbers them in one flat list.
    """
    sd = encoder_state_dict(state_dict)
    base_dim, in_channels = _conv_in(sd, "encoder").shape[:2]
    patch_size = _patch_size(in_channels, "encoder.conv_in has {} input channels")

    down = [k for k in sd if k.startswith("encoder.down_blocks.")]
    blocks = sorted({_block_index(k) for k in down})
    if not blocks or blocks != list(range(len(blocks))):
        raise ValueError(f"state_dict has encoder.down_blocks indices {blocks}; expected 0..N-1")
    residual = any(k.split(".")[3:4] == ["resnets"] for k in down)
    if residual:
        levels = len(blocks)
        num_res_blocks = len({k.split(".")[4] for k in down if k.startswith("encoder.down_blocks.0.resnets.")})
    else:
        # Each level but the last ends in a downsample (the only blocks with a `resample`).
        resamples = sorted({_block_index(k) for k in down if k.split(".")[3:4] == ["resample"]})
        levels = len(resamples) + 1
        num_res_blocks = resamples[0] if resamples else len(blocks)
    partial = WanEncoderConfig(0, base_dim, (1,) * levels, num_res_blocks, (False,) * (levels - 1), in_channels,
                               patch_size, residual)  # names only: widths and time are read below

    widths = [_require_present(sd, f"{partial.resnet(i, 0)}.conv1.weight").shape[0] for i in range(levels)]
    if any(w % base_dim for w in widths):
        raise ValueError(f"encoder widths {widths} are not multiples of conv_in's width {base_dim}")
    dim_mult = tuple(w // base_dim for w in widths)
    # A level downsamples in time iff its downsample has a time_conv.
    temperal_downsample = tuple(any(k.startswith(f"{partial.downsampler(i)}.time_conv.") for k in sd)
                                for i in range(levels - 1))
    if sum(temperal_downsample) != 2:
        raise ValueError(f"encoder downsamples in time at {sum(temperal_downsample)} level(s); the Wan VAE's 4x "
                         "temporal compression needs 2: not a Wan VAE's encoder")
    moments = _require_present(sd, "encoder.conv_out.weight").shape[0]
    if moments % 2:
        raise ValueError(f"encoder.conv_out has {moments} output channels; expected 2 x z_dim (mean and logvar)")

    config = WanEncoderConfig(moments // 2, base_dim, dim_mult, num_res_blocks, temperal_downsample, in_channels,
                              patch_size, residual)
    if residual:
        for i in range(levels):
            # AvgDown3D folds its 2x2(x2) neighbourhood into channels and averages groups of them into the output.
            cin, cout = config.level_widths(i)
            factor = (2 if i < levels - 1 else 1) ** 2 * (2 if i < levels - 1 and temperal_downsample[i] else 1)
            if cin * factor % cout:
                raise ValueError(f"encoder level {i} is {cin} -> {cout} wide: its average-pool shortcut needs "
                                 f"{cout} to divide {cin} x {factor}")
    _check_tensors(sd, expected_encoder_shapes(config), "encoder")
    return config


def expected_encoder_shapes(c: WanEncoderConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the encoder reads, in execution order, with its shape."""
    shapes: dict[str, tuple[int, ...]] = {}
    dims = c.dims
    _conv_shapes(shapes, "encoder.conv_in", dims[0], c.in_channels, (3, 3, 3))
    for i in range(c.levels):
        cin, cout = c.level_widths(i)
        for j in range(c.num_res_blocks):
            _resnet_shapes(shapes, c.resnet(i, j), cin if j == 0 else cout, cout)
        if i != c.levels - 1:
            _conv_shapes(shapes, f"{c.downsampler(i)}.resample.1", cout, cout, (3, 3))
            if c.temperal_downsample[i]:
                _conv_shapes(shapes, f"{c.downsampler(i)}.time_conv", cout, cout, (3, 1, 1))
    _mid_block_shapes(shapes, "encoder.mid_block", dims[-1])
    shapes["encoder.norm_out.gamma"] = (dims[-1], 1, 1, 1)
    _conv_shapes(shapes, "encoder.conv_out", 2 * c.z_dim, dims[-1], (3, 3, 3))
    _conv_shapes(shapes, "quant_conv", 2 * c.z_dim, 2 * c.z_dim, (1, 1, 1))
    return shapes


def encoded_shape(config: WanEncoderConfig, video_shape) -> tuple[int, int, int, int, int]:
    """[B, 2 * z_dim, 1 + (F - 1) // 4, H // s, W // s] for a video [B, 3, F, H, W]: the first frame gives one latent
    frame, every 4 after it one more (frames past the last whole 4 are not encoded); s = `config.spatial_scale`."""
    b, _, f, h, w = video_shape
    s = config.spatial_scale
    return (b, 2 * config.z_dim, 1 + (f - 1) // 4, h // s, w // s)


def check_video(x, config: WanEncoderConfig) -> None:
    """Raise a ValueError naming the problem unless `x` is a floating-point video [B, 3, F, H, W] this encoder takes:
    Wan2.2's (patchify, then an average pool halving the rows at each level) needs H and W multiples of its spatial
    scale (16); Wan2.1's needs at least that many (8: each downsample reads a 3x3 window of the padded rows)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"video must be a torch.Tensor; got {type(x).__name__}")
    if x.dim() != 5 or x.shape[1] != 3:
        raise ValueError(f"video must be [B, 3, F, H, W]; got {list(x.shape)}")
    if min(x.shape) < 1:
        raise ValueError(f"video must have every dimension >= 1; got {list(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"video must be a floating-point tensor; got {x.dtype}")
    h, w, s = x.shape[3], x.shape[4], config.spatial_scale
    if config.residual:
        if h % s or w % s:
            raise ValueError(f"video height and width must be multiples of {s} for this encoder; got {h} x {w}")
    elif h < s or w < s or h % config.patch_size or w % config.patch_size:
        rule = f"at least {s}" + (f" and multiples of {config.patch_size}" if config.patch_size > 1 else "")
        raise ValueError(f"video height and width must be {rule} for this encoder; got {h} x {w}")
