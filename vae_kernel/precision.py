"""What "fp32" means here: fp32, not TF32 (the one switch every fp32 computation of this package runs under)."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def exact_fp32():
    """cuDNN convs and matmuls default to TF32 on recent GPUs; inside this block fp32 means fp32."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
