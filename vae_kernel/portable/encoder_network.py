"""One pass of the Wan VAE encoder network over a few video frames of one sample's rows (or of one tile of them).

The encoder is the decoder's mirror and its pass is the decoder's pass's sibling over the blocks they share
(`network.Blocks`: causal convs with their histories in a `CausalState`, residual blocks, the mid block's attention,
the op table), in the activations' dtype: fp32 for the encoder's fp32 precision, bf16 for its bf16 one. What only
the encoder has: its first frame's causal convs by their last tap (`EncodePass.causal_conv_call`), patchify (Wan2.2),
the downsamples (a zero row and column below and right of the frame, then a 3x3 stride-2 conv; at the temporal
levels a (3, 1, 1) stride-2 time conv after it, skipped on the first frame), Wan2.2's AvgDown3D shortcut, and
quant_conv at the end.

A pass runs in two phases. Phase 1 (`phase1`): patchify, conv_in and every level but the last, which ends at the
latent rows. Phase 2 (`phase2`): the last level, the mid block (whose attention sees every latent pixel of the
frame), the head and quant_conv. Untiled, the two run back to back. A tile (`EncodeTile`) runs phase 1 on its rows
plus margins (`encoder_margins`: the rows a cut edge spoils never reach the rows it keeps), and phase 2 then runs on
the whole frame's latent rows: that makes tiles exact, where a tile encoded whole never is (its attention would see
only the tile).

Steady reuse (`StageMemo`): each stage (level 0 with conv_in, every other level, the mid block with the head) keeps
its last output when the pass left every causal history of the stage unchanged; when the next pass gives the stage
the same input, its output is that one again, bit for bit (the same ops on the same input and state), and the stage
does not run. Image-to-video inputs (an image and zero frames) reach that state level by level.
"""

from __future__ import annotations

import torch

from ..distributed.bands import LocalRows
from .network import Blocks, TileRows


def encoder_margins(config) -> list[tuple[int, int]]:
    """(rows above, rows below) that a tile's phase 1 needs past its own rows at the input of each level but the
    last, in that level's rows, and, last, at conv_in's input (in patchified pixel rows). A 3x3 conv reads one row
    each side, a level's 2 * num_res_blocks of them two each; its downsample's output rows [a, b) read rows
    [2a, 2b + 1) of its input: so each level needs A = 2 A' + 2n above and B = 2 B' + 2n + 1 below, from 0 at phase
    1's end (Wan: 4 and 5 latent rows at level 2's input, 28 and 35 patchified rows at level 0's, 29 and 36 at
    conv_in's)."""
    convs = 2 * config.num_res_blocks
    above = below = 0
    margins = []
    for _ in range(config.levels - 1):
        above, below = 2 * above + convs, 2 * below + convs + 1
        margins.insert(0, (above, below))
    margins.append((above + 1, below + 1))  # conv_in
    return margins


class EncodeTile(TileRows):
    """The latent rows [start, stop) a tile of phase 1 keeps, of a frame `height` latent rows high (`rows` patchified
    pixel rows: Wan2.1's last latent row may read a few more), and the rows it holds now. Its input starts on a
    latent-row boundary (each downsample pairs rows counted from the frame's top), with whole latent rows of margin
    (4 above and 5 below: `input_rows`)."""

    def __init__(self, start: int, stop: int, height: int, rows: int, config, margins=None) -> None:
        super().__init__(start, stop, height)
        self.pixel_rows = rows
        self.margins = encoder_margins(config) if margins is None else margins
        self.scale = 2 ** (config.levels - 1)

    def input_rows(self) -> tuple[int, int]:
        """The patchified pixel rows [a, b) phase 1 reads: the margins at conv_in's input, in whole latent rows."""
        above, below = self.margins[-1]
        s = self.scale
        a = max(self.start - -(-above // s), 0) * s
        b = min((self.stop + -(-below // s)) * s, self.pixel_rows)
        if self.stop == self.height:
            b = self.pixel_rows  # the frame's last latent row reads the remainder rows (Wan2.1, H = 8h + r)
        self.held_start = a
        return a, b

    def crop_level(self, x: torch.Tensor, level: int) -> torch.Tensor:
        """x [1, F, rows held, W, C] at level `level`'s input -> the rows its margins need, an even count unless
        they end at the frame's bottom (Wan2.2's AvgDown3D folds row pairs)."""
        scale = 2 ** (len(self.margins) - 1 - level)
        above, below = self.margins[level]
        bottom = self.held_start + x.shape[2]
        a = max(self.start * scale - above, self.held_start)
        b = min(self.stop * scale + below, bottom)
        if (b - a) % 2 and b < bottom:
            b += 1
        offset = a - self.held_start
        self.held_start = a
        return x[:, :, offset:offset + b - a].contiguous()

    def keep(self, x: torch.Tensor) -> torch.Tensor:
        """Phase 1's output (latent rows) -> this tile's own rows."""
        offset = self.start - self.held_start
        return x[:, :, offset:offset + self.stop - self.start]


class StageMemo:
    """What steady reuse keeps of one stage: its last input and output, when that pass left the stage's histories
    unchanged; and the passes at which it reused them."""

    def __init__(self) -> None:
        self.input: torch.Tensor | None = None
        self.output: torch.Tensor | None = None
        self.held_start = 0  # a tile's first held row after the stage
        self.reused: list[int] = []


class EncodePass(Blocks):
    """One pass of the encoder over `frames` video frames of one sample's rows, or one tile's (see the module)."""

    def __init__(self, ops, p, config, rows: LocalRows, state, first: bool, tile: EncodeTile | None = None,
                 memos: dict[str, StageMemo] | None = None, index: int = 0) -> None:
        super().__init__(ops, p, config, rows, state, first, tile)
        self.memos, self.index = memos, index

    def causal_conv_call(self, window, keep, w, b, out, residual) -> None:
        if self.first and window.shape[1] == keep + 1 and window.dtype == torch.float32:
            # An fp32 encode's first pass (the portable table's: the compiled ones take whole kernels): its one frame
            # meets the causal zeros through every tap but the last, so that tap alone gives the same sums up to
            # their order, in 1/kt of the work (a third of a 9-frame encode's first-frame convs; an image's encode).
            self.ops.conv3d(window[:, keep:], w[:, keep:], b, out, residual)
        else:
            super().causal_conv_call(window, keep, w, b, out, residual)

    def stage(self, key: str, x: torch.Tensor, run) -> torch.Tensor:
        """run(x), or its last output where steady reuse applies (see the module)."""
        if self.memos is None:
            return run(x)
        memo = self.memos.setdefault(key, StageMemo())
        # On the meta device (the planner's replay) there are no values to compare: every stage keeps what a settled
        # one keeps, so the replay counts the most the reuse can hold.
        values = x.device.type != "meta"
        same = values and memo.input is not None and memo.input.shape == x.shape and torch.equal(memo.input, x)
        # Ranks in bands skip a stage together: a stage that runs exchanges halos with its neighbours.
        if values and self.rows.all_agree(same):
            memo.reused.append(self.index)
            if self.tile is not None:
                self.tile.held_start = memo.held_start
            return memo.output
        self.state.watch_histories, self.state.histories_changed = values, False
        out = run(x)
        self.state.watch_histories = False
        steady = not self.state.histories_changed and not self.first if values else True
        memo.input, memo.output = (x, out) if steady else (None, None)
        if self.tile is not None:
            memo.held_start = self.tile.held_start
        return out

    def downsample(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Level i's downsample: a zero row below and a zero column right of x (in bands, the row below is the next
        band's first: a halo), a 3x3 stride-2 conv; at a temporal level, then the (3, 1, 1) stride-2 time conv over
        [the previous pass's last frame, these frames] (the first pass stores its frame and skips it)."""
        name = self.config.downsampler(i)
        _, frames, rows, width, c = x.shape
        padded = self.state.window("down", frames, rows + 1, width + 1, c)
        padded[:, :, :rows, :width].copy_(x)
        self.rows.exchange_row_below(padded[0])
        out = self._empty(1, frames, rows // 2, width // 2, c)
        self.ops.conv3d_strided(padded, self.p[f"{name}.resample.1.weight"], self.p[f"{name}.resample.1.bias"], out,
                                (1, 2, 2))
        if not self.config.temperal_downsample[i]:
            return out
        history = self.state.history(f"{name}.time_conv", (1, 1, rows // 2, width // 2, c))
        if self.first:
            self.state.replace_history(history, out[:, -1:])
            return out
        window = self.state.window("time_down", frames + 1, rows // 2, width // 2, c)
        window[:, :1].copy_(history)
        window[:, 1:].copy_(out)
        timed = self._empty(1, frames // 2, rows // 2, width // 2, c)
        self.ops.conv3d_strided(window, self.p[f"{name}.time_conv.weight"], self.p[f"{name}.time_conv.bias"], timed,
                                (2, 1, 1))
        self.state.replace_history(history, window[:, -1:])
        return timed

    def level(self, i: int, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        if self.tile is not None and i < c.levels - 1:
            x = self.tile.crop_level(x, i)
        block_input = x if c.residual else None  # held for Wan2.2's shortcut only
        for j in range(c.num_res_blocks):
            x = self.residual_block(c.resnet(i, j), x)
        last = i == c.levels - 1
        if not last:
            x = self.downsample(i, x)
            if self.tile is not None:
                self.tile.held_start //= 2
        if c.residual:  # Wan2.2's AvgDown3D shortcut (factor 1 at the last level: the block's input itself)
            temporal = not last and c.temperal_downsample[i]
            self.ops.avg_down_add(block_input, x, 2 if temporal else 1, 1 if last else 2)
        return x

    def phase1(self, video: torch.Tensor) -> torch.Tensor:
        """video [1, 3, F, rows, W] (this pass's frames of these rows, in pixels) -> [1, F', rows / s, W / s, C] at the
        last level's input (a tile: its own latent rows only)."""
        c = self.config
        p = c.patch_size
        frames, rows, width = video.shape[2], video.shape[3] // p, video.shape[4] // p

        def level0(v):
            def fill(dest):
                self.ops.patchify_into(v, dest[:, :, 1:-1], p)

            return self.level(0, self.causal_conv("encoder.conv_in", fill, frames, rows, width, c.in_channels))

        x = self.stage("level0", video, level0)
        for i in range(1, c.levels - 1):
            x = self.stage(f"level{i}", x, lambda h, i=i: self.level(i, h))
        return x if self.tile is None else self.tile.keep(x)

    def phase2(self, x: torch.Tensor) -> torch.Tensor:
        """The last level's input [1, F', h, w, C] (whole frames) -> moments [1, F', h, w, 2 z] (mean | logvar)."""
        last = self.config.levels - 1
        x = self.stage(f"level{last}", x, lambda h: self.level(last, h))
        return self.stage("head", x, self._head)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        x = self.residual_block("encoder.mid_block.resnets.0", x)
        x = self.attention_block("encoder.mid_block.attentions.0", x)
        x = self.residual_block("encoder.mid_block.resnets.1", x)
        x = self.norm_conv("encoder.norm_out", "encoder.conv_out", x)
        moments = self._empty(*x.shape)
        self.ops.conv3d(x, self.p["quant_conv.weight"], self.p["quant_conv.bias"], moments)
        return moments
