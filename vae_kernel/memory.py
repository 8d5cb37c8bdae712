"""Working-memory accounting for the decoder: a live-bytes tracker, budgets, and the dry-run op table.

`max_memory` (see `WanVAEDecoder`) is met by measuring, not guessing: the decoder's own schedule of buffers (causal
histories, windows, activations, tile crops) is replayed on the `meta` device, where tensors have shapes but no data,
under `LiveBytes`, which counts every storage created while it is active and frees it when the last view of it dies.
The ops of that replay (`dry_ops`) do no arithmetic: each allocates, for as long as the op runs, the scratch the
portable op needs (its inputs and outputs in the compute dtype, an upper bound on what `ops.py` materialises), so the
replay's peak is the decode's peak working memory: everything it allocates beyond the weights, the latents and the
returned video. Scratch is counted twice over (`_SCRATCH_COPIES`): the portable ops make a cast copy and a layout copy
of some operands (measured against the real CPU decode under `LiveBytes`, one copy underestimates small tiles by up
to 30%).
"""

from __future__ import annotations

import re

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from .ops import Ops

_SCRATCH_COPIES = 2
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(budget) -> int:
    """A memory budget as bytes: an int (bytes) or a string such as "2GiB", "512 MiB", "3.5GB"."""
    if isinstance(budget, bool):
        raise ValueError(f"max_memory must be bytes (int) or a string like '2GiB'; got {budget!r}")
    if isinstance(budget, int):
        value = budget
    elif isinstance(budget, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)?\s*", budget, flags=re.IGNORECASE)
        if match is None:
            raise ValueError(f"max_memory must be bytes (int) or a string like '2GiB'; got {budget!r}")
        value = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
    else:
        raise ValueError(f"max_memory must be bytes (int) or a string like '2GiB'; got {budget!r}")
    if value < 1:
        raise ValueError(f"max_memory must be positive; got {budget!r}")
    return value


def format_bytes(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages created while active that are still alive; `peak` is their maximum, sampled
    after every op (tensors that existed before entering are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        new = [t.untyped_storage() for t in _tensors(out) if t.untyped_storage()._cdata not in self.live]
        if new:  # frees only matter for the peak at the next allocation
            self._sweep()
            for storage in new:
                if storage._cdata not in self.live:
                    self.live[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
                    self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        return out

    def _sweep(self) -> None:
        for key, (ref, nbytes) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
                self.current -= nbytes


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def dry_ops(compute_itemsize: int) -> Ops:
    """An op table that computes nothing and holds, while it runs, scratch for its tensor arguments at
    `compute_itemsize` bytes per element (the portable ops cast inputs and produce outputs in the compute dtype)."""

    def op(*args, **kwargs):
        elements = sum(a.numel() for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor))
        scratch = torch.empty(_SCRATCH_COPIES * elements * compute_itemsize, dtype=torch.uint8, device="meta")
        del scratch

    def attention(q, kv, out):
        # ... plus the score matrix a math-path softmax attention may materialise (frames x Lq x L).
        scores = q.shape[0] * q.shape[1] * kv.shape[1]
        elements = q.numel() + kv.numel() + out.numel() + scores
        scratch = torch.empty(_SCRATCH_COPIES * elements * compute_itemsize, dtype=torch.uint8, device="meta")
        del scratch

    return Ops("dry", op, op, op, attention, op, op)
