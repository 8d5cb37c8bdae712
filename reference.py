"""The definition of PAN2's results: the reference Wan VAE decoder and encoder, and the reference first-frame reading.

`decode` is the plain-PyTorch Wan VAE decoder, in the Wan2.2 layout (PAN2's) and the Wan2.1 layout alike. It
replays, op for op and in the same order, what diffusers' `AutoencoderKLWan.decode(z).sample` computes, so the two are
bit-identical (`torch.equal`) for the same weights, in fp32 and in bf16, at the same thread count. It is written for
reading against the math, not for speed: the fast decoders in `fastvideo_pan2_ext.vae_kernel` are checked against it.

`encode` is the encoder likewise: diffusers' `AutoencoderKLWan.encode(x).latent_dist.parameters` (the moments, mean
then log-variance, unclamped), bit-identical in fp32 and bf16, both layouts, built from the decoder's own causal
convs, norms, residual blocks and attention.

`load_first_frame` is Wan2.2's own image-to-video preprocessing of the first frame (docs/design.md, "Definitions").

Besides torch, Pillow and numpy it imports only what defines the decoder's and encoder's shapes and inputs
(`vae_kernel.definitions.architecture`) and what fp32 means (`vae_kernel.definitions.precision`): nothing of the
fast decoder itself.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from fastvideo_pan2_ext.vae_kernel.definitions.architecture import (WanEncoderConfig, WanVAEConfig, check_latents,
                                                                  check_video, decoder_state_dict,
                                                                  encoder_state_dict, infer_config,
                                                                  infer_encoder_config)
from fastvideo_pan2_ext.vae_kernel.definitions.precision import exact_fp32

# Frames of history a causal 3x3x3 conv needs (its time kernel is 3, padded 2 before, 0 after).
CACHE_T = 2

DTYPES = (torch.float32, torch.bfloat16)


# --------------------------------------------------------------------------------------------------------------------
# The decoder, one small function per diffusers module
# --------------------------------------------------------------------------------------------------------------------


class _CausalCache:
    """The frames of history each causal conv keeps between latent frames, keyed by the conv's weight name."""

    def __init__(self) -> None:
        self.frames: dict[str, torch.Tensor | str] = {}

    def remember(self, name: str, x: torch.Tensor) -> None:
        # The last CACHE_T frames of this conv's input; a 1-frame input is topped up with the previous last frame.
        cache_x = x[:, :, -CACHE_T:].clone()
        previous = self.frames.get(name)
        if cache_x.shape[2] < 2 and isinstance(previous, torch.Tensor):
            cache_x = torch.cat([previous[:, :, -1].unsqueeze(2), cache_x], dim=2)
        self.frames[name] = cache_x


def _causal_conv3d(x, w, b, cache: torch.Tensor | None = None) -> torch.Tensor:
    """Conv3d with 'same' spatial padding and causal time padding (kt - 1 frames before, from `cache` or zeros)."""
    kt, kh, kw = w.shape[2:]
    pad_t = kt - 1
    if cache is not None and pad_t > 0:
        x = torch.cat([cache, x], dim=2)
        pad_t -= cache.shape[2]
    x = F.pad(x, (kw // 2, kw // 2, kh // 2, kh // 2, pad_t, 0))
    return F.conv3d(x, w, b)


def _cached_conv(p, name, x, cache: _CausalCache) -> torch.Tensor:
    previous = cache.frames.get(name)
    cache.remember(name, x)
    return _causal_conv3d(x, p[f"{name}.weight"], p[f"{name}.bias"], previous)


def _rms_norm(x, gamma, dim=1) -> torch.Tensor:
    # diffusers normalizes low-precision inputs in fp32, then rounds back before scaling.
    upcast = x.dtype in (torch.float16, torch.bfloat16)
    normalized = F.normalize(x.float() if upcast else x, dim=dim).to(x.dtype)
    return normalized * (gamma.shape[0] ** 0.5) * gamma + 0.0  # + diffusers' zero bias (turns -0.0 into 0.0)


def _residual_block(p, name, x, cache: _CausalCache) -> torch.Tensor:
    if f"{name}.conv_shortcut.weight" in p:
        h = _causal_conv3d(x, p[f"{name}.conv_shortcut.weight"], p[f"{name}.conv_shortcut.bias"])
    else:
        h = x
    x = F.silu(_rms_norm(x, p[f"{name}.norm1.gamma"]))
    x = _cached_conv(p, f"{name}.conv1", x, cache)
    x = F.silu(_rms_norm(x, p[f"{name}.norm2.gamma"]))
    x = _cached_conv(p, f"{name}.conv2", x, cache)
    return x + h


def _attention_block(p, name, x) -> torch.Tensor:
    """Single-head self-attention over each frame's pixels."""
    identity = x
    b, c, t, h, w = x.shape
    x = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
    x = _rms_norm(x, p[f"{name}.norm.gamma"])
    qkv = F.conv2d(x, p[f"{name}.to_qkv.weight"], p[f"{name}.to_qkv.bias"])
    qkv = qkv.reshape(b * t, 1, c * 3, -1).permute(0, 1, 3, 2).contiguous()
    q, k, v = qkv.chunk(3, dim=-1)
    x = F.scaled_dot_product_attention(q, k, v)
    x = x.squeeze(1).permute(0, 2, 1).reshape(b * t, c, h, w)
    x = F.conv2d(x, p[f"{name}.proj.weight"], p[f"{name}.proj.bias"])
    x = x.view(b, t, c, h, w).permute(0, 2, 1, 3, 4)
    return x + identity


def _upsample(p, name, x, cache: _CausalCache, temporal: bool) -> torch.Tensor:
    """x2 in space (nearest + 3x3 conv), and x2 in time through a causal (3,1,1) conv giving two frames per frame."""
    b, c, t, h, w = x.shape
    if temporal:
        time_conv = f"{name}.time_conv"
        previous = cache.frames.get(time_conv)
        if previous is None:
            # The first latent frame passes through unchanged: it becomes one video frame, not two.
            cache.frames[time_conv] = "first"
        else:
            cache_x = x[:, :, -CACHE_T:].clone()
            if cache_x.shape[2] < 2:
                head = torch.zeros_like(cache_x) if previous == "first" else previous[:, :, -1].unsqueeze(2)
                cache_x = torch.cat([head, cache_x], dim=2)
            w_t, b_t = p[f"{time_conv}.weight"], p[f"{time_conv}.bias"]
            x = _causal_conv3d(x, w_t, b_t, None if previous == "first" else previous)
            cache.frames[time_conv] = cache_x
            x = x.reshape(b, 2, c, t, h, w)
            x = torch.stack((x[:, 0], x[:, 1]), 3).reshape(b, c, t * 2, h, w)
    t = x.shape[2]
    x = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
    x = F.interpolate(x.float(), scale_factor=(2.0, 2.0), mode="nearest-exact").type_as(x)
    x = F.conv2d(x, p[f"{name}.resample.1.weight"], p[f"{name}.resample.1.bias"], padding=1)
    return x.view(b, t, x.size(1), x.size(2), x.size(3)).permute(0, 2, 1, 3, 4)


def _dup_up(x, out_channels: int, factor_t: int, factor_s: int, first_chunk: bool) -> torch.Tensor:
    """The up block's parameter-free shortcut: repeat channels, then fold them into time and space."""
    in_channels = x.shape[1]
    repeats = out_channels * factor_t * factor_s * factor_s // in_channels
    x = x.repeat_interleave(repeats, dim=1)
    b, _, t, h, w = x.shape
    x = x.view(b, out_channels, factor_t, factor_s, factor_s, t, h, w)
    x = x.permute(0, 1, 5, 2, 6, 3, 7, 4).contiguous()
    x = x.view(b, out_channels, t * factor_t, h * factor_s, w * factor_s)
    return x[:, :, factor_t - 1 :] if first_chunk else x


def _up_block(p, c: WanVAEConfig, i: int, x, cache: _CausalCache, first_chunk: bool) -> torch.Tensor:
    """diffusers' `WanResidualUpBlock` (Wan2.2: + the DupUp shortcut) or `WanUpBlock` (Wan2.1: none)."""
    up = i != len(c.dim_mult) - 1
    temporal = up and c.temperal_upsample[i]
    x_copy = x
    for j in range(c.num_res_blocks + 1):
        x = _residual_block(p, f"decoder.up_blocks.{i}.resnets.{j}", x, cache)
    if up:
        x = _upsample(p, c.upsampler(i), x, cache, temporal)
        if c.residual:
            x = x + _dup_up(x_copy, c.level_widths(i)[2], 2 if temporal else 1, 2, first_chunk)
    return x


def _decode_frame(p, c: WanVAEConfig, x, cache: _CausalCache, first_chunk: bool) -> torch.Tensor:
    """One latent frame through the decoder: 1 video frame for the first, 4 for every later one (before unpatchify)."""
    x = _cached_conv(p, "decoder.conv_in", x, cache)
    x = _residual_block(p, "decoder.mid_block.resnets.0", x, cache)
    x = _attention_block(p, "decoder.mid_block.attentions.0", x)
    x = _residual_block(p, "decoder.mid_block.resnets.1", x, cache)
    for i in range(len(c.dim_mult)):
        x = _up_block(p, c, i, x, cache, first_chunk)
    x = F.silu(_rms_norm(x, p["decoder.norm_out.gamma"]))
    return _cached_conv(p, "decoder.conv_out", x, cache)


def _unpatchify(x, patch_size: int) -> torch.Tensor:
    if patch_size == 1:
        return x
    b, cp, t, h, w = x.shape
    c = cp // (patch_size * patch_size)
    x = x.view(b, c, patch_size, patch_size, t, h, w).permute(0, 1, 4, 5, 3, 6, 2).contiguous()
    return x.view(b, c, t, h * patch_size, w * patch_size)


@torch.no_grad()
def decode(z: torch.Tensor, state_dict: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode latents `z` [B, z_dim, T, h, w] (already de-normalized) into a video [B, 3, 4T-3, s*h, s*w] in [-1, 1]
    (s = 16 for Wan2.2, 8 for Wan2.1).

    Bit-identical to `AutoencoderKLWan(...).to(dtype).decode(z.to(dtype)).sample` for the same weights.
    Runs on `z.device`; the weights are cast to `dtype` and moved there.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {[str(d) for d in DTYPES]}; got {dtype}")
    config = infer_config(state_dict)
    check_latents(z, config.z_dim)
    p = {k: v.to(device=z.device, dtype=dtype) for k, v in decoder_state_dict(state_dict).items()}
    z = z.to(dtype)
    with exact_fp32():
        x = _causal_conv3d(z, p["post_quant_conv.weight"], p["post_quant_conv.bias"])
        cache = _CausalCache()
        frames = [_decode_frame(p, config, x[:, :, i : i + 1], cache, first_chunk=i == 0) for i in range(x.shape[2])]
    out = torch.cat(frames, dim=2)
    return torch.clamp(_unpatchify(out, config.patch_size), min=-1.0, max=1.0)


# --------------------------------------------------------------------------------------------------------------------
# The encoder, one small function per diffusers module (the causal convs, norms, resnets and attention are the
# decoder's)
# --------------------------------------------------------------------------------------------------------------------


def _patchify(x, patch_size: int) -> torch.Tensor:
    """[B, 3, F, H, W] -> [B, 3 p p, F, H / p, W / p]: channel c * p * p + dx * p + dy."""
    if patch_size == 1:
        return x
    b, c, f, h, w = x.shape
    x = x.view(b, c, f, h // patch_size, patch_size, w // patch_size, patch_size)
    x = x.permute(0, 1, 6, 4, 2, 3, 5).contiguous()
    return x.view(b, c * patch_size * patch_size, f, h // patch_size, w // patch_size)


def _downsample(p, name, x, cache: _CausalCache, temporal: bool) -> torch.Tensor:
    """/2 in space (a zero row and column after the last, then a 3x3 stride-2 conv, frame by frame), and /2 in time
    through a (3,1,1) stride-2 conv over [the previous pass's last frame, this pass's frames]."""
    b, c, t, h, w = x.shape
    x = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
    x = F.conv2d(F.pad(x, (0, 1, 0, 1)), p[f"{name}.resample.1.weight"], p[f"{name}.resample.1.bias"], stride=2)
    x = x.view(b, t, x.size(1), x.size(2), x.size(3)).permute(0, 2, 1, 3, 4)
    if temporal:
        time_conv = f"{name}.time_conv"
        previous = cache.frames.get(time_conv)
        if previous is None:
            # The first frame passes through: it alone becomes the first latent frame. It is kept as history.
            cache.frames[time_conv] = x.clone()
        else:
            cache.frames[time_conv] = x[:, :, -1:].clone()
            x = torch.cat([previous[:, :, -1:], x], 2)
            x = F.conv3d(x, p[f"{time_conv}.weight"], p[f"{time_conv}.bias"], stride=(2, 1, 1))
    return x


def _avg_down(x, out_channels: int, factor_t: int, factor_s: int) -> torch.Tensor:
    """The down block's parameter-free shortcut (AvgDown3D): zero frames in front up to a multiple of `factor_t`,
    each factor_t x factor_s x factor_s neighbourhood folded into channels, then groups of channels averaged."""
    pad_t = (factor_t - x.shape[2] % factor_t) % factor_t
    x = F.pad(x, (0, 0, 0, 0, pad_t, 0))
    b, c, t, h, w = x.shape
    factor = factor_t * factor_s * factor_s
    x = x.view(b, c, t // factor_t, factor_t, h // factor_s, factor_s, w // factor_s, factor_s)
    x = x.permute(0, 1, 3, 5, 7, 2, 4, 6).contiguous()
    x = x.view(b, c * factor, t // factor_t, h // factor_s, w // factor_s)
    x = x.view(b, out_channels, c * factor // out_channels, t // factor_t, h // factor_s, w // factor_s)
    return x.mean(dim=2)


def _down_level(p, c: WanEncoderConfig, i: int, x, cache: _CausalCache) -> torch.Tensor:
    """diffusers' `WanResidualDownBlock` (Wan2.2: + the AvgDown3D shortcut) or its flat run of blocks (Wan2.1)."""
    down = i != c.levels - 1
    temporal = down and c.temperal_downsample[i]
    x_copy = x
    for j in range(c.num_res_blocks):
        x = _residual_block(p, c.resnet(i, j), x, cache)
    if down:
        x = _downsample(p, c.downsampler(i), x, cache, temporal)
    if c.residual:
        x = x + _avg_down(x_copy, c.level_widths(i)[1], 2 if temporal else 1, 2 if down else 1)
    return x


def _encode_chunk(p, c: WanEncoderConfig, x, cache: _CausalCache) -> torch.Tensor:
    """One pass of the encoder: the first video frame alone, or 4 later ones, to one latent frame of moments."""
    x = _cached_conv(p, "encoder.conv_in", x, cache)
    for i in range(c.levels):
        x = _down_level(p, c, i, x, cache)
    x = _residual_block(p, "encoder.mid_block.resnets.0", x, cache)
    x = _attention_block(p, "encoder.mid_block.attentions.0", x)
    x = _residual_block(p, "encoder.mid_block.resnets.1", x, cache)
    x = F.silu(_rms_norm(x, p["encoder.norm_out.gamma"]))
    return _cached_conv(p, "encoder.conv_out", x, cache)


@torch.no_grad()
def encode(x: torch.Tensor, state_dict: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Encode a video `x` [B, 3, F, H, W] in [-1, 1] into its moments [B, 2 z_dim, 1 + (F - 1) // 4, H / s, W / s]:
    the mean, then the log-variance, unclamped (s = 16 for Wan2.2, 8 for Wan2.1; Wan2.1 takes any H, W >= 8 and
    reads the rows past the last whole 8 into the last latent row). Frames past the last whole 4 after the first
    are not encoded, as in diffusers.

    Bit-identical to `AutoencoderKLWan(...).to(dtype).encode(x.to(dtype)).latent_dist.parameters` for the same
    weights, the whole batch at once. Runs on `x.device`; the weights are cast to `dtype` and moved there.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {[str(d) for d in DTYPES]}; got {dtype}")
    config = infer_encoder_config(state_dict)
    check_video(x, config)
    p = {k: v.to(device=x.device, dtype=dtype) for k, v in encoder_state_dict(state_dict).items()}
    x = _patchify(x.to(dtype).contiguous(), config.patch_size)
    passes = [x[:, :, :1]] + [x[:, :, 1 + 4 * i : 5 + 4 * i] for i in range((x.shape[2] - 1) // 4)]
    with exact_fp32():
        cache = _CausalCache()
        out = torch.cat([_encode_chunk(p, config, chunk, cache) for chunk in passes], dim=2)
        return _causal_conv3d(out, p["quant_conv.weight"], p["quant_conv.bias"])


# --------------------------------------------------------------------------------------------------------------------
# The first frame, as Wan2.2's image-to-video sampler reads it
# --------------------------------------------------------------------------------------------------------------------


def best_output_size(w: int, h: int, dw: int, dh: int, expected_area: int) -> tuple[int, int]:
    """Wan2.2's choice of output (width, height): multiples of (dw, dh), area <= expected_area, aspect closest to w/h."""
    ratio = w / h
    ow = (expected_area * ratio) ** 0.5
    oh = expected_area / ow
    # Width first, then height first; keep whichever keeps the aspect ratio better.
    ow1 = int(ow // dw * dw)
    oh1 = int(expected_area / ow1 // dh * dh) if ow1 else 0
    oh2 = int(oh // dh * dh)
    ow2 = int(expected_area / oh2 // dw * dw) if oh2 else 0
    if 0 in (ow1, oh1, ow2, oh2):
        raise ValueError(f"a {w}x{h} image is too elongated for an output of area {expected_area} in multiples of "
                         f"{dw}x{dh}; ask for a larger height x width")
    ratio1, ratio2 = ow1 / oh1, ow2 / oh2
    if max(ratio / ratio1, ratio1 / ratio) < max(ratio / ratio2, ratio2 / ratio):
        return ow1, oh1
    return ow2, oh2


def load_first_frame(path, height: int, width: int) -> torch.Tensor:
    """The first frame as Wan2.2's i2v sampler makes it: [1, 3, 1, H, W] float32 in [-1, 1].

    The stored pixels (no EXIF orientation) as RGB, then `first_frame_from_image`.
    """
    _check_frame_size(height, width)
    return first_frame_from_image(Image.open(path).convert("RGB"), height, width)


def first_frame_from_image(img: Image.Image, height: int, width: int) -> torch.Tensor:
    """An RGB image -> [1, 3, 1, H, W] float32 in [-1, 1]: an output size of area height x width in multiples of 32
    with the image's aspect ratio; LANCZOS resize to cover it; centre crop; `(x / 255 - 0.5) / 0.5`."""
    _check_frame_size(height, width)
    iw, ih = img.size
    ow, oh = best_output_size(iw, ih, 32, 32, height * width)
    scale = max(ow / iw, oh / ih)
    img = img.resize((round(iw * scale), round(ih * scale)), Image.LANCZOS)
    x1, y1 = (img.width - ow) // 2, (img.height - oh) // 2
    img = img.crop((x1, y1, x1 + ow, y1 + oh))
    pixels = torch.from_numpy(np.array(img, dtype=np.uint8)).permute(2, 0, 1).contiguous()
    frame = pixels.to(torch.float32).div(255).sub_(0.5).div_(0.5)
    return frame.unsqueeze(1).unsqueeze(0)


def _check_frame_size(height, width) -> None:
    for name, value in (("height", height), ("width", width)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 32:
            raise ValueError(f"{name} must be an int >= 32; got {value!r}")
