"""`WanVAEDecoder`: the fast Wan VAE decoder's public API (docs/design.md, "Public API").

The same math as `reference.decode` (diffusers' `AutoencoderKLWan.decode`), organised for speed by the modules below
this one: `network` (one pass of the network over a band of rows), `passes` (the loops over passes, bands and tiles),
`bands` (how rows are split across ranks), `memory` (peak working memory and the plan: `memory.choose_plan`),
`backends` (which op table runs: portable or compiled). This module validates input, runs the plan, keeps the ranks
in step (`agreement`) and retries a decode that ran out of memory.
"""

from __future__ import annotations

import logging
from typing import Iterator

import torch
import torch.distributed as dist

from . import options as options_mod
from .backends import select_ops
from .definitions.architecture import check_latents, video_shape
from .distributed.agreement import (AttemptFailed, DecodeRequest, agree, failure, finish, retry_choice, settle,
                                    supported_dtype)
from .distributed.bands import FAILED, OK, LocalRows, RankRows, comm_device
from .planning import memory
from .planning.memory import DecodePlan
from .portable import weights as weights_mod
from .portable.passes import Chunk, PassRunner, latent_passes

logger = logging.getLogger(__name__)


def _module_device(vae_or_state_dict):
    """Where a module's weights are (the decoder's default device); "cuda" for a state dict or a weightless module."""
    if isinstance(vae_or_state_dict, torch.nn.Module):
        weight = next(vae_or_state_dict.parameters(), None)
        if weight is not None and weight.device.type != "meta":
            return weight.device
    return "cuda"


def _resolve_device(device) -> torch.device:
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be a torch device or its name; got {device!r} (names are such as 'cuda', "
                         "'cuda:1', 'cpu')") from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device} requested but CUDA is not available (torch sees no GPU here): "
                             "decode on the CPU (device='cpu')")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


class DecodeOutOfMemoryError(torch.OutOfMemoryError):
    """A decode ran out of memory at every plan it tried, the smallest included (`plans`: each, in order)."""

    def __init__(self, message: str, plans: tuple[DecodePlan, ...]) -> None:
        super().__init__(message)
        self.plans = plans


class DecodeRestart(torch.OutOfMemoryError):
    """`decode_iter` ran out of memory after it had yielded chunks, which cannot be taken back: the consumer discards
    what it received and iterates `decode_iter(latents)` again, which decodes from the first frame at `plan` (the
    decoder keeps it for latents of this shape). Raised on every rank of a group alike."""

    def __init__(self, message: str, plan: DecodePlan) -> None:
        super().__init__(message)
        self.plan = plan


class WanVAEDecoder:
    """The fast Wan VAE decoder (the Wan2.2 and the Wan2.1 layout).

    `WanVAEDecoder(vae_or_state_dict, device=None, pg=None, local=False, **options)` takes diffusers' (or
    FastVideo's) `AutoencoderKLWan` or its state dict; the architecture is read from the weights. `device` defaults
    to the module's (where its weights are), or "cuda" for a state dict. Made from a module, it follows the module's
    weights: each decode first takes any change of them (`sync_weights`), and its prepared weights can leave the
    device with the module (`follow_vae`); made from a state dict, it keeps the values given. The options
    (`frames_per_pass`, `tile_rows`, `max_memory`, `backend`, `conv_algorithm`) are defined in `options.OPTIONS`.
    `decode(latents)` maps de-normalized latents [B, z_dim, T, h, w] to a bf16 video [B, 3, 4T - 3, s*h, s*w] in
    [-1, 1] (s = 16 for Wan2.2, 8 for Wan2.1). With a process group of N ranks each rank decodes a band of rows and
    rank 0 returns the video (the others None); `local=True` decodes on the calling rank alone. `backend`: "auto"
    (compiled where built and self-checked, else portable), "cuda" (compiled or an error), "torch" (portable, CPU
    too), or an `ops.Ops` table to run as given.
    `frames_per_pass`: latent frames per pass (memory vs speed; the same video), or "auto" (the default).
    `tile_rows=n` (or `enable_tiling(n)`): exact tiled decode of a single-rank decoder, n latent rows per tile.
    `max_memory=bytes` (or a string such as "2GiB"): a single-rank decoder's budget for its peak working memory
    (`peak_bytes`: what a decode allocates beyond weights, latents and the returned video). How these choose each
    decode's plan is `planning.memory.choose_plan`; `plan(latents_shape)` tells what a decode will do. `decode` and
    `decode_iter` both honour tiling.
    `conv_algorithm`: the 3x3 spatial convs "direct", by "winograd" F(2x2, 3x3) (2.25x fewer multiplies, within the
    allowance at every layer), or "auto" (the per-layer choice the GPU check measured for this GPU; direct where
    nothing was measured, and on CPU); honoured by every backend (`backends.select_ops`).
    """

    def __init__(self, vae_or_state_dict, device=None, pg=None, local: bool = False, **options) -> None:
        opts = self.options = options_mod.check(options)
        self.frames_per_pass = opts.frames_per_pass
        self.tile_rows = None
        self.max_memory = None
        self.device = _resolve_device(_module_device(vae_or_state_dict) if device is None else device)
        weights = weights_mod.checked(vae_or_state_dict)  # a bad state dict is an error before any build
        self.ops = select_ops(opts.backend, self.device, opts.conv_algorithm)
        self._weights = weights_mod.DecoderWeights(vae_or_state_dict, weights, self.device,
                                                   self.ops.cpu_compute_layout)
        self.config = self._weights.config
        if pg is None and not local and dist.is_available() and dist.is_initialized():
            pg = dist.group.WORLD
        # A group of one rank decodes alone (and may tile), e.g. in a one-GPU FastVideo process.
        self.pg = None if local or pg is None or dist.get_world_size(pg) == 1 else pg
        self._comm_device = None if self.pg is None else comm_device(self.pg, self.device)
        self._planner = memory.MemoryPlanner(self.weights, self.config, self.device)
        self.last_plan: DecodePlan | None = None  # what the latest decode or decode_iter ran (the ranks' agreed plan)
        # The plans the latest decode (or decode_iter, over its restarts) ran out of memory at, in order
        # (docs/design.md, "Out-of-memory retries"); empty when the first plan held.
        self.last_retries: tuple[DecodePlan, ...] = ()
        self._ceilings: dict[tuple, DecodePlan] = {}  # (T, h, w, stream) -> the plan a retry chose: plans stay below
        self._tried: dict[tuple, list[DecodePlan]] = {}  # plans that ran out of memory, across decode_iter restarts
        if opts.tile_rows is not None:
            self.enable_tiling(opts.tile_rows)
        if opts.max_memory is not None:
            self.set_max_memory(opts.max_memory)

    @property
    def backend(self) -> str:
        return self.ops.name

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """The prepared weights (name -> tensor, in execution order; empty while released)."""
        return self._weights.tensors

    # ---------------------------------------------------------------------------------------------------------------
    # The weights follow the VAE (weights.DecoderWeights; docs/design.md, "What a weight change costs")
    # ---------------------------------------------------------------------------------------------------------------

    def sync_weights(self) -> bool:
        """Bring the prepared weights in step with the VAE this decoder was made from (every decode does this
        first); True when any changed. A new architecture is taken too (the plans of the old one are dropped)."""
        changed = self._weights.sync()
        if self._weights.config != self.config:
            self.config = self._weights.config
            self._planner = memory.MemoryPlanner(self.weights, self.config, self.device)
            self._ceilings.clear()
            self._tried.clear()
        return changed

    def release_weights(self) -> None:
        """Free the prepared weights (the VAE left this decoder's device); the next decode prepares them again from
        the VAE. ValueError for a decoder made from a state dict (they are its only copy)."""
        self._weights.release()

    def follow_vae(self) -> None:
        """Call after the VAE this decoder was made from moved (`.to()`): when its weights are no longer on this
        decoder's device, the prepared weights leave it too (`release_weights`)."""
        where = self._weights.module_device()
        if where is not None and where != self.device and self.weights:
            self.release_weights()

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

    def peak_bytes(self, latents_shape, frames_per_pass: int | None = None, tile_rows: int | None = None,
                   stream: bool = False) -> int:
        """Peak working memory (bytes) of decoding latents of `latents_shape` at `frames_per_pass` (None: this
        decoder's; for "auto", what `plan` chooses) in tiles of `tile_rows` (None: untiled), by `decode` or
        (stream=True) `decode_iter` (see `memory.MemoryPlanner.peak_bytes`)."""
        shape = self._shape(latents_shape)
        if frames_per_pass is None:
            frames_per_pass = self.plan(shape, stream).frames_per_pass
        return self._planner.peak_bytes(shape, frames_per_pass, tile_rows, stream)

    def plan(self, latents_shape, stream: bool = False) -> DecodePlan:
        """How `decode` (or, stream=True, `decode_iter`) decodes latents of `latents_shape` on this rank now (with
        "auto", the free device memory is read at each call); ValueError when `max_memory` cannot be met. Never
        larger than a plan an earlier decode of this shape retried at after running out of memory."""
        shape = self._shape(latents_shape)
        planned = memory.choose_plan(self._planner, shape, self.frames_per_pass, self.tile_rows, stream,
                                     self.max_memory, self._ranks, self.ops.row_multiple)
        ceiling = self._ceilings.get((shape[2:], stream))
        return planned if ceiling is None or planned.size() <= ceiling.size() else ceiling

    def _shape(self, latents_shape) -> tuple[int, ...]:
        shape = tuple(latents_shape)
        if len(shape) != 5 or shape[1] != self.config.z_dim or not all(isinstance(n, int) and n >= 1 for n in shape):
            raise ValueError(f"latents_shape must be [B, {self.config.z_dim}, T, h, w] with every size >= 1; got "
                             f"{latents_shape!r}")
        return shape

    @property
    def _ranks(self) -> int:
        return 1 if self.pg is None else dist.get_world_size(self.pg)

    # ---------------------------------------------------------------------------------------------------------------
    # Input checks (every rank agrees before any work starts)
    # ---------------------------------------------------------------------------------------------------------------

    def _input_error(self, latents) -> str | None:
        try:
            self.sync_weights()  # the weights are input too: a VAE changed since the last decode is read again
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
        """Check the input and plan the decode; the ranks of a group first agree on both (`agreement.agree`: an error
        on one rank, whatever it is, raises on all; they decode at the `memory.smallest` of their plans)."""

        def checked_plan() -> DecodePlan:
            error = self._input_error(latents)
            if error:
                raise ValueError(error)
            return self.plan(latents.shape, stream)

        if self.pg is None:
            plan = checked_plan()
        else:
            planned = agree(self.pg, self._comm_device, lambda: DecodeRequest.of(
                latents, self.frames_per_pass, checked_plan().frames_per_pass, self.config, self._weights.checksum()))
            plan = memory.smallest(DecodePlan(fpp, None) for fpp in planned)
        self.last_plan = plan
        return plan, self._rows(latents.shape[3])

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
        `peak_bytes(shape, tile_rows=n, stream=True)`.
        Out of memory before the first chunk: retried at a smaller plan, unseen. After it: `DecodeRestart` (every
        rank), and iterating `decode_iter(latents)` again decodes from the first frame at the smaller plan.
        In a group, a consumer that stops before the last chunk, or before the first, closes the iterator (`close()`,
        or by dropping it): the other ranks then raise instead of waiting for this one."""
        start = self._start(latents, stream=True)
        chunks = self._attempts(latents, True, start)
        next(chunks)  # to its first yield, before any work: from here on, closing it tells the group
        return chunks

    def decode(self, latents: torch.Tensor) -> torch.Tensor | None:
        """latents [B, z_dim, T, h, w] (de-normalized) -> video [B, 3, 4T - 3, 16h, 16w] bf16 on rank 0, else None.
        Out of memory: retried from the start at a smaller plan (the same video); `DecodeOutOfMemoryError` when the
        smallest plan fails too."""
        start = self._start(latents, stream=False)
        video: list[torch.Tensor] = []  # allocated and filled inside each attempt, so that a failure there is heard
        for _ in self._attempts(latents, False, start, video):
            pass  # decode's attempts yield nothing
        return video[0] if video else None

    # ---------------------------------------------------------------------------------------------------------------
    # Out-of-memory retries (docs/design.md, "Out-of-memory retries")
    # ---------------------------------------------------------------------------------------------------------------

    def _attempt(self, latents, plan: DecodePlan, rows: LocalRows, stream: bool, video: list | None):
        """One attempt's chunks. decode (video is a list): the video is allocated here on the root, and tiles are
        decoded into it before anything is yielded."""
        runner = self._runner(plan)
        if video is not None and rows.is_root:
            video.clear()
            video.append(torch.empty(self.output_shape(latents), dtype=torch.bfloat16, device=self.device))
        if plan.tile_rows is None:
            return runner.iter_bands(latents, rows) if rows.active else iter(())
        if stream:
            return runner.iter_tiles(latents, plan.tile_rows)
        runner.decode_tiles(latents, video[0], plan.tile_rows)
        return iter(())

    def _attempts(self, latents, stream: bool, start, video: list | None = None) -> Iterator[Chunk]:
        """Every attempt of one decode: each runs from the start at its plan; the ranks of a group settle each one
        together (`agreement.settle`)."""
        key = (tuple(latents.shape[2:]), stream)
        tried = self._tried.setdefault(key, [])
        yielded = False
        primed = video is not None  # decode_iter's iterator is started by decode_iter itself (see there)
        plan, rows = start
        while True:
            chunks = error = None
            try:
                try:
                    chunks = self._attempt(latents, plan, rows, stream, video)
                    remaining = 0 if not rows.active or plan.tile_rows is not None and not stream else \
                        latents.shape[0] * len(latent_passes(latents.shape[2], plan.frames_per_pass))
                    if not primed:
                        primed = True
                        yield None
                    for item in chunks:
                        remaining -= 1
                        if video is None:
                            yielded = True  # decode_iter's consumer has it: a retry cannot take it back
                            yield item
                        elif item[2] is not None:  # decode: copied into the video here (a retry copies it again)
                            b, frame, chunk = item
                            video[0][b:b + 1, :, frame:frame + chunk.shape[2]].copy_(chunk)  # allocates nothing
                            del chunk
                        del item  # not held while the next pass runs
                except GeneratorExit:  # the consumer stopped: the group hears of it unless every chunk was out
                    status = OK if remaining <= 0 else FAILED
                    finish(rows, status)
                    try:
                        settle(rows, status, None, False, "its consumer stopped iterating decode_iter")
                    except AttemptFailed:
                        pass
                    raise
                finish(rows, OK)
                settle(rows, OK, None, yielded)
                break
            except GeneratorExit:
                raise
            except BaseException as exc:  # noqa: BLE001 - the group hears of any failure, an interrupt too
                error = exc  # raised again below, on this rank
            finally:
                if chunks is not None and hasattr(chunks, "close"):
                    chunks.close()  # drops the attempt's tensors
                chunks = None
            if video:
                video.clear()
            failed = failure(error, rows, yielded)
            error = None
            if failed.error is not None:
                raise failed.error
            if failed.status == FAILED:
                raise failed.peer_error
            plan, rows = self._retry(latents, stream, key, tried, plan, failed)
        self.last_retries = tuple(tried)
        tried.clear()

    def _retry(self, latents, stream: bool, key, tried: list, failed: DecodePlan,
               attempt: AttemptFailed) -> tuple[DecodePlan, LocalRows]:
        """After an out-of-memory attempt (on any rank): release what it held, choose the plan below it (the ranks
        take the `memory.smallest` of their proposals, in a round that a rank whose choice fails joins too), warn,
        and start again (or raise when no smaller plan is left)."""
        text, yielded = attempt.text, attempt.yielded
        tried.append(failed)

        def proposal() -> DecodePlan | None:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            shape = memory.band_shape(latents.shape, self._ranks, self.ops.row_multiple)
            return self._planner.retry_plan(shape, failed.frames_per_pass, failed.tile_rows, stream,
                                            may_tile=self.pg is None)

        smaller = retry_choice(self.pg, self._comm_device, proposal)
        if smaller is None:
            plans = "; ".join(str(p) for p in tried)
            self.last_retries = tuple(tried)
            tried.clear()
            raise DecodeOutOfMemoryError(f"the VAE decode of latents {list(latents.shape)} ran out of memory at every "
                                         f"plan it tried, the smallest included: {plans} ({text})",
                                         tuple(self.last_retries)) from None
        self._ceilings[key] = smaller
        if yielded:
            logger.warning("VAE decode ran out of memory at %s after it had yielded frames; decode_iter restarts "
                           "from the first frame at %s (%s)", failed, smaller, text)
            raise DecodeRestart(f"decode_iter ran out of memory at {failed} after it had yielded frames: discard them "
                                f"and iterate decode_iter again, which decodes at {smaller} ({text})", smaller)
        logger.warning("VAE decode ran out of memory at %s; decoding again from the start at %s, the same video (%s)",
                       failed, smaller, text)
        return self._start(latents, stream)
