"""PAN2's DiT configuration in FastVideo's form (`PAN2DiTConfig`, as `fastvideo/configs/models/dits/hunyuanvideo.py`
is HunyuanVideo's): the `transformer/config.json` keys as architecture fields, which FastVideo's `TransformerLoader`
overwrites from the checkpoint (`update_model_arch`), and the diffusers -> FastVideo parameter names.

The module names of `model.transformer.PAN2Transformer3DModel` differ from diffusers' where FastVideo's layers name
their weights differently or where projections are fused:
- q, k and v are fused, one `ReplicatedLinear` each for the video stream (`attn.to_qkv`), the text stream
  (`attn.add_qkv_proj`) and the text refiner (`attn.to_qkv`), so each stream projects in one GEMM; FastVideo's loader
  concatenates the three checkpoint tensors along the output dim (the `(name, index, count)` form below);
- FastVideo's `PatchEmbed` (`x_embedder.proj`), `TimestepEmbedder` (`time_embedder.mlp.fc_in/fc_out`), `MLP`
  (`ff.fc_in/fc_out`) and `ModulateProjection` (`video_mod.linear`);
- `to_out.0` -> `to_out`, `context_embedder.0/.1` -> `context_embedder.norm/.proj`.
Every other name is diffusers' own.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from fastvideo_pan2_ext.fastvideo_integration import compat
from fastvideo_pan2_ext.model.architecture import PAN2TransformerConfig

_REAL = PAN2TransformerConfig()
_Backends = compat.symbol("AttentionBackendEnum")


def is_joint_block(name: str, module) -> bool:
    """One of the joint (video + text) blocks: FSDP and compile units."""
    return re.fullmatch(r"transformer_blocks\.\d+", name) is not None


def is_refiner_block(name: str, module) -> bool:
    """One of the text refiner's blocks: FSDP and compile units."""
    return re.fullmatch(r"context_refiner\.\d+", name) is not None


_STACKS = r"(transformer_blocks|context_refiner)"

PARAM_NAMES_MAPPING = {
    # Embedders.
    r"^x_embedder\.(weight|bias)$": r"x_embedder.proj.\1",
    r"^time_embedder\.linear_1\.(.*)$": r"time_embedder.mlp.fc_in.\1",
    r"^time_embedder\.linear_2\.(.*)$": r"time_embedder.mlp.fc_out.\1",
    r"^context_embedder\.0\.(.*)$": r"context_embedder.norm.\1",
    r"^context_embedder\.1\.(.*)$": r"context_embedder.proj.\1",
    # Attention (joint blocks and refiner): q/k/v fused, in that order along the output dim.
    rf"^{_STACKS}\.(\d+)\.attn\.to_q\.(.*)$": (r"\1.\2.attn.to_qkv.\3", 0, 3),
    rf"^{_STACKS}\.(\d+)\.attn\.to_k\.(.*)$": (r"\1.\2.attn.to_qkv.\3", 1, 3),
    rf"^{_STACKS}\.(\d+)\.attn\.to_v\.(.*)$": (r"\1.\2.attn.to_qkv.\3", 2, 3),
    r"^transformer_blocks\.(\d+)\.attn\.add_q_proj\.(.*)$": (r"transformer_blocks.\1.attn.add_qkv_proj.\2", 0, 3),
    r"^transformer_blocks\.(\d+)\.attn\.add_k_proj\.(.*)$": (r"transformer_blocks.\1.attn.add_qkv_proj.\2", 1, 3),
    r"^transformer_blocks\.(\d+)\.attn\.add_v_proj\.(.*)$": (r"transformer_blocks.\1.attn.add_qkv_proj.\2", 2, 3),
    rf"^{_STACKS}\.(\d+)\.attn\.to_out\.0\.(.*)$": r"\1.\2.attn.to_out.\3",
    # Feed-forwards (diffusers' FeedForward: net.0.proj, net.2).
    rf"^{_STACKS}\.(\d+)\.(ff|ff_context)\.net\.0\.proj\.(.*)$": r"\1.\2.\3.fc_in.\4",
    rf"^{_STACKS}\.(\d+)\.(ff|ff_context)\.net\.2\.(.*)$": r"\1.\2.\3.fc_out.\4",
    # The joint blocks' video AdaLN-zero projection.
    r"^transformer_blocks\.(\d+)\.norm1\.linear\.(.*)$": r"transformer_blocks.\1.video_mod.linear.\2",
}

# Attention backends that run a full, unmasked, bidirectional attention at head dim 128 (FLASH_ATTN includes FA4
# where FASTVIDEO_FA4 turns it on; the two Sage backends are FastVideo's quantized opt-ins). The sparse backends
# (VSA, VMoBA, SLA, BSA, NABLA) need a layout or learned parameters PAN2 does not have; the QAT ones need a model
# trained for them.
SUPPORTED_ATTENTION_BACKENDS = (_Backends.FLASH_ATTN, _Backends.TORCH_SDPA, _Backends.SAGE_ATTN,
                                _Backends.SAGE_ATTN_THREE)


@dataclass
class PAN2ArchConfig(compat.symbol("DiTArchConfig")):
    """The 14 `transformer/config.json` keys (the real PAN2's values by default) and FastVideo's DiT fields."""

    _fsdp_shard_conditions: list = field(default_factory=lambda: [is_joint_block, is_refiner_block])
    _compile_conditions: list = field(default_factory=lambda: [is_joint_block, is_refiner_block])
    param_names_mapping: dict = field(default_factory=lambda: dict(PARAM_NAMES_MAPPING))
    _supported_attention_backends: tuple = SUPPORTED_ATTENTION_BACKENDS
    cast_prompt_embeds_to_dit_dtype: bool = True

    patch_size: tuple[int, int, int] = _REAL.patch_size
    in_channels: int = _REAL.in_channels
    out_channels: int = _REAL.out_channels
    num_attention_heads: int = _REAL.num_attention_heads
    attention_head_dim: int = _REAL.attention_head_dim
    num_layers: int = _REAL.num_layers
    num_refiner_layers: int = _REAL.num_refiner_layers
    mlp_ratio: float = _REAL.mlp_ratio
    context_mlp_ratio: float = _REAL.context_mlp_ratio
    refiner_mlp_ratio: float = _REAL.refiner_mlp_ratio
    text_embed_dim: int = _REAL.text_embed_dim
    rope_axes_dim: tuple[int, int, int] = _REAL.rope_axes_dim
    rope_theta: float = _REAL.rope_theta
    rope_temporal_scale: float = _REAL.rope_temporal_scale

    def __post_init__(self) -> None:
        super().__post_init__()
        # config.json holds lists; the definition checks every key (raises on an inconsistent checkpoint).
        definition = self.transformer_config()
        self.patch_size = definition.patch_size
        self.rope_axes_dim = definition.rope_axes_dim
        self.hidden_size = definition.inner_dim
        self.num_channels_latents = definition.out_channels  # the noise channels (in_channels adds condition, mask)

    def transformer_config(self) -> PAN2TransformerConfig:
        """These fields as the torch-free definition (`model.architecture`)."""
        return PAN2TransformerConfig(**{f.name: getattr(self, f.name)
                                        for f in dataclasses.fields(PAN2TransformerConfig)})


@dataclass
class PAN2DiTConfig(compat.symbol("DiTConfig")):
    arch_config: PAN2ArchConfig = field(default_factory=PAN2ArchConfig)

    prefix: str = "PAN2"

    def transformer_config(self) -> PAN2TransformerConfig:
        return self.arch_config.transformer_config()
