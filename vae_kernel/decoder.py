"""`WanVAEDecoder`: the fast Wan2.2 VAE decoder (DESIGN.md §3, §5).

The same math as `reference.decode` (diffusers' `AutoencoderKLWan.decode`), organised for speed:
- activations are channels-last bf16; every hot step is one call into an op table (`ops.py`), so compiled kernels
  replace ops without touching this file;
- each causal conv owns its history (the last kt - 1 frames of its input, halo rows included) in a `_DecodeState`;
  a pass copies that history in front of its new frames inside a reusable window, so causal padding costs two frame
  copies per conv per pass, not a `torch.cat` of every frame;
- a pass decodes `frames_per_pass` latent frames at once (the first latent frame, which becomes one video frame,
  always goes alone: its temporal upsamplers pass it through and its DupUp shortcut keeps one frame of two);
- rows come in bands (`bands.py`): one band for a local decode, one band per rank across a process group;
- tiled decode (`tile_rows`) runs row tiles one after another, each over the whole clip, so only one tile's
  activations and histories are alive at a time. It is exact, not blended: the mid block (whose attention sees the
  whole frame) runs on the whole frame at latent resolution, and each tile then carries enough extra rows, cropped
  level by level (`tile_margins`), that the zero rows at its cut edges never reach the rows it keeps. `decode_iter`
  tiles pass by pass instead (each tile keeps its own history), so streaming and tiling combine;
- `max_memory` picks the tile from the decoder's own buffers: `peak_bytes` replays a decode's allocations on the meta
  device (`memory.py`) and the largest tile whose peak fits the budget wins.

Batch elements are decoded one after another: they are independent, and it keeps every activation of a pass
contiguous.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
import torch.distributed as dist

from fastvideo_pan2_ext.reference import check_latents, exact_fp32

from . import memory
from . import weights as weights_mod
from .bands import LocalRows, RankRows
from .ops import Ops, select_ops

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}
_PROGRESS_DELAY_S = 3.0  # show a progress bar only for decodes that last longer than this
# peak_bytes' replay underestimates the real CPU decode's peak by up to 26% for one-row tiles of 2-column-wide test
# frames (7% at 3 columns; fixed per-op costs, not yet modelled, weigh most there), so a budget is checked against
# 1.3 x the replay.
_PEAK_HEADROOM = 1.3


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


class _DecodeState:
    """Everything one sample's decode carries from pass to pass: each causal conv's history, and reusable windows."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.histories: dict[str, torch.Tensor] = {}
        self.windows: dict[tuple, torch.Tensor] = {}

    def history(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        # Zeros before the first frame: the causal padding.
        if name not in self.histories:
            self.histories[name] = torch.zeros(shape, dtype=torch.bfloat16, device=self.device)
        return self.histories[name]

    def window(self, kind: str, frames: int, rows: int, width: int, channels: int) -> torch.Tensor:
        """A zero-initialised [1, >= frames, rows, W, C] buffer shared by the convs of one shape (slice it)."""
        key = (kind, rows, width, channels)
        buffer = self.windows.get(key)
        if buffer is None or buffer.shape[1] < frames:
            buffer = torch.zeros((1, frames, rows, width, channels), dtype=torch.bfloat16, device=self.device)
            self.windows[key] = buffer
        return buffer[:, :frames]


def tile_margins(config) -> tuple[int, list[int]]:
    """Extra rows a tile carries past its own rows on each cut side: (at the mid block's second resnet, in latent
    rows; at the start of each up block, in that level's rows). A cut edge's zero halo spoils one more row per 3x3
    conv, and a nearest-2x + 3x3 upsample of c spoiled rows gives 2c + 1; working back from the output (the last
    level's convs plus conv_out) gives the margins that keep every kept row exact (Wan2.2: 15 and 13, 12, 10, 7)."""
    convs = 2 * (config.num_res_blocks + 1)
    margin = convs + 1  # the last level: its resnets' convs and conv_out
    margins = [margin]
    for _ in range(len(config.dim_mult) - 1):
        margin = math.ceil((margin + 2 * convs + 1) / 2)
        margins.insert(0, margin)
    return margins[0] + 2, margins  # + the mid block's second resnet


class _Tile:
    """The latent rows [start, stop) a tile keeps, of a frame `height` latent rows high, and the rows it holds now."""

    def __init__(self, start: int, stop: int, height: int, config) -> None:
        self.start, self.stop, self.height = start, stop, height
        self.mid_margin, self.margins = tile_margins(config)
        self.held_start = 0  # first row held, at the current level's scale (the mid block starts on the whole frame)

    def crop(self, x: torch.Tensor, scale: int, margin: int) -> torch.Tensor:
        """x [1, F, rows held, W, C] at `scale` x latent rows -> the rows within `margin` of this tile's own."""
        a = max(self.start * scale - margin, 0)
        b = min(self.stop * scale + margin, self.height * scale)
        offset = a - self.held_start
        self.held_start = a
        return x[:, :, offset:offset + b - a].contiguous()


def _tiles(height: int, tile_rows: int) -> list[tuple[int, int]]:
    return [(s, min(s + tile_rows, height)) for s in range(0, height, tile_rows)]


def _video_frames(t0: int, t1: int) -> range:
    """The video frames a pass over latent frames [t0, t1) makes: the first latent frame makes frame 0, every later
    one four frames."""
    return range(0, 1) if t0 == 0 else range(4 * t0 - 3, 4 * t1 - 3)


class _Pass:
    """One pass of the decoder over `frames` latent frames of one sample's band of rows (or one tile)."""

    def __init__(self, ops: Ops, p: dict[str, torch.Tensor], config, rows: LocalRows, state: _DecodeState,
                 first: bool, tile: _Tile | None = None) -> None:
        self.ops, self.p, self.config, self.rows, self.state, self.first = ops, p, config, rows, state, first
        self.tile = tile

    def _empty(self, *shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.bfloat16, device=self.state.device)

    def causal_conv(self, name: str, fill, frames: int, rows: int, width: int, channels: int,
                    residual: torch.Tensor | None = None) -> torch.Tensor:
        """A causal (kt, 3, 3) conv of `frames` new frames: `fill(dest)` writes them into a haloed window after the
        conv's history; halos are exchanged, the conv runs, the last kt - 1 frames become the new history."""
        w, b = self.p[f"{name}.weight"], self.p[f"{name}.bias"]
        keep = w.shape[1] - 1
        window = self.state.window("conv", keep + frames, rows + 2, width, channels)
        history = self.state.history(name, (1, keep, rows + 2, width, channels))
        window[:, :keep].copy_(history)
        fill(window[:, keep:])
        self.rows.exchange_halos(window[0, keep:])
        out = self._empty(1, frames, rows, width, w.shape[0])
        self.ops.conv3d(window, w, b, out, residual)
        history.copy_(window[:, frames:])
        return out

    def norm_conv(self, norm: str, conv: str, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """conv(silu(rms_norm(x))): the norm writes straight into the conv's window, inside the halo rows."""
        _, frames, rows, width, channels = x.shape
        gamma = self.p[f"{norm}.gamma"]
        return self.causal_conv(conv, lambda dest: self.ops.rms_norm_silu(x, gamma, dest[:, :, 1:-1]),
                                frames, rows, width, channels, residual)

    def residual_block(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if f"{name}.conv_shortcut.weight" in self.p:
            shortcut = self._empty(*x.shape[:-1], self.p[f"{name}.conv_shortcut.weight"].shape[0])
            self.ops.conv3d(x, self.p[f"{name}.conv_shortcut.weight"], self.p[f"{name}.conv_shortcut.bias"], shortcut)
        else:
            shortcut = x
        h = self.norm_conv(f"{name}.norm1", f"{name}.conv1", x)
        return self.norm_conv(f"{name}.norm2", f"{name}.conv2", h, residual=shortcut)

    def attention_block(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Single-head attention over whole frames: this band's queries against every band's keys and values."""
        _, frames, rows, width, c = x.shape
        normed = self._empty(*x.shape)
        self.ops.rms_norm_silu(x, self.p[f"{name}.norm.gamma"], normed, silu=False)
        w_qkv, b_qkv = self.p[f"{name}.to_qkv.weight"], self.p[f"{name}.to_qkv.bias"]
        q, kv = self._empty(*x.shape), self._empty(*x.shape[:-1], 2 * c)
        self.ops.conv3d(normed, w_qkv[:c], b_qkv[:c], q)
        self.ops.conv3d(normed, w_qkv[c:], b_qkv[c:], kv)
        kv_frame = self.rows.all_rows(kv[0])
        attended = self._empty(frames, rows * width, c)
        self.ops.attention(q.view(frames, rows * width, c), kv_frame.reshape(frames, -1, 2 * c), attended)
        out = self._empty(*x.shape)
        self.ops.conv3d(attended.view(x.shape), self.p[f"{name}.proj.weight"], self.p[f"{name}.proj.bias"], out,
                        residual=x)
        return out

    def upsample(self, name: str, x: torch.Tensor, temporal: bool) -> torch.Tensor:
        """x2 in space (sub-pixel conv); x2 in time through the causal (3, 1, 1) time conv, except for the first
        latent frame, which passes through as one frame (and whose zeros, not itself, are the time conv's history)."""
        _, frames, rows, width, c = x.shape
        out_frames = frames * 2 if temporal and not self.first else frames
        up_in = self.state.window("up", out_frames, rows + 2, width, c)[0]
        if out_frames == frames:
            up_in[:, 1:-1].copy_(x[0])
        else:
            doubled = self.causal_time_conv(f"{name}.time_conv", x)  # [1, frames, rows, W, 2c]: frame 2t | 2t + 1
            up_in[:, 1:-1].view(frames, 2, rows, width, c).copy_(
                doubled[0].view(frames, rows, width, 2, c).permute(0, 3, 1, 2, 4))
        self.rows.exchange_halos(up_in)
        out = self._empty(1, out_frames, 2 * rows, 2 * width, c)
        self.ops.upsample2x_conv3x3(up_in, self.p[f"{name}.resample.1.weight"], self.p[f"{name}.resample.1.bias"],
                                    out[0])
        return out

    def causal_time_conv(self, name: str, x: torch.Tensor) -> torch.Tensor:
        w, b = self.p[f"{name}.weight"], self.p[f"{name}.bias"]
        _, frames, rows, width, c = x.shape
        keep = w.shape[1] - 1
        window = self.state.window("time", keep + frames, rows, width, c)
        history = self.state.history(name, (1, keep, rows, width, c))
        window[:, :keep].copy_(history)
        window[:, keep:].copy_(x)
        out = self._empty(1, frames, rows, width, w.shape[0])
        self.ops.conv3d(window, w, b, out)
        history.copy_(window[:, frames:])
        return out

    def up_block(self, i: int, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        name = f"decoder.up_blocks.{i}"
        if self.tile is not None:
            x = self.tile.crop(x, 2 ** i, self.tile.margins[i])
        block_input = x
        for j in range(c.num_res_blocks + 1):
            x = self.residual_block(f"{name}.resnets.{j}", x)
        if i == len(c.dim_mult) - 1:
            return x
        temporal = c.temperal_upsample[i]
        x = self.upsample(f"{name}.upsampler", x, temporal)
        factor_t = 2 if temporal else 1
        self.ops.dup_up_add(block_input, x, factor_t, factor_t - 1 if self.first else 0)
        if self.tile is not None:
            self.tile.held_start *= 2
        return x

    def run(self, z: torch.Tensor) -> torch.Tensor:
        """z: [C, frames, rows + halo, w] latents of this band with the rows around it that exist (see `decode`).
        Returns [1, video frames, 8 * rows, 8 * w, 3 * p * p] (before unpatchify)."""
        start, stop = self.rows.rows
        _, frames, _, width = z.shape
        rows = stop - start
        above = 1 if start > 0 else 0
        # post_quant_conv (1x1x1) in fp32 on the caller's latents, written into conv_in's window with its halo rows.
        w_pq = self.p["post_quant_conv.weight"].view(self.config.z_dim, self.config.z_dim)
        pq = torch.einsum("ctyx,oc->tyxo", z.float(), w_pq) + self.p["post_quant_conv.bias"]

        def fill(dest):
            dest[0, :, 1 - above:1 - above + pq.shape[1]].copy_(pq)

        x = self.causal_conv("decoder.conv_in", fill, frames, rows, width, self.config.z_dim)
        x = self.residual_block("decoder.mid_block.resnets.0", x)
        x = self.attention_block("decoder.mid_block.attentions.0", x)
        if self.tile is not None:
            self.tile.held_start = 0
            x = self.tile.crop(x, 1, self.tile.mid_margin)
        x = self.residual_block("decoder.mid_block.resnets.1", x)
        for i in range(len(self.config.dim_mult)):
            x = self.up_block(i, x)
        x = self.norm_conv("decoder.norm_out", "decoder.conv_out", x)
        if self.tile is not None:
            x = self.tile.crop(x, 2 ** (len(self.config.dim_mult) - 1), 0)
        return x


class WanVAEDecoder:
    """The fast Wan2.2 VAE decoder.

    `WanVAEDecoder(vae_or_state_dict, device="cuda", pg=None, frames_per_pass=4, local=False, backend="auto")`
    takes diffusers' `AutoencoderKLWan` (Wan2.2 layout) or its state dict; the architecture is read from the weights.
    `decode(latents)` maps de-normalized latents [B, z_dim, T, h, w] to a bf16 video [B, 3, 4T - 3, 16h, 16w] in
    [-1, 1] (for patch size 2). With a process group of N ranks each rank decodes a band of rows and rank 0 returns the
    video (the others None); `local=True` decodes on the calling rank alone. `backend`: "auto" (compiled where built
    and self-checked, else portable), "cuda" (compiled or an error), "torch" (portable, CPU too).
    `tile_rows=n` (or `enable_tiling(n)`): exact tiled decode of a single-rank decoder, n latent rows per tile.
    `max_memory=bytes` (or a string such as "2GiB"): a single-rank decoder picks, per latent shape, the largest tile
    whose peak working memory (`peak_bytes`: what a decode allocates beyond weights, latents and the returned video)
    fits; the plain decode when it fits whole. `decode` and `decode_iter` both honour tiling.
    """

    def __init__(self, vae_or_state_dict, device="cuda", pg=None, frames_per_pass: int = 4, local: bool = False,
                 backend: str = "auto", tile_rows: int | None = None, max_memory: int | str | None = None) -> None:
        if isinstance(frames_per_pass, bool) or not isinstance(frames_per_pass, int) or frames_per_pass < 1:
            raise ValueError(f"frames_per_pass must be an int >= 1; got {frames_per_pass!r}")
        if tile_rows is not None and max_memory is not None:
            raise ValueError(f"pass tile_rows or max_memory, not both; got tile_rows={tile_rows!r}, "
                             f"max_memory={max_memory!r}")
        self.tile_rows = None
        self.max_memory = None
        self._meta_weights = None
        self._plans: dict[tuple, int | None] = {}
        self.device = _resolve_device(device)
        self.frames_per_pass = frames_per_pass
        self.config, self.weights = weights_mod.load(vae_or_state_dict, self.device)
        self.ops = select_ops(backend, self.device)
        if local:
            self.pg = None
        elif pg is not None:
            self.pg = pg
        else:
            self.pg = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        self._fingerprint = self._config_fingerprint()
        if tile_rows is not None:
            self.enable_tiling(tile_rows)
        if max_memory is not None:
            self.set_max_memory(max_memory)

    def enable_tiling(self, tile_rows: int) -> None:
        """Decode in tiles of `tile_rows` latent rows, one after another (exact; peak memory falls with the tile)."""
        if isinstance(tile_rows, bool) or not isinstance(tile_rows, int) or tile_rows < 1:
            raise ValueError(f"tile_rows must be an int >= 1; got {tile_rows!r}")
        if self.pg is not None:
            raise ValueError("tiled decode runs on one rank: pass local=True (or no process group) to use tile_rows")
        self.tile_rows, self.max_memory = tile_rows, None

    def set_max_memory(self, max_memory: int | str) -> None:
        """Choose the tile per latent shape so that the decode's peak working memory fits `max_memory` bytes."""
        budget = memory.parse_bytes(max_memory)
        if self.pg is not None:
            raise ValueError("max_memory tiles the decode, which runs on one rank: pass local=True (or no process "
                             "group)")
        self.tile_rows, self.max_memory, self._plans = None, budget, {}

    def disable_tiling(self) -> None:
        self.tile_rows = self.max_memory = None

    # ---------------------------------------------------------------------------------------------------------------
    # Memory: the peak of a decode, measured by replaying its buffers on the meta device (see memory.py)
    # ---------------------------------------------------------------------------------------------------------------

    def peak_bytes(self, latents_shape, tile_rows: int | None = None, stream: bool = False) -> int:
        """Peak working memory (bytes) of decoding one sample of latents of `latents_shape` ([B, C, T, h, w]) with
        `tile_rows` (None: untiled), by `decode` (stream=False) or `decode_iter` (stream=True; tiles then advance
        together, so every tile's causal history is alive at once). Excludes weights, latents and the returned video
        (for `decode_iter`, the chunk being yielded is included). Batch elements are decoded one after another, so
        the batch size does not change it."""
        _, _, t, height, width = latents_shape
        if self._meta_weights is None:
            self._meta_weights = {k: v.to("meta") for k, v in self.weights.items()}
        itemsize = 4 if self.device.type == "cpu" else 2  # the portable ops compute in fp32 on CPU, bf16 on GPU
        ops, p = memory.dry_ops(itemsize), self.config.patch_size
        passes = self._passes(t)[:2]  # the first frame, then the largest pass: later passes repeat it
        z = torch.empty((self.config.z_dim, passes[-1][1], height, width), device="meta")
        meta = torch.device("meta")
        if tile_rows is None or tile_rows >= height:
            plans = [(None, LocalRows(height))]
        elif stream:
            plans = [(tile, LocalRows(height)) for tile in _tiles(height, tile_rows)]
        else:  # tile by tile: the middle tile holds the most margin rows
            start = (height - tile_rows) // 2
            plans = [((start, start + tile_rows), LocalRows(height))]
        with memory.LiveBytes() as tracker:
            states = [_DecodeState(meta) for _ in plans]
            for t0, t1 in passes:
                chunk = None
                if stream or tile_rows is None:
                    frames = len(_video_frames(t0, t1))
                    chunk = torch.empty((1, 3, frames, 8 * p * height, 8 * p * width), dtype=torch.bfloat16,
                                        device=meta)
                for (tile, rows), state in zip(plans, states):
                    spec = None if tile is None else _Tile(*tile, height, self.config)
                    zin = z[:, t0:t1] if spec is not None else z[:, t0:t1, 0:height]
                    out = _Pass(ops, self._meta_weights, self.config, rows, state, t0 == 0, spec).run(zin)
                    ops.unpatchify_clamp(out, out, p)
                    del out
                del chunk
            del states
        return tracker.peak

    def plan_tile_rows(self, latents_shape, stream: bool = False) -> int | None:
        """The tile `decode` (or, stream=True, `decode_iter`) uses for latents of `latents_shape`: with max_memory,
        None (untiled) when the plain decode fits, else the largest tile_rows that fits; ValueError when even
        one-row tiles do not fit."""
        return self._tile_rows_for(torch.empty(tuple(latents_shape), device="meta"), stream)

    def _fits(self, shape, tile_rows, stream) -> bool:
        return self.peak_bytes(shape, tile_rows, stream) * _PEAK_HEADROOM <= self.max_memory

    def _plan(self, shape, stream: bool) -> int | None:
        height = shape[3]
        if self._fits(shape, None, stream):
            return None
        if stream:
            return self._plan_stream(shape)
        smallest = int(self.peak_bytes(shape, 1) * _PEAK_HEADROOM)
        if smallest > self.max_memory:
            raise self._too_small(shape, smallest, "even in one-row tiles")
        lo, hi = 1, height - 1  # the largest tile that fits (tile by tile, peak grows with the tile)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._fits(shape, mid, False):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _plan_stream(self, shape) -> int:
        """Streaming keeps every tile's history, and the tiles' margins overlap, so below some size smaller tiles
        cost more (Wan2.2 at 704x1248: least near 11 rows). Try each tile count's largest tile, largest first."""
        height = shape[3]
        candidates = sorted({-(-height // k) for k in range(2, height + 1)}, reverse=True)
        peaks = []
        for rows in candidates:
            peak = int(self.peak_bytes(shape, rows, True) * _PEAK_HEADROOM)
            if peak <= self.max_memory:
                return rows
            peaks.append(peak)
        raise self._too_small(shape, min(peaks), "streamed (decode_iter) in any tile size")

    def _too_small(self, shape, needed: int, how: str) -> ValueError:
        return ValueError(
            f"max_memory {memory.format_bytes(self.max_memory)} ({self.max_memory} bytes) is too small to decode "
            f"latents {list(shape)} {how}: that needs at least {memory.format_bytes(needed)} ({needed} bytes)")

    @property
    def backend(self) -> str:
        return self.ops.name

    def _config_fingerprint(self) -> int:
        c = self.config
        values = [c.z_dim, c.decoder_base_dim, c.num_res_blocks, c.out_channels, c.patch_size, *c.dim_mult,
                  *map(int, c.temperal_upsample)]
        return sum(v * 1009 ** i for i, v in enumerate(values)) % (1 << 50)

    # ---------------------------------------------------------------------------------------------------------------
    # Input checks (every rank agrees before any work starts)
    # ---------------------------------------------------------------------------------------------------------------

    def _input_error(self, latents) -> str | None:
        try:
            check_latents(latents, self.config.z_dim)
        except ValueError as exc:
            return str(exc)
        if latents.dtype not in _DTYPE_CODES:
            return f"latents must be float32, bfloat16, float16 or float64; got {latents.dtype}"
        if latents.device != self.device:
            return f"latents are on {latents.device}; this decoder runs on {self.device}"
        if not bool(torch.isfinite(latents).all()):
            return "latents contain NaN or Inf"
        return None

    def _descriptor(self, latents, error: str | None) -> torch.Tensor:
        """What every rank must agree on: validity, shape, dtype, frames per pass, architecture, a content checksum."""
        values = [0.0 if error else 1.0] + [-1.0] * 9
        if error is None:
            z = latents.detach().double()
            values[1:] = [*map(float, latents.shape), float(_DTYPE_CODES[latents.dtype]),
                          float(self.frames_per_pass), float(self._fingerprint), float(z.abs().sum())]
        return torch.tensor(values, dtype=torch.float64)

    def _check_input(self, latents, rows: RankRows | None) -> None:
        error = self._input_error(latents)
        if rows is None:
            if error:
                raise ValueError(error)
            return
        mine = self._descriptor(latents, error).to(rows.comm_device)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.pg))]
        dist.all_gather(everyone, mine, group=self.pg)
        if error:
            raise ValueError(error)
        for rank, theirs in enumerate(everyone):
            theirs = theirs.cpu()
            if theirs[0] == 0:
                raise ValueError(f"rank {rank} of the decode group rejected its latents; see that rank's error")
            if not torch.equal(theirs[1:9], mine.cpu()[1:9]) or not math.isclose(
                    float(theirs[9]), float(mine[9]), rel_tol=1e-9, abs_tol=1e-9):
                raise ValueError(
                    f"ranks disagree about the decode: rank {rank} has latents {theirs[1:6].long().tolist()} "
                    f"dtype code {int(theirs[6])}, frames_per_pass {int(theirs[7])} (checksum {float(theirs[9]):.6g}); "
                    f"this rank has {mine[1:6].long().tolist()} dtype code {int(mine[6])}, frames_per_pass "
                    f"{int(mine[7])} (checksum {float(mine[9]):.6g}); every rank must pass the same latents")

    # ---------------------------------------------------------------------------------------------------------------
    # Decoding
    # ---------------------------------------------------------------------------------------------------------------

    def _rows(self, height: int):
        return LocalRows(height) if self.pg is None else RankRows(height, self.pg, self.device)

    def _passes(self, t: int) -> list[tuple[int, int]]:
        """Latent frame ranges: the first frame alone, then frames_per_pass at a time."""
        return [(0, 1)] + [(s, min(s + self.frames_per_pass, t)) for s in range(1, t, self.frames_per_pass)]

    def output_shape(self, latents: torch.Tensor) -> tuple[int, ...]:
        b, _, t, h, w = latents.shape
        s = 8 * self.config.patch_size
        return (b, 3, 4 * t - 3, s * h, s * w)

    def decode_iter(self, latents: torch.Tensor) -> Iterator[tuple[int, int, torch.Tensor | None]]:
        """Decode pass by pass: yields (sample index, first video frame, chunk [1, 3, F, 16h, 16w] bf16 or None on
        ranks other than 0), in order; frames 0..4T-4 of each sample come out consecutively, so a caller that only
        writes them out never holds the whole video. Input errors raise here, before the first chunk. With tiling
        (`tile_rows` / `max_memory`) every pass runs tile after tile, each tile keeping its own causal history, so the
        chunks are the same, the activations are one tile's, and the histories are the whole frame's (plus margins):
        `peak_bytes(shape, n, stream=True)`."""
        rows = self._rows(latents.shape[3] if isinstance(latents, torch.Tensor) and latents.dim() == 5 else 1)
        self._check_input(latents, rows if isinstance(rows, RankRows) else None)
        tile_rows = self._tile_rows_for(latents, stream=True)
        if tile_rows is not None:
            return self._iter_tiled(latents, tile_rows)
        return self._iter_checked(latents, rows)

    def _tile_rows_for(self, latents, stream: bool) -> int | None:
        if self.max_memory is None:
            return self.tile_rows if self.tile_rows is not None and self.tile_rows < latents.shape[3] else None
        key = (*latents.shape[2:], stream)
        if key not in self._plans:
            self._plans[key] = self._plan(latents.shape, stream)
        return self._plans[key]

    def _iter_tiled(self, latents, tile_rows: int) -> Iterator[tuple[int, int, torch.Tensor]]:
        batch, _, t, height, width = latents.shape
        tiles = _tiles(height, tile_rows)
        passes = self._passes(t)
        scale = 8 * self.config.patch_size
        progress = _progress(batch * len(passes), True)
        with torch.no_grad(), exact_fp32():
            for b in range(batch):
                states = [_DecodeState(self.device) for _ in tiles]
                for t0, t1 in passes:
                    frames = _video_frames(t0, t1)
                    chunk = torch.empty((1, 3, len(frames), scale * height, scale * width), dtype=torch.bfloat16,
                                        device=self.device)
                    for (start, stop), state in zip(tiles, states):
                        self._tile_pass(latents[b], t0, t1, (start, stop), state,
                                        chunk[..., scale * start:scale * stop, :])
                    progress.update(1)
                    yield b, frames.start, chunk
                    del chunk
                del states
        progress.close()

    def _tile_pass(self, z: torch.Tensor, t0: int, t1: int, rows: tuple[int, int], state: _DecodeState,
                   dest: torch.Tensor) -> None:
        """Decode latent frames [t0, t1) of one sample's z [C, T, h, w], keeping latent rows `rows`, into `dest`
        (those rows of the pass's video frames); `state` is that tile's causal history."""
        height = z.shape[2]
        tile = _Tile(*rows, height, self.config)
        out = _Pass(self.ops, self.weights, self.config, LocalRows(height), state, t0 == 0, tile).run(z[:, t0:t1])
        self.ops.unpatchify_clamp(out, dest, self.config.patch_size)

    def _iter_checked(self, latents, rows) -> Iterator[tuple[int, int, torch.Tensor | None]]:
        if isinstance(rows, RankRows) and not rows.active:
            return
        batch, _, t, height, _ = latents.shape
        start, stop = rows.rows
        lo, hi = max(start - 1, 0), min(stop + 1, height)
        passes = self._passes(t)
        progress = _progress(batch * len(passes), rows.is_root)
        with torch.no_grad(), exact_fp32():
            for b in range(batch):
                state = _DecodeState(self.device)
                for t0, t1 in passes:
                    run = _Pass(self.ops, self.weights, self.config, rows, state, first=t0 == 0)
                    out = run.run(latents[b, :, t0:t1, lo:hi])
                    p = self.config.patch_size
                    chunk = torch.empty((1, 3, out.shape[1], p * out.shape[2], p * out.shape[3]),
                                        dtype=torch.bfloat16, device=self.device)
                    self.ops.unpatchify_clamp(out, chunk, p)
                    del out
                    parts = rows.gather_to_root(chunk)
                    del chunk
                    if parts is not None:
                        parts = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)
                    progress.update(1)
                    yield b, _video_frames(t0, t1).start, parts
                    del parts
        progress.close()

    def decode(self, latents: torch.Tensor) -> torch.Tensor | None:
        """latents [B, z_dim, T, h, w] (de-normalized) -> video [B, 3, 4T - 3, 16h, 16w] bf16 on rank 0, else None."""
        if self.tile_rows is not None or self.max_memory is not None:
            self._check_input(latents, None)
            tile_rows = self._tile_rows_for(latents, stream=False)
            if tile_rows is not None:
                return self._decode_tiled(latents, tile_rows)
        chunks = self.decode_iter(latents)
        video = None
        for b, frame, chunk in chunks:
            if chunk is None:
                continue
            if video is None:
                video = torch.empty(self.output_shape(latents), dtype=torch.bfloat16, device=self.device)
            video[b:b + 1, :, frame:frame + chunk.shape[2]].copy_(chunk)
        return video

    def _decode_tiled(self, latents: torch.Tensor, tile_rows: int) -> torch.Tensor:
        """Tile by tile, each over the whole clip, so one tile's state is alive at a time (see the module notes)."""
        batch, _, t, height, _ = latents.shape
        tiles = _tiles(height, tile_rows)
        passes = self._passes(t)
        video = torch.empty(self.output_shape(latents), dtype=torch.bfloat16, device=self.device)
        scale = 8 * self.config.patch_size
        progress = _progress(batch * len(tiles) * len(passes), True)
        with torch.no_grad(), exact_fp32():
            for b in range(batch):
                for start, stop in tiles:
                    state = _DecodeState(self.device)
                    for t0, t1 in passes:
                        frames = _video_frames(t0, t1)
                        self._tile_pass(latents[b], t0, t1, (start, stop), state,
                                        video[b:b + 1, :, frames.start:frames.stop, scale * start:scale * stop])
                        progress.update(1)
                    del state
        progress.close()
        return video


def _progress(total: int, show: bool):
    from tqdm.auto import tqdm  # noqa: PLC0415 - only needed while decoding

    return tqdm(total=total, desc="VAE decode", unit="pass", delay=_PROGRESS_DELAY_S, disable=not show or total < 2,
                leave=False)
