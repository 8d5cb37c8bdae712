"""`WanVAEDecoder`: the fast Wan VAE decoder's public API (docs/design.md, "Public API").

The same math as `reference.decode` (diffusers' `AutoencoderKLWan.decode`), organised for speed by the modules below
this one: `network` (one pass of the network over a band of rows), `passes` (the loops over passes, bands and tiles),
`bands` (how rows are split across ranks), `memory` (peak working memory and the tile planner), `backends` (which op
table runs: portable or compiled). This module validates input, chooses among those, and keeps the ranks in step
(`agreement`).
"""

from __future__ import annotations

import math
from typing import Iterator, NamedTuple

import torch
import torch.distributed as dist

from . import options as options_mod
from .planning import memory
from .portable import weights as weights_mod
from .distributed.agreement import DecodeRequest, agree, supported_dtype
from .definitions.architecture import check_latents, video_shape
from .backends import select_ops
from .distributed.bands import LocalRows, RankRows, split_rows
from .portable.passes import Chunk, PassRunner, collect


def _resolve_device(device) -> torch.device:
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be a torch device or its name; got {device!r}") from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device} requested but CUDA is not available")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


class DecodePlan(NamedTuple):
    """How one decode runs: latent frames per pass, and latent rows per tile (None: untiled)."""

    frames_per_pass: int
    tile_rows: int | None


class WanVAEDecoder:
    """The fast Wan VAE decoder (the Wan2.2 and the Wan2.1 layout).

    `WanVAEDecoder(vae_or_state_dict, device="cuda", pg=None, local=False, **options)` takes diffusers' (or
    FastVideo's) `AutoencoderKLWan` or its state dict; the architecture is read from the weights. The options
    (`frames_per_pass`, `tile_rows`, `max_memory`, `backend`, `conv_algorithm`) are defined in `options.OPTIONS`.
    `decode(latents)` maps de-normalized latents [B, z_dim, T, h, w] to a bf16 video [B, 3, 4T - 3, s*h, s*w] in
    [-1, 1] (s = 16 for Wan2.2, 8 for Wan2.1). With a process group of N ranks each rank decodes a band of rows and
    rank 0 returns the video (the others None); `local=True` decodes on the calling rank alone. `backend`: "auto"
    (compiled where built and self-checked, else portable), "cuda" (compiled or an error), "torch" (portable, CPU
    too), or an `ops.Ops` table to run as given.
    `frames_per_pass`: latent frames per pass (memory vs speed; the same video), or "auto": per decode, the largest of
    8, 4, 2, 1 whose planned peak fits `max_memory` when set, else both the free device memory and
    `memory.DEFAULT_MEMORY_GOAL` (16 GiB for weights, working memory and video together); when even 1 does not fit
    the free memory, a single-rank decode tiles to fit it. The ranks of a group take the smallest any of them can
    afford. `plan(latents_shape)` tells what a decode will do.
    `tile_rows=n` (or `enable_tiling(n)`): exact tiled decode of a single-rank decoder, n latent rows per tile.
    `max_memory=bytes` (or a string such as "2GiB"): a single-rank decoder picks, per latent shape, the largest tile
    whose peak working memory (`peak_bytes`: what a decode allocates beyond weights, latents and the returned video)
    fits; the plain decode when it fits whole. `decode` and `decode_iter` both honour tiling.
    `conv_algorithm`: the 3x3 spatial convs "direct", by "winograd" F(2x2, 3x3) (2.25x fewer multiplies, within the
    allowance at every layer), or "auto" (the per-layer choice the GPU check measured for this GPU; direct where
    nothing was measured, and on CPU); honoured by every backend (`backends.select_ops`).
    """

    def __init__(self, vae_or_state_dict, device="cuda", pg=None, local: bool = False, **options) -> None:
        opts = self.options = options_mod.check(options)
        self.frames_per_pass = opts.frames_per_pass
        self.tile_rows = None
        self.max_memory = None
        self.device = _resolve_device(device)
        self.config, self.weights = weights_mod.load(vae_or_state_dict, self.device)
        self.ops = select_ops(opts.backend, self.device, opts.conv_algorithm)
        if pg is None and not local and dist.is_available() and dist.is_initialized():
            pg = dist.group.WORLD
        # A group of one rank decodes alone (and may tile), e.g. in a one-GPU FastVideo process.
        self.pg = None if local or pg is None or dist.get_world_size(pg) == 1 else pg
        self._planner = memory.MemoryPlanner(self.weights, self.config, self.device)
        self.last_plan: DecodePlan | None = None  # what the latest decode or decode_iter ran (the ranks' agreed plan)
        if opts.tile_rows is not None:
            self.enable_tiling(opts.tile_rows)
        if opts.max_memory is not None:
            self.set_max_memory(opts.max_memory)

    @property
    def backend(self) -> str:
        return self.ops.name

    @property
    def is_root(self) -> bool:
        """Whether this rank receives the video (rank 0 of the decode group, or a single-rank decoder)."""
        return self.pg is None or dist.get_rank(self.pg) == 0

    def enable_tiling(self, tile_rows: int) -> None:
        """Decode in tiles of `tile_rows` latent rows, one after another (exact; peak memory falls with the tile)."""
        options_mod.check({"tile_rows": tile_rows})
        if self.pg is not None:
            raise ValueError("tiled decode runs on one rank: pass local=True (or no process group) to use tile_rows")
        self.tile_rows, self.max_memory = tile_rows, None

    def set_max_memory(self, max_memory: int | str) -> None:
        """Choose the tile per latent shape so that the decode's peak working memory fits `max_memory` bytes."""
        budget = memory.parse_bytes(max_memory)
        if self.pg is not None:
            raise ValueError("max_memory tiles the decode, which runs on one rank: pass local=True (or no process "
                             "group)")
        self.tile_rows, self.max_memory = None, budget

    def disable_tiling(self) -> None:
        self.tile_rows = self.max_memory = None

    # ---------------------------------------------------------------------------------------------------------------
    # Memory (memory.MemoryPlanner)
    # ---------------------------------------------------------------------------------------------------------------

    def peak_bytes(self, latents_shape, tile_rows: int | None = None, stream: bool = False,
                   frames_per_pass: int | None = None) -> int:
        """Peak working memory (bytes) of decoding latents of `latents_shape` at `frames_per_pass` (None: this
        decoder's; for "auto", what `plan` chooses) (see `memory.MemoryPlanner`)."""
        shape = self._shape(latents_shape)
        if frames_per_pass is None:
            frames_per_pass = self.plan(shape, stream).frames_per_pass
        return self._planner.peak_bytes(shape, frames_per_pass, tile_rows, stream)

    def plan_tile_rows(self, latents_shape, stream: bool = False) -> int | None:
        """The tile `decode` (or, stream=True, `decode_iter`) uses for latents of `latents_shape`: with max_memory,
        None (untiled) when the plain decode fits, else the largest tile_rows that fits; ValueError when even
        one-row tiles do not fit."""
        return self.plan(latents_shape, stream).tile_rows

    def plan(self, latents_shape, stream: bool = False) -> DecodePlan:
        """How `decode` (or, stream=True, `decode_iter`) decodes latents of `latents_shape` on this rank now (with
        "auto", the free device memory is read at each call); ValueError when `max_memory` cannot be met."""
        shape = self._shape(latents_shape)
        if self.frames_per_pass != memory.AUTO:
            return DecodePlan(self.frames_per_pass, self._tile_rows_for(shape, stream, self.frames_per_pass))
        if self.max_memory is not None:  # the largest setting that decodes untiled within budget, else tiles at 1
            fpp = self._planner.frames_per_pass(shape, self.max_memory, stream) or 1
            return DecodePlan(fpp, self._tile_rows_for(shape, stream, fpp))
        band = self._band_shape(shape)
        video = 0 if stream else 2 * math.prod(video_shape(self.config, shape))  # decode returns it, bf16
        free = memory.free_device_bytes(self.device)
        room = None if free is None else free - video
        goal = memory.DEFAULT_MEMORY_GOAL - self._planner.weight_bytes - video
        fpp = self._planner.frames_per_pass(band, goal if room is None else min(goal, room), stream, self.tile_rows)
        if fpp is not None:
            return DecodePlan(fpp, self._tile_rows_for(shape, stream, fpp))
        if room is None or self.pg is not None or self.tile_rows is not None \
                or self._planner.fits(band, None, stream, room, 1):
            return DecodePlan(1, self._tile_rows_for(shape, stream, 1))
        try:  # even one frame per pass overflows the free memory: exact tiles that fit it
            return DecodePlan(1, self._planner.tile_rows(shape, room, stream, 1))
        except ValueError:
            return DecodePlan(1, None)  # nothing fits by the plan: leave it to the allocator

    def _shape(self, latents_shape) -> tuple[int, ...]:
        shape = tuple(latents_shape)
        if len(shape) != 5 or shape[1] != self.config.z_dim or not all(isinstance(n, int) and n >= 1 for n in shape):
            raise ValueError(f"latents_shape must be [B, {self.config.z_dim}, T, h, w] with every size >= 1; got "
                             f"{latents_shape!r}")
        return shape

    def _tile_rows_for(self, latents_shape, stream: bool, frames_per_pass: int) -> int | None:
        if self.max_memory is None:
            return self.tile_rows if self.tile_rows is not None and self.tile_rows < latents_shape[3] else None
        return self._planner.tile_rows(latents_shape, self.max_memory, stream, frames_per_pass)

    def _band_shape(self, latents_shape) -> tuple[int, ...]:
        """The latents one rank decodes: its band of rows plus a halo row on each side (the whole frame alone)."""
        if self.pg is None:
            return latents_shape
        height = latents_shape[3]
        bands = split_rows(height, dist.get_world_size(self.pg), self.ops.row_multiple)
        rows = min(max(stop - start for start, stop in bands) + 2, height)
        return (*latents_shape[:3], rows, latents_shape[4])

    # ---------------------------------------------------------------------------------------------------------------
    # Input checks (every rank agrees before any work starts)
    # ---------------------------------------------------------------------------------------------------------------

    def _input_error(self, latents) -> str | None:
        try:
            check_latents(latents, self.config.z_dim)
        except ValueError as exc:
            return str(exc)
        if not supported_dtype(latents.dtype):
            return f"latents must be float32, bfloat16, float16 or float64; got {latents.dtype}"
        if latents.device != self.device:
            return f"latents are on {latents.device}; this decoder runs on {self.device}"
        if not bool(torch.isfinite(latents).all()):
            return "latents contain NaN or Inf"
        return None

    def _start(self, latents, stream: bool) -> tuple[DecodePlan, LocalRows]:
        """Check the input and plan the decode; the ranks of a group first agree on both (an error on one rank raises
        on all; they decode at the smallest frames_per_pass any of them planned)."""
        rows = self._rows(latents.shape[3] if isinstance(latents, torch.Tensor) and latents.dim() == 5 else 1)
        error = self._input_error(latents)
        plan = None if error else self.plan(latents.shape, stream)
        if isinstance(rows, RankRows):
            mine = DecodeRequest(False) if error else DecodeRequest.of(latents, self.frames_per_pass,
                                                                       plan.frames_per_pass, self.config)
            plan = DecodePlan(agree(self.pg, rows.comm_device, mine, error), None)
        elif error:
            raise ValueError(error)
        self.last_plan = plan
        return plan, rows

    # ---------------------------------------------------------------------------------------------------------------
    # Decoding
    # ---------------------------------------------------------------------------------------------------------------

    def _rows(self, height: int) -> LocalRows:
        return LocalRows(height) if self.pg is None else RankRows(height, self.pg, self.device, self.ops.row_multiple)

    def _runner(self, plan: DecodePlan) -> PassRunner:
        return PassRunner(self.ops, self.weights, self.config, self.device, plan.frames_per_pass)

    def output_shape(self, latents: torch.Tensor) -> tuple[int, ...]:
        return video_shape(self.config, latents.shape)

    def decode_iter(self, latents: torch.Tensor) -> Iterator[Chunk]:
        """Decode pass by pass: yields (sample index, first video frame, chunk [1, 3, F, 16h, 16w] bf16 or None on
        ranks other than 0), in order; frames 0..4T-4 of each sample come out consecutively, so a caller that only
        writes them out never holds the whole video. Input errors raise here, before the first chunk. With tiling
        (`tile_rows` / `max_memory`) every pass runs tile after tile, each tile keeping its own causal history, so the
        chunks are the same, the activations are one tile's, and the histories are the whole frame's (plus margins):
        `peak_bytes(shape, n, stream=True)`."""
        plan, rows = self._start(latents, stream=True)
        if plan.tile_rows is not None:
            return self._runner(plan).iter_tiles(latents, plan.tile_rows)
        if not rows.active:
            return iter(())
        return self._runner(plan).iter_bands(latents, rows)

    def decode(self, latents: torch.Tensor) -> torch.Tensor | None:
        """latents [B, z_dim, T, h, w] (de-normalized) -> video [B, 3, 4T - 3, 16h, 16w] bf16 on rank 0, else None."""
        plan, rows = self._start(latents, stream=False)
        if plan.tile_rows is not None:
            video = torch.empty(self.output_shape(latents), dtype=torch.bfloat16, device=self.device)
            return self._runner(plan).decode_tiles(latents, video, plan.tile_rows)
        chunks = self._runner(plan).iter_bands(latents, rows) if rows.active else iter(())
        return collect(chunks, self.output_shape(latents), self.device)
