"""What "fp32" means here: fp32, not TF32 (the one switch every fp32 computation of this package runs under); and
the decoder's arithmetic, which no caller's autocast changes."""

from __future__ import annotations

import contextlib

import torch


def _fp32_precision_settings() -> list:
    """torch's per-backend fp32 precision settings (`fp32_precision`: "ieee" or "tf32"; torch 2.9 and later)."""
    backends = (getattr(torch.backends.cuda, "matmul", None), getattr(torch.backends.cudnn, "conv", None),
                getattr(torch.backends.cudnn, "rnn", None))
    return [b for b in backends if b is not None and hasattr(b, "fp32_precision")]


@contextlib.contextmanager
def exact_fp32():
    """cuDNN convs and matmuls default to TF32 on recent GPUs; inside this block fp32 means fp32. Through the
    `allow_tf32` flags, or, where the caller set TF32 through torch's per-backend `fp32_precision` settings (after
    which torch refuses to read those flags), through those."""
    try:
        saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    except RuntimeError:  # the flags were mixed with the newer settings: use the newer settings alone
        settings = _fp32_precision_settings()
        before = [s.fp32_precision for s in settings]
        for s in settings:
            s.fp32_precision = "ieee"
        try:
            yield
        finally:
            for s, value in zip(settings, before):
                s.fp32_precision = value
        return
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@contextlib.contextmanager
def own_arithmetic(device: torch.device, tf32_as_caller: bool = False):
    """The decoder's arithmetic is its own (bf16 tensors, fp32 statistics and accumulation, weights prepared in
    fp32): no autograd, fp32 that means fp32, and no autocast region around it (FastVideo's decoding stage has one)
    changing an op's dtype. Enter it around work, never across a generator's yield: the caller's code between
    chunks keeps its own settings. `tf32_as_caller`: fp32 convs and matmuls use TF32 where the caller's torch
    settings say so (the encoder's precision "auto", as diffusers' own encode would)."""
    with torch.no_grad(), contextlib.nullcontext() if tf32_as_caller else exact_fp32(), \
            torch.autocast(device.type, enabled=False):
        yield
