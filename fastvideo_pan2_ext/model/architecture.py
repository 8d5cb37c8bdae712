"""PAN2's transformer as its checkpoint describes it: the `transformer/config.json` keys, the diffusers weight names
and shapes, the token counts. One definition, read by the reference (`fastvideo_pan2_ext.reference`), the FastVideo
DiT (`model.transformer`), the tiny checkpoint maker and the memory plan. Torch-free.

The keys and the real values are those of diffusers' `PAN2Transformer3DModel` constructor (docs/design/pan2.md, "PAN2").
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

TRANSFORMER_CLASS_NAME = "PAN2Transformer3DModel"  # transformer/config.json `_class_name`, FastVideo's registry key
TEXT_ENCODER_CLASS_NAME = "Qwen3_5TextModel"  # text_encoder/config.json `architectures`
LATENT_CHANNELS = 48  # the Wan2.2 VAE's z_dim: noise, condition and output channels
TIMESTEP_CHANNELS = 256  # the sinusoidal timestep embedding's width
LAYER_NORM_EPS = 1e-6  # the joint blocks' LayerNorms (no affine), norm_out, and the joint q/k RMSNorms
TEXT_RMS_EPS = 1e-5  # the context embedder's RMSNorm and everything in the text refiner


@dataclass(frozen=True)
class PAN2TransformerConfig:
    """`transformer/config.json`: the real PAN2's values by default (29.2 B parameters)."""

    patch_size: tuple[int, int, int] = (1, 2, 2)
    in_channels: int = 2 * LATENT_CHANNELS + 1  # noisy latents, condition latents, mask
    out_channels: int = LATENT_CHANNELS
    num_attention_heads: int = 32
    attention_head_dim: int = 128
    num_layers: int = 44
    num_refiner_layers: int = 4
    mlp_ratio: float = 8.0
    context_mlp_ratio: float = 4.0
    refiner_mlp_ratio: float = 4.0
    text_embed_dim: int = 4096
    rope_axes_dim: tuple[int, int, int] = (16, 56, 56)
    rope_theta: float = 256.0
    rope_temporal_scale: float = 16 / 24

    def __post_init__(self) -> None:
        object.__setattr__(self, "patch_size", tuple(int(p) for p in self.patch_size))
        object.__setattr__(self, "rope_axes_dim", tuple(int(d) for d in self.rope_axes_dim))
        if len(self.patch_size) != 3 or min(self.patch_size) < 1:
            raise ValueError(f"patch_size must be three positive ints (t, h, w); got {self.patch_size}")
        if len(self.rope_axes_dim) != 3 or any(d % 2 for d in self.rope_axes_dim):
            raise ValueError(f"rope_axes_dim must be three even ints (t, h, w); got {self.rope_axes_dim}")
        if sum(self.rope_axes_dim) != self.attention_head_dim:
            raise ValueError(f"rope_axes_dim {self.rope_axes_dim} must sum to attention_head_dim "
                             f"{self.attention_head_dim}")
        if self.in_channels != 2 * self.out_channels + 1:
            raise ValueError(f"in_channels must be 2 x out_channels + 1 (noisy latents, condition latents, mask); got "
                             f"{self.in_channels} and {self.out_channels}")

    @classmethod
    def from_json(cls, config: dict) -> PAN2TransformerConfig:
        """The config from `transformer/config.json`'s dict (diffusers' bookkeeping keys such as `_class_name` are
        ignored; a missing key takes the real model's value)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in config.items() if k in names})

    def to_json(self) -> dict:
        return {"_class_name": TRANSFORMER_CLASS_NAME, **{k: (list(v) if isinstance(v, tuple) else v)
                                                          for k, v in dataclasses.asdict(self).items()}}

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    def ff_dim(self, ratio: float) -> int:
        return int(self.inner_dim * ratio)

    @property
    def patch_volume(self) -> int:
        return math.prod(self.patch_size)


def weight_shapes(c: PAN2TransformerConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the diffusers model, by its state-dict name, in the model's module order."""
    d = c.inner_dim
    hd = c.attention_head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "x_embedder.weight": (d, c.in_channels, *c.patch_size),
        "x_embedder.bias": (d,),
        "time_embedder.linear_1.weight": (d, TIMESTEP_CHANNELS),
        "time_embedder.linear_1.bias": (d,),
        "time_embedder.linear_2.weight": (d, d),
        "time_embedder.linear_2.bias": (d,),
        "context_embedder.0.weight": (c.text_embed_dim,),
        "context_embedder.1.weight": (d, c.text_embed_dim),
        "context_embedder.1.bias": (d,),
    }
    refiner_ff = c.ff_dim(c.refiner_mlp_ratio)
    for j in range(c.num_refiner_layers):
        p = f"context_refiner.{j}."
        shapes.update({
            p + "norm1.weight": (d,),
            p + "attn.to_q.weight": (d, d),
            p + "attn.to_k.weight": (d, d),
            p + "attn.to_v.weight": (d, d),
            p + "attn.norm_q.weight": (hd,),
            p + "attn.norm_k.weight": (hd,),
            p + "attn.to_out.0.weight": (d, d),
            p + "norm2.weight": (d,),
            p + "ff.net.0.proj.weight": (2 * refiner_ff, d),  # SwiGLU: value half, then gate half
            p + "ff.net.2.weight": (d, refiner_ff),
        })
    shapes["context_type_embedding"] = (d,)
    ff, ff_context = c.ff_dim(c.mlp_ratio), c.ff_dim(c.context_mlp_ratio)
    for i in range(c.num_layers):
        p = f"transformer_blocks.{i}."
        shapes.update({
            p + "norm1.linear.weight": (6 * d, d),
            p + "norm1.linear.bias": (6 * d,),
            p + "scale_shift_table_context": (6 * d,),
        })
        for proj in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
            shapes[p + f"attn.{proj}.weight"] = (d, d)
            shapes[p + f"attn.{proj}.bias"] = (d,)
        for norm in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            shapes[p + f"attn.{norm}.weight"] = (hd,)
        shapes.update({
            p + "attn.to_out.0.weight": (d, d),
            p + "attn.to_out.0.bias": (d,),
            p + "attn.to_add_out.weight": (d, d),
            p + "attn.to_add_out.bias": (d,),
            p + "ff.net.0.proj.weight": (ff, d),
            p + "ff.net.0.proj.bias": (ff,),
            p + "ff.net.2.weight": (d, ff),
            p + "ff.net.2.bias": (d,),
            p + "ff_context.net.0.proj.weight": (ff_context, d),
            p + "ff_context.net.0.proj.bias": (ff_context,),
            p + "ff_context.net.2.weight": (d, ff_context),
            p + "ff_context.net.2.bias": (d,),
        })
    shapes.update({
        "norm_out.linear.weight": (2 * d, d),
        "norm_out.linear.bias": (2 * d,),
        "proj_out.weight": (c.patch_volume * c.out_channels, d),
        "proj_out.bias": (c.patch_volume * c.out_channels,),
    })
    return shapes


def stored_in_fp32(name: str) -> bool:
    """The weights IFM's checkpoint stores in fp32 (the joint blocks' AdaLN `norm1.linear`); the rest are bf16."""
    return name.startswith("transformer_blocks.") and ".norm1.linear." in name


def parameter_count(c: PAN2TransformerConfig) -> int:
    return sum(math.prod(shape) for shape in weight_shapes(c).values())


def latent_grid(c: PAN2TransformerConfig, latent_frames: int, latent_height: int, latent_width: int
                ) -> tuple[int, int, int]:
    """The token grid (t, h, w) of a latent video: the patch embedding's output extents."""
    pt, ph, pw = c.patch_size
    if latent_frames % pt or latent_height % ph or latent_width % pw:
        raise ValueError(f"latent extents {(latent_frames, latent_height, latent_width)} must be multiples of the "
                         f"patch {c.patch_size}")
    return latent_frames // pt, latent_height // ph, latent_width // pw


def video_tokens(c: PAN2TransformerConfig, latent_frames: int, latent_height: int, latent_width: int) -> int:
    return math.prod(latent_grid(c, latent_frames, latent_height, latent_width))
