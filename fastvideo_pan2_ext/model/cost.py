"""PAN2's compute per sampler step, by arithmetic (docs/design/pan2.md, "PAN2's cost"): the transformer's linear layers
(the patch embedding's convolution among them) and its attention, separately, for a request's token counts, one
sample. Counted in FLOPs, a multiply-add being 2, as torch's FlopCounterMode counts them (tests/model/test_pan2_memory.py
holds the two equal on the reference transformer)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fastvideo_pan2_ext.model.architecture import PAN2TransformerConfig


@dataclass(frozen=True)
class ForwardFlops:
    linear: int
    attention: int

    @property
    def total(self) -> int:
        return self.linear + self.attention


def forward_flops(c: PAN2TransformerConfig, video_tokens: int, text_tokens: int) -> ForwardFlops:
    """One transformer forward over `video_tokens` and `text_tokens`."""
    d, out = c.inner_dim, c.patch_volume * c.out_channels
    video = 4 * d * d + 2 * d * c.ff_dim(c.mlp_ratio)  # q, k, v, out; the feed-forward's two linears
    text = 4 * d * d + 2 * d * c.ff_dim(c.context_mlp_ratio)
    refiner = 4 * d * d + 3 * d * c.ff_dim(c.refiner_mlp_ratio)  # SwiGLU: two inputs, one output
    one_row = 256 * d + d * d + c.num_layers * 6 * d * d + 2 * d * d  # timestep embedder, AdaLN, output norm
    per_token = c.in_channels * c.patch_volume * d + d * out  # patch embedding, output projection
    linear = 2 * (c.num_layers * (video_tokens * video + text_tokens * text) + c.num_refiner_layers * text_tokens *
                  refiner + text_tokens * c.text_embed_dim * d + video_tokens * per_token + one_row)
    joint = video_tokens + text_tokens
    # Q K^T and P V over every head: 2 x joint^2 x d multiply-adds per joint block; the refiner over the text alone.
    attention = 2 * (2 * c.num_layers * joint * joint * d + 2 * c.num_refiner_layers * text_tokens * text_tokens * d)
    return ForwardFlops(linear, attention)


def step_flops(c: PAN2TransformerConfig, video_tokens: int, text_tokens: int, guidance: bool = True) -> ForwardFlops:
    """One sampler step: two forwards with guidance (the prompt and the negative prompt), else one."""
    one = forward_flops(c, video_tokens, text_tokens)
    n = 2 if guidance else 1
    return ForwardFlops(n * one.linear, n * one.attention)


def joint_block_flops(c: PAN2TransformerConfig, video_tokens: int, text_tokens: int) -> ForwardFlops:
    """One joint block of a forward (its AdaLN projection included): what one more block adds to `forward_flops`."""
    one, two = (forward_flops(dataclasses.replace(c, num_layers=n), video_tokens, text_tokens) for n in (1, 2))
    return ForwardFlops(two.linear - one.linear, two.attention - one.attention)
