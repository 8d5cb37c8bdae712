"""`PAN2Pipeline`: PAN2's sampler as a FastVideo composed pipeline (stages in `stages`, the DiT in
`fastvideo_pan2_ext.model`), loaded from IFM/PAN2's public layout (`checkpoint`)."""

from __future__ import annotations

import logging
import os

import torch

from fastvideo_pan2_ext.attention import ENV_VAR, apply_fa4_policy
from fastvideo_pan2_ext.attention.fa4 import loaded_fa4_readers
from fastvideo_pan2_ext.configs import PAN2PipelineConfig, PAN2SamplingParam
from fastvideo_pan2_ext.vae_kernel.errors import first_line

from . import cancel, checkpoint, compat, request_failure
from .stages import (PAN2ConditionStage, PAN2DecodingStage, PAN2DenoisingStage, PAN2InputStage,
                     PAN2LatentPreparationStage, PAN2TextEncodingStage)

logger = logging.getLogger(__name__)


class PAN2Pipeline(compat.symbol("ComposedPipelineBase")):
    """first frame -> prompts -> noise -> condition -> denoise -> decode (docs/design/pan2.md, "PAN2's sampler")."""

    pipeline_config_cls = PAN2PipelineConfig
    sampling_params_cls = PAN2SamplingParam
    _required_config_modules = list(checkpoint.REQUIRED_COMPONENTS)

    def __init__(self, model_path, fastvideo_args, *args, **kwargs):
        # Where FastVideo's attention is about to be chosen: loading the DiT (below) is what imports FastVideo's
        # attention backends, which read FASTVIDEO_FA4 once.
        set_here = apply_fa4_policy()
        logger.info("PAN2 attention policy: %s=%s (%s); FastVideo modules that read it already loaded: %s", ENV_VAR,
                    os.environ.get(ENV_VAR, "<unset>"), "set here" if set_here else "inherited or left as is",
                    ", ".join(loaded_fa4_readers()) or "none")
        super().__init__(model_path, fastvideo_args, *args, **kwargs)

    def _load_config(self, model_path: str) -> dict:
        super()._load_config(model_path)  # downloads a hub id: self.model_path is then the local folder
        # Checked (a hub id only now), and a Modular Diffusers manifest in the form FastVideo's loader reads (it takes
        # each component's library from the entry's first element, and skips entries where that is null).
        return checkpoint.check_pan2_checkpoint(self.model_path)

    def create_pipeline_stages(self, fastvideo_args) -> None:
        _log_dit_share(self.get_module("transformer"))
        if fastvideo_args.use_fsdp_inference and fastvideo_args.pipeline_config.dit_precision == "fp32":
            logger.warning("dit_precision fp32 with use_fsdp_inference: FastVideo's FSDP inference gathers the DiT's "
                           "weights in bf16, so this run computes bf16's numbers "
                           "(docs/design/pan2.md, \"The transformer\")")
        vae = self.get_module("vae")
        self.add_stage("input_validation_stage", PAN2InputStage())
        self.add_stage("prompt_encoding_stage",
                       PAN2TextEncodingStage(self.get_module("text_encoder"), self.get_module("tokenizer")))
        self.add_stage("latent_preparation_stage", PAN2LatentPreparationStage())
        self.add_stage("condition_stage", PAN2ConditionStage(vae))
        self.add_stage("denoising_stage",
                       PAN2DenoisingStage(self.get_module("transformer"), self.get_module("scheduler")))
        self.add_stage("decoding_stage", PAN2DecodingStage(vae=vae, pipeline=self))

    def forward(self, batch, fastvideo_args):
        # Several ranks: one that failed alone would leave the others waiting in a collective; they all stop instead,
        # as in FastVideo (/health then says so). A JobCancelled fails alone there too: every rank raises it at the
        # same step (`cancel.check`).
        if not compat.executor.batch_extra(batch, request_failure.FAILS_ALONE_KEY, bool):
            return super().forward(batch, fastvideo_args)
        try:
            return super().forward(batch, fastvideo_args)
        except Exception as exc:  # not an interrupt: this request fails, the worker serves the next one
            cancelled = isinstance(exc, cancel.JobCancelled)  # raised by every rank at the same step
            if fastvideo_args.num_gpus > 1 and not cancelled:
                raise
            if cancelled:
                logger.info("PAN2 request stopped in the worker (%s); the worker stays up", exc)
            else:
                logger.exception("PAN2 request failed in the worker; the worker stays up")
            batch.output = torch.empty(0)
            batch.extra[request_failure.FAILURE_KEY] = first_line(exc, with_type=True)
            return batch


def _log_dit_share(transformer) -> None:
    """How much of the DiT this rank holds: FastVideo logs nothing of its FSDP sharding (`use_fsdp_inference`)."""
    from torch.distributed.tensor import DTensor

    params = list(transformer.parameters())
    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
    logger.info("PAN2 DiT: this rank holds %d of its %d parameters", held, sum(p.numel() for p in params))


EntryClass = PAN2Pipeline
