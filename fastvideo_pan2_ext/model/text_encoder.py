"""PAN2's text encoder in FastVideo: transformers' `Qwen3_5TextModel` as the checkpoint ships it (Qwen3.5-9B, not
fine-tuned), loaded by FastVideo's `TextEncoderLoader` through its pass-through for Hugging Face models (as FastVideo's
own Qwen3 and Mistral3 encoders are). No port: transformers owns the architecture (its Gated-DeltaNet layers included)
and PAN2's prompt stage (`fastvideo_integration.stages.PAN2TextEncodingStage`) calls it as PAN2's sampler does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from fastvideo_pan2_ext.fastvideo_integration import compat
from fastvideo_pan2_ext.model.architecture import TEXT_ENCODER_CLASS_NAME


@dataclass
class PAN2TextEncoderArchConfig(compat.symbol("TextEncoderArchConfig")):
    """What FastVideo's loader reads from `text_encoder/config.json` (`architectures` selects the class below)."""

    architectures: list[str] = field(default_factory=lambda: [TEXT_ENCODER_CLASS_NAME])
    hidden_size: int = 4096
    num_hidden_layers: int = 32


@dataclass
class PAN2TextEncoderConfig(compat.symbol("TextEncoderConfig")):
    arch_config: PAN2TextEncoderArchConfig = field(default_factory=PAN2TextEncoderArchConfig)
    is_chat_model: bool = True


class PAN2Qwen3_5TextEncoder(nn.Module):
    """FastVideo's registry entry for `Qwen3_5TextModel`: `from_pretrained_local` returns transformers' model."""

    supports_hf_from_pretrained = True

    @classmethod
    def from_pretrained_local(cls, model_path: str, model_config, dtype: torch.dtype, device: torch.device
                              ) -> nn.Module:
        from transformers import Qwen3_5TextModel

        return Qwen3_5TextModel.from_pretrained(model_path, local_files_only=True, dtype=dtype,
                                                low_cpu_mem_usage=True).eval().to(device)
