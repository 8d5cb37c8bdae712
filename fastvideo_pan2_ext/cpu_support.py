"""Let FastVideo 0.2.1 run a pipeline on a machine with no GPU (tests, the demo, CI). Does nothing anywhere else.

FastVideo 0.2.1 resolves the CPU platform on such a machine but cannot run on it. `install()` closes exactly these
gaps, and only when FastVideo's platform is CPU and torch sees no CUDA device (GPU runs are untouched):

1. `fastvideo.distributed.parallel_state.get_local_torch_device()` returns ``mps`` on every platform that is not
   CUDA/ROCm/NPU. It is replaced by one that returns ``cpu`` on the CPU platform, in parallel_state and in every
   already-imported FastVideo module that bound it with ``from ... import`` (later imports get the new one).
2. `CpuPlatform` has no `get_attn_backend_cls`, so no attention backend is ever found: it gets one that answers with
   FastVideo's torch SDPA backend.
3. Stages run under ``torch.autocast("cuda", bf16)``, a no-op without CUDA, so the denoising stage's bf16 latents
   meet fp32 weights and activations: on a GPU-less machine ``torch.autocast("cuda", ...)`` means CPU autocast
   (the same mixed precision, on the device that exists).
4. With ``FASTVIDEO_STAGE_LOGGING=1`` every stage calls ``torch.cuda.synchronize()``, which raises without CUDA:
   with no CUDA device there is nothing to wait for, so it becomes a no-op.
5. FastVideo's offload defaults (DiT/text encoder/image encoder/VAE offload, pinned memory, layerwise offload, FSDP
   inference) need CUDA (the parent, too, pins its output buffer): every `FastVideoArgs` made on such a machine gets
   them turned off right after its own `__post_init__` (workers receive the parent's, already adjusted).
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger(__name__)

SDPA_BACKEND = "fastvideo.attention.backends.sdpa.SDPABackend"
_OFFLOAD_FLAGS = ("dit_cpu_offload", "dit_layerwise_offload", "text_encoder_cpu_offload",
                  "image_encoder_cpu_offload", "vae_cpu_offload", "pin_cpu_memory", "use_fsdp_inference")

_installed = False


def cpu_only() -> bool:
    """True when FastVideo resolved the CPU platform and torch sees no CUDA device."""
    import torch
    from fastvideo.platforms import current_platform

    return current_platform.is_cpu() and not torch.cuda.is_available()


def use_cpu_settings(fastvideo_args) -> None:
    """Every offload off (gap 5), in place."""
    for flag in _OFFLOAD_FLAGS:
        if getattr(fastvideo_args, flag, False):
            setattr(fastvideo_args, flag, False)


def install() -> bool:
    """Close the CPU gaps if this is a GPU-less machine; returns whether it did (idempotent)."""
    global _installed
    if _installed:
        return True
    if not cpu_only():
        return False
    _installed = True

    import torch
    import fastvideo.distributed.parallel_state as parallel_state
    from fastvideo.fastvideo_args import FastVideoArgs
    from fastvideo.platforms.cpu import CpuPlatform

    original_device_fn = parallel_state.get_local_torch_device

    def get_local_torch_device() -> torch.device:
        return torch.device("cpu")

    parallel_state.get_local_torch_device = get_local_torch_device
    for name, module in list(sys.modules.items()):
        if name.startswith("fastvideo") and getattr(module, "get_local_torch_device", None) is original_device_fn:
            module.get_local_torch_device = get_local_torch_device

    if "get_attn_backend_cls" not in CpuPlatform.__dict__:
        CpuPlatform.get_attn_backend_cls = classmethod(lambda cls, selected_backend, head_size, dtype: SDPA_BACKEND)

    class autocast(torch.autocast):
        """torch.autocast, with device_type "cuda" meaning "cpu" (there is no CUDA device here)."""

        def __init__(self, device_type, *args, **kwargs):
            super().__init__("cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    torch.autocast = autocast
    torch.cuda.synchronize = lambda device=None: None

    original_post_init = FastVideoArgs.__post_init__

    def __post_init__(self) -> None:
        original_post_init(self)
        use_cpu_settings(self)

    FastVideoArgs.__post_init__ = __post_init__
    logger.info("fastvideo_pan2_ext: no GPU; FastVideo set up to run on CPU (see fastvideo_pan2_ext.cpu_support)")
    return True
