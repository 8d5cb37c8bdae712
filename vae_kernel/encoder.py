"""`WanVAEEncoder`: the fast Wan VAE encoder's public API (docs/design/encoder.md, "The encoder").

The same math as `reference.encode` (diffusers' `AutoencoderKLWan.encode`), on the machinery it shares with the
decoder: the op table, the causal histories, the prepared weights that follow the VAE (`weights.PreparedWeights` with
the encoder's part), the memory planner and its out-of-memory retry plans (`planning.memory`), and the worker core
(`worker`: device and group, the weights' sync, the ranks' agreement, the attempts and their retries). This module
validates the video, chooses the precision and the plan, and runs the encoder's passes.
"""

from __future__ import annotations

import logging
import weakref

import torch

from . import options as options_mod
from .backends import select_ops
from .definitions.architecture import check_video, encoded_shape
from .definitions.precision import own_arithmetic
from .distributed.agreement import AttemptFailed
from .distributed.bands import LocalRows
from .planning import memory
from .planning.memory import Plan
from .portable import weights as weights_mod
from .portable.ops import TORCH_OPS, Ops
from .portable.passes import EncodeRunner
from .worker import Job, VAEOutOfMemoryError, Worker

logger = logging.getLogger(__name__)


class EncodeOutOfMemoryError(VAEOutOfMemoryError):
    """An encode ran out of memory at every plan it tried, the smallest included (`plans`: each, in order)."""


def _vae_dtype(vae_or_state_dict) -> torch.dtype:
    """The dtype the VAE's encoder holds its weights in (quant_conv's; fp32 where it cannot be read)."""
    if isinstance(vae_or_state_dict, torch.nn.Module):
        layer = getattr(vae_or_state_dict, "quant_conv", None)
        weight = getattr(getattr(layer, "base_layer", layer), "weight", None)
    else:
        weight = vae_or_state_dict.get("quant_conv.weight") if isinstance(vae_or_state_dict, dict) else None
    return weight.dtype if isinstance(weight, torch.Tensor) and weight.is_floating_point() else torch.float32


def _encoder_ops(backend, device: torch.device, dtype: torch.dtype) -> Ops:
    """The encoder's op table for `backend` at activations of `dtype`: a bf16 encode takes the decoder's choice
    (`backends.select_ops`: the compiled table where it is built and self-checked, its self-check covering the
    encoder's convs too; direct convs); an fp32 encode runs portable (the kernels are bf16), and `backend="cuda"`
    then is a ValueError naming the precision. A given `Ops` table runs as given."""
    if isinstance(backend, Ops):
        return backend
    if dtype == torch.bfloat16 or (backend == "cuda" and device.type != "cuda"):
        return select_ops(backend, device, "direct")
    if backend == "cuda":
        raise ValueError("backend='cuda' runs the compiled bf16 kernels, and this encode computes in fp32 (precision "
                         "'fp32', or 'auto' for a VAE that is not bf16): pass precision='bf16' or backend='auto'")
    return TORCH_OPS


class WanVAEEncoder(Worker):
    """The fast Wan VAE encoder (the Wan2.2 and the Wan2.1 layout).

    `WanVAEEncoder(vae_or_state_dict, device=None, pg=None, local=False, **options)` takes diffusers' (or
    FastVideo's) `AutoencoderKLWan` or its state dict; the architecture is read from the weights, and `device`
    defaults to the module's (where its weights are), or "cuda" for a state dict. Made from a module it follows the
    module's weights, as `WanVAEDecoder` does. The options are defined in `options.ENCODE_OPTIONS`:
    `frames_per_pass`, `tile_rows` / `max_memory` (exact two-phase tiles, one rank), `backend` (a bf16 encode: as
    the decoder's, the compiled table where it passes its self-check, which covers the encoders' convs; an fp32
    encode: portable), `precision`, `reuse_steady`. As the decoder: with a process group of N ranks (`pg`; by
    default the initialized default group) each rank encodes a band of latent rows, halo rows exchanged at every
    conv and the attention's keys and values gathered, and every rank returns the whole moments (the ranks must pass
    the same video); `local=True` encodes on the calling rank alone (ranks that hold different videos).

    `encode(video)` maps a video [B, 3, F, H, W] in [-1, 1] to the moments [B, 2 z_dim, 1 + (F - 1) // 4, H / s,
    W / s] (mean, then logvar before diffusers' clamp), in the VAE's dtype: diffusers'
    `encode(video).latent_dist.parameters`. `encode_dist(video, cls)` wraps them in `cls` (diffusers' or FastVideo's
    DiagonalGaussianDistribution), so that `.mode()`, `.mean` and `.sample(generator)` draw what that class would.

    Every plan gives the same moments bit for bit at a given precision: frames per pass, tiles, batch samples and
    the steady reuse run the same ops on the same inputs (docs/design/encoder.md, "Exact by construction").
    """

    WORK = "encode"
    OUT_OF_MEMORY = EncodeOutOfMemoryError

    def __init__(self, vae_or_state_dict, device=None, pg=None, local: bool = False, **options) -> None:
        opts = self.options = options_mod.check(options, part="encode")
        self._place(vae_or_state_dict, device, pg, local)
        self._tiling(opts)  # before any weights are prepared: a group never tiles
        # The VAE itself is held weakly (a diffusers VAE holds its fast encoder: no reference cycle).
        self._source = weakref.ref(vae_or_state_dict) if isinstance(vae_or_state_dict, torch.nn.Module) else \
            vae_or_state_dict
        self._last_vae_dtype = _vae_dtype(vae_or_state_dict)
        self.dtype = self._activation_dtype()
        self.ops = _encoder_ops(opts.backend, self.device, self.dtype)
        part = weights_mod.encoder_part(self.dtype)
        self._weights = weights_mod.PreparedWeights(vae_or_state_dict, weights_mod.checked(vae_or_state_dict, part),
                                                    self.device, self.ops.cpu_compute_layout, part)
        self.config = self._weights.config
        self._planners: dict[tuple[int, int], memory.EncoderPlanner] = {}
        # stage ("level0", ..., "head") -> the passes at which the latest encode reused its output (first sample).
        self.last_reuse: dict[str, tuple[int, ...]] = {}

    def _vae(self):
        """The VAE (or state dict) this encoder was made from; None once that module no longer exists (the encoder
        then keeps the weights it prepared, as the decoder does)."""
        return self._source() if isinstance(self._source, weakref.ref) else self._source

    @property
    def vae_dtype(self) -> torch.dtype:
        """The dtype of the VAE's encoder weights: the moments' dtype (the last one seen once the VAE is gone)."""
        vae = self._vae()
        if vae is not None:
            self._last_vae_dtype = _vae_dtype(vae)
        return self._last_vae_dtype

    def _activation_dtype(self) -> torch.dtype:
        precision = self.options.precision
        if precision == "bf16" or (precision == "auto" and self.vae_dtype == torch.bfloat16):
            return torch.bfloat16
        return torch.float32

    def _take_weights(self) -> bool:
        """Take any change of the VAE's weights (`sync_weights`); a VAE cast to another dtype changes the "auto"
        precision too (the op table and the weights are then prepared for the new one)."""
        dtype = self._activation_dtype()
        if dtype != self.dtype and self._vae() is not None:
            table, part = _encoder_ops(self.options.backend, self.device, dtype), weights_mod.encoder_part(dtype)
            prepared = weights_mod.PreparedWeights(self._vae(), weights_mod.checked(self._vae(), part), self.device,
                                                   table.cpu_compute_layout, part)
            self.ops, self._weights, self.dtype = table, prepared, dtype  # all three, or none if preparing failed
            return True
        return self._weights.sync()

    def _plans_stale(self) -> bool:
        return any(p.dtype != self.dtype for p in self._planners.values())

    def _drop_plans(self) -> None:
        super()._drop_plans()
        self._planners.clear()

    def _planner(self, video_shape) -> memory.EncoderPlanner:
        """The planner for videos of this size (one per remainder of rows and columns past whole latent pixels)."""
        s = self.config.spatial_scale
        remainder = (video_shape[3] % s, video_shape[4] % s)
        if remainder not in self._planners:
            self._planners[remainder] = memory.EncoderPlanner(self.weights, self.config, self.device, self.dtype,
                                                              remainder, self.options.reuse_steady)
        return self._planners[remainder]

    # ---------------------------------------------------------------------------------------------------------------
    # Input and plan
    # ---------------------------------------------------------------------------------------------------------------

    def _checked(self, video) -> torch.Tensor:
        check_video(video, self.config)
        if video.device != self.device:
            raise ValueError(f"video is on {video.device}; this encoder runs on {self.device}")
        frames = video.shape[2]
        kept = 1 + (frames - 1) // 4 * 4
        if kept != frames:
            logger.warning("the VAE encodes 1 + 4k frames: frames %d..%d of %d are dropped (as diffusers does)",
                           kept, frames - 1, frames)
            video = video[:, :, :kept]
        for frame in video.unbind(2):  # frame by frame: the check's temporaries stay one frame's
            if not bool(torch.isfinite(frame).all()):
                raise ValueError("video contains NaN or Inf")
        return video

    def _repeats(self, video: torch.Tensor) -> bool:
        """Whether every frame after the first is the same (image-to-video's zeros, an all-zero video): the input
        whose passes the steady reuse skips, one latent frame per pass."""
        tail = video[:, :, 1:]
        return tail.shape[2] > 4 and torch.equal(tail, tail[:, :, :1].expand_as(tail))

    def plan(self, video_shape, repeats: bool = False) -> Plan:
        """How `encode` encodes a video of `video_shape` now: frames per pass and tile rows (`memory.choose_plan`,
        in latent frames and rows; never above a plan an encode of this shape retried at after running out of
        memory). `repeats`: every frame after the first is the same, and with the steady reuse on, "auto" then
        takes one latent frame per pass (the reuse skips a stage's pass only when the pass before had its shape and
        left it settled: long passes settle late and rarely repeat)."""
        latent = encoded_shape(self.config, tuple(video_shape))
        fpp = self.options.frames_per_pass
        if fpp == memory.AUTO and repeats and self.options.reuse_steady:
            fpp = 1
        planned = memory.choose_plan(self._planner(video_shape), latent, fpp, self.tile_rows, False,
                                     self.max_memory, self._ranks, self.ops.row_multiple)
        return self._capped(planned, self._ceiling_key(video_shape))

    def _fingerprint(self):
        # The ranks must also run the same exchanges: the same activations and reuse (ints: hashed alike by all).
        return self.config, self.dtype.itemsize, self.options.reuse_steady

    def _start(self, video) -> tuple[torch.Tensor, Plan]:
        """Check the input and plan the encode, the ranks of a group agreeing on both: (the video, frames past 1 + 4k
        dropped; the plan)."""
        kept = []

        def checked() -> tuple[torch.Tensor, Plan]:
            self.sync_weights()  # the weights are input too: a VAE changed since the last encode is read again
            kept.append(self._checked(video))
            repeats = self.options.frames_per_pass == memory.AUTO and self.options.reuse_steady and \
                self._repeats(kept[0])
            return kept[0], self.plan(kept[0].shape, repeats)

        plan = self._agreed_plan(checked, self.options.frames_per_pass)
        return kept[0], plan

    def _ceiling_key(self, video_shape) -> tuple:
        return (*encoded_shape(self.config, tuple(video_shape))[2:], *tuple(video_shape)[3:])

    # ---------------------------------------------------------------------------------------------------------------
    # Encoding
    # ---------------------------------------------------------------------------------------------------------------

    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """video [B, 3, F, H, W] in [-1, 1] -> moments [B, 2 z_dim, 1 + (F - 1) // 4, H / s, W / s] in the VAE's
        dtype (see the class), on every rank of a group. Out of memory (on any rank): encoded again from the start
        at a smaller plan (the same moments); `EncodeOutOfMemoryError` when the smallest plan fails too. An error on
        one rank raises on every rank."""
        video, plan = self._start(video)
        latent = encoded_shape(self.config, video.shape)
        job = Job(video, latent, f"a video {list(video.shape)}", self._ceiling_key(video.shape),
                  self._planner(video.shape), False, [])
        done: list = []  # the moments and their buffers for the ranks' sharing, made inside the attempt

        def attempt(plan: Plan, rows: LocalRows):
            out = self._run(video, latent, plan, rows)
            done[:] = [out, rows.share_buffers(out, 3)]
            return iter(()), 0

        rows = self._rows(latent[3])
        for _ in self._attempts(job, (plan, rows), attempt, discard=done.clear):
            pass  # an encode's attempts yield nothing
        out, buffers = done
        rows.share(out, 3, buffers)
        return out

    def _resume(self, job: Job, failed: Plan, smaller: Plan, attempt: AttemptFailed,
                rows: LocalRows) -> tuple[Plan, LocalRows]:
        logger.warning("VAE encode ran out of memory at %s; encoding again from the start at %s, the same latents "
                       "(%s)", failed, smaller, attempt.text)
        return smaller, rows

    def _run(self, video: torch.Tensor, latent, plan: Plan, rows: LocalRows) -> torch.Tensor:
        """One attempt: every sample in turn, this rank's band of rows (the whole frame alone) into the moments."""
        runner = EncodeRunner(self.ops, self.weights, self.config, self.device, self.dtype, plan.frames_per_pass,
                              self.options.reuse_steady)
        out = torch.empty(latent, dtype=self.vae_dtype, device=self.device)
        tf32 = self.options.precision == "auto" and self.dtype == torch.float32
        start, stop = rows.rows if rows.active else (0, 0)
        self.last_reuse = {}  # a rank holding no rows runs and reuses nothing
        with own_arithmetic(self.device, tf32_as_caller=tf32):
            for b in range(video.shape[0] if rows.active else 0):
                moments, reused = runner.encode(video[b:b + 1], (1, *latent[1:]), plan.tile_rows, rows)
                out[b:b + 1, :, :, start:stop].copy_(moments.permute(0, 4, 1, 2, 3))
                if b == 0:
                    self.last_reuse = reused
                del moments
        return out

    def encode_dist(self, video: torch.Tensor, distribution):
        """`encode(video)` wrapped in `distribution`, a class taking the moments: diffusers' or FastVideo's
        `DiagonalGaussianDistribution` (`fastvideo_pan2_ext.diffusers_integration.fast_encode` passes diffusers')."""
        return distribution(self.encode(video))
