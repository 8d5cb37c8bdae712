"""Working-memory accounting for the decoder: a live-bytes tracker, budgets, the dry-run op table and the planner.

`max_memory` (see `WanVAEDecoder`) is met by measuring, not guessing: the decoder's own schedule of buffers (causal
histories, windows, activations, tile crops) is replayed on the `meta` device, where tensors have shapes but no data,
under `LiveBytes`, which counts every storage created while it is active and frees it when the last view of it dies.
The ops of that replay (`dry_ops`) do no arithmetic: each allocates, for as long as the op runs, the scratch the
portable op needs (its inputs and outputs in the compute dtype, an upper bound on what `ops.py` materialises), so the
replay's peak is the decode's peak working memory: everything it allocates beyond the weights, the latents and the
returned video. Scratch is counted twice over (`_SCRATCH_COPIES`): the portable ops make a cast copy and a layout copy
of some operands (measured against the real CPU decode under `LiveBytes`, one copy underestimates small tiles by up
to 30%).

`frames_per_pass="auto"` (the default) is planned here too: the largest of `FRAMES_PER_PASS_CHOICES` whose peak fits
a budget (docs/design.md, "The decoder": memory planner).
"""

from __future__ import annotations

import re

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from ..distributed.bands import LocalRows
from ..portable.network import DecodeState, NetworkPass, Tile
from ..portable.ops import Ops
from ..portable.passes import latent_passes, pass_video_frames, row_tiles

_SCRATCH_COPIES = 2
AUTO = "auto"
FRAMES_PER_PASS_CHOICES = (8, 4, 2, 1)  # what frames_per_pass="auto" chooses among, largest first
# frames_per_pass="auto" keeps a decode's whole allocation (weights, working memory, returned video) within this when
# nothing smaller bounds it: PAN2's default video (704x1248, 193 frames) then decodes at frames_per_pass 1 on one GPU.
DEFAULT_MEMORY_GOAL = 16 * 2**30
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(budget, name: str = "max_memory") -> int:
    """A memory budget as bytes: an int (bytes) or a string such as "2GiB", "512 MiB", "3.5GB" (errors call it
    `name`)."""
    if isinstance(budget, bool):
        raise ValueError(f"{name} must be bytes (int) or a string like '2GiB'; got {budget!r}")
    if isinstance(budget, int):
        value = budget
    elif isinstance(budget, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)?\s*", budget, flags=re.IGNORECASE)
        if match is None:
            raise ValueError(f"{name} must be bytes (int) or a string like '2GiB'; got {budget!r}")
        value = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
    else:
        raise ValueError(f"{name} must be bytes (int) or a string like '2GiB'; got {budget!r}")
    if value < 1:
        raise ValueError(f"{name} must be positive; got {budget!r}")
    return value


def free_device_bytes(device: torch.device) -> int | None:
    """What a decode may still allocate on `device`: the device's free memory plus what torch's caching allocator holds
    unused (None on a CPU: not measured, only `DEFAULT_MEMORY_GOAL` bounds the plan there)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


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


# peak_bytes' replay underestimates the real CPU decode's peak by up to 26% for one-row tiles of 2-column-wide test
# frames at 2 frames per pass (7% at 3 columns; fixed per-op costs, not yet modelled, weigh most there), so a budget is
# checked against 1.3 x the replay. At 1 frame per pass such frames are worse (3-row tiles: 44%; 4 columns: 12-17%;
# 6 columns: within 4%): the tests that hold a decode to its budget use frames at least 4 columns wide.
PEAK_HEADROOM = 1.3
# A decode that ran out of memory retries at a plan whose replayed peak is at most this fraction of the failed plan's
# (docs/design.md, "Out-of-memory retries"): every retry cuts the planned peak by a quarter or more, so a decode tries
# few plans (PAN2's video at 4 frames per pass: 4, 2, 1, then tiles), and the smallest plan is tried last.
RETRY_PEAK_FRACTION = 0.75
_STREAM_RETRY_TILES = (2, 3, 4, 6, 8)  # tile counts a streamed decode's retry tries


class MemoryPlanner:
    """A decode's peak working memory, measured by replaying its buffers on the meta device, and the tile that keeps
    it within a budget."""

    def __init__(self, weights: dict[str, torch.Tensor], config, device: torch.device) -> None:
        self.config, self.device = config, device
        self._weights = weights
        self._meta_weights = None
        self._peaks: dict[tuple, int] = {}
        self._plans: dict[tuple, int | None] = {}

    @property
    def weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in self._weights.values())

    def peak_bytes(self, latents_shape, frames_per_pass: int, tile_rows: int | None = None,
                   stream: bool = False) -> int:
        """Peak working memory (bytes) of decoding one sample of latents of `latents_shape` ([B, C, T, h, w]) with
        `tile_rows` (None: untiled) at `frames_per_pass`, by `decode` (stream=False) or `decode_iter` (stream=True;
        tiles then advance together, so every tile's causal history is alive at once). Excludes weights, latents and
        the returned video (for `decode_iter`, the chunk being yielded is included). Batch elements are decoded one
        after another, so the batch size does not change it. Remembered per shape and setting."""
        key = (*latents_shape[2:], tile_rows, stream, frames_per_pass)
        if key not in self._peaks:
            self._peaks[key] = self._replay(latents_shape, tile_rows, stream, frames_per_pass)
        return self._peaks[key]

    def _replay(self, latents_shape, tile_rows: int | None, stream: bool, frames_per_pass: int) -> int:
        _, _, t, height, width = latents_shape
        if self._meta_weights is None:
            self._meta_weights = {k: v.to("meta") for k, v in self._weights.items()}
        itemsize = 4 if self.device.type == "cpu" else 2  # the portable ops compute in fp32 on CPU, bf16 on GPU
        ops, p, s = dry_ops(itemsize), self.config.patch_size, self.config.spatial_scale
        # The first frame, a pass whose causal history is that one frame, then one with the full history (two frames
        # at every conv): later passes repeat the third.
        passes = latent_passes(t, frames_per_pass)[:3]
        z = torch.empty((self.config.z_dim, passes[-1][1], height, width), device="meta")
        meta = torch.device("meta")
        if tile_rows is None or tile_rows >= height:
            tiles = [None]
        elif stream:
            tiles = row_tiles(height, tile_rows)
        else:  # tile by tile: the middle tile holds the most margin rows
            start = (height - tile_rows) // 2
            tiles = [(start, start + tile_rows)]
        with LiveBytes() as tracker:
            states = [DecodeState(meta) for _ in tiles]
            for t0, t1 in passes:
                chunk = None
                if stream or tile_rows is None:
                    chunk = torch.empty((1, 3, len(pass_video_frames(t0, t1)), s * height, s * width),
                                        dtype=torch.bfloat16, device=meta)
                for tile, state in zip(tiles, states):
                    spec = None if tile is None else Tile(*tile, height, self.config)
                    out = NetworkPass(ops, self._meta_weights, self.config, LocalRows(height), state, t0 == 0,
                                      spec).run(z[:, t0:t1])
                    ops.unpatchify_clamp(out, out, p)
                    del out
                del chunk
            del states
        return tracker.peak

    def frames_per_pass(self, latents_shape, budget: int, stream: bool, tile_rows: int | None = None) -> int | None:
        """The largest of `FRAMES_PER_PASS_CHOICES` whose peak (with `tile_rows`) fits `budget` bytes, None when
        none does. A clip of T latent frames never needs more than T - 1 per pass (the first frame goes alone)."""
        most = max(latents_shape[2] - 1, 1)
        for fpp in FRAMES_PER_PASS_CHOICES:
            if fpp <= most and self.fits(latents_shape, tile_rows, stream, budget, fpp):
                return fpp
        return None

    def tile_rows(self, latents_shape, budget: int, stream: bool, frames_per_pass: int) -> int | None:
        """The largest tile whose peak fits `budget` bytes (None: the untiled decode fits); ValueError when even
        one-row tiles do not fit. Remembered per latent shape."""
        key = (*latents_shape[2:], budget, stream, frames_per_pass)
        if key not in self._plans:
            self._plans[key] = self._plan(tuple(latents_shape), budget, stream, frames_per_pass)
        return self._plans[key]

    def fits(self, shape, tile_rows, stream, budget, frames_per_pass) -> bool:
        """Whether the planned peak (x PEAK_HEADROOM) of this decode setting fits `budget` bytes."""
        return self.peak_bytes(shape, frames_per_pass, tile_rows, stream) * PEAK_HEADROOM <= budget

    def retry_plan(self, shape, frames_per_pass: int, tile_rows: int | None, stream: bool,
                   may_tile: bool) -> tuple[int, int | None] | None:
        """The plan a decode that ran out of memory at (`frames_per_pass`, `tile_rows`) retries at: among the smaller
        plans (fewer frames per pass at the same tiles; then, at 1 frame per pass and where `may_tile`, smaller
        exact tiles, largest first), the first whose peak is at most RETRY_PEAK_FRACTION of the failed plan's; else
        the smaller plan with the least peak, if that is below the failed plan's; None when no smaller plan is
        left."""
        failed = self.peak_bytes(shape, frames_per_pass, tile_rows, stream)
        budget = failed * RETRY_PEAK_FRACTION
        most = min(frames_per_pass, max(shape[2] - 1, 1))  # more than T - 1 per pass runs as T - 1
        fewer = [(fpp, tile_rows) for fpp in FRAMES_PER_PASS_CHOICES if fpp < most]
        for plan in fewer:
            if self.peak_bytes(shape, *plan, stream) <= budget:
                return plan
        height = shape[3] if tile_rows is None else tile_rows
        tiles = [] if not may_tile or height < 2 else self._smaller_tiles(shape, height, stream, budget)
        candidates = fewer + [(1, rows) for rows in tiles]
        for plan in candidates[len(fewer):]:
            if self.peak_bytes(shape, *plan, stream) <= budget:
                return plan
        if not candidates:
            return None
        least = min(candidates, key=lambda plan: self.peak_bytes(shape, *plan, stream))
        return least if self.peak_bytes(shape, *least, stream) < failed else None

    def _smaller_tiles(self, shape, below: int, stream: bool, budget: float) -> list[int]:
        """Tile sizes under `below` rows to try at 1 frame per pass, largest first. Tile by tile the peak grows with
        the tile, so the largest tile within `budget` (binary search) and the one-row tile (the least peak) are the
        only ones worth trying. Streamed, every tile's history is alive at once and smaller tiles can cost more (see
        `_plan_stream`): the largest tile of 2, 3, 4, 6 and 8 tiles (a handful of replays: a streamed replay of a
        large frame is slow)."""
        if stream:
            return sorted({rows for rows in (-(-shape[3] // k) for k in _STREAM_RETRY_TILES) if rows < below},
                          reverse=True)
        lo, hi = 1, below - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.peak_bytes(shape, 1, mid) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return sorted({lo, 1}, reverse=True)

    def _plan(self, shape, budget: int, stream: bool, fpp: int) -> int | None:
        height = shape[3]
        if self.fits(shape, None, stream, budget, fpp):
            return None
        if stream:
            return self._plan_stream(shape, budget, fpp)
        smallest = int(self.peak_bytes(shape, fpp, 1) * PEAK_HEADROOM)
        if smallest > budget:
            raise _too_small(budget, shape, smallest, "even in one-row tiles")
        lo, hi = 1, height - 1  # the largest tile that fits (tile by tile, peak grows with the tile)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.fits(shape, mid, False, budget, fpp):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _plan_stream(self, shape, budget: int, fpp: int) -> int:
        """Streaming keeps every tile's history, and the tiles' margins overlap, so below some size smaller tiles
        cost more (Wan2.2 at 704x1248: least near 11 rows). Try each tile count's largest tile, largest first."""
        height = shape[3]
        candidates = sorted({-(-height // k) for k in range(2, height + 1)}, reverse=True)
        peaks = []
        for rows in candidates:
            peak = int(self.peak_bytes(shape, fpp, rows, True) * PEAK_HEADROOM)
            if peak <= budget:
                return rows
            peaks.append(peak)
        raise _too_small(budget, shape, min(peaks), "streamed (decode_iter) in any tile size")


def _too_small(budget: int, shape, needed: int, how: str) -> ValueError:
    return ValueError(f"max_memory {format_bytes(budget)} ({budget} bytes) is too small to decode latents "
                      f"{list(shape)} {how}: that needs at least {format_bytes(needed)} ({needed} bytes)")
