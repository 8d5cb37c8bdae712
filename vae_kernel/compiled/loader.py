"""The compiled op table for a device: built or loaded from the cache, verified once per process, remembered.

    table = loader.load_ops(device)    # an ops.Ops, or CompiledUnavailable (a RuntimeError) saying why not

A failure (no GPU, no kernels for its architecture, no toolchain, a failed build or self-check) is remembered for the
process and device: the same exception again, without rebuilding. A failed self-check of a built extension is also
remembered across processes (`verification.remembered_verdict`): later processes refuse it without checking again. "auto" callers catch it and use the portable path
(`backends.select_ops`); "cuda" callers let it propagate.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Callable

import torch

from .extension import CompiledUnavailable, ExtensionSource, arch_for_device, built
from .kernels import make_ops
from ..portable.ops import Ops
from .verification import verify_build_isolated, verify_ops

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_loaded: dict[tuple, Ops | CompiledUnavailable] = {}  # (device, factory) -> op table or the reason it is unusable


def _built_ops(device: torch.device, source: ExtensionSource, winograd: bool | frozenset) -> Ops:
    ext = source.open()
    verify_build_isolated(source, device, winograd=bool(winograd))
    if isinstance(winograd, frozenset):  # the measured layers only (every layer was verified)
        return make_ops(ext, winograd_convs=True, keep_direct=lambda co, ci, kt: (co, ci, kt) not in winograd)
    return make_ops(ext, winograd_convs=winograd)


def load_ops(device: torch.device | str | int = "cuda", *, source: ExtensionSource | None = None,
             winograd: bool | frozenset = False, factory: Callable[[torch.device], Ops] | None = None) -> Ops:
    """The compiled op table for `device`, verified (see the module notes).

    `source`: the extension to open instead of the one built for the device (`extension.built(arch)`), e.g. a
    stand-in for a CPU rehearsal of this whole path, child-process self-check included. `winograd`: the (kt, 3, 3)
    convs by the Winograd kernels (True: every such layer; a frozenset of (Co, Ci, kt): those layers), verified with
    every layer by Winograd. `factory(device) -> Ops` replaces the build altogether: the table is then self-checked in this
    process with the same cases and judgement, and remembered the same way."""
    device = torch.device(device)
    if factory is None and source is None:
        if device.type != "cuda":
            raise CompiledUnavailable(f"the compiled backend needs a CUDA device; got {device}")
        if not torch.cuda.is_available():
            raise CompiledUnavailable("the compiled backend needs a CUDA GPU; torch.cuda.is_available() is False")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _lock:
        key = (str(device), source, winograd, factory)
        cached = _loaded.get(key)
        if isinstance(cached, CompiledUnavailable):
            raise cached
        if cached is not None:
            return cached
        try:
            if factory is None:
                with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                    table = _built_ops(device, source or built(arch_for_device(device)), winograd)
            else:
                table = factory(device)
                verify_ops(table, device)
        except CompiledUnavailable as exc:
            _loaded[key] = exc
            logger.warning("compiled VAE decoder disabled for this process on %s: %s", device, exc)
            raise
        except Exception as exc:  # a build error, or a CUDA error inside the kernels
            wrapped = CompiledUnavailable(f"compiled backend unavailable on {device}: {type(exc).__name__}: {exc}")
            _loaded[key] = wrapped
            logger.warning("compiled VAE decoder disabled for this process on %s: %s", device, wrapped)
            raise wrapped from exc
        _loaded[key] = table
        return table
