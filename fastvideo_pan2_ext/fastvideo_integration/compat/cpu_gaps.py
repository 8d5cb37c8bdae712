"""FastVideo on a GPU-less machine (fastvideo.platforms.cpu, fastvideo.distributed, FSDP's mesh, torch's autocast):
the CPU-only replacements, applied only in a process where FastVideo resolved the CPU platform and torch sees no CUDA
device; GPU runs never get them."""

from __future__ import annotations

import logging
import sys

from . import registry
from .seams import Seam

logger = logging.getLogger(__name__)

SEAMS = (
    Seam("fastvideo.platforms", "current_platform", "CPU only: the replacements apply only where FastVideo resolved "
         "the CPU platform"),
    Seam("fastvideo.distributed.parallel_state", "get_local_torch_device", "the device of this rank "
         "(`executor.local_torch_device`); CPU only: it answers 'mps' on every platform that is not CUDA/ROCm/NPU, so "
         "it is replaced", replaced=True),
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
)

# FastVideo's offloads need CUDA (the parent, too, pins its output buffer): off in GPU-less processes.
CPU_OFFLOAD_FLAGS = ("dit_cpu_offload", "dit_layerwise_offload", "text_encoder_cpu_offload",
                     "image_encoder_cpu_offload", "vae_cpu_offload", "pin_cpu_memory")
SDPA_BACKEND = "fastvideo.attention.backends.sdpa.SDPABackend"


def cpu_only() -> bool:
    """True when FastVideo resolved the CPU platform and torch sees no CUDA device."""
    import torch
    from fastvideo.platforms import current_platform

    return current_platform.is_cpu() and not torch.cuda.is_available()


_cpu_gaps_closed = False


def close_cpu_gaps() -> bool:
    """Let FastVideo run a pipeline in a GPU-less process (the seams above); returns whether it did.
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
    registry.on_fastvideo_args(use_cpu_settings, "after")
    logger.info("fastvideo_pan2_ext: no GPU; FastVideo set up to run on CPU "
                "(fastvideo_pan2_ext.fastvideo_integration.compat.cpu_gaps)")
    return True


def use_cpu_settings(fastvideo_args) -> None:
    """Every offload off, in place (workers receive the parent's args, already adjusted)."""
    for flag in CPU_OFFLOAD_FLAGS:
        if getattr(fastvideo_args, flag, False):
            setattr(fastvideo_args, flag, False)
