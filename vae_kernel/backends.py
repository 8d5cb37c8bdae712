"""Which op table a decoder runs: the portable one, or the compiled one where it is built and verified."""

from __future__ import annotations

import logging

import torch

from .loader import load_ops
from .ops import TORCH_OPS, Ops

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "cuda", "torch")


def select_ops(backend, device: torch.device) -> Ops:
    """The op table for `backend` on `device`.

    "torch": the portable table. "cuda": `loader.load_ops(device)` or a RuntimeError saying why not.
    "auto": the compiled table where it loads (built and self-checked for this device), else the portable one.
    An `ops.Ops` table is used as given (a table loaded some other way, e.g. `loader.load_ops(device, arch=...)`).
    """
    if isinstance(backend, Ops):
        return backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}; got {backend!r}")
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return TORCH_OPS
    if device.type != "cuda":
        raise ValueError(f"backend='cuda' needs a CUDA device; got device {device}")
    try:
        return load_ops(device)
    except Exception as exc:  # any failure to build, load or self-check means "not available here"
        if backend == "cuda":
            raise RuntimeError(f"the compiled CUDA decoder is not available on {device}: {exc}") from exc
        logger.info("compiled VAE decoder unavailable on %s (%s); using the portable PyTorch ops", device, exc)
        return TORCH_OPS
