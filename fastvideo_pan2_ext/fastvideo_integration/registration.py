"""`register()`: what the ``fastvideo.plugins`` entry point does in every FastVideo process. Idempotent.

1. Checks that the installed FastVideo has every seam this package uses (`compat.check`: one line if not), and
   makes FastVideo's colour codes go only to terminals, never with NO_COLOR (`compat.logs.colour_only_on_terminals`).
2. On a GPU-less machine, lets FastVideo run on CPU (`compat.cpu_gaps.close_cpu_gaps`; nothing happens where a GPU
   exists).
3. Registers `PAN2PipelineConfig` + `PAN2SamplingParam` with FastVideo's config registry (text- and image-to-video,
   the hub id `IFM/PAN2`), with a detector for PAN2 manifests (`checkpoint.looks_like_pan2`) ahead of FastVideo's
   own, pinned to the `PAN2Pipeline` class; PAN2's DiT and Qwen3.5 text encoder into FastVideo's model registry under
   their checkpoint class names (`model.registry`).
4. Registers the ``pan2`` preset (sampling defaults).
5. Adds `PAN2Pipeline` to FastVideo's ``basic`` pipelines (imported only when FastVideo builds a pipeline).
6. Makes a `PAN2PipelineConfig` select `PAN2Pipeline` (FastVideo picks the class from the checkpoint, not the config)
   and checks its checkpoint in the process that makes the args.
7. Gives FastVideo's Wan VAE config the fast decoder's and the fast encoder's switches and routes its VAE's decode
   and encode through them where a switch is on (`fast_decode`, `fast_encode`), with the switches' options checked
   when FastVideoArgs are made.
8. Checks PAN2's memory plan where FastVideoArgs are made (the weights, before any loads; `memory_check`).
9. Adds ``--pipeline`` to ``fastvideo generate`` (`cli`), the streamed, atomic save (`streamed_save`), and keeps the
   latents of a decode that fails with the fast decoder on (`kept_latents`).
10. Serves PAN2 with ``fastvideo serve`` (`serving`): one job at a time, requests checked at submission, a request
    that fails in the worker failing alone (`request_failure`).
"""

from __future__ import annotations

import logging

from fastvideo_pan2_ext.model.registry import register_models
from fastvideo_pan2_ext.names import HUB_ID
from fastvideo_pan2_ext.configs.pan2 import (MODEL_FAMILY, PAN2_PRESET, PIPELINE_CLASS_NAME, PRESET_NAME,
                                             PAN2PipelineConfig, PAN2SamplingParam)

from . import (cli, compat, fast_decode, fast_encode, kept_latents, memory_check, request_failure, serving,
               streamed_save)
from .checkpoint import check_pan2_checkpoint, looks_like_pan2

logger = logging.getLogger(__name__)

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    compat.check()
    compat.logs.colour_only_on_terminals()
    compat.cpu_gaps.close_cpu_gaps()
    compat.registry.register_pipeline_config(
        pipeline_config_cls=PAN2PipelineConfig, sampling_param_cls=PAN2SamplingParam,
        workload_types=(compat.symbol("WorkloadType").T2V, compat.symbol("WorkloadType").I2V),
        detector=looks_like_pan2, model_family=MODEL_FAMILY, default_preset=PRESET_NAME,
        pipeline_cls_name=PIPELINE_CLASS_NAME, hf_model_paths=(HUB_ID, ))
    register_models()
    compat.registry.register_preset(PAN2_PRESET)
    compat.registry.add_pipeline_class("basic", PIPELINE_CLASS_NAME, _pipeline_class)
    compat.registry.on_fastvideo_args(_pan2_config_selects_pan2_pipeline, "before")
    compat.wan_vae.add_config_fields({**fast_decode.CONFIG_FIELDS, **fast_encode.CONFIG_FIELDS})
    compat.wan_vae.route("decode", lambda vae_config: fast_decode.options(vae_config) is not None, fast_decode.decode)
    compat.wan_vae.route("encode", lambda vae_config: fast_encode.options(vae_config) is not None, fast_encode.encode)
    compat.wan_vae.after_moves(fast_decode.vae_moved)
    compat.wan_vae.after_moves(fast_encode.vae_moved)
    compat.registry.on_fastvideo_args(fast_decode.check_fastvideo_args, "after")
    compat.registry.on_fastvideo_args(fast_encode.check_fastvideo_args, "after")
    compat.registry.on_fastvideo_args(_pan2_weights_fit, "after")
    cli.install()
    streamed_save.install()
    kept_latents.install()
    compat.executor.on_execute_forward(request_failure.check_output)
    compat.executor.run_requests_in_scope()
    serving.install()
    _registered = True
    logger.debug("fastvideo_pan2_ext registered with FastVideo")


def _pipeline_class() -> type:
    from .pipeline import PAN2Pipeline  # noqa: PLC0415 - FastVideo's model code: only when a pipeline is built

    return PAN2Pipeline


def _pan2_weights_fit(args) -> None:
    if isinstance(args.pipeline_config, PAN2PipelineConfig):
        memory_check.check(args)  # before any worker loads a weight


def _pan2_config_selects_pan2_pipeline(args) -> None:
    if isinstance(args.pipeline_config, PAN2PipelineConfig) and args.override_pipeline_cls_name is None:
        check_pan2_checkpoint(args.model_path)
        args.override_pipeline_cls_name = PIPELINE_CLASS_NAME
