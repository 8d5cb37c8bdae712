"""FastVideo's model code (fastvideo.models, fastvideo.layers, fastvideo.attention, fastvideo.distributed's sequence
ops, fastvideo.platforms): PAN2's DiT on FastVideo's layers, its text encoder through FastVideo's loader, and the
modules that read FASTVIDEO_FA4 (`fastvideo_pan2_ext.attention.fa4` must choose before they load)."""

from __future__ import annotations

from .seams import Seam

# FastVideo modules that read FASTVIDEO_FA4 when they are imported; once one is loaded, this process's choice is made.
FA4_READERS = (
    "fastvideo.attention.backends.flash_attn",
    "fastvideo.attention.utils.flash_attn_default",
    "fastvideo.attention.utils.flash_attn_no_pad",
)

SEAMS = (
    Seam("fastvideo.models.loader.component_loader", "TextEncoderLoader.load_model", "a class with "
         "supports_hf_from_pretrained returns transformers' model (Qwen3.5)", mentions="from_pretrained_local"),
    Seam(FA4_READERS[0], "", "imports FA4's reader of FASTVIDEO_FA4: the FA4 policy must run before",
         mentions=FA4_READERS[1]),
    *(Seam(reader, "", "reads FASTVIDEO_FA4 once, when imported: the FA4 policy must run before",
           mentions="FASTVIDEO_FA4") for reader in FA4_READERS[1:]),
    Seam("fastvideo.platforms", "AttentionBackendEnum", "the attention backends PAN2's DiT supports",
         name="AttentionBackendEnum"),
    Seam("fastvideo.models.dits.base", "BaseDiT", "PAN2's DiT is one (TransformerLoader builds it)", name="BaseDiT"),
    Seam("fastvideo.attention.layer", "DistributedAttention", "the joint [video; text] attention: video q/k/v "
         "sequence-parallel, text q/k/v replicated (appended after the video)", name="DistributedAttention"),
    Seam("fastvideo.attention.layer", "DistributedAttention.forward", "... which rotates the video q/k by freqs_cis "
         "(half-dim cos/sin) interleaved (GPT-J), PAN2's RoPE convention", mentions="is_neox_style=False"),
    Seam("fastvideo.layers.rotary_embedding", "_apply_rotary_emb", "... GPT-J style: pairs (x[2i], x[2i+1])",
         mentions="x[..., ::2]"),
    Seam("fastvideo.attention.layer", "LocalAttention", "the text refiner's self-attention (replicated text)",
         name="LocalAttention"),
    Seam("fastvideo.layers.linear", "ReplicatedLinear", "PAN2's DiT linears", name="ReplicatedLinear"),
    Seam("fastvideo.layers.layernorm", "RMSNorm", "PAN2's RMSNorms (the product cast to the weight dtype first, as "
         "diffusers' RMSNorm does)", name="RMSNorm"),
    Seam("fastvideo.layers.layernorm", "LayerNormScaleShift", "the joint blocks' modulated LayerNorms",
         name="LayerNormScaleShift"),
    Seam("fastvideo.layers.layernorm", "ScaleResidualLayerNormScaleShift", "... gated residual, then LayerNorm",
         name="ScaleResidualLayerNormScaleShift"),
    Seam("fastvideo.layers.layernorm", "ScaleResidual", "... gated residual", name="ScaleResidual"),
    Seam("fastvideo.layers.mlp", "MLP", "the joint blocks' GELU-tanh feed-forwards", name="MLP"),
    Seam("fastvideo.layers.visual_embedding", "PatchEmbed", "the patch embedding (Conv3d, tokens in t, h, w order)",
         name="PatchEmbed"),
    Seam("fastvideo.layers.visual_embedding", "TimestepEmbedder", "the timestep embedding: fp32 sinusoid cast to the "
         "weight dtype, Linear, SiLU, Linear", name="TimestepEmbedder"),
    Seam("fastvideo.layers.visual_embedding", "timestep_embedding", "... cos first (diffusers' flip_sin_to_cos), "
         "frequencies exp(-ln(10000) i / half)", mentions="torch.cat([torch.cos(args), torch.sin(args)]"),
    Seam("fastvideo.layers.visual_embedding", "ModulateProjection", "the joint blocks' AdaLN-zero projection",
         name="ModulateProjection"),
    Seam("fastvideo.layers.visual_embedding", "unpatchify", "PAN2's unpatchify: each token's features ordered "
         "(C, pt, ph, pw)", mentions='"nthwcopq->nctohpwq"', name="unpatchify"),
    Seam("fastvideo.distributed.communication_op", "sequence_model_parallel_shard", "the video tokens over the "
         "sequence-parallel ranks (padded)", name="sequence_model_parallel_shard"),
    Seam("fastvideo.distributed.communication_op", "sequence_model_parallel_all_gather_with_unpad", "... and back",
         name="sequence_model_parallel_all_gather_with_unpad"),
)
