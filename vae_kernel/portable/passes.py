"""The decode loops: a clip's latent frames in passes, its rows in bands or tiles, the video out in chunks.

A pass decodes `frames_per_pass` latent frames at once (the first latent frame, which becomes one video frame, always
goes alone: its temporal upsamplers pass it through and its DupUp shortcut keeps one frame of two). Batch elements are
decoded one after another: they are independent, and it keeps every activation of a pass contiguous.

- `iter_bands`: pass by pass over this rank's band of rows (the whole frame for one rank); rank 0 gathers each chunk.
- `iter_tiles`: pass by pass, every pass run tile after tile, each tile keeping its own causal history (streaming and
  tiling combine: one tile's activations, every tile's history).
- `decode_tiles`: tile by tile, each over the whole clip, so only one tile's activations and history are alive.
"""

from __future__ import annotations

import contextvars
import os
from typing import Iterator

import torch

from ..definitions.architecture import WanVAEConfig, video_frames
from ..distributed.bands import LocalRows
from .encoder_network import EncodePass, EncodeTile
from .network import CausalState, DecodePass, Tile
from .ops import FP32_CPU_ENCODE_CALL_PIXELS, Ops, frame_shape
from ..definitions.precision import own_arithmetic

# The decoder's own bar follows tqdm's conventions: after a few seconds, only where its stream is a terminal
# (`disable=None`: a file, a pipe or a CI log gets no carriage-return updates), and a TQDM_<NAME> variable the user
# set (TQDM_DISABLE=1, TQDM_DELAY=0, ...) wins over these defaults, as it does over tqdm's own.
_BAR_DEFAULTS = {"delay": 3.0, "leave": False, "disable": None}

Chunk = tuple[int, int, "torch.Tensor | None"]  # (sample index, first video frame, [1, 3, F, H, W] or None)


def latent_passes(t: int, frames_per_pass: int) -> list[tuple[int, int]]:
    """Latent frame ranges [t0, t1): the first frame alone, then frames_per_pass at a time."""
    return [(0, 1)] + [(s, min(s + frames_per_pass, t)) for s in range(1, t, frames_per_pass)]


def pass_video_frames(t0: int, t1: int) -> range:
    """The video frames a pass over latent frames [t0, t1) makes."""
    return range(video_frames(t0) if t0 else 0, video_frames(t1))


def row_tiles(height: int, tile_rows: int) -> list[tuple[int, int]]:
    """Latent rows [start, stop) of each tile of `tile_rows` rows (the last may be shorter)."""
    return [(s, min(s + tile_rows, height)) for s in range(0, height, tile_rows)]


class DecodeRunner:
    """Runs the network (`network.DecodePass`) over whole clips with one op table and one set of prepared weights."""

    def __init__(self, ops: Ops, weights: dict[str, torch.Tensor], config: WanVAEConfig, device: torch.device,
                 frames_per_pass: int) -> None:
        self.ops, self.weights, self.config, self.device = ops, weights, config, device
        self.frames_per_pass = frames_per_pass

    def _chunk(self, frames: int, height: int, width: int) -> torch.Tensor:
        s = self.config.spatial_scale
        return torch.empty((1, 3, frames, s * height, s * width), dtype=torch.bfloat16, device=self.device)

    def iter_bands(self, latents: torch.Tensor, rows: LocalRows) -> Iterator[Chunk]:
        """This rank's band of rows, pass by pass; yields whole-frame chunks on the root rank, None elsewhere."""
        batch, _, t, height, _ = latents.shape
        start, stop = rows.rows
        lo, hi = max(start - 1, 0), min(stop + 1, height)
        passes = latent_passes(t, self.frames_per_pass)
        progress = _progress(batch * len(passes), rows.is_root)
        p = self.config.patch_size
        for b in range(batch):
            state = CausalState(self.device)
            for t0, t1 in passes:
                with own_arithmetic(self.device):
                    out = DecodePass(self.ops, self.weights, self.config, rows, state, t0 == 0).run(
                        latents[b, :, t0:t1, lo:hi])
                    chunk = torch.empty((1, 3, out.shape[1], p * out.shape[2], p * out.shape[3]),
                                        dtype=torch.bfloat16, device=self.device)
                    self.ops.unpatchify_clamp(out, chunk, p)
                    del out
                    parts = rows.gather_to_root(chunk)
                    del chunk
                    if parts is not None:
                        parts = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)
                progress.update(1)
                yield b, pass_video_frames(t0, t1).start, parts
                del parts
        progress.close()

    def tile_pass(self, z: torch.Tensor, t0: int, t1: int, rows: tuple[int, int], state: CausalState,
                  dest: torch.Tensor) -> None:
        """Decode latent frames [t0, t1) of one sample's z [C, T, h, w], keeping latent rows `rows`, into `dest`
        (those rows of the pass's video frames); `state` is that tile's causal history."""
        height = z.shape[2]
        tile = Tile(*rows, height, self.config)
        out = DecodePass(self.ops, self.weights, self.config, LocalRows(height), state, t0 == 0, tile).run(
            z[:, t0:t1])
        self.ops.unpatchify_clamp(out, dest, self.config.patch_size)

    def iter_tiles(self, latents: torch.Tensor, tile_rows: int) -> Iterator[Chunk]:
        """Pass by pass, each pass tile after tile (each tile keeps its own history); whole-frame chunks."""
        batch, _, t, height, width = latents.shape
        tiles = row_tiles(height, tile_rows)
        passes = latent_passes(t, self.frames_per_pass)
        s = self.config.spatial_scale
        progress = _progress(batch * len(passes), True)
        for b in range(batch):
            states = [CausalState(self.device) for _ in tiles]
            for t0, t1 in passes:
                frames = pass_video_frames(t0, t1)
                chunk = self._chunk(len(frames), height, width)
                with own_arithmetic(self.device):
                    for (start, stop), state in zip(tiles, states):
                        self.tile_pass(latents[b], t0, t1, (start, stop), state, chunk[..., s * start:s * stop, :])
                progress.update(1)
                yield b, frames.start, chunk
                del chunk
            del states
        progress.close()

    def decode_tiles(self, latents: torch.Tensor, video: torch.Tensor, tile_rows: int) -> torch.Tensor:
        """Tile by tile, each over the whole clip, into `video` (so one tile's state is alive at a time)."""
        batch, _, t, height, _ = latents.shape
        tiles = row_tiles(height, tile_rows)
        passes = latent_passes(t, self.frames_per_pass)
        s = self.config.spatial_scale
        progress = _progress(batch * len(tiles) * len(passes), True)
        with own_arithmetic(self.device):
            for b in range(batch):
                for start, stop in tiles:
                    state = CausalState(self.device)
                    for t0, t1 in passes:
                        frames = pass_video_frames(t0, t1)
                        self.tile_pass(latents[b], t0, t1, (start, stop), state,
                                       video[b:b + 1, :, frames.start:frames.stop, s * start:s * stop])
                        progress.update(1)
                    del state
        progress.close()
        return video


PassRunner = DecodeRunner  # its name from before the encoder's runner stood beside it


def collect(chunks: Iterator[Chunk], video_shape, device: torch.device) -> torch.Tensor | None:
    """The chunks of a decode assembled into the whole video (None on ranks that received no chunk)."""
    video = None
    for b, frame, chunk in chunks:
        if chunk is None:
            continue
        if video is None:
            video = torch.empty(video_shape, dtype=torch.bfloat16, device=device)
        video[b:b + 1, :, frame:frame + chunk.shape[2]].copy_(chunk)
    return video


# A caller's own progress bars (a diffusers pipeline's `progress_bar`, so its `set_progress_bar_config` holds):
# `progress_bars.set(lambda total: bar)` in the decoding thread; None: the decoder's own tqdm bar.
progress_bars: contextvars.ContextVar = contextvars.ContextVar("progress_bars", default=None)


def _progress(total: int, show: bool, desc: str = "VAE decode"):
    from tqdm.auto import tqdm  # noqa: PLC0415 - only needed while decoding

    if not show or total < 2:
        return tqdm(total=total, disable=True)
    factory = progress_bars.get()
    if factory is not None:
        return factory(total)
    defaults = {name: value for name, value in _BAR_DEFAULTS.items() if f"TQDM_{name.upper()}" not in os.environ}
    return tqdm(total=total, desc=desc, unit="pass", **defaults)


class EncodeRunner:
    """Runs the encoder network (`encoder_network.EncodePass`) over one sample's clip with one op table and one set
    of prepared weights, in `dtype` activations: pass by pass (the first video frame alone, then 4 per latent frame),
    untiled or in exact two-phase tiles (docs/design/encoder.md, "Two-phase tiles")."""

    def __init__(self, ops: Ops, weights: dict[str, torch.Tensor], config, device: torch.device, dtype: torch.dtype,
                 frames_per_pass: int, reuse_steady: bool, progress: bool = True) -> None:
        self.ops, self.weights, self.config, self.device, self.dtype = ops, weights, config, device, dtype
        self.frames_per_pass, self.reuse_steady, self.progress = frames_per_pass, reuse_steady, progress

    def _pass(self, state: CausalState, first: bool, tile, memos, index: int, rows: LocalRows) -> EncodePass:
        return EncodePass(self.ops, self.weights, self.config, rows, state, first, tile, memos, index)

    def encode(self, video: torch.Tensor, latent_shape, tile_rows: int | None,
               rows: LocalRows | None = None) -> tuple[torch.Tensor, dict]:
        """video [1, 3, F, H, W] (F = 4T - 3) -> (moments [1, T, h, w, 2z] in the activations' dtype, the passes each
        stage reused: stage -> pass indices; tiled, those every tile reused). In bands (`rows`: a `RankRows`), this
        rank's band of the moments [1, T, stop - start, w, 2z] from its band of the video, rows exchanged as halos
        (untiled only)."""
        # sizes the CPU convs' row blocks (`ops.fp32_call_rows`)
        with frame_shape(*latent_shape[-2:], FP32_CPU_ENCODE_CALL_PIXELS):
            return self._encode(video, latent_shape, tile_rows, rows or LocalRows(latent_shape[3]))

    def _encode(self, video: torch.Tensor, latent_shape, tile_rows: int | None,
                rows: LocalRows) -> tuple[torch.Tensor, dict]:
        _, _, t, height, width = latent_shape
        passes = latent_passes(t, self.frames_per_pass)
        memos = {} if self.reuse_steady else None
        tiles = [] if tile_rows is None or tile_rows >= height else row_tiles(height, tile_rows)
        progress = _progress(len(passes) * (len(tiles) + 1), self.progress and rows.is_root, "VAE encode")
        if not tiles:
            start, stop = rows.rows
            s = self.config.spatial_scale  # the band's pixel rows; the last band's reach the frame's bottom
            band = video[:, :, :, s * start:s * stop if stop < height else video.shape[3]]
            moments = torch.empty((1, t, stop - start, width, 2 * self.config.z_dim), dtype=self.dtype,
                                  device=self.device)
            state = CausalState(self.device, self.dtype)
            for index, (t0, t1) in enumerate(passes):
                frames = pass_video_frames(t0, t1)
                step = self._pass(state, t0 == 0, None, memos, index, rows)
                moments[:, t0:t1] = step.phase2(step.phase1(band[:, :, frames.start:frames.stop]))
                progress.update(1)
            progress.close()
            return moments, _reused([memos])
        moments = torch.empty((1, t, height, width, 2 * self.config.z_dim), dtype=self.dtype, device=self.device)
        bottom_width = self.config.dims[-2]
        bottom = torch.empty((1, t, height, width, bottom_width), dtype=self.dtype, device=self.device)
        tile_memos = []
        for start, stop in tiles:  # phase 1, tile by tile over the whole clip
            state = CausalState(self.device, self.dtype)
            tile_memos.append({} if self.reuse_steady else None)
            for index, (t0, t1) in enumerate(passes):
                frames = pass_video_frames(t0, t1)
                tile = EncodeTile(start, stop, height, video.shape[3] // self.config.patch_size, self.config)
                a, b = tile.input_rows()
                p = self.config.patch_size
                step = self._pass(state, t0 == 0, tile, tile_memos[-1], index, rows)
                bottom[:, t0:t1, start:stop] = step.phase1(video[:, :, frames.start:frames.stop, p * a:p * b])
                progress.update(1)
            for memo in (tile_memos[-1] or {}).values():  # a finished tile's stages are never run again
                memo.input = memo.output = None
            del state
        state = CausalState(self.device, self.dtype)  # phase 2 on whole frames
        for index, (t0, t1) in enumerate(passes):
            moments[:, t0:t1] = self._pass(state, t0 == 0, None, memos, index, rows).phase2(bottom[:, t0:t1])
            progress.update(1)
        progress.close()
        return moments, {**_reused(tile_memos), **_reused([memos])}


def _reused(memo_sets) -> dict[str, tuple[int, ...]]:
    """stage -> the passes at which every one of `memo_sets` (a tile's stage memos each) reused it."""
    memo_sets = [m for m in memo_sets if m]
    if not memo_sets:
        return {}
    stages = set.intersection(*(set(m) for m in memo_sets))
    return {stage: tuple(sorted(set.intersection(*(set(m[stage].reused) for m in memo_sets)))) for stage in stages}
