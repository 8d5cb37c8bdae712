"""PAN2's transformer as a FastVideo DiT: `PAN2Transformer3DModel`, built on FastVideo's layers, so FastVideo's
loader, attention backend choice (FA4 included), sequence parallelism, FSDP, compile and layerwise offload apply.

It computes diffusers' `PAN2Transformer3DModel` (`fastvideo_pan2_ext.reference.pan2_transformer` is the plain-torch
oracle; tests/model/test_pan2_dit.py holds the two together):
- patch embedding (Conv3d, kernel = stride = patch), tokens in (t, h, w) order;
- timestep embedding: 256-channel sinusoid in fp32, cos first, cast to the DiT dtype, Linear, SiLU, Linear -> temb;
- text: RMSNorm (1e-5) and Linear, the refiner blocks (pre-norm RMS, self-attention with per-head RMS q/k and no
  RoPE, SwiGLU with the value half first), plus `context_type_embedding`;
- the joint blocks: AdaLN-zero video modulation from temb, a constant learned text modulation table, joint attention
  over [video; text] (3-axis RoPE on the video q/k, interleaved), gated residuals, GELU-tanh feed-forwards;
- AdaLayerNormContinuous (scale first), the output projection and the (C, pt, ph, pw) unpatchify.

Sequence parallelism (FastVideo's sp_size): the video tokens are split over the ranks (zero-padded to a multiple of
the ranks) after the patch embedding; FastVideo's DistributedAttention all-to-alls the video q/k/v to whole sequence
and a slice of the heads, trims the padding, rotates them by the whole sequence's RoPE table, and appends the text
q/k/v (replicated on every rank, head-sliced). Each rank computes the text stream whole. The output projection runs on
each rank's tokens; the (192-wide) result is gathered and unpadded before the unpatchify. One rank: no-ops.

All parameters are in the DiT dtype (IFM ships the joint blocks' `norm1.linear` in fp32; they load cast, as
vLLM-Omni loads them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fastvideo_pan2_ext.fastvideo_integration import compat
from fastvideo_pan2_ext.model.architecture import (LAYER_NORM_EPS, TEXT_RMS_EPS, TIMESTEP_CHANNELS,
                                                   PAN2TransformerConfig, latent_grid)
from fastvideo_pan2_ext.model.dit_config import PAN2DiTConfig

_ReplicatedLinear = compat.symbol("ReplicatedLinear")
_LayerNormScaleShift = compat.symbol("LayerNormScaleShift")
_ScaleResidualLayerNormScaleShift = compat.symbol("ScaleResidualLayerNormScaleShift")
_ScaleResidual = compat.symbol("ScaleResidual")
_MLP = compat.symbol("MLP")
_DistributedAttention = compat.symbol("DistributedAttention")
_LocalAttention = compat.symbol("LocalAttention")

_CONFIG = PAN2DiTConfig()


class PAN2RMSNorm(compat.symbol("RMSNorm")):
    """FastVideo's RMSNorm with diffusers' casts: the variance and the normalisation in fp32, the normalised value
    cast to the weight's dtype before the multiply (FastVideo's casts it to the input's dtype, which differs when the
    input is not in the weight's dtype, e.g. fp32 prompt embeddings into a bf16 DiT)."""

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is not None:
            raise NotImplementedError("PAN2RMSNorm takes no residual")
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"Expected hidden_size {self.hidden_size}, found {x.shape[-1]}")
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.variance_epsilon)
        return x.to(self.weight.dtype) * self.weight


def rope_tables(config: PAN2TransformerConfig, grid: tuple[int, int, int], device: torch.device | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The video tokens' half-dim RoPE tables (cos, sin), each [t*h*w, head_dim/2], fp32, in token order (t, h, w).

    Positions are patch indices, the frame ones times `rope_temporal_scale`; per axis of dimension d the frequencies
    are 1/theta^(2i/d) (fp32), the angles their outer product with the positions, cos/sin those of
    `torch.polar(1, angle)` (as diffusers' `get_1d_rotary_pos_embed(use_real=False)`); the axes are concatenated t, h,
    w along the last dim."""
    cos_parts, sin_parts = [], []
    for axis, (size, dim) in enumerate(zip(grid, config.rope_axes_dim)):
        positions = torch.arange(size, dtype=torch.float32, device=device)
        if axis == 0:
            positions = positions * config.rope_temporal_scale
        exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device)[:dim // 2] / dim
        freqs = 1.0 / (config.rope_theta**exponents)
        angles = torch.outer(positions, freqs)
        rotation = torch.polar(torch.ones_like(angles), angles)
        shape = [1, 1, 1, dim // 2]
        shape[axis] = size
        cos_parts.append(rotation.real.reshape(shape).expand(*grid, dim // 2))
        sin_parts.append(rotation.imag.reshape(shape).expand(*grid, dim // 2))
    half = config.attention_head_dim // 2
    return torch.cat(cos_parts, dim=-1).reshape(-1, half), torch.cat(sin_parts, dim=-1).reshape(-1, half)


def _heads(x: torch.Tensor, parts: int, heads: int) -> list[torch.Tensor]:
    """[B, S, parts*H*hd] -> `parts` views [B, S, H, hd]."""
    b, s, _ = x.shape
    return list(x.view(b, s, parts, heads, -1).unbind(2))


class PAN2ContextEmbedder(nn.Module):
    """RMSNorm(text_embed_dim, 1e-5), then Linear(text_embed_dim -> D)."""

    def __init__(self, text_embed_dim: int, dim: int, prefix: str = "") -> None:
        super().__init__()
        self.norm = PAN2RMSNorm(text_embed_dim, eps=TEXT_RMS_EPS, dtype=torch.get_default_dtype())
        self.proj = _ReplicatedLinear(text_embed_dim, dim, bias=True, prefix=f"{prefix}.proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))[0]


class PAN2RefinerAttention(nn.Module):
    """The refiner's self-attention: fused q/k/v without bias, per-head RMS (1e-5) on q and k, no RoPE, no mask."""

    def __init__(self, dim: int, heads: int, head_dim: int, prefix: str = "") -> None:
        super().__init__()
        self.heads = heads
        self.to_qkv = _ReplicatedLinear(dim, 3 * heads * head_dim, bias=False, prefix=f"{prefix}.to_qkv")
        self.norm_q = PAN2RMSNorm(head_dim, eps=TEXT_RMS_EPS, dtype=torch.get_default_dtype())
        self.norm_k = PAN2RMSNorm(head_dim, eps=TEXT_RMS_EPS, dtype=torch.get_default_dtype())
        self.to_out = _ReplicatedLinear(heads * head_dim, dim, bias=False, prefix=f"{prefix}.to_out")
        self.attn = _LocalAttention(num_heads=heads, head_size=head_dim, causal=False,
                                    supported_attention_backends=_CONFIG._supported_attention_backends)

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        q, k, v = _heads(self.to_qkv(c)[0], 3, self.heads)
        out = self.attn(self.norm_q(q), self.norm_k(k), v)
        return self.to_out(out.flatten(2))[0]


class PAN2SwiGLU(nn.Module):
    """diffusers' FeedForward(activation_fn="swiglu", bias=False): the projection's first half is the value, the
    second the gate: fc_out(a * silu(g))."""

    def __init__(self, dim: int, inner_dim: int, prefix: str = "") -> None:
        super().__init__()
        self.fc_in = _ReplicatedLinear(dim, 2 * inner_dim, bias=False, prefix=f"{prefix}.fc_in")
        self.fc_out = _ReplicatedLinear(inner_dim, dim, bias=False, prefix=f"{prefix}.fc_out")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value, gate = self.fc_in(x)[0].chunk(2, dim=-1)
        return self.fc_out(value * F.silu(gate))[0]


class PAN2RefinerBlock(nn.Module):
    """c + attn(RMS(c)), then c + ff(RMS(c)); no temb, no bias."""

    def __init__(self, config: PAN2TransformerConfig, prefix: str = "") -> None:
        super().__init__()
        dim = config.inner_dim
        self.norm1 = PAN2RMSNorm(dim, eps=TEXT_RMS_EPS, dtype=torch.get_default_dtype())
        self.attn = PAN2RefinerAttention(dim, config.num_attention_heads, config.attention_head_dim,
                                         prefix=f"{prefix}.attn")
        self.norm2 = PAN2RMSNorm(dim, eps=TEXT_RMS_EPS, dtype=torch.get_default_dtype())
        self.ff = PAN2SwiGLU(dim, config.ff_dim(config.refiner_mlp_ratio), prefix=f"{prefix}.ff")

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        c = c + self.attn(self.norm1(c))
        return c + self.ff(self.norm2(c))


class PAN2JointAttention(nn.Module):
    """Joint attention over [video; text]: per-stream fused q/k/v with bias and per-head RMS (1e-6); the video q/k
    rotated (interleaved RoPE, inside DistributedAttention); scale 1/sqrt(head_dim), no mask; per-stream outputs."""

    def __init__(self, dim: int, heads: int, head_dim: int, prefix: str = "") -> None:
        super().__init__()
        self.heads = heads
        inner = heads * head_dim
        dtype = torch.get_default_dtype()
        self.to_qkv = _ReplicatedLinear(dim, 3 * inner, bias=True, prefix=f"{prefix}.to_qkv")
        self.norm_q = PAN2RMSNorm(head_dim, eps=LAYER_NORM_EPS, dtype=dtype)
        self.norm_k = PAN2RMSNorm(head_dim, eps=LAYER_NORM_EPS, dtype=dtype)
        self.add_qkv_proj = _ReplicatedLinear(dim, 3 * inner, bias=True, prefix=f"{prefix}.add_qkv_proj")
        self.norm_added_q = PAN2RMSNorm(head_dim, eps=LAYER_NORM_EPS, dtype=dtype)
        self.norm_added_k = PAN2RMSNorm(head_dim, eps=LAYER_NORM_EPS, dtype=dtype)
        self.to_out = _ReplicatedLinear(inner, dim, bias=True, prefix=f"{prefix}.to_out")
        self.to_add_out = _ReplicatedLinear(inner, dim, bias=True, prefix=f"{prefix}.to_add_out")
        self.attn = _DistributedAttention(num_heads=heads, head_size=head_dim, causal=False,
                                          supported_attention_backends=_CONFIG._supported_attention_backends,
                                          prefix=f"{prefix}.attn")

    def forward(self, x: torch.Tensor, c: torch.Tensor, freqs_cis: tuple[torch.Tensor, torch.Tensor],
                video_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = _heads(self.to_qkv(x)[0], 3, self.heads)
        cq, ck, cv = _heads(self.add_qkv_proj(c)[0], 3, self.heads)
        x_out, c_out = self.attn(self.norm_q(q), self.norm_k(k), v, video_tokens,
                                 self.norm_added_q(cq), self.norm_added_k(ck), cv, freqs_cis=freqs_cis)
        return self.to_out(x_out.flatten(2))[0], self.to_add_out(c_out.flatten(2))[0]


class PAN2JointBlock(nn.Module):
    """One MMDiT block: video AdaLN-zero from temb, text modulation from `scale_shift_table_context`, both chunked
    (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp); LayerNorms without affine, eps 1e-6."""

    def __init__(self, config: PAN2TransformerConfig, prefix: str = "") -> None:
        super().__init__()
        dim = config.inner_dim
        dtype = torch.get_default_dtype()
        self.video_mod = compat.symbol("ModulateProjection")(dim, factor=6, act_layer="silu",
                                                              prefix=f"{prefix}.video_mod")
        self.scale_shift_table_context = nn.Parameter(torch.empty(6 * dim))

        def norm():
            return _LayerNormScaleShift(dim, norm_type="layer", eps=LAYER_NORM_EPS, elementwise_affine=False,
                                        dtype=dtype)

        def residual_norm():
            return _ScaleResidualLayerNormScaleShift(dim, norm_type="layer", eps=LAYER_NORM_EPS,
                                                     elementwise_affine=False, dtype=dtype)

        self.video_attn_norm, self.text_attn_norm = norm(), norm()
        self.attn = PAN2JointAttention(dim, config.num_attention_heads, config.attention_head_dim,
                                       prefix=f"{prefix}.attn")
        self.video_attn_residual_mlp_norm, self.text_attn_residual_mlp_norm = residual_norm(), residual_norm()
        self.ff = _MLP(dim, config.ff_dim(config.mlp_ratio), bias=True, act_type="gelu_pytorch_tanh",
                       prefix=f"{prefix}.ff")
        self.ff_context = _MLP(dim, config.ff_dim(config.context_mlp_ratio), bias=True, act_type="gelu_pytorch_tanh",
                               prefix=f"{prefix}.ff_context")
        self.video_mlp_residual, self.text_mlp_residual = _ScaleResidual(), _ScaleResidual()

    def forward(self, x: torch.Tensor, c: torch.Tensor, temb: torch.Tensor,
                freqs_cis: tuple[torch.Tensor, torch.Tensor], video_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = \
            self.video_mod(temb).unsqueeze(1).chunk(6, dim=-1)  # each [B, 1, D]
        c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = \
            self.scale_shift_table_context.to(temb.dtype).chunk(6, dim=-1)  # each [D]

        x_attn, c_attn = self.attn(self.video_attn_norm(x, shift_msa, scale_msa),
                                   self.text_attn_norm(c, c_shift_msa, c_scale_msa), freqs_cis, video_tokens)
        x_ff_in, x = self.video_attn_residual_mlp_norm(x, x_attn, gate_msa, shift_mlp, scale_mlp)
        c_ff_in, c = self.text_attn_residual_mlp_norm(c, c_attn, c_gate_msa, c_shift_mlp, c_scale_mlp)
        x = self.video_mlp_residual(x, self.ff(x_ff_in), gate_mlp)
        c = self.text_mlp_residual(c, self.ff_context(c_ff_in), c_gate_mlp)
        return x, c


class PAN2OutputNorm(nn.Module):
    """diffusers' AdaLayerNormContinuous(D, D, elementwise_affine=False, eps=1e-6): Linear(SiLU(temb)) chunked
    scale first, then shift; LN(x) * (1 + scale) + shift."""

    def __init__(self, dim: int, prefix: str = "") -> None:
        super().__init__()
        self.linear = _ReplicatedLinear(dim, 2 * dim, bias=True, prefix=f"{prefix}.linear")
        self.norm = nn.LayerNorm(dim, eps=LAYER_NORM_EPS, elementwise_affine=False)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(F.silu(temb).to(x.dtype))[0].unsqueeze(1).chunk(2, dim=-1)
        return self.norm(x) * (1 + scale) + shift


class PAN2Transformer3DModel(compat.symbol("BaseDiT")):
    """PAN2's 29 B MMDiT. forward(hidden_states [B, 2*C+1, T', H, W], encoder_hidden_states [B, L, text_embed_dim]
    (or a one-element list of it), timestep [B] (sigma x 1000)) -> [B, C, T', H, W]."""

    _fsdp_shard_conditions = _CONFIG._fsdp_shard_conditions
    _compile_conditions = _CONFIG._compile_conditions
    _supported_attention_backends = _CONFIG._supported_attention_backends
    param_names_mapping = _CONFIG.param_names_mapping
    reverse_param_names_mapping = _CONFIG.reverse_param_names_mapping
    lora_param_names_mapping = _CONFIG.lora_param_names_mapping

    def __init__(self, config: PAN2DiTConfig, hf_config: dict[str, Any], **kwargs) -> None:
        super().__init__(config=config, hf_config=hf_config)
        arch = config.transformer_config()
        self.arch = arch
        dim = arch.inner_dim
        self.hidden_size = dim
        self.num_attention_heads = arch.num_attention_heads
        self.num_channels_latents = arch.out_channels
        self.out_channels = arch.out_channels
        self.patch_size = arch.patch_size
        prefix = config.prefix

        self.x_embedder = compat.symbol("PatchEmbed")(list(arch.patch_size), arch.in_channels, dim,
                                                       prefix=f"{prefix}.x_embedder")
        self.time_embedder = compat.symbol("TimestepEmbedder")(dim, act_layer="silu",
                                                                frequency_embedding_size=TIMESTEP_CHANNELS,
                                                                prefix=f"{prefix}.time_embedder")
        self.context_embedder = PAN2ContextEmbedder(arch.text_embed_dim, dim, prefix=f"{prefix}.context_embedder")
        # The joint blocks are the model's FIRST nn.ModuleList: FastVideo's layerwise offload hooks only that one.
        self.transformer_blocks = nn.ModuleList(
            [PAN2JointBlock(arch, prefix=f"{prefix}.transformer_blocks.{i}") for i in range(arch.num_layers)])
        self.context_refiner = nn.ModuleList(
            [PAN2RefinerBlock(arch, prefix=f"{prefix}.context_refiner.{j}") for j in range(arch.num_refiner_layers)])
        self.context_type_embedding = nn.Parameter(torch.empty(dim))
        self.norm_out = PAN2OutputNorm(dim, prefix=f"{prefix}.norm_out")
        self.proj_out = _ReplicatedLinear(dim, arch.patch_volume * arch.out_channels, bias=True,
                                          prefix=f"{prefix}.proj_out")
        self.__post_init__()

    def forward(self,
                hidden_states: torch.Tensor,
                encoder_hidden_states: torch.Tensor | list[torch.Tensor],
                timestep: torch.Tensor,
                encoder_hidden_states_image: torch.Tensor | list[torch.Tensor] | None = None,
                guidance=None,
                **kwargs) -> torch.Tensor:
        if isinstance(encoder_hidden_states, (list, tuple)):
            if len(encoder_hidden_states) != 1:
                raise ValueError(f"PAN2 takes one text embedding tensor; got {len(encoder_hidden_states)}")
            encoder_hidden_states = encoder_hidden_states[0]
        if hidden_states.dim() != 5 or hidden_states.shape[1] != self.arch.in_channels:
            raise ValueError(f"hidden_states must be [B, {self.arch.in_channels}, T, H, W]; got "
                             f"{tuple(hidden_states.shape)}")
        batch = hidden_states.shape[0]
        if encoder_hidden_states.dim() != 3 or encoder_hidden_states.shape[0] != batch:
            raise ValueError(f"encoder_hidden_states must be [{batch}, L, {self.arch.text_embed_dim}]; got "
                             f"{tuple(encoder_hidden_states.shape)}")
        grid = latent_grid(self.arch, *hidden_states.shape[2:])
        dtype = self.x_embedder.proj.weight.dtype

        x = self.x_embedder(hidden_states.to(dtype))  # [B, S, D], tokens in (t, h, w) order
        freqs_cis = rope_tables(self.arch, grid, x.device)  # the whole sequence's: applied after the all-to-all
        x, video_tokens = compat.symbol("sequence_model_parallel_shard")(x, dim=1)

        temb = self.time_embedder(timestep.reshape(-1).expand(batch) if timestep.numel() == 1 else timestep)
        c = self.context_embedder(encoder_hidden_states)
        for block in self.context_refiner:
            c = block(c)
        c = c + self.context_type_embedding

        for block in self.transformer_blocks:
            x, c = block(x, c, temb, freqs_cis, video_tokens)

        x = self.proj_out(self.norm_out(x, temb))[0]
        x = compat.symbol("sequence_model_parallel_all_gather_with_unpad")(x, video_tokens, dim=1)
        return compat.symbol("unpatchify")(x, *grid, self.patch_size, self.out_channels)

