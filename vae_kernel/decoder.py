"""`WanVAEDecoder`: the fast Wan VAE decoder's public API (docs/design.md, "Public API").

The same math as `reference.decode` (diffusers' `AutoencoderKLWan.decode`), organised for speed by the modules below
this one: `network` (one pass of the network over a band of rows), `passes` (the loops over passes, bands and tiles),
`bands` (how rows are split across ranks), `memory` (peak working memory and the plan: `memory.choose_plan`),
`backends` (which op table runs: portable or compiled), on the worker core it shares with the encoder (`worker`:
device and group, the weights that follow the VAE, the ranks' agreement, the attempts and their out-of-memory
retries). This module validates the latents, plans the decode and runs its passes.
"""

from __future__ import annotations

import logging
from typing import Iterator

import torch

from . import options as options_mod
from .backends import select_ops
from .definitions.architecture import check_latents, video_shape
from .distributed.agreement import AttemptFailed, supported_dtype
from .distributed.bands import LocalRows
from .planning import memory
from .planning.memory import DecodePlan, Plan  # noqa: F401 - DecodePlan: the plan's name before the encoder shared it
from .portable import weights as weights_mod
from .portable.passes import Chunk, DecodeRunner, latent_passes
from .portable.winograd import winograd_conv
from .worker import Job, VAEOutOfMemoryError, Worker

logger = logging.getLogger(__name__)


class DecodeOutOfMemoryError(VAEOutOfMemoryError):
    """A decode ran out of memory at every plan it tried, the smallest included (`plans`: each, in order)."""


class DecodeRestart(torch.OutOfMemoryError):
    """`decode_iter` ran out of memory after it had yielded chunks, which cannot be taken back: the consumer discards
    what it received and iterates `decode_iter(latents)` again, which decodes from the first frame at `plan` (the
    decoder keeps it for latents of this shape). Raised on every rank of a group alike."""

    def __init__(self, message: str, plan: Plan) -> None:
        super().__init__(message)
        self.plan = plan


class WanVAEDecoder(Worker):
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

    WORK = "decode"
    OUT_OF_MEMORY = DecodeOutOfMemoryError

    def __init__(self, vae_or_state_dict, device=None, pg=None, local: bool = False, **options) -> None:
        opts = self.options = options_mod.check(options)
        self.frames_per_pass = opts.frames_per_pass
        self._place(vae_or_state_dict, device, pg, local)
        weights = weights_mod.checked(vae_or_state_dict)  # a bad state dict is an error before any build
        self.ops = select_ops(opts.backend, self.device, opts.conv_algorithm)
        self._weights = weights_mod.PreparedWeights(vae_or_state_dict, weights, self.device,
                                                    self.ops.cpu_compute_layout)
        self.config = self._weights.config
        self._planner = memory.MemoryPlanner(self.weights, self.config, self.device, winograd_conv(self.ops))
        self._tried: dict[tuple, list[Plan]] = {}  # plans that ran out of memory, across decode_iter restarts
        self._tiling(opts)

    def _drop_plans(self) -> None:  # a new architecture (`sync_weights`)
        super()._drop_plans()
        self._planner = memory.MemoryPlanner(self.weights, self.config, self.device, winograd_conv(self.ops))
        self._tried.clear()

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

    def plan(self, latents_shape, stream: bool = False) -> Plan:
        """How `decode` (or, stream=True, `decode_iter`) decodes latents of `latents_shape` on this rank now (with
        "auto", the free device memory is read at each call); ValueError when `max_memory` cannot be met. Never
        larger than a plan an earlier decode of this shape retried at after running out of memory."""
        shape = self._shape(latents_shape)
        planned = memory.choose_plan(self._planner, shape, self.frames_per_pass, self.tile_rows, stream,
                                     self.max_memory, self._ranks, self.ops.row_multiple)
        return self._capped(planned, (shape[2:], stream))

    def _shape(self, latents_shape) -> tuple[int, ...]:
        shape = tuple(latents_shape)
        if len(shape) != 5 or shape[1] != self.config.z_dim or not all(isinstance(n, int) and n >= 1 for n in shape):
            raise ValueError(f"latents_shape must be [B, {self.config.z_dim}, T, h, w] with every size >= 1; got "
                             f"{latents_shape!r}")
        return shape

    # ---------------------------------------------------------------------------------------------------------------
    # Input checks (every rank agrees before any work starts: `worker.Worker._agreed_plan`)
    # ---------------------------------------------------------------------------------------------------------------

    def _input_error(self, latents) -> str | None:
        # The weights are input too: a VAE changed since the last decode is read again (its ValueError, e.g. a
        # `weights.WeightValuesError`, raised as it is: a route falls back on that one).
        self.sync_weights()
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

    def _start(self, latents, stream: bool) -> tuple[Plan, LocalRows]:
        """Check the input and plan the decode, the ranks of a group agreeing on both."""

        def checked() -> tuple[torch.Tensor, Plan]:
            error = self._input_error(latents)
            if error:
                raise ValueError(error)
            return latents, self.plan(latents.shape, stream)

        return self._agreed_plan(checked, self.frames_per_pass), self._rows(latents.shape[3])

    # ---------------------------------------------------------------------------------------------------------------
    # Decoding
    # ---------------------------------------------------------------------------------------------------------------

    def _runner(self, plan: Plan) -> DecodeRunner:
        return DecodeRunner(self.ops, self.weights, self.config, self.device, plan.frames_per_pass)

    def output_shape(self, latents: torch.Tensor) -> tuple[int, ...]:
        return video_shape(self.config, latents.shape)

    def _job(self, latents: torch.Tensor, stream: bool) -> Job:
        key = (tuple(latents.shape[2:]), stream)
        return Job(latents, tuple(latents.shape), f"latents {list(latents.shape)}", key, self._planner, stream,
                   self._tried.setdefault(key, []))

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
        chunks = self._attempts(self._job(latents, True), start,
                                lambda plan, rows: self._attempt(latents, plan, rows, True, None), primed=False)
        next(chunks)  # to its first yield, before any work: from here on, closing it tells the group
        return chunks

    def decode(self, latents: torch.Tensor) -> torch.Tensor | None:
        """latents [B, z_dim, T, h, w] (de-normalized) -> video [B, 3, 4T - 3, 16h, 16w] bf16 on rank 0, else None.
        Out of memory: retried from the start at a smaller plan (the same video); `DecodeOutOfMemoryError` when the
        smallest plan fails too."""
        start = self._start(latents, stream=False)
        video: list[torch.Tensor] = []  # allocated and filled inside each attempt, so that a failure there is heard

        def deliver(item: Chunk) -> None:  # copied into the video inside the attempt (a retry copies it again)
            b, frame, chunk = item
            if chunk is not None:
                video[0][b:b + 1, :, frame:frame + chunk.shape[2]].copy_(chunk)  # allocates nothing

        for _ in self._attempts(self._job(latents, False), start,
                                lambda plan, rows: self._attempt(latents, plan, rows, False, video), deliver,
                                video.clear):
            pass  # decode's attempts yield nothing
        return video[0] if video else None

    def _attempt(self, latents, plan: Plan, rows: LocalRows, stream: bool,
                 video: list | None) -> tuple[Iterator[Chunk], int]:
        """One attempt's chunks, and how many this rank makes. decode (video is a list): the video is allocated here
        on the root, and tiles are decoded into it before anything is yielded."""
        runner = self._runner(plan)
        if video is not None and rows.is_root:
            video.clear()
            video.append(torch.empty(self.output_shape(latents), dtype=torch.bfloat16, device=self.device))
        if plan.tile_rows is None:
            if not rows.active:
                return iter(()), 0
            return runner.iter_bands(latents, rows), latents.shape[0] * len(latent_passes(latents.shape[2],
                                                                                         plan.frames_per_pass))
        if stream:
            return runner.iter_tiles(latents, plan.tile_rows), \
                latents.shape[0] * len(latent_passes(latents.shape[2], plan.frames_per_pass))
        runner.decode_tiles(latents, video[0], plan.tile_rows)
        return iter(()), 0

    def _resume(self, job: Job, failed: Plan, smaller: Plan, attempt: AttemptFailed,
                rows: LocalRows) -> tuple[Plan, LocalRows]:
        """After a retry's plan was chosen: the decode starts again (checked and agreed as at first), or, when
        decode_iter had yielded chunks, `DecodeRestart` on every rank."""
        text = attempt.text
        if attempt.yielded:
            logger.warning("VAE decode ran out of memory at %s after it had yielded frames; decode_iter restarts "
                           "from the first frame at %s (%s)", failed, smaller, text)
            raise DecodeRestart(f"decode_iter ran out of memory at {failed} after it had yielded frames: discard them "
                                f"and iterate decode_iter again, which decodes at {smaller} ({text})", smaller)
        logger.warning("VAE decode ran out of memory at %s; decoding again from the start at %s, the same video (%s)",
                       failed, smaller, text)
        return self._start(job.input, job.stream)
