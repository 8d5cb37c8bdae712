"""One pass of the Wan VAE decoder network over a few latent frames of one band (or tile) of rows, and the blocks it
shares with the encoder's pass (`Blocks`; `encoder_network.EncodePass` is `DecodePass`'s sibling).

Activations are channels-last bf16 and every hot step is one call into an op table (`ops.py`), so compiled kernels
replace ops without touching this file. Each causal conv owns its history (the last kt - 1 frames of its input, halo
rows included) in a `CausalState`; a pass copies that history in front of its new frames inside a reusable window, so
causal padding costs two frame copies per conv per pass, not a `torch.cat` of every frame. Rows come in bands
(`bands.py`): the ops never know whether their rows are the whole frame.

A tile (`Tile`) is a band decoded without its neighbours: the mid block (whose attention sees the whole frame) runs on
the whole frame at latent resolution, and the tile then carries enough extra rows, cropped level by level
(`tile_margins`), that the zero rows at its cut edges never reach the rows it keeps. That makes tiles exact.
"""

from __future__ import annotations

import math

import torch

from ..distributed.bands import LocalRows
from .ops import Ops, frame_shape


class CausalState:
    """Everything one sample's pass through the network (the decoder's or the encoder's) carries from pass to pass:
    each causal conv's history, and reusable windows, in the activations' dtype (bf16; the encoder's fp32 precision:
    fp32). `histories_changed` says whether a pass changed any history since it was last reset (the encoder's steady
    reuse reads it)."""

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> None:
        self.device, self.dtype = device, dtype
        self.histories: dict[str, torch.Tensor] = {}
        self.windows: dict[tuple, torch.Tensor] = {}
        self.watch_histories = False  # compare each history with what replaces it (`replace_history`)
        self.histories_changed = False

    def history(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        # Zeros before the first frame: the causal padding.
        if name not in self.histories:
            self.histories[name] = torch.zeros(shape, dtype=self.dtype, device=self.device)
        return self.histories[name]

    def replace_history(self, history: torch.Tensor, frames: torch.Tensor) -> None:
        if self.watch_histories and not self.histories_changed and not torch.equal(history, frames):
            self.histories_changed = True
        history.copy_(frames)

    def window(self, kind: str, frames: int, rows: int, width: int, channels: int) -> torch.Tensor:
        """A zero-initialised [1, >= frames, rows, W, C] buffer shared by the convs of one shape (slice it)."""
        key = (kind, rows, width, channels)
        buffer = self.windows.get(key)
        if buffer is None or buffer.shape[1] < frames:
            buffer = torch.zeros((1, frames, rows, width, channels), dtype=self.dtype, device=self.device)
            self.windows[key] = buffer
        return buffer[:, :frames]


DecodeState = CausalState  # its name from before the encoder shared it


def tile_margins(config) -> tuple[int, list[int]]:
    """Extra rows a tile carries past its own rows on each cut side: (at the mid block's second resnet, in latent
    rows; at the start of each up block, in that level's rows). A cut edge's zero halo spoils one more row per 3x3
    conv, and a nearest-2x + 3x3 upsample of c spoiled rows gives 2c + 1; working back from the output (the last
    level's convs plus conv_out) gives the margins that keep every kept row exact. Only 3x3 convs mix rows (the time
    convs, 1x1 shortcuts and Wan2.2's DupUp do not), so Wan2.2 and Wan2.1 share them: 15 and 13, 12, 10, 7."""
    convs = 2 * (config.num_res_blocks + 1)
    margin = convs + 1  # the last level: its resnets' convs and conv_out
    margins = [margin]
    for _ in range(len(config.dim_mult) - 1):
        margin = math.ceil((margin + 2 * convs + 1) / 2)
        margins.insert(0, margin)
    return margins[0] + 2, margins  # + the mid block's second resnet


class TileRows:
    """The latent rows [start, stop) a tile keeps, of a frame `height` latent rows high, and the first row it holds
    now (`held_start`, at the current level's scale): what the decoder's and the encoder's tiles share."""

    def __init__(self, start: int, stop: int, height: int) -> None:
        self.start, self.stop, self.height = start, stop, height
        self.held_start = 0


class Tile(TileRows):
    """A tile of the decoder: its rows, and the margins it carries past them (`tile_margins`)."""

    def __init__(self, start: int, stop: int, height: int, config) -> None:
        super().__init__(start, stop, height)  # the mid block starts on the whole frame: held from row 0
        self.mid_margin, self.margins = tile_margins(config)

    def crop(self, x: torch.Tensor, scale: int, margin: int, multiple: int = 1) -> torch.Tensor:
        """x [1, F, rows held, W, C] at `scale` x latent rows -> the rows within `margin` of this tile's own, starting
        on a multiple of `multiple` rows (the convs that follow may pair rows globally: `ops.Ops.row_multiple`)."""
        a = max(self.start * scale - margin, 0) // multiple * multiple
        b = min(self.stop * scale + margin, self.height * scale)
        offset = a - self.held_start
        self.held_start = a
        return x[:, :, offset:offset + b - a].contiguous()


class Blocks:
    """The blocks of one pass that the decoder's (`DecodePass`) and the encoder's (`encoder_network.EncodePass`)
    share: causal convs with their histories, residual blocks, the mid block's attention, over one sample's band of
    rows (or one tile) in the activations' dtype (`state.dtype`)."""

    def __init__(self, ops: Ops, p: dict[str, torch.Tensor], config, rows: LocalRows, state: CausalState,
                 first: bool, tile: TileRows | None = None) -> None:
        self.ops, self.p, self.config, self.rows, self.state, self.first = ops, p, config, rows, state, first
        self.tile = tile

    def _empty(self, *shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=self.state.dtype, device=self.state.device)

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
        self.causal_conv_call(window, keep, w, b, out, residual)
        self.state.replace_history(history, window[:, frames:])
        return out

    def causal_conv_call(self, window: torch.Tensor, keep: int, w: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                         residual: torch.Tensor | None) -> None:
        """The op a causal conv runs: its whole kernel over the history (`keep` frames) and the new frames."""
        self.ops.conv3d(window, w, b, out, residual)

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


class DecodePass(Blocks):
    """One pass of the decoder over `frames` latent frames of one sample's band of rows (or one `Tile`)."""

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
        w_sub = self.p[f"{name}.resample.1.weight"]
        out = self._empty(1, out_frames, 2 * rows, 2 * width, w_sub.shape[2])  # Wan2.1: half of c
        self.ops.upsample2x_conv3x3(up_in, w_sub, self.p[f"{name}.resample.1.bias"], out[0])
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
        self.state.replace_history(history, window[:, frames:])
        return out

    def up_block(self, i: int, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        name = f"decoder.up_blocks.{i}"
        if self.tile is not None:
            x = self.tile.crop(x, 2 ** i, self.tile.margins[i], self.ops.row_multiple)
        block_input = x
        for j in range(c.num_res_blocks + 1):
            x = self.residual_block(f"{name}.resnets.{j}", x)
        if i == len(c.dim_mult) - 1:
            return x
        temporal = c.temperal_upsample[i]
        x = self.upsample(c.upsampler(i), x, temporal)
        if c.residual:  # Wan2.2's DupUp shortcut; Wan2.1's up blocks have none
            factor_t = 2 if temporal else 1
            self.ops.dup_up_add(block_input, x, factor_t, factor_t - 1 if self.first else 0)
        if self.tile is not None:
            self.tile.held_start *= 2
        return x

    def run(self, z: torch.Tensor) -> torch.Tensor:
        """z: [C, frames, rows + halo, w] latents of this band with the rows around it that exist (see `decode`).
        Returns [1, video frames, 8 * rows, 8 * w, 3 * p * p] (before unpatchify)."""
        with frame_shape(self.rows.height, z.shape[-1]):  # sizes the CPU convs' row blocks (`ops.fp32_call_rows`)
            return self._run(z)

    def _run(self, z: torch.Tensor) -> torch.Tensor:
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
            x = self.tile.crop(x, 1, self.tile.mid_margin, self.ops.row_multiple)
        x = self.residual_block("decoder.mid_block.resnets.1", x)
        for i in range(len(self.config.dim_mult)):
            x = self.up_block(i, x)
        x = self.norm_conv("decoder.norm_out", "decoder.conv_out", x)
        if self.tile is not None:
            x = self.tile.crop(x, 2 ** (len(self.config.dim_mult) - 1), 0)
        return x


NetworkPass = DecodePass  # its name from before the encoder's pass stood beside it
