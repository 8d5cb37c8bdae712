"""The one seam between this package and FastVideo's internals (docs/design.md, "FastVideo facts relied on").

Every FastVideo name this package relies on (modules, classes, functions, attributes, stage names) and every attribute
it replaces at run time is in `SEAMS`, with the reason, and is used through this module (`symbol(name)` for the
classes and functions other modules build on); nothing else in the package imports FastVideo beyond its top-level
package (tests/test_architecture.py checks the import graph). An upgrade of FastVideo is this file to read: a seam
lists the spellings of the releases in `TESTED_RELEASES` (the first that the installed FastVideo has is used).
`check()` (run by `register()`) looks every seam up in the installed FastVideo and fails with one line naming the
FastVideo version and the first missing symbol, instead of a traceback deep in a worker.

The CPU-only replacements (`close_cpu_gaps`) are applied only in a process where FastVideo resolved the CPU platform
and torch sees no CUDA device; GPU runs never get them.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import glob
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

from fastvideo_pan2_ext.vae_kernel.errors import first_line

logger = logging.getLogger(__name__)

TESTED_RELEASES = ("0.2.1",)  # the FastVideo releases this package's tests ran against (pyproject pins the range)


@dataclasses.dataclass(frozen=True)
class Seam:
    module: str
    attribute: str  # dotted within the module; "" for the module itself (found, and read, without importing it)
    why: str
    replaced: bool = False  # this package replaces it at run time (else it only reads or calls it)
    mentions: str = ""  # a name the attribute's source must contain (a convention no lookup can check)
    name: str = ""  # the name other modules ask `symbol()` for
    alternatives: tuple[tuple[str, str], ...] = ()  # (module, attribute) spellings of other tested releases

    def spellings(self) -> tuple[tuple[str, str], ...]:
        return ((self.module, self.attribute), *self.alternatives)


# The stages of FastVideo's Wan pipeline that PAN2Pipeline replaces, as FastVideo names them.
# FastVideo modules that read FASTVIDEO_FA4 when they are imported; once one is loaded, this process's choice is made.
FA4_READERS = (
    "fastvideo.attention.backends.flash_attn",
    "fastvideo.attention.utils.flash_attn_default",
    "fastvideo.attention.utils.flash_attn_no_pad",
)

SEAMS = (
    Seam("fastvideo.configs.pipelines.base", "PipelineConfig", "PAN2's pipeline config is one", name="PipelineConfig"),
    Seam("fastvideo.configs.models.dits.base", "DiTConfig", "the pipeline config's DiT field", name="DiTConfig"),
    Seam("fastvideo.configs.models.vaes.base", "VAEConfig", "the pipeline config's VAE field", name="VAEConfig"),
    Seam("fastvideo.configs.models.vaes", "WanVAEConfig", "PAN2's VAE is the Wan2.2 VAE", name="WanVAEConfig"),
    Seam("fastvideo.configs.models.encoders.base", "TextEncoderConfig", "PAN2's Qwen3.5 text encoder config",
         name="TextEncoderConfig"),
    Seam("fastvideo.configs.models.encoders.base", "TextEncoderArchConfig", "... and its architecture fields",
         name="TextEncoderArchConfig"),
    Seam("fastvideo.models.registry", "ModelRegistry", "PAN2's DiT and text encoder are found by their checkpoint "
         "class names", name="ModelRegistry"),
    Seam("fastvideo.models.loader.component_loader", "TextEncoderLoader.load_model", "a class with "
         "supports_hf_from_pretrained returns transformers' model (Qwen3.5)", mentions="from_pretrained_local"),
    Seam("fastvideo.pipelines.composed_pipeline_base", "ComposedPipelineBase", "PAN2Pipeline is one",
         name="ComposedPipelineBase"),
    Seam("fastvideo.pipelines.composed_pipeline_base", "ComposedPipelineBase.load_modules", "a Modular Diffusers "
         "manifest is rewritten into [library, class] entries, which this reads", mentions="module_spec[0]"),
    Seam("fastvideo.pipelines.stages.base", "PipelineStage", "PAN2's own stages", name="PipelineStage"),
    Seam("fastvideo.api.compat", "generator_config_to_fastvideo_args", "the CLI checks PAN2's memory plan on the "
         "FastVideoArgs its run will make, before anything loads", name="generator_config_to_fastvideo_args"),
    Seam("fastvideo.forward_context", "set_forward_context", "FastVideo's attention reads the forward context",
         name="set_forward_context"),
    Seam("diffusers.utils.torch_utils", "randn_tensor", "the noise drawn as FastVideo's latent stage draws it",
         name="randn_tensor"),
    Seam("fastvideo.configs.pipelines.base", "PipelineConfig.update_pipeline_config", "a pipeline config file sets "
         "dataclass fields only: PAN2's config extends it to its switches (views of vae_config)",
         mentions="fields(self)"),
    Seam("fastvideo.api.sampling_param", "SamplingParam", "PAN2's sampling defaults", name="SamplingParam"),
    Seam("fastvideo.api.presets", "InferencePreset", "the pan2 preset", name="InferencePreset"),
    Seam("fastvideo.api.presets", "PresetStageSpec", "the pan2 preset's denoising stage", name="PresetStageSpec"),
    Seam("fastvideo.fastvideo_args", "WorkloadType", "PAN2 registers for text- and image-to-video",
         name="WorkloadType"),
    Seam("fastvideo.entrypoints.video_generator", "VideoGenerator", "the demo generates as a user does",
         name="VideoGenerator"),
    Seam("fastvideo.pipelines.stages", "InputValidationStage", "PAN2's first-frame stage extends it",
         name="InputValidationStage"),
    Seam("fastvideo.pipelines.stages", "DecodingStage", "PAN2's decoding stage extends it", name="DecodingStage"),
    Seam(FA4_READERS[0], "", "imports FA4's reader of FASTVIDEO_FA4: the FA4 policy must run before",
         mentions=FA4_READERS[1]),
    *(Seam(reader, "", "reads FASTVIDEO_FA4 once, when imported: the FA4 policy must run before",
           mentions="FASTVIDEO_FA4") for reader in FA4_READERS[1:]),
    Seam("fastvideo.registry", "_CONFIG_REGISTRY", "register PAN2's config once per process: look for it first"),
    Seam("fastvideo.registry", "_MODEL_NAME_DETECTORS", "FastVideo takes the first matching checkpoint detector in "
         "registration order; PAN2's must come before the Wan ones, which also match a PAN2 checkpoint"),
    Seam("fastvideo.registry", "get_model_info.cache_clear", "the detector order changed after a lookup was cached"),
    Seam("fastvideo.registry", "get_pipeline_config_cls_from_name", "a plain serve config on a PAN2 checkpoint is "
         "served with PAN2's rules: the config FastVideo picks for it says so"),
    Seam("fastvideo.api.presets", "_PRESET_REGISTRY", "register the pan2 preset once per process"),
    Seam("fastvideo.pipelines.pipeline_registry", "_import_pipeline_classes_cached", "pipeline classes come from a "
         "cached scan of fastvideo.pipelines.basic.*, which cannot see a plugin's class: wrapped to add it",
         replaced=True),
    Seam("fastvideo.fastvideo_args", "FastVideoArgs.__post_init__", "FastVideo picks the pipeline class from the "
         "checkpoint, not the config: a PAN2 config must select PAN2Pipeline (and, on CPU, turn offloads off)",
         replaced=True),
    Seam("fastvideo.entrypoints.cli.generate", "GenerateSubcommand.subparser_init", "adds --pipeline", replaced=True),
    Seam("fastvideo.entrypoints.cli.generate", "GenerateSubcommand.validate", "--pipeline builds the run config",
         replaced=True),
    Seam("fastvideo.entrypoints.cli.generate", "GenerateSubcommand.cmd", "a --pipeline run ends cleanly on Ctrl-C, "
         "SIGTERM or a dying worker (FastVideo's run leaves a traceback and, mid-save, a partial file)",
         replaced=True),
    Seam("fastvideo.entrypoints.cli.main", "main", "the dotted overrides travel as args._unknown",
         mentions="args._unknown"),
    Seam("fastvideo.entrypoints.cli.generate", "_VALIDATED_RUN_CONFIG_ATTR", "--pipeline hands the run config it "
         "built to generate where FastVideo's validate() leaves its own"),
    Seam("fastvideo.entrypoints.cli.inference_config", "_load_nested_config", "--pipeline reads --config as the CLI "
         "does"),
    Seam("fastvideo.entrypoints.cli.inference_config", "_apply_dotted_overrides", "... and applies the dotted "
         "overrides as the CLI does"),
    Seam("fastvideo.entrypoints.cli.inference_config", "_GENERATE_OVERRIDE_PREFIXES", "... with the CLI's prefixes"),
    Seam("fastvideo.entrypoints.cli.inference_config", "_ensure_generate_cli_defaults", "... and its defaults"),
    Seam("fastvideo.entrypoints.cli.inference_config", "_validate_num_gpus", "... and its checks"),
    Seam("fastvideo.entrypoints.cli.inference_config", "_validate_generate_prompt_sources", "... and its checks"),
    Seam("fastvideo.entrypoints.cli.serve", "ServeSubcommand.subparser_init", "adds --pipeline to serve",
         replaced=True),
    Seam("fastvideo.entrypoints.cli.serve", "ServeSubcommand.validate", "a PAN2 serve config is built by this "
         "package (FastVideo's parser refuses its `pipeline` key)", replaced=True),
    Seam("fastvideo.entrypoints.cli.serve", "ServeSubcommand.cmd", "a PAN2 server runs with its serving rules",
         replaced=True),
    Seam("fastvideo.entrypoints.cli.serve", "_VALIDATED_SERVE_CONFIG_ATTR", "PAN2's validate hands its serve config "
         "to cmd where FastVideo's leaves its own"),
    Seam("fastvideo.entrypoints.cli.inference_config", "_SERVE_OVERRIDE_PREFIXES", "a PAN2 serve config takes the "
         "serve CLI's dotted overrides"),
    Seam("fastvideo.api.schema", "ServeConfig", "the serve config a PAN2 server is checked into"),
    Seam("fastvideo.api.compat", "generator_config_to_fastvideo_args", "the serve config's generator, as serve "
         "builds it"),
    Seam("fastvideo.worker.multiproc_executor", "MultiprocExecutor._init_executor", "/health asks its worker "
         "processes (`self.workers`, each with its `proc`)", mentions="self.workers ="),
    Seam("fastvideo.entrypoints.video_generator", "VideoGenerator._generate_single_video", "FastVideo saves in the "
         "parent after the worker returns the whole video; a streamed save is requested from here, through its "
         "`_extra_overrides` keyword (copied into the worker's batch.extra)", replaced=True),
    Seam("fastvideo.worker.multiproc_executor", "MultiprocExecutor.execute_forward", "a decode that failed in the "
         "worker (its latents kept) comes back as a marker in the output batch's extra: the parent raises there, "
         "before FastVideo post-processes the placeholder output", replaced=True),
    Seam("fastvideo.pipelines.stages", "DecodingStage._denormalize_latents", "the fast decoder takes latents "
         "de-normalized exactly as FastVideo's decode does"),
    Seam("fastvideo.configs.models.vaes", "WanVAEConfig", "gets the fast decoder's and the fast encoder's switches "
         "and options as dataclass fields, so every Wan pipeline's config, CLI override and config file can set them",
         replaced=True),
    Seam("fastvideo.models.vaes.wanvae", "AutoencoderKLWan.decode", "routed to the fast decoder when its config's "
         "decode_kernel is on (FastVideo's decoding stage calls it with de-normalized latents)", replaced=True),
    Seam("fastvideo.models.vaes.wanvae", "AutoencoderKLWan.encode", "routed to the fast encoder when its config's "
         "encode_kernel is on (every Wan encode: image-to-video's conditioning, TI2V's first frame, video-to-video, "
         "preprocessing); it returns a DiagonalGaussianDistribution of the moments", replaced=True),
    Seam("fastvideo.models.vaes.wanvae", "AutoencoderKLWan.encode", "... and runs the feature-cache encode (the one "
         "the fast encoder computes) only while the module's use_feature_cache is on",
         mentions="self.use_feature_cache"),
    Seam("fastvideo.models.vaes.common", "DiagonalGaussianDistribution", "the fast encoder's moments are returned in "
         "FastVideo's own distribution class, so .mean, .mode() and .sample(generator) are FastVideo's",
         name="DiagonalGaussianDistribution"),
    Seam("fastvideo.distributed.parallel_state", "get_world_group", "the ranks of a request decode one video "
         "together over FastVideo's world group"),
    Seam("fastvideo.distributed.parallel_state", "get_local_torch_device", "the device of this rank; CPU only: it "
         "answers 'mps' on every platform that is not CUDA/ROCm/NPU, so it is replaced", replaced=True,
         name="get_local_torch_device"),
    Seam("fastvideo.platforms.cpu", "CpuPlatform", "CPU only: it has no get_attn_backend_cls, so no attention "
         "backend is ever found; it gets one answering torch SDPA", replaced=True),
    Seam("fastvideo.pipelines.composed_pipeline_base", "warmup_sequence_parallel_communication", "CPU only: with "
         "sp_size > 1 a pipeline warms its all-to-alls up on a CUDA tensor; on a GPU-less machine, on CPU tensors "
         "(gloo)", replaced=True),
    Seam("fastvideo.models.loader.fsdp_load", "init_device_mesh", "CPU only: FSDP inference (use_fsdp_inference) "
         "shards the DiT over a device mesh it builds on 'cuda' (which needs a driver); on a GPU-less machine on "
         "'cpu' (gloo), where torch's FSDP2 runs", replaced=True),
    Seam("torch", "autocast", "CPU only: stages run under autocast('cuda', bf16), a no-op without CUDA; on a "
         "GPU-less machine 'cuda' means CPU autocast (the same mixed precision on the device that exists)",
         replaced=True),
    Seam("torch", "cuda.synchronize", "CPU only: FASTVIDEO_STAGE_LOGGING=1 synchronizes after every stage, which "
         "raises without CUDA; with no CUDA device there is nothing to wait for", replaced=True),
    Seam("fastvideo.utils", "_add_prefix", "a worker prefixes each line of its stdout and stderr with its name in "
         "colour codes, whatever the stream is (a file, a pipe): wrapped so that only a terminal gets them",
         replaced=True, mentions="{CYAN}("),
    Seam("fastvideo.utils", "CYAN", "... read when a stream is prefixed: empty for a stream that gets none",
         replaced=True),
    Seam("fastvideo.utils", "RESET", "... likewise", replaced=True),
    Seam("fastvideo.logger", "_info", "the first logger.info of a distributed process (WORLD_SIZE > 1) warns in "
         "colour codes, read from the module when it logs", mentions="GREEN,"),
    Seam("fastvideo.logger", "GREEN", "... empty where FastVideo's log stream (stdout) gets none", replaced=True),
    Seam("fastvideo.logger", "RESET", "... likewise", replaced=True),
    # The PAN2 DiT (fastvideo_pan2_ext.model)
    Seam("fastvideo.configs.models.dits.base", "DiTArchConfig", "PAN2's DiT architecture config is one",
         name="DiTArchConfig"),
    Seam("fastvideo.platforms", "AttentionBackendEnum", "the attention backends PAN2's DiT supports",
         name="AttentionBackendEnum"),
    Seam("fastvideo.models.dits.base", "BaseDiT", "PAN2's DiT is one (TransformerLoader builds it)", name="BaseDiT"),
    Seam("fastvideo.models.registry", "_LazyRegisteredModel", "PAN2's DiT is registered lazily (by module and class "
         "name); FastVideo 0.2.1's register_model(arch, 'module:Class') builds this with two of its three fields",
         name="LazyRegisteredModel"),
    Seam("fastvideo.models.registry", "ModelRegistry.models", "... so the entry is stored here (and looked up, for "
         "idempotence)"),
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
         name="sequence_model_parallel_all_gather_with_unpad"),)
# What a PAN2 server needs of FastVideo's HTTP server (its optional web stack: fastapi, uvicorn, aiofiles): checked
# when a PAN2 server starts (`check_serving`), so a FastVideo without them still runs PAN2 everywhere else.
SERVE_SEAMS = (
    Seam("fastvideo.entrypoints.openai.api_server", "run_server", "a PAN2 server runs what run_server runs (its "
         "default_request check, create_app, uvicorn), with PAN2's HTTP limits as uvicorn's options (FastVideo's: "
         "httptools, no header bound, a 300 s keep-alive)", mentions="uvicorn.run("),
    Seam("fastvideo.entrypoints.openai.video_api", "download_video_content", "GET /v1/videos/{id}/content serves "
         "whatever is at the job's file_path, links followed: PAN2's route, matched before it, serves only the file "
         "the job wrote", replaced=True, mentions="FileResponse("),
    Seam("fastvideo.entrypoints.openai.utils", "_save_upload_to_path", "reads an upload whole into memory: PAN2 "
         "copies it in chunks", replaced=True, mentions="await upload.read()"),
    Seam("fastvideo.entrypoints.openai.api_server", "_validate_default_request_against_preset", "a scaled-out PAN2 "
         "server checks its default_request as run_server does, before any replica starts"),
    Seam("fastvideo.entrypoints.openai.api_server", "create_app", "PAN2's /health replaces FastVideo's (always "
         "'ok', even with its workers dead), and its /v1/images routes are not served (they run the generator "
         "outside PAN2's checks and its one-job-at-a-time queue)", replaced=True),
    Seam("fastvideo.entrypoints.openai.image_api", "router", "... the image routes, as create_app mounts them"),
    Seam("fastvideo.entrypoints.openai.video_api", "save_image_to_path", "FastVideo stores an upload as "
         "uploads/<request id>_<the client's file name>, a name that can hold a path ('../x'): PAN2 keeps it in "
         "uploads/", replaced=True),
    Seam("fastvideo.entrypoints.openai.video_api", "_build_generation_kwargs", "PAN2 checks every request here, "
         "before a job exists: FastVideo's create_video calls it, then queues the job; it makes the video's folder "
         "(following links), so PAN2 hands it one that exists and makes the request's own once it passed",
         replaced=True, mentions="os.makedirs(output_dir"),
    Seam("fastvideo.api.compat", "explicit_request_updates", "the default_request fields the operator wrote, which "
         "_build_generation_kwargs applies: its output_path is checked at start and used as FastVideo uses it"),
    Seam("fastvideo.api.schema", "OutputConfig.output_path", "... set to the folder it names, resolved at start"),
    Seam("fastvideo.entrypoints.openai.video_api", "_run_generation", "FastVideo runs jobs concurrently in the "
         "default thread pool over one unlocked worker pipe (clients get each other's videos): PAN2 runs one at a "
         "time", replaced=True),
    Seam("fastvideo.entrypoints.openai.video_api", "create_video", "calls the two above by their module names",
         mentions="_run_generation(request_id"),
    Seam("fastvideo.entrypoints.openai.video_api", "create_video", "... and stores an upload through "
         "save_image_to_path by its module name", mentions="await save_image_to_path(image, input_path)"),
    Seam("fastvideo.entrypoints.openai.video_api", "VideoGenerationsRequest", "a field its model refuses is a one-line "
         "400 (FastVideo: an unhandled error for a multipart request, pydantic's many lines for a JSON one)",
         replaced=True),
    Seam("fastvideo.entrypoints.openai.video_api", "create_video", "... which create_video makes by its module name",
         mentions="req = VideoGenerationsRequest("),
    Seam("fastvideo.entrypoints.openai.stores", "VIDEO_STORE.pop", "a DELETE removes the job's video and keeps a "
         "waiting job from running (FastVideo only forgets the job)", replaced=True),
    Seam("fastvideo.entrypoints.openai.video_api", "delete_video", "... DELETE /v1/videos/{id} pops the job store",
         mentions="VIDEO_STORE.pop(video_id)"),
    Seam("fastvideo.entrypoints.openai.stores", "AsyncDictStore.update_fields", "a job's update says whether the "
         "store still holds it", mentions="return None"),
    Seam("fastvideo.entrypoints.openai.state", "get_generator", "the server's VideoGenerator"),
    Seam("fastvideo.entrypoints.openai.state", "get_output_dir", "the server's output folder"),
    Seam("fastvideo.entrypoints.openai.stores", "VIDEO_STORE", "job status updates"),
)

# FastVideo's offloads need CUDA (the parent, too, pins its output buffer): off in GPU-less processes.
CPU_OFFLOAD_FLAGS = ("dit_cpu_offload", "dit_layerwise_offload", "text_encoder_cpu_offload",
                     "image_encoder_cpu_offload", "vae_cpu_offload", "pin_cpu_memory")
SDPA_BACKEND = "fastvideo.attention.backends.sdpa.SDPABackend"


class IncompatibleFastVideo(RuntimeError):
    """The installed FastVideo lacks a symbol this package relies on (one line: version and symbol)."""


def fastvideo_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fastvideo")
    except PackageNotFoundError:
        return "not installed"


def _lookup_spelling(module: str, attribute: str, mentions: str) -> Any:
    import importlib.util
    import inspect

    if not attribute:  # importing it would have effects (the FA4 readers): its spec and source instead
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.origin or (mentions and mentions not in Path(spec.origin).read_text()):
            raise ImportError(module)
        return spec
    value = importlib.import_module(module)
    for part in filter(None, attribute.split(".")):
        value = getattr(value, part)
    if mentions and mentions not in inspect.getsource(value):
        raise AttributeError(mentions)
    return value


def _lookup(seam: Seam) -> Any:
    """The first spelling of `seam` the installed FastVideo has; IncompatibleFastVideo (one line) if none."""
    for module, attribute in seam.spellings():
        try:
            return _lookup_spelling(module, attribute, seam.mentions)
        except (ImportError, AttributeError, OSError, TypeError):
            continue
    where = f"{seam.module}.{seam.attribute}" if seam.attribute else seam.module
    raise IncompatibleFastVideo(
        f"fastvideo_pan2_ext needs {where} (FastVideo {', '.join(TESTED_RELEASES)}; {seam.why}), which FastVideo "
        f"{fastvideo_version()} does not have")


def check() -> None:
    """Raise IncompatibleFastVideo naming the first seam the installed FastVideo does not have."""
    for seam in SEAMS:
        _lookup(seam)


def check_serving() -> None:
    """`check` for what a PAN2 server needs besides (`SERVE_SEAMS`)."""
    for seam in SERVE_SEAMS:
        _lookup(seam)


_BY_NAME = {seam.name: seam for seam in SEAMS if seam.name}


def symbol(name: str) -> Any:
    """The FastVideo class or function the seam called `name` names (e.g. "WanPipeline")."""
    return _lookup(_BY_NAME[name])


def _once(owner, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace `owner.name` by `make(original)`, once per process (the replacement is marked)."""
    original = getattr(owner, name)
    if getattr(original, "_pan2_replacement", False):
        return
    replacement = make(original)
    replacement._pan2_replacement = True
    setattr(owner, name, replacement)


# --------------------------------------------------------------------------------------------------- registries


def register_pipeline_config(*, pipeline_config_cls, sampling_param_cls, workload_types, detector, model_family,
                             default_preset, pipeline_cls_name, hf_model_paths=()) -> None:
    """Register a pipeline config with a checkpoint detector that goes before FastVideo's own (idempotent)."""
    import fastvideo.registry as registry

    if any(info.pipeline_config_cls is pipeline_config_cls for info in registry._CONFIG_REGISTRY.values()):
        return
    registry.register_configs(sampling_param_cls=sampling_param_cls, pipeline_config_cls=pipeline_config_cls,
                              workload_types=workload_types, model_detectors=[detector], model_family=model_family,
                              default_preset=default_preset, pipeline_cls_name=pipeline_cls_name,
                              hf_model_paths=list(hf_model_paths) or None)
    registry._MODEL_NAME_DETECTORS.sort(key=lambda entry: entry[1] is not detector)  # stable: others keep order
    registry.get_model_info.cache_clear()


def register_preset(preset) -> None:
    """Register an InferencePreset (idempotent)."""
    from fastvideo.api import presets

    if (preset.model_family, preset.name, preset.version) not in presets._PRESET_REGISTRY:
        presets.register_preset(preset)


def add_pipeline_class(pipeline_type: str, name: str, load_class: Callable[[], type]) -> None:
    """Make FastVideo's pipeline registry list `load_class()` as `name` among its `pipeline_type` pipelines (the class
    is imported only when FastVideo scans for pipelines)."""
    import fastvideo.pipelines.pipeline_registry as pipeline_registry

    def make(scan):
        @functools.lru_cache
        def import_pipeline_classes(pipeline_types=None):
            classes = scan(pipeline_types)
            if pipeline_type in classes:
                classes[pipeline_type].setdefault(name, load_class())
            return classes

        return import_pipeline_classes

    _once(pipeline_registry, "_import_pipeline_classes_cached", make)


_args_hooks: dict[str, list[Callable]] = {"before": [], "after": []}


def on_fastvideo_args(hook: Callable, when: str) -> None:
    """Run `hook(args)` on every FastVideoArgs made in this process, before or after FastVideo's own __post_init__
    (each hook once, in registration order)."""
    from fastvideo.fastvideo_args import FastVideoArgs

    if hook not in _args_hooks[when]:
        _args_hooks[when].append(hook)

    def make(original):
        def __post_init__(self) -> None:
            for before in _args_hooks["before"]:
                before(self)
            original(self)
            for after in _args_hooks["after"]:
                after(self)

        return __post_init__

    _once(FastVideoArgs, "__post_init__", make)


# --------------------------------------------------------------------------------------------------- the CLI


def extend_generate_cli(add_arguments: Callable, validate: Callable, run: Callable) -> None:
    """`fastvideo generate`: `add_arguments(parser)` after FastVideo's own; `validate(args, original)` and
    `run(args, original)` instead of FastVideo's validation and run (call `original(args)` to keep it).
    Idempotent."""
    from fastvideo.entrypoints.cli.generate import GenerateSubcommand

    _extend_subcommand(GenerateSubcommand, add_arguments, validate, run)


def extend_serve_cli(add_arguments: Callable, validate: Callable, run: Callable) -> None:
    """`fastvideo serve`, as `extend_generate_cli` does `generate`."""
    from fastvideo.entrypoints.cli.serve import ServeSubcommand

    _extend_subcommand(ServeSubcommand, add_arguments, validate, run)


def _extend_subcommand(cls, add_arguments: Callable, validate: Callable, run: Callable) -> None:
    def make_init(original):
        def subparser_init(self, subparsers):
            parser = original(self, subparsers)
            add_arguments(parser)
            return parser

        return subparser_init

    def make_validate(original):
        def validate_(self, args):
            return validate(args, lambda a: original(self, a))

        return validate_

    def make_run(original):
        def cmd(self, args):
            return run(args, lambda a: original(self, a))

        return cmd

    _once(cls, "subparser_init", make_init)
    _once(cls, "validate", make_validate)
    _once(cls, "cmd", make_run)


def generate_cli_overrides(args) -> list[str] | None:
    """The dotted overrides `fastvideo generate` collected (FastVideo keeps them on the namespace)."""
    return getattr(args, "_unknown", None)


def raw_generate_config(config_path: str | None, overrides: list[str] | None) -> dict:
    """The nested run config `fastvideo generate` builds from --config (optional here) and the dotted overrides,
    with the CLI's defaults, before validation."""
    from fastvideo.entrypoints.cli import inference_config as ic

    raw: dict[str, Any] = ic._load_nested_config(config_path) if config_path else {"generator": {}}
    raw.setdefault("request", {})
    raw = ic._apply_dotted_overrides(raw, overrides, allowed_prefixes=ic._GENERATE_OVERRIDE_PREFIXES)
    ic._ensure_generate_cli_defaults(raw)
    return raw


def validated_generate_config(raw: dict):
    """`raw` parsed into FastVideo's RunConfig and checked as `fastvideo generate` checks it."""
    from fastvideo.api.parser import parse_config
    from fastvideo.api.schema import RunConfig
    from fastvideo.entrypoints.cli import inference_config as ic

    config = parse_config(RunConfig, raw)
    ic._validate_num_gpus(config.generator.engine.num_gpus)
    ic._validate_generate_prompt_sources(config)
    return config


def hand_run_config_to_generate(args, config) -> None:
    """What FastVideo's own validate() leaves for its generate command: the validated run config."""
    from fastvideo.entrypoints.cli import generate

    setattr(args, generate._VALIDATED_RUN_CONFIG_ATTR, config)


# --------------------------------------------------------------------------------------------------- generation


def raw_serve_config(config_path: str, overrides: list[str] | None) -> dict:
    """The nested serve config `fastvideo serve` builds from --config and the dotted overrides, before validation."""
    from fastvideo.entrypoints.cli import inference_config as ic

    raw = ic._load_nested_config(config_path)
    raw.setdefault("server", {})
    raw.setdefault("default_request", {})
    return ic._apply_dotted_overrides(raw, overrides, allowed_prefixes=ic._SERVE_OVERRIDE_PREFIXES)


def validated_serve_config(raw: dict):
    """`raw` parsed into FastVideo's ServeConfig and checked as `fastvideo serve` checks it."""
    from fastvideo.api.parser import parse_config
    from fastvideo.api.schema import ServeConfig
    from fastvideo.entrypoints.cli import inference_config as ic

    config = parse_config(ServeConfig, raw)
    ic._validate_num_gpus(config.generator.engine.num_gpus)
    return config


def hand_serve_config_to_serve(args, config) -> None:
    """What FastVideo's own validate() leaves for its serve command: the validated serve config."""
    from fastvideo.entrypoints.cli import serve

    setattr(args, serve._VALIDATED_SERVE_CONFIG_ATTR, config)


def validated_serve_config_of(args):
    from fastvideo.entrypoints.cli import serve

    return getattr(args, serve._VALIDATED_SERVE_CONFIG_ATTR)


def run_video_server(config, *, uvicorn_options: dict, **parts) -> None:
    """FastVideo's REST server for `config` (a ServeConfig), run as its run_server runs it (the default_request
    check, create_app, uvicorn) with `parts` in place of its own (`_replace_server_parts`) and uvicorn run with
    `uvicorn_options` (FastVideo's own: httptools, no header bound, a 300 s keep-alive). Returns when the server
    stops."""
    import uvicorn
    from fastvideo.api.compat import generator_config_to_fastvideo_args
    from fastvideo.entrypoints.openai import api_server

    _replace_server_parts(**parts)
    server = config.server
    check_default_request(config)
    app = api_server.create_app(generator_config_to_fastvideo_args(config.generator), output_dir=server.output_dir,
                                default_request=config.default_request)
    logger.info("Starting FastVideo server (PAN2) on %s:%d; model %s", server.host, server.port,
                config.generator.model_path)
    uvicorn.run(app, host=server.host, port=server.port, log_level="info", **uvicorn_options)


def video_server_app(config, **parts):
    """The ASGI app `run_video_server` serves (the same replacements), for an engine that runs apps itself (a Ray
    Serve replica): the model loads in its lifespan's startup, `stopped()` runs after its shutdown. Check
    `config.default_request` first (`check_default_request`), as FastVideo's run_server does."""
    from fastvideo.api.compat import generator_config_to_fastvideo_args
    from fastvideo.entrypoints.openai import api_server

    _replace_server_parts(**parts)
    return api_server.create_app(generator_config_to_fastvideo_args(config.generator),
                                 output_dir=config.server.output_dir, default_request=config.default_request)


def default_output_path(default_request) -> str | None:
    """The folder a serve config's `default_request` sends videos to when the operator set one (FastVideo's
    `_build_generation_kwargs` applies only the fields written), else None."""
    from fastvideo.api.compat import explicit_request_updates

    return None if default_request is None else explicit_request_updates(default_request).get("output_path")


def set_default_output_path(config, folder: str) -> None:
    config.default_request.output.output_path = folder


def check_default_request(config) -> None:
    """FastVideo's start-up check of a serve config's `default_request` against the model's preset."""
    from fastvideo.entrypoints.openai import api_server

    if config.default_request is not None:
        api_server._validate_default_request_against_preset(config.default_request, config.generator.model_path)


def _replace_server_parts(*, check_request: Callable, run_job: Callable, health: Callable, stopped: Callable,
                          deleted: Callable, content: Callable, middleware=()) -> None:
    """In this process's FastVideo server modules: `check_request(request_id, req, build, default_folder)` in place of
    its request-to-kwargs step (`build(folder)`: FastVideo's kwargs for the request with its video in `folder`, which
    FastVideo makes, following links; `default_folder`: `default_output_path` of the default_request; returns the
    kwargs, or raises fastapi's HTTPException), `run_job(request_id, kwargs)` (a
    coroutine) in place of its job runner, `health()` (a coroutine returning a response) as /health,
    `content(video_id)` as GET /v1/videos/{video_id}/content, `deleted(job)` called with each job a DELETE removed
    from the job store, `stopped()` called after FastVideo's shutdown (uvicorn re-raises a SIGTERM after it: nothing
    runs later), each `(middleware class, its options)` around the app (the first outermost), and uploads copied to
    their file in chunks."""
    import contextlib

    from fastvideo.entrypoints.openai import api_server, video_api
    from fastvideo.entrypoints.openai.stores import VIDEO_STORE

    build = video_api._build_generation_kwargs
    video_api._build_generation_kwargs = lambda request_id, req, default_request=None: check_request(
        request_id, req, lambda folder: build(request_id, req.model_copy(update={"output_path": str(folder)}),
                                              default_request=default_request), default_output_path(default_request))
    video_api._run_generation = run_job

    def make_save(save):
        async def save_image_to_path(image, target_path: str) -> str:
            if isinstance(image, str) and image.lower().startswith(("http://", "https://")):
                raise ValueError("this server fetches no reference_url over http(s) (a client could make it read any "
                                 "host, any size, into memory): send the image itself (multipart input_reference, "
                                 "or a data: URL)")
            path = _in_uploads(target_path)
            try:
                saved = await (save(image, path) if isinstance(image, str) else _save_upload(image, path))
            except BaseException:
                for written in glob.glob(glob.escape(path) + "*"):  # what a failed save wrote (it may add a suffix)
                    Path(written).unlink(missing_ok=True)
                raise
            holder = _SAVED_UPLOADS.get()
            if holder is not None:
                holder.append(saved)
            return saved

        return save_image_to_path

    _once(video_api, "save_image_to_path", make_save)
    _once(video_api, "VideoGenerationsRequest", lambda original: functools.partial(_request_or_400, original))

    def make_pop(pop):  # the job store's pop serves DELETE /v1/videos/{id} only
        async def pop_job(key: str):
            job = await pop(key)
            if job is not None:
                deleted(job)
            return job

        return pop_job

    _once(VIDEO_STORE, "pop", make_pop)

    def make(original):
        def create_app(*args, **kwargs):
            app = original(*args, **kwargs)
            app.router.routes[:] = [r for r in app.router.routes if not _unserved(r)]
            app.add_api_route("/health", health, methods=["GET"])
            # Before FastVideo's video routes (FastAPI keeps its router whole): matched first.
            app.add_api_route("/v1/videos/{video_id}/content", content, methods=["GET"])
            app.router.routes.insert(0, app.router.routes.pop())
            app.add_middleware(_UploadGuard)
            for cls, options in reversed(middleware):  # Starlette's last added is the outermost
                app.add_middleware(cls, **options)
            fastvideo_lifespan = app.router.lifespan_context

            @contextlib.asynccontextmanager
            async def lifespan(app_):
                try:
                    async with fastvideo_lifespan(app_):
                        yield
                finally:
                    stopped()

            app.router.lifespan_context = lifespan
            return app

        return create_app

    _once(api_server, "create_app", make)


# The uploads the POST being handled saved (a list per request, set by `_UploadGuard` around it).
_SAVED_UPLOADS: contextvars.ContextVar[list | None] = contextvars.ContextVar("pan2_saved_uploads", default=None)


class _UploadGuard:
    """ASGI middleware around POST /v1/videos: the uploads the request saved go when it is not accepted (any answer but
    200: PAN2's refusals, FastVideo's own 400s), and an error FastVideo's handler lets escape after saving one (a
    multipart `extra_body` that is JSON but not an object, say: a dropped connection) is a one-line 400."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"].rstrip("/") != "/v1/videos":
            await self.app(scope, receive, send)
            return
        from fastapi.responses import JSONResponse

        saved: list[str] = []
        statuses: list[int] = []

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])
            await send(message)

        token = _SAVED_UPLOADS.set(saved)
        try:
            await self.app(scope, receive, sending)
        except Exception as exc:  # noqa: BLE001 - not an interrupt: this request is refused, the server goes on
            for upload in saved:
                Path(upload).unlink(missing_ok=True)
            if statuses:  # the answer had started: nothing more can be said
                raise
            await JSONResponse({"detail": f"invalid request: {first_line(exc, with_type=True)}"}, status_code=400)(
                scope, receive, send)
            return
        finally:
            _SAVED_UPLOADS.reset(token)
        if statuses[:1] != [200]:
            for upload in saved:
                Path(upload).unlink(missing_ok=True)


def _one_line_400(detail: str):
    """fastapi's HTTPException 400 whose str is its detail alone (FastVideo's JSON branch quotes str(exception))."""
    from fastapi import HTTPException

    class OneLine(HTTPException):
        def __str__(self) -> str:
            return self.detail

    return OneLine(status_code=400, detail=detail)


def _request_or_400(request_class, /, **fields):
    """FastVideo's request object from a submission's fields; fields it refuses are a one-line 400 (FastVideo answers
    a multipart one with an unhandled error and a JSON one with pydantic's many lines)."""
    import pydantic

    try:
        return request_class(**fields)
    except pydantic.ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'request'}: {e['msg']}" for e in exc.errors())
        raise _one_line_400(f"invalid request: {problems}") from None


def _unserved(route) -> bool:
    """FastVideo's routes a PAN2 server drops: its /health (PAN2's replaces it) and its image routes (FastAPI keeps an
    included router whole, as `original_router`; older releases copy its routes, each with its path)."""
    from fastvideo.entrypoints.openai import image_api

    path = getattr(route, "path", None) or ""
    return path == "/health" or path.startswith("/v1/images") or \
        getattr(route, "original_router", None) is image_api.router


def _in_uploads(target_path: str) -> str:
    """FastVideo's path for an upload, uploads/<request id>_<the client's file name>, with that name made one safe
    file name in uploads/ (a separator or any other character but letters, digits, '.', '-' and '_' becomes '_')."""
    from fastvideo.entrypoints.openai.state import get_output_dir

    uploads = os.path.join(get_output_dir(), "uploads")
    if not target_path.startswith(uploads + os.sep):
        raise ValueError(f"an upload must be stored in {uploads}")
    return os.path.join(uploads, re.sub(r"[^\w.-]", "_", target_path[len(uploads) + 1:]))


async def _save_upload(upload, path: str) -> str:
    """FastVideo's save of an uploaded file, but copied in chunks (FastVideo reads it whole into memory) into a file
    created exclusively, never through a link, in a folder below output_dir reached without one."""
    from fastvideo_pan2_ext.media.video_io import open_folder

    folder = open_folder(os.path.dirname(path), served_output_dir())
    try:
        fd = os.open(os.path.basename(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=folder)
    finally:
        os.close(folder)
    with os.fdopen(fd, "wb") as out:
        await upload.seek(0)
        while chunk := await upload.read(1 << 20):  # Starlette spooled it to disk past 1 MiB
            out.write(chunk)
    return path


async def served_job(request_id: str) -> dict | None:
    """The server's job `request_id` (what GET /v1/videos/{id} answers), or None."""
    from fastvideo.entrypoints.openai.stores import VIDEO_STORE

    return await VIDEO_STORE.get(request_id)


def pipeline_config_class(model_path: str):
    """The pipeline config class FastVideo's registry picks for `model_path` (by a registered hub id or name, or the
    checkpoint's manifest), or None where it finds none (or cannot look: a hub id offline)."""
    from fastvideo.registry import get_pipeline_config_cls_from_name

    try:
        return get_pipeline_config_cls_from_name(model_path)
    except Exception:  # noqa: BLE001 - any failure to look is "not known": FastVideo reports its own later
        return None


def served_generator():
    """The running server's VideoGenerator."""
    from fastvideo.entrypoints.openai.state import get_generator

    return get_generator()


def served_output_dir() -> str:
    from fastvideo.entrypoints.openai.state import get_output_dir

    return get_output_dir()


async def update_job(request_id: str, fields: dict) -> bool:
    """Update a job's fields in the server's job store (what GET /v1/videos/{id} answers); False when the store no
    longer holds the job (a DELETE removed it)."""
    from fastvideo.entrypoints.openai.stores import VIDEO_STORE

    return await VIDEO_STORE.update_fields(request_id, fields) is not None


def worker_processes(generator) -> list:
    """The worker processes of a VideoGenerator's `mp` executor (empty for another executor)."""
    return [worker.proc for worker in getattr(generator.executor, "workers", None) or []]




def wrap_generate_single_video(wrapper: Callable) -> None:
    """`VideoGenerator._generate_single_video` becomes `wrapper(original, generator, prompt, sampling_param,
    fastvideo_args, **kwargs)`. Idempotent."""
    from fastvideo.entrypoints.video_generator import VideoGenerator

    def make(original):
        @functools.wraps(original)
        def generate_single_video(self, prompt, sampling_param=None, fastvideo_args=None, **kwargs):
            return wrapper(original, self, prompt, sampling_param, fastvideo_args, **kwargs)

        return generate_single_video

    _once(VideoGenerator, "_generate_single_video", make)


def with_batch_extra(kwargs: dict, key: str, value) -> dict:
    """`_generate_single_video` keyword arguments that put `value` into the worker's `batch.extra[key]`."""
    return {**kwargs, "_extra_overrides": {**kwargs.get("_extra_overrides", {}), key: value}}


def batch_extra(batch, key: str, cls: type):
    """The `cls` the parent put into this batch's `batch.extra[key]` (`with_batch_extra`), or None where it put none
    (TypeError for anything else)."""
    value = (batch.extra or {}).get(key)
    if value is not None and not isinstance(value, cls):
        raise TypeError(f"batch.extra[{key!r}] must be a {cls.__name__}; got {type(value).__name__}")
    return value


def local_torch_device():
    """This rank's device, as FastVideo's stages place tensors."""
    return symbol("get_local_torch_device")()


_forward_checks: list[Callable] = []


def on_execute_forward(check: Callable) -> None:
    """`MultiprocExecutor.execute_forward` (the parent's call into the workers) calls `check(output_batch)` on what the
    workers return, before FastVideo reads it (`check` may raise); each check once, in registration order."""
    from fastvideo.worker.multiproc_executor import MultiprocExecutor

    if check not in _forward_checks:
        _forward_checks.append(check)

    def make(original):
        @functools.wraps(original)
        def execute_forward(self, forward_batch, fastvideo_args):
            output_batch = original(self, forward_batch, fastvideo_args)
            for each in _forward_checks:
                each(output_batch)
            return output_batch

        return execute_forward

    _once(MultiprocExecutor, "execute_forward", make)


def denormalize_latents(stage, latents, fastvideo_args):
    """Latents as FastVideo's decode hands them to the VAE (`z * std + mean` for a Wan VAE)."""
    return stage._denormalize_latents(latents, fastvideo_args)


# --------------------------------------------------------------------------------------------------- the Wan VAE


def add_config_fields(fields: dict[str, tuple[Any, Any]]) -> None:
    """Add dataclass fields (name -> (type, default)) to FastVideo's WanVAEConfig, in place (idempotent): its
    constructor, `dataclasses.fields` (which FastVideo's config-file and CLI routes check) and pickling see them."""
    from fastvideo.configs.models.vaes import WanVAEConfig as cls

    if all(name in cls.__dataclass_fields__ for name in fields):
        return
    annotations = cls.__dict__["__annotations__"]
    for f in dataclasses.fields(cls):  # the class body's own fields, as dataclass() first read them
        if f.name in annotations:
            setattr(cls, f.name, f)
    for name, (annotation, default) in fields.items():
        annotations[name] = annotation
        setattr(cls, name, default)
    for generated in ("__init__", "__repr__", "__eq__"):
        if generated in cls.__dict__:
            delattr(cls, generated)
    p = cls.__dataclass_params__
    dataclasses.dataclass(cls, init=p.init, repr=p.repr, eq=p.eq, order=p.order, unsafe_hash=p.unsafe_hash,
                          frozen=p.frozen)


def route_wan_vae_decode(switched_on: Callable[[Any], bool], fast_decode: Callable) -> None:
    """FastVideo's `AutoencoderKLWan.decode(self, z)` calls `fast_decode(self, z)` where `switched_on(self.config)`,
    and runs unchanged elsewhere. Idempotent."""
    from fastvideo.models.vaes.wanvae import AutoencoderKLWan

    def make(original):
        @functools.wraps(original)
        def decode(self, z):
            return fast_decode(self, z) if switched_on(self.config) else original(self, z)

        return decode

    _once(AutoencoderKLWan, "decode", make)


def route_wan_vae_encode(switched_on: Callable[[Any], bool], fast_encode: Callable) -> None:
    """FastVideo's `AutoencoderKLWan.encode(self, x)` calls `fast_encode(self, x, original)` where
    `switched_on(self.config)` (`original(self, x)` is FastVideo's own encode, for what the fast one cannot serve),
    and runs unchanged elsewhere. Idempotent."""
    from fastvideo.models.vaes.wanvae import AutoencoderKLWan

    def make(original):
        @functools.wraps(original)
        def encode(self, x):
            return fast_encode(self, x, original) if switched_on(self.config) else original(self, x)

        return encode

    _once(AutoencoderKLWan, "encode", make)


_move_hooks: list[Callable[[Any], None]] = []


def after_wan_vae_moves(moved: Callable[[Any], None]) -> None:
    """FastVideo's `AutoencoderKLWan._apply` (what `.to()` runs: FastVideo's `vae_cpu_offload` moves the VAE to the
    CPU after each decode, and its encoding stages move it to the GPU before an encode and back after) calls
    `moved(self)` after it (each hook once, in registration order). Idempotent."""
    from fastvideo.models.vaes.wanvae import AutoencoderKLWan

    if moved not in _move_hooks:
        _move_hooks.append(moved)

    def make(original):
        @functools.wraps(original)
        def _apply(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            for hook in _move_hooks:
                hook(self)
            return result

        return _apply

    _once(AutoencoderKLWan, "_apply", make)


def decode_group():
    """The process group of the ranks that run this request together (FastVideo's world group), or None when it
    runs on one rank."""
    from fastvideo.distributed import parallel_state

    try:
        world = parallel_state.get_world_group()
    except AssertionError:  # FastVideo's distributed environment is not initialized: one process
        return None
    return world.device_group if world.world_size > 1 else None


# --------------------------------------------------------------------------------------------------- output


def colours(stream) -> bool:
    """Whether ANSI colour codes may be written to `stream` (no-color.org's convention): never with NO_COLOR set (to
    anything but the empty string), else only where the stream is a terminal."""
    if os.environ.get("NO_COLOR"):
        return False
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # not a file, or a closed one
        return False


def colour_only_on_terminals() -> None:
    """FastVideo writes colour codes whatever its output is (a worker's line prefix, a warning of distributed
    processes), so a log file or a pipe gets raw escape sequences: they follow `colours` instead. Idempotent."""
    import fastvideo.logger as fastvideo_logger
    import fastvideo.utils as fastvideo_utils

    if not colours(sys.stdout):  # where FastVideo's logging writes
        fastvideo_logger.GREEN = fastvideo_logger.RESET = ""

    def make(original):
        @functools.wraps(original)
        def _add_prefix(file, *args, **kwargs):
            codes = fastvideo_utils.CYAN, fastvideo_utils.RESET
            if not colours(file):
                fastvideo_utils.CYAN = fastvideo_utils.RESET = ""
            try:
                return original(file, *args, **kwargs)
            finally:
                fastvideo_utils.CYAN, fastvideo_utils.RESET = codes

        return _add_prefix

    _once(fastvideo_utils, "_add_prefix", make)


# --------------------------------------------------------------------------------------------------- no GPU


def cpu_only() -> bool:
    """True when FastVideo resolved the CPU platform and torch sees no CUDA device."""
    import torch
    from fastvideo.platforms import current_platform

    return current_platform.is_cpu() and not torch.cuda.is_available()


_cpu_gaps_closed = False


def close_cpu_gaps() -> bool:
    """Let FastVideo run a pipeline in a GPU-less process (the CPU-only seams above); returns whether it did.
    Idempotent; does nothing where a GPU exists."""
    global _cpu_gaps_closed
    if _cpu_gaps_closed:
        return True
    if not cpu_only():
        return False
    _cpu_gaps_closed = True

    import fastvideo.distributed.parallel_state as parallel_state
    import torch
    from fastvideo.platforms.cpu import CpuPlatform

    original_device_fn = parallel_state.get_local_torch_device

    def get_local_torch_device() -> torch.device:
        return torch.device("cpu")

    parallel_state.get_local_torch_device = get_local_torch_device
    for name, module in list(sys.modules.items()):  # modules that bound it with `from ... import`
        if (name == "fastvideo" or name.startswith("fastvideo.")) \
                and getattr(module, "get_local_torch_device", None) is original_device_fn:
            module.get_local_torch_device = get_local_torch_device

    from fastvideo.models.loader import fsdp_load

    mesh = fsdp_load.init_device_mesh
    fsdp_load.init_device_mesh = lambda device_type, *args, **kwargs: mesh(
        "cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    import fastvideo.pipelines.composed_pipeline_base as composed

    warmup = composed.warmup_sequence_parallel_communication
    composed.warmup_sequence_parallel_communication = lambda device=None: warmup(torch.device("cpu"))

    if "get_attn_backend_cls" not in CpuPlatform.__dict__:
        CpuPlatform.get_attn_backend_cls = classmethod(lambda cls, selected_backend, head_size, dtype: SDPA_BACKEND)

    class autocast(torch.autocast):
        """torch.autocast, with device_type "cuda" meaning "cpu" (there is no CUDA device here)."""

        def __init__(self, device_type, *args, **kwargs):
            super().__init__("cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    torch.autocast = autocast
    torch.cuda.synchronize = lambda device=None: None
    on_fastvideo_args(use_cpu_settings, "after")
    logger.info("fastvideo_pan2_ext: no GPU; FastVideo set up to run on CPU (fastvideo_pan2_ext.fastvideo_integration.adapter)")
    return True


def use_cpu_settings(fastvideo_args) -> None:
    """Every offload off, in place (workers receive the parent's args, already adjusted)."""
    for flag in CPU_OFFLOAD_FLAGS:
        if getattr(fastvideo_args, flag, False):
            setattr(fastvideo_args, flag, False)
