"""`WanVAEDecoder`: the fast Wan VAE decoder's public API (docs/design.md, "Public API").

The same math as `reference.decode` (diffusers' `AutoencoderKLWan.decode`), organised for speed by the modules below
this one: `network` (one pass of the network over a band of rows), `passes` (the loops over passes, bands and tiles),
`bands` (how rows are split across ranks), `memory` (peak working memory and the tile planner), `backends` (which op
table runs: portable or compiled). This module validates input, chooses among those, and keeps the ranks in step
(`agreement`).
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from . import memory
from . import weights as weights_mod
from .agreement import DecodeRequest, agree, supported_dtype
from .architecture import check_latents, video_shape
from .backends import select_ops
from .bands import LocalRows, RankRows
from .passes import Chunk, PassRunner, collect


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


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1; got {value!r}")
    return value


OPTION_NAMES = ("backend", "frames_per_pass", "tile_rows", "max_memory")


def check_decode_options(frames_per_pass, tile_rows, max_memory, enabled: bool = True,
                         names: tuple[str, str, str, str] = OPTION_NAMES) -> None:
    """ValueError naming the first bad decoder option. `names`: what the caller calls the switch that turns this
    decoder on and the three options; `enabled`: that switch (tiling options without it are an error: nothing else
    tiles exactly)."""
    switch, names = names[0], names[1:]
    if not isinstance(enabled, bool):
        raise ValueError(f"{switch} must be a bool; got {enabled!r}")
    _positive_int(names[0], frames_per_pass)
    if tile_rows is not None:
        try:
            _positive_int(names[1], tile_rows)
        except ValueError:
            raise ValueError(f"{names[1]} must be an int >= 1 (latent rows per tile) or None; got {tile_rows!r}") \
                from None
    if max_memory is not None:
        memory.parse_bytes(max_memory, names[2])
    if tile_rows is not None and max_memory is not None:
        raise ValueError(f"set {names[1]} or {names[2]}, not both: the budget picks the tile")
    if (tile_rows is not None or max_memory is not None) and not enabled:
        raise ValueError(f"{names[1]} / {names[2]} tile the fast decoder: set {switch}=True (FastVideo's own Wan VAE "
                         "decode has no exact tiling)")


class WanVAEDecoder:
    """The fast Wan VAE decoder (the Wan2.2 and the Wan2.1 layout).

    `WanVAEDecoder(vae_or_state_dict, device="cuda", pg=None, frames_per_pass=4, local=False, backend="auto")`
    takes diffusers' (or FastVideo's) `AutoencoderKLWan` or its state dict; the architecture is read from the weights.
    `decode(latents)` maps de-normalized latents [B, z_dim, T, h, w] to a bf16 video [B, 3, 4T - 3, s*h, s*w] in
    [-1, 1] (s = 16 for Wan2.2, 8 for Wan2.1). With a process group of N ranks each rank decodes a band of rows and
    rank 0 returns the video (the others None); `local=True` decodes on the calling rank alone. `backend`: "auto"
    (compiled where built and self-checked, else portable), "cuda" (compiled or an error), "torch" (portable, CPU
    too), or an `ops.Ops` table to run as given.
    `tile_rows=n` (or `enable_tiling(n)`): exact tiled decode of a single-rank decoder, n latent rows per tile.
    `max_memory=bytes` (or a string such as "2GiB"): a single-rank decoder picks, per latent shape, the largest tile
    whose peak working memory (`peak_bytes`: what a decode allocates beyond weights, latents and the returned video)
    fits; the plain decode when it fits whole. `decode` and `decode_iter` both honour tiling.
    `conv_algorithm`: the 3x3 spatial convs "direct", by "winograd" F(2x2, 3x3) (2.25x fewer multiplies, within the
    allowance at every layer), or "auto" (the per-layer choice the GPU check measured for this GPU; direct where
    nothing was measured, and on CPU); honoured by every backend (`backends.select_ops`).
    """

    def __init__(self, vae_or_state_dict, device="cuda", pg=None, frames_per_pass: int = 4, local: bool = False,
                 backend: str = "auto", tile_rows: int | None = None, max_memory: int | str | None = None,
                 conv_algorithm: str = "auto") -> None:
        check_decode_options(frames_per_pass, tile_rows, max_memory)
        self.frames_per_pass = frames_per_pass
        self.tile_rows = None
        self.max_memory = None
        self.device = _resolve_device(device)
        self.config, self.weights = weights_mod.load(vae_or_state_dict, self.device)
        self.ops = select_ops(backend, self.device, conv_algorithm)
        if pg is None and not local and dist.is_available() and dist.is_initialized():
            pg = dist.group.WORLD
        # A group of one rank decodes alone (and may tile), e.g. in a one-GPU FastVideo process.
        self.pg = None if local or pg is None or dist.get_world_size(pg) == 1 else pg
        self._planner = memory.MemoryPlanner(self.weights, self.config, self.device, self.frames_per_pass)
        if tile_rows is not None:
            self.enable_tiling(tile_rows)
        if max_memory is not None:
            self.set_max_memory(max_memory)

    @property
    def backend(self) -> str:
        return self.ops.name

    @property
    def is_root(self) -> bool:
        """Whether this rank receives the video (rank 0 of the decode group, or a single-rank decoder)."""
        return self.pg is None or dist.get_rank(self.pg) == 0

    def enable_tiling(self, tile_rows: int) -> None:
        """Decode in tiles of `tile_rows` latent rows, one after another (exact; peak memory falls with the tile)."""
        _positive_int("tile_rows", tile_rows)
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

    def peak_bytes(self, latents_shape, tile_rows: int | None = None, stream: bool = False) -> int:
        """Peak working memory (bytes) of decoding latents of `latents_shape` (see `memory.MemoryPlanner`)."""
        return self._planner.peak_bytes(latents_shape, tile_rows, stream)

    def plan_tile_rows(self, latents_shape, stream: bool = False) -> int | None:
        """The tile `decode` (or, stream=True, `decode_iter`) uses for latents of `latents_shape`: with max_memory,
        None (untiled) when the plain decode fits, else the largest tile_rows that fits; ValueError when even
        one-row tiles do not fit."""
        return self._tile_rows_for(tuple(latents_shape), stream)

    def _tile_rows_for(self, latents_shape, stream: bool) -> int | None:
        if self.max_memory is None:
            return self.tile_rows if self.tile_rows is not None and self.tile_rows < latents_shape[3] else None
        return self._planner.tile_rows(latents_shape, self.max_memory, stream)

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

    def _check_input(self, latents, rows: LocalRows) -> None:
        error = self._input_error(latents)
        if not isinstance(rows, RankRows):
            if error:
                raise ValueError(error)
            return
        mine = DecodeRequest(False) if error else DecodeRequest.of(latents, self.frames_per_pass, self.config)
        agree(self.pg, rows.comm_device, mine, error)

    # ---------------------------------------------------------------------------------------------------------------
    # Decoding
    # ---------------------------------------------------------------------------------------------------------------

    def _rows(self, height: int) -> LocalRows:
        return LocalRows(height) if self.pg is None else RankRows(height, self.pg, self.device, self.ops.row_multiple)

    def _runner(self) -> PassRunner:
        return PassRunner(self.ops, self.weights, self.config, self.device, self.frames_per_pass)

    def output_shape(self, latents: torch.Tensor) -> tuple[int, ...]:
        return video_shape(self.config, latents.shape)

    def decode_iter(self, latents: torch.Tensor) -> Iterator[Chunk]:
        """Decode pass by pass: yields (sample index, first video frame, chunk [1, 3, F, 16h, 16w] bf16 or None on
        ranks other than 0), in order; frames 0..4T-4 of each sample come out consecutively, so a caller that only
        writes them out never holds the whole video. Input errors raise here, before the first chunk. With tiling
        (`tile_rows` / `max_memory`) every pass runs tile after tile, each tile keeping its own causal history, so the
        chunks are the same, the activations are one tile's, and the histories are the whole frame's (plus margins):
        `peak_bytes(shape, n, stream=True)`."""
        rows = self._rows(latents.shape[3] if isinstance(latents, torch.Tensor) and latents.dim() == 5 else 1)
        self._check_input(latents, rows)
        tile_rows = self._tile_rows_for(latents.shape, stream=True)
        if tile_rows is not None:
            return self._runner().iter_tiles(latents, tile_rows)
        if not rows.active:
            return iter(())
        return self._runner().iter_bands(latents, rows)

    def decode(self, latents: torch.Tensor) -> torch.Tensor | None:
        """latents [B, z_dim, T, h, w] (de-normalized) -> video [B, 3, 4T - 3, 16h, 16w] bf16 on rank 0, else None."""
        if self.tile_rows is not None or self.max_memory is not None:
            self._check_input(latents, LocalRows(1))
            tile_rows = self._tile_rows_for(latents.shape, stream=False)
            if tile_rows is not None:
                video = torch.empty(self.output_shape(latents), dtype=torch.bfloat16, device=self.device)
                return self._runner().decode_tiles(latents, video, tile_rows)
        chunks = self.decode_iter(latents)  # checks the input first
        return collect(chunks, self.output_shape(latents), self.device)
