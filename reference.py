"""The definition of PAN2's results: the reference Wan2.2 VAE decoder and the reference first-frame reading.

`decode` is the plain-PyTorch Wan2.2 VAE decoder. It replays, op for op and in the same order, what diffusers'
`AutoencoderKLWan.decode(z).sample` computes, so the two are bit-identical (`torch.equal`) for the same weights, in
fp32 and in bf16, at the same thread count. It is written for reading against the math, not for speed: the fast
decoders in `fastvideo_pan2_ext.vae_kernel` are checked against it.

`load_first_frame` is Wan2.2's own image-to-video preprocessing of the first frame (DESIGN.md §4).

Only torch, Pillow and numpy are imported here.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

# Frames of history a causal 3x3x3 conv needs (its time kernel is 3, padded 2 before, 0 after).
CACHE_T = 2

DTYPES = (torch.float32, torch.bfloat16)


# --------------------------------------------------------------------------------------------------------------------
# Architecture, read from the weights
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WanVAEConfig:
    """The decoder's shape, as far as the weights determine it (diffusers' names)."""

    z_dim: int  # latent channels (48 for Wan2.2)
    decoder_base_dim: int  # 256 for Wan2.2
    dim_mult: tuple[int, ...]  # (1, 2, 4, 4)
    num_res_blocks: int  # 2
    temperal_upsample: tuple[bool, ...]  # (True, True, False): per upsampling level, in the decoder's order
    out_channels: int  # channels before unpatchify (12 = 3 x 2 x 2)
    patch_size: int  # 2 for Wan2.2

    @property
    def dims(self) -> list[int]:
        """Channel width at the decoder's input and after each up block."""
        return [self.decoder_base_dim * m for m in (self.dim_mult[-1], *self.dim_mult[::-1])]


def _strip_prefix(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Accept a whole `AutoencoderKLWan` state dict or one with only `post_quant_conv.*` and `decoder.*`."""
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


def _require(sd: dict[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    if name not in sd:
        raise ValueError(f"state_dict is missing {name!r} (expected shape {list(shape)})")
    if tuple(sd[name].shape) != tuple(shape):
        raise ValueError(f"state_dict[{name!r}] has shape {list(sd[name].shape)}; expected {list(shape)}")
    return sd[name]


def infer_config(state_dict: dict[str, torch.Tensor]) -> WanVAEConfig:
    """Read the decoder's architecture from its weights and check every weight the decoder uses.

    Only the Wan2.2 layout (`is_residual=True`, a patchified output) is supported: that is the VAE PAN2 ships.
    """
    sd = _strip_prefix(state_dict)
    if "decoder.conv_in.weight" not in sd:
        raise ValueError("state_dict has no 'decoder.conv_in.weight': not a Wan VAE decoder state dict")
    conv_in = sd["decoder.conv_in.weight"]
    if conv_in.dim() != 5:
        raise ValueError(f"state_dict['decoder.conv_in.weight'] must be 5-D; got shape {list(conv_in.shape)}")
    top, z_dim = conv_in.shape[0], conv_in.shape[1]

    if any(".upsamplers." in k for k in sd):
        raise ValueError("state_dict is a Wan2.1-layout VAE (is_residual=False); only the Wan2.2 layout is supported")
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
    temperal_upsample = tuple(any(k.startswith(f"decoder.up_blocks.{i}.upsampler.time_conv.") for k in sd)
                              for i in levels[:-1])
    if sum(temperal_upsample) != 2:
        raise ValueError(f"decoder upsamples in time at {sum(temperal_upsample)} levels; Wan2.2's 4x temporal "
                         "compression needs 2")

    out_channels = _require_present(sd, "decoder.conv_out.weight").shape[0]
    patch_size = math.isqrt(out_channels // 3)
    if patch_size * patch_size * 3 != out_channels:
        raise ValueError(f"decoder.conv_out has {out_channels} output channels; expected 3 x p x p")

    config = WanVAEConfig(z_dim, base, dim_mult, num_res_blocks, temperal_upsample, out_channels, patch_size)
    expected = expected_shapes(config)
    for name, shape in expected.items():
        _require(sd, name, shape)
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
    for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
        block = f"decoder.up_blocks.{i}"
        for j in range(c.num_res_blocks + 1):
            resnet(f"{block}.resnets.{j}", cin if j == 0 else cout, cout)
        if i != len(c.dim_mult) - 1:
            if c.temperal_upsample[i]:
                conv(f"{block}.upsampler.time_conv", cout * 2, cout, (3, 1, 1))
            conv(f"{block}.upsampler.resample.1", cout, cout, (3, 3))
    shapes["decoder.norm_out.gamma"] = (dims[-1], 1, 1, 1)
    conv("decoder.conv_out", c.out_channels, dims[-1], (3, 3, 3))
    return shapes


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
    name = f"decoder.up_blocks.{i}"
    up = i != len(c.dim_mult) - 1
    temporal = up and c.temperal_upsample[i]
    x_copy = x.clone()
    for j in range(c.num_res_blocks + 1):
        x = _residual_block(p, f"{name}.resnets.{j}", x, cache)
    if up:
        x = _upsample(p, f"{name}.upsampler", x, cache, temporal)
        x = x + _dup_up(x_copy, c.dims[i + 1], 2 if temporal else 1, 2, first_chunk)
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


@contextlib.contextmanager
def exact_fp32():
    """cuDNN convs and matmuls default to TF32 on recent GPUs; the reference's fp32 means fp32."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


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


@torch.no_grad()
def decode(z: torch.Tensor, state_dict: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode latents `z` [B, z_dim, T, h, w] (already de-normalized) into a video [B, 3, 4T-3, 16h, 16w] in [-1, 1].

    Bit-identical to `AutoencoderKLWan(...).to(dtype).decode(z.to(dtype)).sample` for the same weights.
    Runs on `z.device`; the weights are cast to `dtype` and moved there.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {[str(d) for d in DTYPES]}; got {dtype}")
    config = infer_config(state_dict)
    check_latents(z, config.z_dim)
    p = {k: v.to(device=z.device, dtype=dtype) for k, v in _strip_prefix(state_dict).items()}
    z = z.to(dtype)
    with exact_fp32():
        x = _causal_conv3d(z, p["post_quant_conv.weight"], p["post_quant_conv.bias"])
        cache = _CausalCache()
        frames = [_decode_frame(p, config, x[:, :, i : i + 1], cache, first_chunk=i == 0) for i in range(x.shape[2])]
    out = torch.cat(frames, dim=2)
    return torch.clamp(_unpatchify(out, config.patch_size), min=-1.0, max=1.0)


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
