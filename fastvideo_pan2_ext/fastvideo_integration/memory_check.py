"""PAN2's memory plan (`model.memory`) checked where FastVideo runs it, in the parent, before the work: the weights
when FastVideoArgs are made (before any worker loads one), the whole request before it goes to the workers (the CLI
checks both before anything loads). A ValueError of one line names what does not fit and the options that would
make it fit. Nothing is checked without a CUDA GPU (a CPU run's memory is the host's)."""

from __future__ import annotations

import os

from fastvideo_pan2_ext.model import memory

# The smallest request: what the weights alone need (checked when FastVideoArgs are made, the request unknown).
WEIGHTS_ONLY = memory.Request(height=32, width=32, num_frames=1, text_tokens=1, label="its weights")


def gpu_bytes(num_gpus: int) -> int | None:
    """The memory of the smallest of the GPUs a run uses, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    count = min(max(1, num_gpus), torch.cuda.device_count())
    return min(torch.cuda.get_device_properties(i).total_memory for i in range(count))


def layout(args) -> memory.Layout:
    """What FastVideoArgs make a GPU hold."""
    config = args.pipeline_config
    return memory.Layout(num_gpus=args.num_gpus, sp_size=args.sp_size or 1,
                         use_fsdp_inference=bool(args.use_fsdp_inference),
                         dit_layerwise_offload=bool(args.dit_layerwise_offload),
                         text_encoder_cpu_offload=bool(args.text_encoder_cpu_offload),
                         vae_cpu_offload=bool(args.vae_cpu_offload), dit_precision=config.dit_precision,
                         text_encoder_precision=config.text_encoder_precisions[0],
                         vae_precision=config.vae_precision)


def check(args, request: memory.Request = WEIGHTS_ONLY) -> memory.MemoryPlan | None:
    """The plan of `request` for these FastVideoArgs on this machine's GPUs (None where nothing is checked: no GPU,
    or a checkpoint not on disk yet); ValueError of one line where it does not fit."""
    available = gpu_bytes(args.num_gpus)
    if available is None or not os.path.isdir(args.model_path):
        return None
    return memory.check(memory.Sizes.from_checkpoint(args.model_path), request, layout(args), available)


def check_sampling(args, sampling_param) -> memory.MemoryPlan | None:
    return check(args, memory.Request(sampling_param.height, sampling_param.width, sampling_param.num_frames))


def choose_layout(generator: dict, request: memory.Request) -> memory.Layout | None:
    """PAN2's preset for the GPUs this machine has: in a raw run config's `generator` section where the user set none
    of the options the plan decides (FastVideo's offload flags, FSDP), the fastest layout that fits (`memory`:
    FastVideo's own defaults stream every block from the CPU, which a 141 GB GPU does not need). Returns it, or None
    where nothing was chosen (no GPU, a checkpoint not on disk, options given, nothing fits: the check then says so)."""
    engine = generator.setdefault("engine", {})
    offload = engine.setdefault("offload", {})
    if any(key in offload for key in ("dit", "dit_layerwise", "text_encoder", "vae")) or "use_fsdp_inference" in engine:
        return None
    num_gpus = int(engine.get("num_gpus", 1))
    available = gpu_bytes(num_gpus)
    model_path = generator.get("model_path")
    if available is None or not model_path or not os.path.isdir(model_path):
        return None
    fitting = memory.first_fitting(memory.Sizes.from_checkpoint(model_path), request, available, num_gpus)
    if fitting is None:
        return None
    chosen = fitting.layout
    offload.update(dit=False, dit_layerwise=chosen.dit_layerwise_offload, text_encoder=chosen.text_encoder_cpu_offload,
                   vae=chosen.vae_cpu_offload)
    engine["use_fsdp_inference"] = chosen.use_fsdp_inference
    engine.setdefault("parallelism", {}).setdefault("sp_size", chosen.sp_size)
    return chosen
