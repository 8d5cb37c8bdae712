"""The definition of PAN2's results: the reference Wan VAE decoder and encoder, the reference first-frame reading, and
PAN2's sampler.

`decode` is the plain-PyTorch Wan VAE decoder, in the Wan2.2 layout (PAN2's) and the Wan2.1 layout alike. It
replays, op for op and in the same order, what diffusers' `AutoencoderKLWan.decode(z).sample` computes, so the two are
bit-identical (`torch.equal`) for the same weights, in fp32 and in bf16, at the same thread count. It is written for
reading against the math, not for speed: the fast decoders in `fastvideo_pan2_ext.vae_kernel` are checked against it.

`encode` is the encoder likewise: diffusers' `AutoencoderKLWan.encode(x).latent_dist.parameters` (the moments, mean
then log-variance, unclamped), bit-identical in fp32 and bf16, both layouts, built from the decoder's own causal
convs, norms, residual blocks and attention.


The PAN2 section defines PAN2's sampler (docs/design/pan2.md, "PAN2") as diffusers' `PAN2Transformer3DModel` and IFM's
pipeline compute it, read through vLLM-Omni's port (the one public implementation), plain functions over a state dict:
`pan2_transformer` (the DiT over a state dict, in fp32 or bf16 with diffusers' precision rules), `pan2_rope`,
`pan2_prompt_embeds` (Qwen3.5's `hidden_states[-3]` after the user header), `load_first_frame` (PAN2's own cover
resize and round() crop, not Wan2.2's), `pan2_condition` (the 49-channel first-frame condition), `pan2_sigmas` /
`pan2_timesteps` (diffusers' flow-match schedule with a static shift), `pan2_noise` (FastVideo's draw for a seed) and
`pan2_sample` (the flow-match Euler loop with CFG, latents in fp32).

Besides torch, Pillow and numpy it imports only what defines the decoder's and encoder's shapes and inputs
(`vae_kernel.definitions.architecture`), what fp32 means (`vae_kernel.definitions.precision`) and PAN2's transformer
config and weight names (`model.architecture`): nothing of the fast decoder or of the FastVideo DiT itself.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from fastvideo_pan2_ext.model.architecture import (LAYER_NORM_EPS, TEXT_RMS_EPS, TIMESTEP_CHANNELS,
                                                  PAN2TransformerConfig, latent_grid, weight_shapes)
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


def _check_frame_size(height, width) -> None:
    for name, value in (("height", height), ("width", width)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 32:
            raise ValueError(f"{name} must be an int >= 32; got {value!r}")


# --------------------------------------------------------------------------------------------------------------------
# PAN2's transformer, one small function per diffusers module. `p` is the state dict, cast to the DiT's dtype: every
# op runs in that dtype except where diffusers upcasts (the timestep sinusoid, the RMSNorm variance, the RoPE turn).
# --------------------------------------------------------------------------------------------------------------------


def _pan2_linear(p, name, x) -> torch.Tensor:
    return F.linear(x, p[f"{name}.weight"], p.get(f"{name}.bias"))


def _pan2_rms_norm(x, weight, eps: float) -> torch.Tensor:
    """diffusers' RMSNorm: the mean square in fp32; x / rms rounded to the weight's dtype, then scaled."""
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(variance + eps)).to(weight.dtype) * weight


def _pan2_modulate(x, shift, scale) -> torch.Tensor:
    """LayerNorm without affine (eps 1e-6, in x's dtype), then x * (1 + scale) + shift."""
    return F.layer_norm(x, x.shape[-1:], eps=LAYER_NORM_EPS) * (1 + scale) + shift


def _pan2_timestep_embedding(p, timestep, dtype) -> torch.Tensor:
    """`time_proj` = Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0) in fp32, [cos, sin]; cast to the
    DiT dtype; `time_embedder` = TimestepEmbedding (linear, SiLU, linear): temb [B, D]."""
    half = TIMESTEP_CHANNELS // 2
    exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32, device=timestep.device) / half
    angles = timestep[:, None].float() * torch.exp(exponent)[None, :]
    sinusoid = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1).to(dtype)
    return _pan2_linear(p, "time_embedder.linear_2", F.silu(_pan2_linear(p, "time_embedder.linear_1", sinusoid)))


def _pan2_swiglu_ff(p, name, x) -> torch.Tensor:
    """FeedForward(activation_fn="swiglu", bias=False): the projection's first half is the value, the second the
    gate: value * SiLU(gate)."""
    value, gate = _pan2_linear(p, f"{name}.net.0.proj", x).chunk(2, dim=-1)
    return _pan2_linear(p, f"{name}.net.2", value * F.silu(gate))


def _pan2_gelu_ff(p, name, x) -> torch.Tensor:
    """FeedForward(activation_fn="gelu-approximate"): linear, GELU (tanh), linear."""
    return _pan2_linear(p, f"{name}.net.2", F.gelu(_pan2_linear(p, f"{name}.net.0.proj", x), approximate="tanh"))


def _pan2_ada_norm_zero(p, name, x, temb) -> tuple[torch.Tensor, ...]:
    """AdaLayerNormZero(norm_type="layer_norm"): Linear(SiLU(temb)) chunked shift, scale, gate (attention), then
    shift, scale, gate (feed-forward). Returns the modulated x and gate_msa, shift_mlp, scale_mlp, gate_mlp [B, D]."""
    emb = _pan2_linear(p, f"{name}.linear", F.silu(temb))
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
    return _pan2_modulate(x, shift_msa[:, None], scale_msa[:, None]), gate_msa, shift_mlp, scale_mlp, gate_mlp


def _pan2_ada_norm_continuous(p, name, x, temb) -> torch.Tensor:
    """AdaLayerNormContinuous(elementwise_affine=False, eps=1e-6): Linear(SiLU(temb)) chunked scale first, then
    shift."""
    scale, shift = _pan2_linear(p, f"{name}.linear", F.silu(temb).to(x.dtype)).chunk(2, dim=1)
    return _pan2_modulate(x, shift[:, None], scale[:, None])


def pan2_rope(config: PAN2TransformerConfig, grid: tuple[int, int, int], device=None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The video tokens' rotary tables: cos, sin [S, head_dim / 2] fp32, tokens in (t, h, w) order over the patch
    `grid`. Per axis of dimension d, freq_i = 1 / theta^(2i / d) and the angle is position x freq_i; the frame
    positions are scaled by `rope_temporal_scale` (the frame rate the RoPE was trained at). Axes t, h, w are
    concatenated (diffusers' `get_1d_rotary_pos_embed(use_real=False)`, its real and imaginary parts)."""
    if len(grid) != 3 or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in grid):
        raise ValueError(f"grid must be three positive ints (t, h, w); got {grid!r}")
    axes = [torch.arange(n, dtype=torch.float32, device=device) for n in grid]
    axes[0] = axes[0] * config.rope_temporal_scale
    positions = [g.reshape(-1) for g in torch.meshgrid(*axes, indexing="ij")]
    cos, sin = [], []
    for pos, dim in zip(positions, config.rope_axes_dim):
        freqs = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
        angles = torch.outer(pos, freqs)
        cos.append(angles.cos())
        sin.append(angles.sin())
    return torch.cat(cos, dim=1), torch.cat(sin, dim=1)


def _pan2_apply_rope(x, cos, sin) -> torch.Tensor:
    """Interleaved (GPT-J) rotation of [B, S, H, hd]: the pair (x[2i], x[2i + 1]) turns by angle i. In fp32 and back
    to x's dtype, as diffusers' complex rotation (and FastVideo's) upcasts."""
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    cos, sin = cos[:, None], sin[:, None]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).type_as(x)


def _pan2_project(p, name, projections, norms, x, heads: int, eps: float) -> tuple[torch.Tensor, ...]:
    """q, k, v [B, S, H, hd] of one stream, q and k through their per-head RMSNorms."""
    q, k, v = (_pan2_linear(p, f"{name}.{proj}", x).unflatten(-1, (heads, -1)) for proj in projections)
    norm_q, norm_k = (p[f"{name}.{norm}.weight"] for norm in norms)
    return _pan2_rms_norm(q, norm_q, eps), _pan2_rms_norm(k, norm_k, eps), v


def _pan2_sdpa(q, k, v) -> torch.Tensor:
    """Full attention, no mask, softmax scale 1 / sqrt(hd), over [B, S, H, hd]: [B, S, H hd]."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale)
    return out.transpose(1, 2).flatten(2, 3)


def _pan2_refiner_block(p, name, c, heads: int) -> torch.Tensor:
    """A text token refiner block: RMS pre-norms (eps 1e-5), self-attention without RoPE or bias, SwiGLU."""
    q, k, v = _pan2_project(p, f"{name}.attn", ("to_q", "to_k", "to_v"), ("norm_q", "norm_k"),
                            _pan2_rms_norm(c, p[f"{name}.norm1.weight"], TEXT_RMS_EPS), heads, TEXT_RMS_EPS)
    c = c + _pan2_linear(p, f"{name}.attn.to_out.0", _pan2_sdpa(q, k, v))
    return c + _pan2_swiglu_ff(p, f"{name}.ff", _pan2_rms_norm(c, p[f"{name}.norm2.weight"], TEXT_RMS_EPS))


def _pan2_joint_attention(p, name, x, c, rope, heads: int, attention=_pan2_sdpa) -> tuple[torch.Tensor, torch.Tensor]:
    """One attention over [video; text] (text at the rear): each stream its own projections and per-head RMSNorms
    (eps 1e-6), RoPE on the video q, k only, each stream its own output projection. `attention`: `_pan2_sdpa`'s
    contract (the GPU check times the block with other kernels in its place)."""
    q, k, v = _pan2_project(p, name, ("to_q", "to_k", "to_v"), ("norm_q", "norm_k"), x, heads, LAYER_NORM_EPS)
    q, k = _pan2_apply_rope(q, *rope), _pan2_apply_rope(k, *rope)
    cq, ck, cv = _pan2_project(p, name, ("add_q_proj", "add_k_proj", "add_v_proj"), ("norm_added_q", "norm_added_k"),
                               c, heads, LAYER_NORM_EPS)
    out = attention(torch.cat([q, cq], dim=1), torch.cat([k, ck], dim=1), torch.cat([v, cv], dim=1))
    video, text = out.split([x.shape[1], c.shape[1]], dim=1)
    return _pan2_linear(p, f"{name}.to_out.0", video), _pan2_linear(p, f"{name}.to_add_out", text)


def _pan2_joint_block(p, name, x, c, temb, rope, heads: int, attention=_pan2_sdpa) -> tuple[torch.Tensor, torch.Tensor]:
    """A joint block: AdaLN-zero on the video from temb; on the text from a learned table that ignores the time."""
    x_hat, gate_msa, shift_mlp, scale_mlp, gate_mlp = _pan2_ada_norm_zero(p, f"{name}.norm1", x, temb)
    c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = (
        p[f"{name}.scale_shift_table_context"].to(temb.dtype).chunk(6))
    attn_x, attn_c = _pan2_joint_attention(p, f"{name}.attn", x_hat, _pan2_modulate(c, c_shift_msa, c_scale_msa),
                                           rope, heads, attention)
    x = x + attn_x * gate_msa[:, None]
    c = c + attn_c * c_gate_msa
    x_hat = _pan2_modulate(x, shift_mlp[:, None], scale_mlp[:, None])
    x = x + _pan2_gelu_ff(p, f"{name}.ff", x_hat) * gate_mlp[:, None]
    c = c + _pan2_gelu_ff(p, f"{name}.ff_context", _pan2_modulate(c, c_shift_mlp, c_scale_mlp)) * c_gate_mlp
    return x, c


def _pan2_unpatchify(x, grid, patch) -> torch.Tensor:
    """[B, S, C pt ph pw] -> [B, C, T' pt, h ph, w pw]. Each token's features run channel outermost, (C, pt, ph, pw):
    PAN2's order, not Wan's (pt, ph, pw, C)."""
    (t, h, w), (pt, ph, pw) = grid, patch
    x = x.reshape(x.shape[0], t, h, w, -1, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)
    return x.reshape(x.shape[0], x.shape[1], t * pt, h * ph, w * pw)


def _pan2_weights(state_dict, config: PAN2TransformerConfig, device, dtype) -> dict[str, torch.Tensor]:
    """The state dict checked against the config's names and shapes, cast to the DiT dtype (IFM's fp32 `norm1.linear`
    included: the DiT runs them in its dtype, as vLLM-Omni does)."""
    shapes = weight_shapes(config)
    missing = [name for name in shapes if name not in state_dict]
    extra = [name for name in state_dict if name not in shapes]
    if missing or extra:
        raise ValueError(f"the state dict does not match the config: missing {missing[:5]} ({len(missing)}), "
                         f"unexpected {extra[:5]} ({len(extra)})")
    for name, shape in shapes.items():
        if tuple(state_dict[name].shape) != shape:
            raise ValueError(f"{name} has shape {tuple(state_dict[name].shape)}; the config says {shape}")
    return {name: state_dict[name].to(device=device, dtype=dtype) for name in shapes}


@torch.no_grad()
def pan2_transformer(hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                     state_dict: dict[str, torch.Tensor], config: PAN2TransformerConfig) -> torch.Tensor:
    """PAN2's DiT: the velocity [B, out_channels, T', h, w] for `hidden_states` [B, in_channels, T', h, w] (noisy
    latents, condition latents, mask), `timestep` [B] (sigma x 1000; pass it in fp32: the sinusoid reads it in fp32,
    so a bf16 timestep would be rounded) and `encoder_hidden_states` [B, L, text_embed_dim].

    Computes in `hidden_states`' dtype (fp32 or bf16), on its device: the weights and the text are cast to it.
    """
    dtype = hidden_states.dtype
    if dtype not in DTYPES:
        raise ValueError(f"hidden_states must be one of {[str(d) for d in DTYPES]}; got {dtype}")
    if hidden_states.dim() != 5 or hidden_states.shape[1] != config.in_channels:
        raise ValueError(f"hidden_states must be [B, {config.in_channels}, T, h, w]; got {tuple(hidden_states.shape)}")
    b = hidden_states.shape[0]
    if tuple(timestep.shape) != (b,):
        raise ValueError(f"timestep must be [{b}] (one per sample); got {tuple(timestep.shape)}")
    if encoder_hidden_states.dim() != 3 or encoder_hidden_states.shape[0] != b or \
            encoder_hidden_states.shape[2] != config.text_embed_dim:
        raise ValueError(f"encoder_hidden_states must be [{b}, L, {config.text_embed_dim}]; got "
                         f"{tuple(encoder_hidden_states.shape)}")
    grid = latent_grid(config, *hidden_states.shape[2:])
    heads = config.num_attention_heads
    p = _pan2_weights(state_dict, config, hidden_states.device, dtype)
    with exact_fp32():
        rope = pan2_rope(config, grid, hidden_states.device)
        x = F.conv3d(hidden_states, p["x_embedder.weight"], p["x_embedder.bias"], stride=config.patch_size)
        x = x.flatten(2).transpose(1, 2)  # tokens in (t, h, w) order
        temb = _pan2_timestep_embedding(p, timestep.to(hidden_states.device), dtype)
        c = encoder_hidden_states.to(device=hidden_states.device, dtype=dtype)
        c = _pan2_rms_norm(c, p["context_embedder.0.weight"], TEXT_RMS_EPS)
        c = _pan2_linear(p, "context_embedder.1", c)
        for j in range(config.num_refiner_layers):
            c = _pan2_refiner_block(p, f"context_refiner.{j}", c, heads)
        c = c + p["context_type_embedding"]
        for i in range(config.num_layers):
            x, c = _pan2_joint_block(p, f"transformer_blocks.{i}", x, c, temb, rope, heads)
        x = _pan2_linear(p, "proj_out", _pan2_ada_norm_continuous(p, "norm_out", x, temb))
    return _pan2_unpatchify(x, grid, config.patch_size)


# --------------------------------------------------------------------------------------------------------------------
# PAN2's pipeline: the prompt, the first frame and its condition, the schedule, the noise, the sampling loop
# --------------------------------------------------------------------------------------------------------------------

PAN2_SYSTEM_MESSAGE = "You are a helpful assistant. Generate the video with the following instructions."
# The conditioning starts after the first user header: the prompt, then the assistant header and generation prompt.
PAN2_USER_HEADER = "<|im_start|>user\n"
PAN2_MAX_PROMPT_TOKENS = 1536
# `hidden_states[-3]`: the text encoder's last two layers are skipped (the last entry is the final-normed output).
PAN2_TEXT_HIDDEN_STATE = -3


@torch.no_grad()
def pan2_prompt_embeds(prompt: str, tokenizer, text_encoder, max_tokens: int = PAN2_MAX_PROMPT_TOKENS
                       ) -> torch.Tensor:
    """PAN2's text conditioning [1, L, D], in the text encoder's dtype: the chat (the system message, then the prompt
    as the user's; an empty prompt is a single space, as in training) through the tokenizer's own chat template with
    its generation prompt, cut `max_tokens` tokens after the user header; the text encoder's `hidden_states[-3]` over
    the whole sequence (the system message takes part through causal attention), no mask; the tokens after the user
    header."""
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a str; got {type(prompt).__name__}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int; got {max_tokens!r}")
    messages = [{"role": "system", "content": PAN2_SYSTEM_MESSAGE}, {"role": "user", "content": prompt or " "}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    ids = ids["input_ids"]  # transformers 5: a flat list of ints for one conversation
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"the chat template's input_ids must be a flat list of ints; got {type(ids).__name__}")
    header = tokenizer(PAN2_USER_HEADER, add_special_tokens=False)["input_ids"]
    n = len(header)
    crop_start = next((i + n for i in range(len(ids) - n + 1) if ids[i:i + n] == header), None)
    if crop_start is None:
        raise ValueError(f"the chat template's tokens hold no {PAN2_USER_HEADER!r} (ids {header})")
    input_ids = torch.tensor([ids[:crop_start + max_tokens]], device=next(text_encoder.parameters()).device)
    hidden = text_encoder(input_ids=input_ids, output_hidden_states=True).hidden_states[PAN2_TEXT_HIDDEN_STATE]
    return hidden[:, crop_start:]


def load_first_frame(path, height: int, width: int) -> torch.Tensor:
    """The first frame as PAN2's sampler reads it: [1, 3, 1, H, W] float32 in [-1, 1]. The stored pixels (no EXIF
    orientation) as RGB, then `first_frame_from_image`."""
    _check_frame_size(height, width)
    return first_frame_from_image(Image.open(path).convert("RGB"), height, width)


def first_frame_from_image(img: Image.Image, height: int, width: int) -> torch.Tensor:
    """An RGB image -> [1, 3, 1, H, W] float32 in [-1, 1]: LANCZOS resize to cover height x width at the rounded size,
    centre crop at round()ed offsets (Python's, half to even; Wan2.2's floors), then diffusers' VaeImageProcessor
    scaling: x / 255 in fp32, then 2 x - 1."""
    _check_frame_size(height, width)
    scale = max(width / img.width, height / img.height)
    img = img.resize((round(img.width * scale), round(img.height * scale)), Image.LANCZOS)
    left, top = round((img.width - width) / 2), round((img.height - height) / 2)
    img = img.crop((left, top, left + width, top + height))
    pixels = torch.from_numpy(np.array(img).astype(np.float32) / 255.0).permute(2, 0, 1)
    return (2.0 * pixels - 1.0).unsqueeze(1).unsqueeze(0)


@torch.no_grad()
def pan2_condition(first_frame: torch.Tensor | None, vae_state_dict: dict[str, torch.Tensor], latents_mean,
                   latents_std, latent_shape: tuple[int, int, int, int, int], dtype: torch.dtype = torch.float32
                   ) -> torch.Tensor:
    """The condition half of the DiT's input, [B, C + 1, T', h, w] float32 for latents of `latent_shape`
    [B, C, T', h, w]: zeros (text-to-video); with a first frame [1, 3, 1, H, W], its VAE mode (the moments' mean,
    encoded in `dtype`), normalised by the VAE config's `latents_mean` / `latents_std`, in [:, :C, :1] of every
    sample, and the mask channel C of frame 0 set to 1. The noisy latents are never overwritten (unlike Wan2.2)."""
    b, c, t, h, w = latent_shape
    if first_frame is None:
        return torch.zeros(b, c + 1, t, h, w)
    if first_frame.dim() != 5 or first_frame.shape[:3] != (1, 3, 1):
        raise ValueError(f"first_frame must be [1, 3, 1, H, W]; got {tuple(first_frame.shape)}")
    moments = encode(first_frame.to(dtype), vae_state_dict, dtype)
    if tuple(moments.shape) != (1, 2 * c, 1, h, w):
        raise ValueError(f"the first frame encodes to moments {tuple(moments.shape)}; latents {latent_shape} need "
                         f"{(1, 2 * c, 1, h, w)}")
    mu = moments[:, :c]
    mean = torch.as_tensor(latents_mean, dtype=torch.float32).view(1, -1, 1, 1, 1).to(mu)
    std = torch.as_tensor(latents_std, dtype=torch.float32).view(1, -1, 1, 1, 1).to(mu)
    condition = torch.zeros(b, c + 1, t, h, w, device=first_frame.device)
    condition[:, :c, :1] = (mu - mean) / std
    condition[:, c, :1] = 1.0
    return condition


def pan2_sigmas(num_steps: int, shift: float) -> torch.Tensor:
    """The N sigmas [N] float32 (the terminal 0 excluded): linspace(1, 0, N + 1)[:-1] through the static shift
    sigma' = k sigma / (1 + (k - 1) sigma), as diffusers' FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas=...)
    computes it (numpy, cast to float32 first)."""
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int; got {num_steps!r}")
    if not shift > 0:
        raise ValueError(f"shift must be positive; got {shift!r}")
    sigmas = np.linspace(1.0, 0.0, num_steps + 1)[:-1].astype(np.float32)
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    return torch.from_numpy(sigmas).to(torch.float32)


def pan2_timesteps(sigmas: torch.Tensor) -> torch.Tensor:
    """The DiT's timesteps: sigma x 1000 (diffusers' num_train_timesteps), float32."""
    return sigmas * 1000


def pan2_noise(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 noise FastVideo draws for `seed`: video i from its own CPU generator seeded seed + i (input
    validation), drawn alone (diffusers' randn_tensor over that generator list). For one video:
    torch.randn(shape, generator=torch.Generator().manual_seed(seed))."""
    b, *rest = shape
    return torch.cat([torch.randn((1, *rest), generator=torch.Generator("cpu").manual_seed(seed + i),
                                  dtype=torch.float32) for i in range(b)])


@torch.no_grad()
def pan2_sample(state_dict: dict[str, torch.Tensor], config: PAN2TransformerConfig, prompt_embeds: torch.Tensor,
                negative_embeds: torch.Tensor | None, condition: torch.Tensor, noise: torch.Tensor,
                sigmas: torch.Tensor, guidance_scale: float, dtype: torch.dtype) -> list[torch.Tensor]:
    """The flow-match Euler loop from `noise` [B, C, T', h, w] over `sigmas` [N] (`pan2_sigmas`): the latents after
    every step, float32 (the last entry is the result). Each step feeds [latents in `dtype`; condition] and
    sigma x 1000 to the DiT; with `guidance_scale` > 1 the prediction is neg + g (pos - neg), else the positive branch
    alone (the negative is never run); then x <- x + (sigma_next - sigma) v in fp32, sigma_next = 0 after the last."""
    do_cfg = guidance_scale > 1
    if do_cfg and negative_embeds is None:
        raise ValueError(f"guidance_scale {guidance_scale} > 1 needs negative_embeds")
    b, device = noise.shape[0], noise.device
    p = _pan2_weights(state_dict, config, device, dtype)  # cast once; pan2_transformer's cast is then a no-op
    positive = prompt_embeds.to(device=device, dtype=dtype).expand(b, -1, -1)
    negative = negative_embeds.to(device=device, dtype=dtype).expand(b, -1, -1) if do_cfg else None
    condition = condition.to(device=device, dtype=dtype)
    sigmas = sigmas.to(device)
    timesteps = pan2_timesteps(sigmas)
    sigmas = torch.cat([sigmas, torch.zeros(1, device=device)])
    latents = noise.float()
    trajectory = []
    for i, t in enumerate(timesteps):
        model_input = torch.cat([latents.to(dtype), condition], dim=1)
        # vLLM-Omni and diffusers pass the scheduler's float32 timestep, one per sample.
        timestep = t.expand(b)
        velocity = pan2_transformer(model_input, timestep, positive, p, config)
        if do_cfg:
            # Combined in the DiT's dtype, then widened, as vLLM-Omni and FastVideo do.
            uncond = pan2_transformer(model_input, timestep, negative, p, config)
            velocity = uncond + guidance_scale * (velocity - uncond)
        latents = latents + (sigmas[i + 1] - sigmas[i]) * velocity.float()
        trajectory.append(latents)
    return trajectory
