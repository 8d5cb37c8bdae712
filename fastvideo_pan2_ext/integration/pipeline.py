"""`PAN2Pipeline`: FastVideo's Wan pipeline (which runs Wan2.2 TI2V) with PAN2's first-frame and decode stages."""

from __future__ import annotations

import logging
import os

import torch

from fastvideo_pan2_ext.attention import ENV_VAR, apply_fa4_policy
from fastvideo_pan2_ext.attention.fa4 import loaded_fa4_readers
from fastvideo_pan2_ext.configs import PAN2PipelineConfig, PAN2SamplingParam

from . import adapter, request_failure
from .stages import PAN2DecodingStage, PAN2InputStage

logger = logging.getLogger(__name__)

REPLACED_STAGES = {adapter.INPUT_STAGE: PAN2InputStage, adapter.DECODING_STAGE: PAN2DecodingStage}


class PAN2Pipeline(adapter.symbol("WanPipeline")):
    """Wan2.2-TI2V's stages, with `PAN2InputStage` and `PAN2DecodingStage` in place of FastVideo's two."""

    pipeline_config_cls = PAN2PipelineConfig
    sampling_params_cls = PAN2SamplingParam

    def __init__(self, model_path, fastvideo_args, *args, **kwargs):
        # Where FastVideo's attention is about to be chosen: loading the DiT (below) is what imports FastVideo's
        # attention backends, which read FASTVIDEO_FA4 once.
        set_here = apply_fa4_policy()
        logger.info("PAN2 attention policy: %s=%s (%s); FastVideo modules that read it already loaded: %s", ENV_VAR,
                    os.environ.get(ENV_VAR, "<unset>"), "set here" if set_here else "inherited or left as is",
                    ", ".join(loaded_fa4_readers()) or "none")
        self.replaced_stages: set[str] = set()
        super().__init__(model_path, fastvideo_args, *args, **kwargs)

    def add_stage(self, stage_name, stage):
        if stage_name == adapter.INPUT_STAGE:
            stage = PAN2InputStage()
        elif stage_name == adapter.DECODING_STAGE:
            stage = PAN2DecodingStage(vae=self.get_module("vae"), pipeline=self)
        if stage_name in REPLACED_STAGES:
            self.replaced_stages.add(stage_name)
        super().add_stage(stage_name, stage)

    def forward(self, batch, fastvideo_args):
        # Several ranks: one that failed alone would leave the others waiting in a collective; they all stop instead,
        # as in FastVideo (/health then says so).
        if fastvideo_args.num_gpus > 1 or not adapter.batch_extra(batch, request_failure.FAILS_ALONE_KEY, bool):
            return super().forward(batch, fastvideo_args)
        try:
            return super().forward(batch, fastvideo_args)
        except Exception as exc:  # not an interrupt: this request fails, the worker serves the next one
            logger.exception("PAN2 request failed in the worker; the worker stays up")
            batch.output = torch.empty(0)
            batch.extra[request_failure.FAILURE_KEY] = request_failure.one_line(exc)
            return batch

    def create_pipeline_stages(self, fastvideo_args) -> None:
        super().create_pipeline_stages(fastvideo_args)
        if self.replaced_stages != set(REPLACED_STAGES):
            raise RuntimeError(f"PAN2Pipeline expected FastVideo's Wan pipeline to add {sorted(REPLACED_STAGES)}; it "
                               f"added {sorted(self.replaced_stages)} of them")


EntryClass = PAN2Pipeline
