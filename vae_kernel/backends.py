"""Which op table a decoder runs: the portable one or the compiled one (where it is built and verified), with the
3x3 spatial convs direct or by Winograd F(2x2, 3x3) (docs/design/decoder.md, "Winograd")."""

from __future__ import annotations

import logging

import torch

from .portable import winograd
from .compiled import CompiledUnavailable, load_ops
from . import options
from .portable.ops import TORCH_OPS, Ops

logger = logging.getLogger(__name__)


# The layer shapes (Co, Ci, kt) whose convs run by Winograd under conv_algorithm "auto", per GPU model, as the GPU
# check measured them (gpu_check/gpu_check.py, conv_bench: Winograd faster than direct and within the allowance). A GPU
# without an entry, and the CPU (where the portable Winograd conv is about 2x slower than direct), run direct.
MEASURED_WINOGRAD_LAYERS: dict[str, frozenset[tuple[int, int, int]]] = {}


def _winograd_layers(conv_algorithm: str, device: torch.device) -> bool | frozenset:
    """False: every conv direct; True: every 3x3 conv by Winograd; a frozenset: those layers."""
    if conv_algorithm != "auto":
        return conv_algorithm == "winograd"
    if device.type != "cuda" or not MEASURED_WINOGRAD_LAYERS:
        return False
    return MEASURED_WINOGRAD_LAYERS.get(torch.cuda.get_device_name(device), False)


def check_gpu_for(backend, label: str = "backend") -> None:
    """ValueError when `backend` (called `label`) is "cuda", the compiled kernels on a GPU, and torch sees no GPU
    here: refused where it is given, before any model loads (a model on the CPU may still move to a GPU later; whether
    there is one is what can be known now)."""
    if backend == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{label}='cuda' runs the compiled kernels on a GPU, but torch sees none here "
                         f"(torch.cuda.is_available() is False): set {label} to 'auto' or 'torch'")


def select_ops(backend, device: torch.device, conv_algorithm: str = "auto") -> Ops:
    """The op table for `backend` on `device`, its 3x3 convs by `conv_algorithm`.

    "torch": the portable table. "cuda": `loader.load_ops(device)` or a RuntimeError saying why not.
    "auto": the compiled table where it loads (built and self-checked for this device), else the portable one.
    An `ops.Ops` table is used as given (a table loaded some other way, e.g. `loader.load_ops(device, source=...)`).
    conv_algorithm "winograd" (or "auto" where the GPU check measured Winograd faster) on the compiled backend uses
    the Winograd kernels once they pass the self-check; if they fail it, the direct kernels run, with a warning.
    """
    options.check({"backend": backend, "conv_algorithm": conv_algorithm})
    if isinstance(backend, Ops):
        return backend
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        layers = _winograd_layers(conv_algorithm, device)
        if not layers:
            return TORCH_OPS
        keep_direct = (lambda co, ci, kt: (co, ci, kt) not in layers) if isinstance(layers, frozenset) else ()
        return winograd.winograd_ops(TORCH_OPS, 2, keep_direct)
    if device.type != "cuda":
        raise ValueError(f"backend='cuda' needs a CUDA device; got device {device}: on the CPU use backend "
                         "'auto' or 'torch'")
    try:
        layers = _winograd_layers(conv_algorithm, device)
        if layers:
            try:
                return load_ops(device, winograd=layers)
            except CompiledUnavailable as exc:
                logger.warning("the Winograd kernels are disabled on %s (%s); the direct kernels run instead",
                               device, exc)
        return load_ops(device)
    except Exception as exc:  # any failure to build, load or self-check means "not available here"
        if backend == "cuda":
            raise RuntimeError(f"the compiled CUDA decoder is not available on {device}: {exc}") from exc
        logger.info("compiled VAE decoder unavailable on %s (%s); using the portable PyTorch ops", device, exc)
        return TORCH_OPS
