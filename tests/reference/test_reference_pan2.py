"""The PAN2 section of `reference` against independent implementations: diffusers' own modules with seeded random
weights (Timesteps + TimestepEmbedding, RMSNorm, AdaLayerNormZero, AdaLayerNormContinuous, FeedForward swiglu and
gelu-approximate, get_1d_rotary_pos_embed with a complex rotation, FlowMatchEulerDiscreteScheduler, randn_tensor,
VaeImageProcessor, AutoencoderKLWan), a whole tiny DiT assembled here from those modules the way vLLM-Omni's port
composes them, a tiny transformers Qwen3.5 text model with a byte-level ChatML tokenizer, and numpy/Pillow.

fp32 pieces that replay diffusers op for op are compared bit for bit; the rest to rounding (the reference may order
ops differently: its RoPE turns real pairs where the oracle multiplies complex numbers). bf16: see
`test_transformer_bf16_within_allowance`.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fastvideo_pan2_ext import reference
from fastvideo_pan2_ext.model.architecture import PAN2TransformerConfig, weight_shapes

# 2 heads x 16, rope (4, 6, 6); latents [B, 4, 2, 4, 6] -> a (2, 2, 3) patch grid: an odd width count.
TINY = PAN2TransformerConfig(in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
                             num_refiner_layers=1, text_embed_dim=24, rope_axes_dim=(4, 6, 6))
LATENT = (2, 4, 6)  # T', h, w
TEXT_LEN = 5
FP32_TIGHT = {"rtol": 1e-5, "atol": 1e-5}


def _seeded_(module: nn.Module, seed: int) -> nn.Module:
    """Every parameter seeded random at a sensible scale: matrices 1 / sqrt(fan-in), norm gains about 1, the rest
    (biases, tables, the text type embedding) small."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(module.named_parameters()):
            noise = torch.randn(param.shape, generator=g)
            if param.dim() > 1:
                param.copy_(noise / math.sqrt(param[0].numel()))
            elif "norm" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(0.1 * noise)
    return module.eval()


def _state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in module.state_dict().items()}


# --------------------------------------------------------------------------------------------------------------------
# The oracle DiT: diffusers' modules composed as vLLM-Omni's `pan2_transformer.py` composes them
# --------------------------------------------------------------------------------------------------------------------


def _oracle_rope(config, grid) -> torch.Tensor:
    """The complex half-dim RoPE table [S, hd / 2] from diffusers' get_1d_rotary_pos_embed(use_real=False)."""
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    axes = [torch.arange(0, n, dtype=torch.float32) for n in grid]
    positions = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=0)
    positions[0] = positions[0] * config.rope_temporal_scale
    return torch.cat([get_1d_rotary_pos_embed(d, positions[i].reshape(-1), config.rope_theta, use_real=False)
                      for i, d in enumerate(config.rope_axes_dim)], dim=1)


def _oracle_rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """GPT-J RoPE as a complex multiply: (x[2i] + i x[2i + 1]) * e^(i angle_i); x [B, S, H, hd]."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs[None, :, None, :]).flatten(-2).type_as(x)


def _oracle_attention(q, k, v) -> torch.Tensor:
    """[B, S, H, hd] -> [B, S, H hd] through SDPA with its default scale."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).flatten(2, 3)


class _RefinerAttention(nn.Module):
    def __init__(self, dim, heads, head_dim, eps):
        from diffusers.models.normalization import RMSNorm

        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, heads * head_dim, bias=False) for _ in range(3))
        self.norm_q, self.norm_k = RMSNorm(head_dim, eps=eps), RMSNorm(head_dim, eps=eps)
        self.to_out = nn.ModuleList([nn.Linear(heads * head_dim, dim, bias=False), nn.Identity()])

    def forward(self, x):
        q, k, v = (proj(x).unflatten(-1, (self.heads, -1)) for proj in (self.to_q, self.to_k, self.to_v))
        q, k = self.norm_q(q).to(v.dtype), self.norm_k(k).to(v.dtype)
        return self.to_out[0](_oracle_attention(q, k, v))


class _RefinerBlock(nn.Module):
    def __init__(self, dim, heads, head_dim, ratio, eps=1e-5):
        from diffusers.models.attention import FeedForward
        from diffusers.models.normalization import RMSNorm

        super().__init__()
        self.norm1 = RMSNorm(dim, eps=eps)
        self.attn = _RefinerAttention(dim, heads, head_dim, eps)
        self.norm2 = RMSNorm(dim, eps=eps)
        self.ff = FeedForward(dim, inner_dim=int(dim * ratio), activation_fn="swiglu", bias=False)

    def forward(self, c):
        c = c + self.attn(self.norm1(c))
        return c + self.ff(self.norm2(c))


class _JointAttention(nn.Module):
    def __init__(self, dim, heads, head_dim, eps=1e-6):
        from diffusers.models.normalization import RMSNorm

        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, heads * head_dim) for _ in range(3))
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(dim, heads * head_dim) for _ in range(3))
        self.norm_q, self.norm_k, self.norm_added_q, self.norm_added_k = (RMSNorm(head_dim, eps=eps) for _ in range(4))
        self.to_out = nn.ModuleList([nn.Linear(heads * head_dim, dim), nn.Identity()])
        self.to_add_out = nn.Linear(heads * head_dim, dim)

    def forward(self, x, c, freqs):
        q, k, v = (proj(x).unflatten(-1, (self.heads, -1)) for proj in (self.to_q, self.to_k, self.to_v))
        q, k = _oracle_rotate(self.norm_q(q).to(q.dtype), freqs), _oracle_rotate(self.norm_k(k).to(k.dtype), freqs)
        cq, ck, cv = (proj(c).unflatten(-1, (self.heads, -1))
                      for proj in (self.add_q_proj, self.add_k_proj, self.add_v_proj))
        cq, ck = self.norm_added_q(cq).to(cv.dtype), self.norm_added_k(ck).to(cv.dtype)
        out = _oracle_attention(torch.cat([q, cq], 1), torch.cat([k, ck], 1), torch.cat([v, cv], 1))
        out_x, out_c = out.split_with_sizes([x.shape[1], c.shape[1]], dim=1)
        return self.to_out[0](out_x), self.to_add_out(out_c)


class _JointBlock(nn.Module):
    def __init__(self, dim, heads, head_dim, mlp_ratio, context_mlp_ratio, eps=1e-6):
        from diffusers.models.attention import FeedForward
        from diffusers.models.normalization import AdaLayerNormZero

        super().__init__()
        self.norm1 = AdaLayerNormZero(dim, norm_type="layer_norm")
        self.norm1_context = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.scale_shift_table_context = nn.Parameter(torch.zeros(6 * dim))
        self.attn = _JointAttention(dim, heads, head_dim, eps)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.ff = FeedForward(dim, inner_dim=int(dim * mlp_ratio), activation_fn="gelu-approximate")
        self.norm2_context = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.ff_context = FeedForward(dim, inner_dim=int(dim * context_mlp_ratio), activation_fn="gelu-approximate")

    def forward(self, x, c, temb, freqs):
        x_hat, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(x, emb=temb)
        c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = (
            self.scale_shift_table_context.to(temb.dtype).chunk(6, dim=-1))
        c_hat = self.norm1_context(c) * (1 + c_scale_msa) + c_shift_msa
        attn_x, attn_c = self.attn(x_hat, c_hat, freqs)
        x = x + attn_x * gate_msa.unsqueeze(1)
        c = c + attn_c * c_gate_msa
        x_hat = self.norm2(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        c_hat = self.norm2_context(c) * (1 + c_scale_mlp) + c_shift_mlp
        x = x + self.ff(x_hat) * gate_mlp.unsqueeze(1)
        return x, c + self.ff_context(c_hat) * c_gate_mlp


class _OraclePAN2(nn.Module):
    def __init__(self, config: PAN2TransformerConfig):
        from diffusers.models.embeddings import TimestepEmbedding, Timesteps
        from diffusers.models.normalization import AdaLayerNormContinuous, RMSNorm

        super().__init__()
        self.config = config
        d, heads, hd = config.inner_dim, config.num_attention_heads, config.attention_head_dim
        self.x_embedder = nn.Conv3d(config.in_channels, d, kernel_size=config.patch_size, stride=config.patch_size)
        self.time_proj = Timesteps(num_channels=256, flip_sin_to_cos=True, downscale_freq_shift=0)
        self.time_embedder = TimestepEmbedding(in_channels=256, time_embed_dim=d)
        self.context_embedder = nn.Sequential(RMSNorm(config.text_embed_dim, eps=1e-5),
                                              nn.Linear(config.text_embed_dim, d))
        self.context_refiner = nn.ModuleList([_RefinerBlock(d, heads, hd, config.refiner_mlp_ratio)
                                              for _ in range(config.num_refiner_layers)])
        self.context_type_embedding = nn.Parameter(torch.zeros(d))
        self.transformer_blocks = nn.ModuleList([_JointBlock(d, heads, hd, config.mlp_ratio, config.context_mlp_ratio)
                                                 for _ in range(config.num_layers)])
        self.norm_out = AdaLayerNormContinuous(d, d, elementwise_affine=False, eps=1e-6)
        self.proj_out = nn.Linear(d, config.patch_volume * config.out_channels)

    @torch.no_grad()
    def forward(self, hidden_states, timestep, encoder_hidden_states):
        b, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.config.patch_size
        grid = (frames // p_t, height // p_h, width // p_w)
        freqs = _oracle_rope(self.config, grid)
        x = self.x_embedder(hidden_states).flatten(2).transpose(1, 2)
        temb = self.time_embedder(self.time_proj(timestep).to(hidden_states.dtype))
        c = self.context_embedder(encoder_hidden_states)
        for block in self.context_refiner:
            c = block(c)
        c = c + self.context_type_embedding
        for block in self.transformer_blocks:
            x, c = block(x, c, temb, freqs)
        x = self.proj_out(self.norm_out(x, temb))
        x = x.reshape(b, *grid, -1, p_t, p_h, p_w).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)


@pytest.fixture(scope="module")
def oracle() -> _OraclePAN2:
    return _seeded_(_OraclePAN2(TINY), seed=0)


def _dit_inputs(batch: int = 2, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, TINY.in_channels, *LATENT, generator=g)
    text = torch.randn(batch, TEXT_LEN, TINY.text_embed_dim, generator=g)
    timestep = torch.tensor([1000.0, 437.5, 3.25][:batch])
    return hidden, timestep, text


# --------------------------------------------------------------------------------------------------------------------
# One diffusers module at a time
# --------------------------------------------------------------------------------------------------------------------


def test_oracle_names_are_the_checkpoint_names(oracle):
    shapes = {name: tuple(t.shape) for name, t in oracle.state_dict().items()}
    assert shapes == weight_shapes(TINY)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_timestep_embedding_is_diffusers(dtype):
    from diffusers.models.embeddings import TimestepEmbedding, Timesteps

    d = 32
    embedder = _seeded_(TimestepEmbedding(in_channels=256, time_embed_dim=d), seed=2).to(dtype)
    p = {f"time_embedder.{k}": v for k, v in embedder.state_dict().items()}
    timestep = torch.tensor([1000.0, 972.97296, 12.5, 0.0])
    with torch.no_grad():
        expected = embedder(Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)(timestep).to(dtype))
    assert torch.equal(reference._pan2_timestep_embedding(p, timestep, dtype), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_rms_norm_is_diffusers(dtype, eps):
    from diffusers.models.normalization import RMSNorm

    norm = _seeded_(RMSNorm(16, eps=eps), seed=3).to(dtype)
    x = (3 * torch.randn(2, 7, 4, 16, generator=torch.Generator().manual_seed(4))).to(dtype)
    with torch.no_grad():
        expected = norm(x)
    assert torch.equal(reference._pan2_rms_norm(x, norm.weight.detach(), eps), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ada_norm_zero_is_diffusers(dtype):
    from diffusers.models.normalization import AdaLayerNormZero

    norm = _seeded_(AdaLayerNormZero(32, norm_type="layer_norm"), seed=5).to(dtype)
    g = torch.Generator().manual_seed(6)
    x, temb = torch.randn(2, 9, 32, generator=g).to(dtype), torch.randn(2, 32, generator=g).to(dtype)
    p = {f"norm1.{k}": v for k, v in norm.state_dict().items()}
    with torch.no_grad():
        expected = norm(x, emb=temb)
    got = reference._pan2_ada_norm_zero(p, "norm1", x, temb)
    assert len(got) == len(expected) == 5
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ada_norm_continuous_is_diffusers(dtype):
    from diffusers.models.normalization import AdaLayerNormContinuous

    norm = _seeded_(AdaLayerNormContinuous(32, 32, elementwise_affine=False, eps=1e-6), seed=7).to(dtype)
    g = torch.Generator().manual_seed(8)
    x, temb = torch.randn(2, 9, 32, generator=g).to(dtype), torch.randn(2, 32, generator=g).to(dtype)
    p = {f"norm_out.{k}": v for k, v in norm.state_dict().items()}
    with torch.no_grad():
        expected = norm(x, temb)
    assert torch.equal(reference._pan2_ada_norm_continuous(p, "norm_out", x, temb), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["swiglu", "gelu-approximate"])
def test_feed_forwards_are_diffusers(kind, dtype):
    from diffusers.models.attention import FeedForward

    bias = kind != "swiglu"  # the refiner's SwiGLU has no biases; the joint blocks' GELU FFs have them
    ff = _seeded_(FeedForward(32, inner_dim=64, activation_fn=kind, bias=bias), seed=9).to(dtype)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(10)).to(dtype)
    p = {f"ff.{k}": v for k, v in ff.state_dict().items()}
    run = reference._pan2_swiglu_ff if kind == "swiglu" else reference._pan2_gelu_ff
    with torch.no_grad():
        expected = ff(x)
    assert torch.equal(run(p, "ff", x), expected)


@pytest.mark.parametrize("grid", [(2, 2, 3), (5, 3, 4)])
def test_rope_tables_are_diffusers(grid):
    config = PAN2TransformerConfig(rope_axes_dim=(16, 56, 56))
    cos, sin = reference.pan2_rope(config, grid)
    freqs = _oracle_rope(config, grid)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (math.prod(grid), 64)
    torch.testing.assert_close(cos, freqs.real, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, freqs.imag, rtol=0, atol=1e-6)
    # The second token steps one w position: its t and h angles are 0, its w angles are the w frequencies.
    w_freqs = 1.0 / 256.0 ** (torch.arange(0, 56, 2, dtype=torch.float64) / 56)
    torch.testing.assert_close(sin[1, 36:].double(), torch.sin(w_freqs), rtol=0, atol=1e-6)
    assert torch.equal(sin[1, :36], torch.zeros(36))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_rotation_is_interleaved_complex_multiply(dtype):
    grid = (2, 2, 3)
    q = torch.randn(2, math.prod(grid), 2, 16, generator=torch.Generator().manual_seed(11)).to(dtype)
    cos, sin = reference.pan2_rope(TINY, grid)
    got = reference._pan2_apply_rope(q, cos, sin)
    expected = _oracle_rotate(q, _oracle_rope(TINY, grid))
    assert got.dtype == dtype
    # The real-pair and complex forms round differently in fp32; in bf16 that can flip one ulp (2^-8 relative).
    torch.testing.assert_close(got.float(), expected.float(), **(FP32_TIGHT if dtype == torch.float32 else
                                                                  {"rtol": 2 ** -7, "atol": 1e-3}))


# --------------------------------------------------------------------------------------------------------------------
# The whole DiT
# --------------------------------------------------------------------------------------------------------------------


def test_transformer_fp32_is_the_oracle(oracle):
    hidden, timestep, text = _dit_inputs()
    expected = oracle(hidden, timestep, text)
    got = reference.pan2_transformer(hidden, timestep, text, _state_dict(oracle), TINY)
    assert got.shape == (2, TINY.out_channels, *LATENT) and got.dtype == torch.float32
    assert expected.abs().mean() > 0.1  # not a vanishing output
    torch.testing.assert_close(got, expected, **FP32_TIGHT)


def test_transformer_bf16_within_allowance(oracle):
    """bf16 against the oracle in bf16 (weights rounded once, both computing in bf16): the two may round differently
    where their op orders differ, so the allowance is stated against bf16's own error. The reference's bf16 error
    (against the fp32 oracle) must be no larger than 1.5 x the oracle's own bf16 error plus 1e-2 x the output's
    mean magnitude, and their difference within 2% of the output's largest magnitude. (On the CPU this was written on
    the two agree bit for bit.)"""
    hidden, timestep, text = _dit_inputs()
    bf16 = torch.bfloat16
    want = oracle(hidden, timestep, text)
    oracle_bf16 = _seeded_(_OraclePAN2(TINY), seed=0).to(bf16)
    expected = oracle_bf16(hidden.to(bf16), timestep, text.to(bf16))
    got = reference.pan2_transformer(hidden.to(bf16), timestep, text, _state_dict(oracle), TINY)
    assert got.dtype == bf16
    err_got, err_oracle = (got.float() - want).abs().max(), (expected.float() - want).abs().max()
    assert err_got <= 1.5 * err_oracle + 1e-2 * want.abs().mean(), (err_got, err_oracle)
    assert (got.float() - expected.float()).abs().max() <= 0.02 * want.abs().max()


def test_unpatchify_is_channel_outermost():
    """Token (t, h, w)'s feature c pt ph pw (channel outermost: PAN2's order, not Wan's) lands at
    [c, t pt, 2 h + ph, 2 w + pw]."""
    grid, patch, channels = (2, 2, 3), (1, 2, 2), 4
    tokens = torch.arange(math.prod(grid) * channels * 4, dtype=torch.float32).reshape(1, math.prod(grid), -1)
    out = reference._pan2_unpatchify(tokens, grid, patch)
    assert out.shape == (1, channels, 2, 4, 6)
    for s, (t, h, w) in enumerate(np.ndindex(*grid)):
        for f in range(channels * 4):
            c, ph, pw = f // 4, (f // 2) % 2, f % 2
            assert out[0, c, t, 2 * h + ph, 2 * w + pw] == tokens[0, s, f]


def test_transformer_names_bad_inputs(oracle):
    hidden, timestep, text = _dit_inputs()
    sd = _state_dict(oracle)
    with pytest.raises(ValueError, match="context_type_embedding"):
        reference.pan2_transformer(hidden, timestep, text, {k: v for k, v in sd.items()
                                                            if k != "context_type_embedding"}, TINY)
    with pytest.raises(ValueError, match=r"proj_out.bias has shape \(3,\)"):
        reference.pan2_transformer(hidden, timestep, text, {**sd, "proj_out.bias": torch.zeros(3)}, TINY)
    with pytest.raises(ValueError, match=r"\[B, 9, T, h, w\]; got \(2, 8, 2, 4, 6\)"):
        reference.pan2_transformer(hidden[:, :8], timestep, text, sd, TINY)
    with pytest.raises(ValueError, match=r"timestep must be \[2\]"):
        reference.pan2_transformer(hidden, timestep[:1], text, sd, TINY)
    with pytest.raises(ValueError, match="multiples of the patch"):
        reference.pan2_transformer(hidden[..., :5], timestep, text, sd, TINY)


# --------------------------------------------------------------------------------------------------------------------
# The pipeline pieces
# --------------------------------------------------------------------------------------------------------------------


def _exif_rotated_jpeg(path, width: int, height: int):
    """A landscape gradient JPEG whose EXIF orientation says 'rotate 90 degrees to display' (the stored pixels stay
    landscape)."""
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // (width - 1), y * 255 // (height - 1), (x * 7 + y * 3) % 256], -1).astype(np.uint8)
    img = Image.fromarray(pixels)
    exif = img.getexif()
    exif[0x0112] = 6
    img.save(path, exif=exif.tobytes(), quality=95)
    return path


def test_first_frame_is_pan2s_cover_crop_without_exif(tmp_path):
    """198x128 stored (EXIF: portrait) to 64x64: scale 0.5 -> 99x64, left = round(17.5) = 18 (half to even; Wan's
    floor would take 17), top 0."""
    from diffusers.video_processor import VideoProcessor
    from PIL import Image, ImageOps

    path = _exif_rotated_jpeg(tmp_path / "rotated.jpg", 198, 128)
    with Image.open(path) as img:
        assert ImageOps.exif_transpose(img).size == (128, 198)  # the tag is live: a viewer shows it portrait
        stored = img.convert("RGB")
    resized = np.asarray(stored.resize((99, 64), Image.LANCZOS))
    expected = (resized[:, 18:82].astype(np.float32) / np.float32(255)) * np.float32(2) - np.float32(1)
    got = reference.load_first_frame(path, 64, 64)
    assert got.shape == (1, 3, 1, 64, 64) and got.dtype == torch.float32
    assert torch.equal(got[0, :, 0], torch.from_numpy(expected).permute(2, 0, 1))
    floor_crop = (resized[:, 17:81].astype(np.float32) / np.float32(255)) * np.float32(2) - np.float32(1)
    assert not torch.equal(got[0, :, 0], torch.from_numpy(floor_crop).permute(2, 0, 1))
    # The [-1, 1] scaling is diffusers' VideoProcessor.preprocess at the same size.
    cropped = stored.resize((99, 64), Image.LANCZOS).crop((18, 0, 82, 64))
    assert torch.equal(got[:, :, 0], VideoProcessor(vae_scale_factor=16).preprocess(cropped, height=64, width=64))


def test_first_frame_covers_a_tall_image():
    """A 50x90 image to 64x32 (H x W): scale max(32/50, 64/90) = 0.711 -> 36x64 (35.56 rounds up), left 2, top 0."""
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, size=(90, 50, 3), dtype=np.uint8)
    img = Image.fromarray(pixels)
    got = reference.first_frame_from_image(img, 64, 32)
    expected = np.asarray(img.resize((36, 64), Image.LANCZOS))[:, 2:34].astype(np.float32) / np.float32(255)
    assert torch.equal(got[0, :, 0], torch.from_numpy(expected * np.float32(2) - np.float32(1)).permute(2, 0, 1))


def test_condition_is_the_normalised_vae_mode(wan22_vae, wan22_state_dict):
    """The first frame's `latent_dist.mode()` from diffusers' AutoencoderKLWan, normalised by the config vectors,
    in frame 0 of every sample, the mask channel after it 1 there; zeros elsewhere and for text-to-video."""
    z = wan22_vae.config.z_dim
    g = torch.Generator().manual_seed(12)
    frame = torch.rand(1, 3, 1, 32, 48, generator=g) * 2 - 1
    mean = (torch.randn(z, generator=g) * 0.5).tolist()
    std = (torch.rand(z, generator=g) + 0.5).tolist()
    shape = (2, z, 3, 2, 3)
    with torch.no_grad():
        mode = wan22_vae.encode(frame).latent_dist.mode()
    normalised = (mode - torch.tensor(mean).view(1, -1, 1, 1, 1)) / torch.tensor(std).view(1, -1, 1, 1, 1)
    got = reference.pan2_condition(frame, wan22_state_dict, mean, std, shape)
    assert got.shape == (2, z + 1, 3, 2, 3) and got.dtype == torch.float32
    for b in range(2):
        assert torch.equal(got[b, :z, :1], normalised[0])
    assert torch.equal(got[:, z, :1], torch.ones(2, 1, 2, 3))
    assert not got[:, :, 1:].any()
    text_to_video = reference.pan2_condition(None, wan22_state_dict, mean, std, shape)
    assert torch.equal(text_to_video, torch.zeros(2, z + 1, 3, 2, 3))
    with pytest.raises(ValueError, match="latents"):
        reference.pan2_condition(frame, wan22_state_dict, mean, std, (1, z, 3, 2, 2))


@pytest.mark.parametrize("steps,shift", [(1, 9.0), (4, 9.0), (50, 9.0), (7, 5), (6, 1.0)])
def test_sigmas_and_timesteps_are_diffusers_scheduler(steps, shift):
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1])
    sigmas = reference.pan2_sigmas(steps, shift)
    assert sigmas.dtype == torch.float32 and sigmas.shape == (steps,)
    assert torch.equal(sigmas, scheduler.sigmas[:-1]) and scheduler.sigmas[-1] == 0
    assert torch.equal(reference.pan2_timesteps(sigmas), scheduler.timesteps)


def test_noise_is_fastvideos_draw():
    """FastVideo's input validation makes one CPU generator per video seeded seed + i; its latent preparation draws
    with diffusers' randn_tensor over that list, in float32 here (PAN2's latents)."""
    from diffusers.utils.torch_utils import randn_tensor

    for batch in (1, 2):
        shape = (batch, 4, 3, 4, 6)
        generators = [torch.Generator("cpu").manual_seed(123 + i) for i in range(batch)]
        expected = randn_tensor(shape, generator=generators, device=torch.device("cpu"), dtype=torch.float32)
        assert torch.equal(reference.pan2_noise(123, shape), expected)
    single = torch.randn((1, 4, 3, 4, 6), generator=torch.Generator().manual_seed(7), dtype=torch.float32)
    assert torch.equal(reference.pan2_noise(7, (1, 4, 3, 4, 6)), single)


@pytest.mark.parametrize("guidance", [3.0, 1.0])
def test_sample_is_diffusers_euler_with_cfg(oracle, guidance):
    """Two steps of diffusers' FlowMatchEulerDiscreteScheduler over the oracle DiT, vLLM-Omni's loop: the latents
    stay fp32, [latents; condition] and the float32 timestep go in, neg + g (pos - neg) when g > 1."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    g = torch.Generator().manual_seed(13)
    noise = reference.pan2_noise(5, (1, TINY.out_channels, *LATENT))
    condition = torch.zeros(1, TINY.out_channels + 1, *LATENT)
    condition[:, :TINY.out_channels, :1] = torch.randn(1, TINY.out_channels, 1, *LATENT[1:], generator=g)
    condition[:, TINY.out_channels, :1] = 1.0
    positive, negative = torch.randn(2, 1, TEXT_LEN, TINY.text_embed_dim, generator=g)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=9.0)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, 3)[:-1])
    latents, expected = noise.clone(), []
    for t in scheduler.timesteps:
        model_input = torch.cat([latents, condition], dim=1)
        v = oracle(model_input, t.expand(1), positive)
        if guidance > 1:
            v_neg = oracle(model_input, t.expand(1), negative)
            v = v_neg + guidance * (v - v_neg)
        latents = scheduler.step(v.float(), t, latents, return_dict=False)[0]
        expected.append(latents)
    got = reference.pan2_sample(_state_dict(oracle), TINY, positive, negative if guidance > 1 else None, condition,
                                noise, reference.pan2_sigmas(2, 9.0), guidance, torch.float32)
    assert len(got) == 2
    for a, b in zip(got, expected):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, **FP32_TIGHT)
    with pytest.raises(ValueError, match="needs negative_embeds"):
        reference.pan2_sample(_state_dict(oracle), TINY, positive, None, condition, noise,
                              reference.pan2_sigmas(2, 9.0), 2.5, torch.float32)


def test_sample_bf16_keeps_fp32_latents(oracle):
    noise = reference.pan2_noise(5, (1, TINY.out_channels, *LATENT))
    text = torch.randn(1, TEXT_LEN, TINY.text_embed_dim, generator=torch.Generator().manual_seed(14))
    condition = torch.zeros(1, TINY.out_channels + 1, *LATENT)
    sigmas = reference.pan2_sigmas(2, 9.0)
    got = reference.pan2_sample(_state_dict(oracle), TINY, text, None, condition, noise, sigmas, 1.0, torch.bfloat16)
    # Step 1 by hand: the bf16 DiT's velocity, widened, then an fp32 Euler step.
    v = reference.pan2_transformer(torch.cat([noise, condition], 1).bfloat16(), reference.pan2_timesteps(sigmas)[:1],
                                   text, _state_dict(oracle), TINY)
    assert got[0].dtype == got[1].dtype == torch.float32
    assert torch.equal(got[0], noise + (sigmas[1] - sigmas[0]) * v.float())


# --------------------------------------------------------------------------------------------------------------------
# The prompt: a tiny Qwen3.5 text model behind a byte-level ChatML tokenizer
# --------------------------------------------------------------------------------------------------------------------

GENERATION_PROMPT = "<|im_start|>assistant\n<think>\n"
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
          "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def text_stack():
    """(tokenizer, text encoder): one token per byte plus the ChatML specials; Qwen3.5 with 4 layers (3 linear
    attention, 1 full), so hidden_states[-3] is layer 1's output."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3_5TextConfig, Qwen3_5TextModel

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<think>", "</think>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=CHATML, eos_token="<|im_end|>")
    config = Qwen3_5TextConfig(vocab_size=len(tokenizer), hidden_size=24, intermediate_size=48, num_hidden_layers=4,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=8, linear_num_key_heads=2,
                               linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
    torch.manual_seed(15)
    return tokenizer, Qwen3_5TextModel(config).eval()


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _hidden_minus_3(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[-3]


def _chat_prefix(tokenizer) -> list[int]:
    """The ids up to and including the user header, written out by hand."""
    return _ids(tokenizer, f"<|im_start|>system\n{reference.PAN2_SYSTEM_MESSAGE}<|im_end|>\n<|im_start|>user\n")


def test_prompt_embeds_are_hidden_state_minus_3_after_the_user_header(text_stack):
    tokenizer, model = text_stack
    prompt = "a red fox runs through snow"
    prefix = _chat_prefix(tokenizer)
    ids = prefix + _ids(tokenizer, f"{prompt}<|im_end|>\n{GENERATION_PROMPT}")
    got = reference.pan2_prompt_embeds(prompt, tokenizer, model)
    assert got.shape == (1, len(ids) - len(prefix), 24)
    assert torch.equal(got, _hidden_minus_3(model, ids)[:, len(prefix):])
    # The first conditioning token is the prompt's first; the state is not the final-normed one.
    assert ids[len(prefix)] == _ids(tokenizer, prompt)[0]
    with torch.no_grad():
        last = model(input_ids=torch.tensor([ids])).last_hidden_state[:, len(prefix):]
    assert not torch.allclose(got, last)
    # The system message takes part: the same tokens without it give other states.
    assert not torch.allclose(got, _hidden_minus_3(model, ids[len(prefix):]))


def test_empty_prompt_is_a_space(text_stack):
    tokenizer, model = text_stack
    assert torch.equal(reference.pan2_prompt_embeds("", tokenizer, model),
                       reference.pan2_prompt_embeds(" ", tokenizer, model))


@pytest.mark.parametrize("max_tokens", [reference.PAN2_MAX_PROMPT_TOKENS, 7])
def test_prompt_is_cut_max_tokens_after_the_header(text_stack, max_tokens):
    tokenizer, model = text_stack
    prompt = "waves " * 300  # 1800 tokens
    prefix = _chat_prefix(tokenizer)
    ids = prefix + _ids(tokenizer, f"{prompt}<|im_end|>\n{GENERATION_PROMPT}")
    got = reference.pan2_prompt_embeds(prompt, tokenizer, model, max_tokens=max_tokens)
    assert got.shape == (1, max_tokens, 24)
    assert torch.equal(got, _hidden_minus_3(model, ids[:len(prefix) + max_tokens])[:, len(prefix):])


def test_prompt_needs_the_user_header(text_stack):
    import copy

    tokenizer, model = text_stack
    other = copy.deepcopy(tokenizer)
    other.chat_template = CHATML.replace("'<|im_start|>' + m['role']", "'<|im_start|>' + m['role'] + ':'")
    with pytest.raises(ValueError, match="user"):
        reference.pan2_prompt_embeds("a cat", other, model)
    with pytest.raises(ValueError, match="max_tokens"):
        reference.pan2_prompt_embeds("a cat", tokenizer, model, max_tokens=0)
