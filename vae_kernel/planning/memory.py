"""Working-memory accounting for the decoder: a live-bytes tracker, budgets, the dry-run op table and the planner.

`max_memory` (see `WanVAEDecoder`) is met by measuring, not guessing: the decoder's own schedule of buffers (causal
histories, windows, activations, tile crops) is replayed on the `meta` device, where tensors have shapes but no data,
under `LiveBytes`, which counts every storage created while it is active and frees it when the last view of it dies
(not the weights a decode reads through views). The ops of that replay (`dry_ops`) do no arithmetic: each holds, for
as long as the op runs, what the portable op in `ops.py` materialises (its casts to the compute dtype, its result,
its reshapes), so the replay's peak is the decode's peak working memory: everything it allocates beyond the weights,
the latents and the returned video (on a CPU, in either weight layout, what the real decode allocates, op for op:
tests/vae_kernel/test_memory_model.py).

How a decode is planned (`frames_per_pass="auto"`, `max_memory`, the tiles, a decode group's agreement) is stated
once, in `choose_plan` and `smallest` (docs/design/decoder.md, "Memory planner"). Every planner method
takes its arguments in one order: (latents_shape, frames_per_pass, tile_rows, stream, budget), those that apply.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from ..definitions.architecture import video_shape
from ..distributed.bands import LocalRows, split_rows
from ..portable import ops
from ..portable.network import CausalState, DecodePass, Tile
from ..portable.ops import Ops
from ..portable.passes import EncodeRunner, latent_passes, pass_video_frames, row_tiles
from ..portable.winograd import WinogradConv3d

AUTO = "auto"
FRAMES_PER_PASS_CHOICES = (8, 4, 2, 1)  # what frames_per_pass="auto" chooses among, largest first (`choose_plan`)
# frames_per_pass="auto" keeps a decode's whole allocation (weights, working memory, returned video) within this when
# nothing smaller bounds it (`choose_plan`): PAN2's default video (704x1248, 241 frames, T = 61) then decodes at
# frames_per_pass 1 on one GPU.
DEFAULT_MEMORY_GOAL = 16 * 2**30
# A budget is checked against 1.3 x the replay: the replay counts the storages torch allocates (on a CPU the same
# as the real decode's, and torch's CPU allocator holds no more but for one call's buffers inside oneDNN:
# tests/vae_kernel/test_memory_model.py), not what oneDNN, cuDNN or a compiled kernel allocate inside a call, nor the
# allocator's rounding and fragmentation.
PEAK_HEADROOM = 1.3
# A decode that ran out of memory retries at a plan whose replayed peak is at most this fraction of the failed plan's
# (docs/design/worker.md, "Out-of-memory retries"): every retry cuts the planned peak by a quarter or more, so a decode
# tries few plans (PAN2's video at 4 frames per pass: 4, 2, 1, then tiles), and the smallest plan is tried last.
RETRY_PEAK_FRACTION = 0.75
_STREAM_RETRY_TILES = (2, 3, 4, 6, 8)  # tile counts a streamed decode's retry tries


class Plan(NamedTuple):
    """How one decode (encode) runs: latent frames per pass, and latent rows per tile (None: untiled)."""

    frames_per_pass: int
    tile_rows: int | None

    def __str__(self) -> str:
        frames = f"{self.frames_per_pass} latent frame{'s' if self.frames_per_pass > 1 else ''} per pass"
        if self.tile_rows is None:
            return f"{frames}, untiled"
        return f"{frames} in tiles of {self.tile_rows} latent row{'s' if self.tile_rows > 1 else ''}"

    def size(self) -> tuple[int, float]:
        """The order of plans (a smaller plan holds less): frames per pass, then tile rows (untiled largest)."""
        return self.frames_per_pass, math.inf if self.tile_rows is None else self.tile_rows


DecodePlan = Plan  # its name from before the encoder shared it


def choose_plan(planner: MemoryPlanner, latents_shape, frames_per_pass: int | str, tile_rows: int | None,
                stream: bool, budget: int | None, ranks: int = 1, row_multiple: int = 1) -> Plan:
    """The plan of one rank's decode (`decode`, or stream=True `decode_iter`) of latents of `latents_shape`, given
    the decoder's options (`frames_per_pass`, `tile_rows`, `budget` = max_memory in bytes) and its group of `ranks`
    (whose bands start on multiples of `row_multiple` rows). The rule, in order:

    1. An explicit `frames_per_pass` is kept; so are explicit `tile_rows` (untiled when not fewer than the frame's
       rows). With `budget`, the largest tile whose planned peak fits it (untiled when the whole frame fits;
       ValueError when even one-row tiles do not).
    2. "auto" with `budget`: the largest of `FRAMES_PER_PASS_CHOICES` whose untiled planned peak fits it, else 1;
       tiles as in 1.
    3. "auto" otherwise: the largest of `FRAMES_PER_PASS_CHOICES` whose planned peak of one rank's band (its rows
       plus a halo row each side), at `tile_rows`, fits both the device's free memory (`free_device_bytes`; not
       measured on a CPU) and `DEFAULT_MEMORY_GOAL` minus the weights, each less the returned video (none for
       decode_iter); else 1.
    4. When even 1 overflows the free memory, a single-rank decoder without `tile_rows` tiles to fit it (the largest
       tile that does; untiled when none does: the allocator decides).

    "Fits" means the replayed peak (`MemoryPlanner.peak_bytes`) x PEAK_HEADROOM is within the bytes. A decode group
    then runs the `smallest` of its ranks' plans; a decode that runs out of memory retries at
    `MemoryPlanner.retry_plan`, and `WanVAEDecoder.plan` never exceeds a plan retried at before."""
    shape = tuple(latents_shape)
    if frames_per_pass != AUTO:
        return Plan(frames_per_pass, _tiles(planner, shape, frames_per_pass, tile_rows, stream, budget))
    if budget is not None:
        fpp = planner.most_frames_per_pass(shape, None, stream, budget) or 1
        return Plan(fpp, _tiles(planner, shape, fpp, tile_rows, stream, budget))
    band = band_shape(shape, ranks, row_multiple)
    video = 0 if stream else planner.output_bytes(shape)  # decode (encode) returns it
    free = free_device_bytes(planner.device)
    room = None if free is None else free - video
    goal = DEFAULT_MEMORY_GOAL - planner.weight_bytes - video
    fpp = planner.most_frames_per_pass(band, tile_rows, stream, goal if room is None else min(goal, room))
    if fpp is not None:
        return Plan(fpp, _tiles(planner, shape, fpp, tile_rows, stream, None))
    if room is None or ranks > 1 or tile_rows is not None or planner.fits(band, 1, None, stream, room):
        return Plan(1, _tiles(planner, shape, 1, tile_rows, stream, None))
    try:  # even one frame per pass overflows the free memory: exact tiles that fit it
        return Plan(1, planner.largest_tile(shape, 1, stream, room))
    except ValueError:
        return Plan(1, None)  # nothing fits by the plan: leave it to the allocator


def smallest(plans: Iterable[Plan]) -> Plan:
    """The plan a decode group runs: the smallest of its ranks' plans (every rank must run the same passes, since
    the halo exchanges happen per pass, and the smallest is one every rank can afford)."""
    return min(plans, key=Plan.size)


def band_shape(latents_shape, ranks: int, row_multiple: int = 1) -> tuple[int, ...]:
    """The latents one rank of a group of `ranks` decodes: its band of rows plus a halo row on each side (the whole
    frame alone)."""
    shape = tuple(latents_shape)
    if ranks == 1:
        return shape
    height = shape[3]
    rows = min(max(stop - start for start, stop in split_rows(height, ranks, row_multiple)) + 2, height)
    return (*shape[:3], rows, shape[4])


def _tiles(planner: MemoryPlanner, shape, frames_per_pass: int, tile_rows: int | None, stream: bool,
           budget: int | None) -> int | None:
    if budget is None:
        return tile_rows if tile_rows is not None and tile_rows < shape[3] else None
    return planner.largest_tile(shape, frames_per_pass, stream, budget)


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
    if n >= 2**30:
        return f"{n / 2**30:.3f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} bytes"


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages created while active that are still alive; `peak` is their maximum, sampled
    after every op (tensors that existed before entering are not counted). `device`: count only the storages there."""

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__()
        self.device = device
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # A view (or in-place result) shares an argument's storage: one not yet counted existed before (a weight).
        inputs = {t.untyped_storage()._cdata for t in _tensors([*args, *(kwargs or {}).values()])}
        new = [t.untyped_storage() for t in _tensors(out)
               if t.untyped_storage()._cdata not in self.live and t.untyped_storage()._cdata not in inputs
               and (self.device is None or t.device == self.device)]
        if new:  # frees only matter for the peak at the next allocation
            self._sweep()
            for storage in new:
                if storage._cdata not in self.live:
                    self.live[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
                    self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        return out

    def bytes_alive(self) -> int:
        """The counted storages' bytes alive now, frees since the last op included."""
        self._sweep()
        return self.current

    def _sweep(self) -> None:
        for key, (ref, nbytes) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
                self.current -= nbytes


def _tensors(value):
    if isinstance(value, torch.Tensor):
        if not value.is_mkldnn:  # an opaque tensor (a prepacked weight, `ops.prepack`) has no storage to count
            yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def dry_ops(device: torch.device, compute: torch.dtype | None = None) -> Ops:
    """An op table that computes nothing and holds, while each op runs, the temporaries the portable op (`ops.py`)
    materialises on `device`, which computes in `ops.compute_dtype(device)`. The convs and the attention: a copy in
    the compute dtype of each operand held in another (bf16 weights where the table takes them as prepared), the
    input with its zero rows where a bf16 conv is tiny (`ops.tiny_call_rows`), and the result in the compute dtype; a
    CPU computing in fp32 holds one row block's input and output instead of the result (`ops._fp32_row_blocks`);
    views and the destination cost nothing. The norm, the DupUp shortcut and the unpatchify compute the same on every
    device: the portable ops themselves run (on meta tensors: shapes only)."""
    compute = compute or ops.compute_dtype(device)
    size = compute.itemsize

    def casts(*operands: torch.Tensor) -> int:
        return sum(t.numel() * size for t in operands if t.dtype != compute)

    def computing(x: torch.Tensor) -> Ops | None:
        """Another table for activations that compute in another dtype (`ops.activation_compute_dtype`: the
        encoder's fp32 ones compute in fp32 on every device)."""
        return dry_ops(device, torch.float32) if x.dtype == torch.float32 and compute != torch.float32 else None

    def hold(nbytes: int) -> None:
        scratch = torch.empty(nbytes, dtype=torch.uint8, device="meta")
        del scratch

    def conv_held(x, out_spatial, kernel, stride, co, channels_last: bool, into_fp32: bool) -> tuple[int, int]:
        """(what a conv holds besides its weights' casts, its destination and its result; its result) (`ops._conv`).
        On a CPU computing in fp32, one row block's input (channels last: of every frame a 3-D conv reads) and its
        result block, unless oneDNN adds the results into the fp32 destination (`into_fp32`:
        `ops.fp32_writes_into_out`; then a spare block where the frame's rows are no whole number of blocks), and no
        whole result; elsewhere x's cast, the padded copy of a tiny bf16 call, and the result with its padded rows."""
        if compute == torch.float32 and device.type == "cpu" and torch.backends.mkldnn.is_available():
            block = ops.fp32_call_rows(out_spatial[-1])
            kt = kernel[0] if len(kernel) == 3 else 1  # a 2-D conv reads one frame
            frames_in = (out_spatial[0] - 1) * stride[0] + kt if len(kernel) == 3 and channels_last else kt
            block_in = frames_in * ((block - 1) * stride[-2] + kernel[-2]) * x.shape[-2] * x.shape[-1] * size
            in_place = channels_last and into_fp32 and out_spatial[-2] % block == 0
            return block_in + (0 if in_place else block * out_spatial[-1] * co * size), 0
        result = x.shape[0] * math.prod(out_spatial) * co * size
        rows_in, rows = x.shape[-3], out_spatial[-2]
        extra = ops.tiny_call_rows(out_spatial, device) if compute == torch.bfloat16 else 0
        copy = x.numel() // rows_in * (rows_in + extra * stride[-2]) * x.element_size() if extra else 0
        return copy + casts(x), result * (rows + extra) // rows

    def conv3d_held(x, w, out, stride) -> tuple[int, int]:
        return conv_held(x, out.shape[1:-1], w.shape[1:-1], stride, out.shape[-1],
                         not ops.computes_channels_first(w), out.dtype == torch.float32 and ops.fp32_writes_into_out(w))

    def conv3d(x, w, b, out, residual=None):
        if computing(x) is not None:
            return computing(x).conv3d(x, w, b, out, residual)
        held, result = conv3d_held(x, w, out, (1, 1, 1))
        hold(held + casts(w, b) + result)
        if residual is not None and compute != torch.float32:  # the inputs' copies are gone when it is added
            hold(result + out.numel() * size)

    def upsample2x_conv3x3(x, w_sub, b, out):
        m, hi, width, _ = x.shape
        phases = 4 * w_sub.shape[2]  # the four phases' outputs over the padded low-resolution grid, and their bias
        grid = m * (hi - 1) * (width + 1) * phases * size  # where the conv writes them (in the compute dtype)
        held, result = conv_held(x, (hi - 1, width + 1), (2, 2), (1, 1), phases, True,
                                 ops.fp32_writes_into_out(w_sub))
        hold(held + result + grid + casts(w_sub) + phases * (b.element_size() + (size if compute != b.dtype else 0)))

    def attention(q, kv, out):
        # On a CPU the queries in whole blocks (`ops.attention`: a padded copy, and its result); plus the score matrix
        # a math-path softmax attention may materialise (frames x queries x L).
        if computing(q) is not None:
            return computing(q).attention(q, kv, out)
        frames, queries, channels = q.shape
        if device.type == "cpu":
            held = casts(kv) + 2 * frames * ops.attention_queries(queries, device) * channels * size
        else:
            held = casts(q, kv) + out.numel() * size
        hold(held + frames * queries * kv.shape[1] * size)

    def conv3d_strided(x, w, b, out, stride):  # what the conv holds is its input's cast and its result
        if computing(x) is not None:
            return computing(x).conv3d_strided(x, w, b, out, stride)
        hold(sum(conv3d_held(x, w, out, stride)) + casts(w, b))

    return Ops("dry", conv3d, ops.rms_norm_silu, upsample2x_conv3x3, attention, ops.dup_up_add, ops.unpatchify_clamp,
               conv3d_strided=conv3d_strided)


class MemoryPlanner:
    """A decode's peak working memory, measured by replaying its buffers on the meta device, and the tile that keeps
    it within a budget."""

    def __init__(self, weights: dict[str, torch.Tensor], config, device: torch.device,
                 winograd: WinogradConv3d | None = None) -> None:
        self.config, self.device = config, device
        self.winograd = winograd  # the decoder's Winograd conv (`winograd.winograd_conv`), None where convs are direct
        # Read once from the weights as prepared: a decode holds these bytes whether or not the weights are on the
        # device between decodes (they are prepared again, the same shapes, before one: `weights.PreparedWeights`).
        self._meta_weights = {k: v.to("meta") for k, v in weights.items()}
        # The weights' bytes; a conv weight the convs also hold in oneDNN's blocking is held twice (`ops.held_twice`).
        self.weight_bytes = sum(w.numel() * w.element_size() * (2 if ops.held_twice(w) else 1)
                                for w in weights.values())
        self._peaks: dict[tuple, int] = {}
        self._plans: dict[tuple, int | None] = {}

    what = "decode latents"  # what a plan is for, in messages

    def output_bytes(self, latents_shape) -> int:
        """What a decode returns: the bf16 video."""
        return 2 * math.prod(video_shape(self.config, latents_shape))

    def peak_bytes(self, latents_shape, frames_per_pass: int, tile_rows: int | None = None,
                   stream: bool = False) -> int:
        """Peak working memory (bytes) of decoding one sample of latents of `latents_shape` ([B, C, T, h, w]) with
        `tile_rows` (None: untiled) at `frames_per_pass`, by `decode` (stream=False) or `decode_iter` (stream=True;
        tiles then advance together, so every tile's causal history is alive at once). Excludes weights, latents and
        the returned video (for `decode_iter`, the chunk being yielded is included). Batch elements are decoded one
        after another, so the batch size does not change it. Remembered per shape and setting."""
        key = (*latents_shape[2:], frames_per_pass, tile_rows, stream)
        if key not in self._peaks:
            self._peaks[key] = self._replay(latents_shape, frames_per_pass, tile_rows, stream)
        return self._peaks[key]

    def _replay(self, latents_shape, frames_per_pass: int, tile_rows: int | None, stream: bool) -> int:
        _, _, t, height, width = latents_shape
        dry, p, s = dry_ops(self.device), self.config.patch_size, self.config.spatial_scale
        if self.winograd is not None:
            # The portable Winograd conv itself runs on the meta tensors: its transforms' buffers are counted as a
            # CPU holds them (a compiled kernel holds no more), and so are the transformed weights, made afresh as
            # a new decoder makes them at its first decode (later decodes reuse them).
            dry = dataclasses.replace(dry, conv3d=WinogradConv3d(dry.conv3d, self.winograd.tile,
                                                                 self.winograd.keep_direct))
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
        untiled = tiles == [None]
        # decode_tiles writes into the returned video (made before the replay's count starts: not counted).
        most = max(len(pass_video_frames(t0, t1)) for t0, t1 in passes)
        video = torch.empty((1, 3, most, s * height, s * width), dtype=torch.bfloat16, device=meta)
        with LiveBytes() as tracker:
            states = [CausalState(meta) for _ in tiles]
            for t0, t1 in passes:
                frames = len(pass_video_frames(t0, t1))
                # The pass's chunk of video: streamed tiles decode into it (`iter_tiles`), an untiled pass fills it
                # after the network (`iter_bands`).
                chunk = torch.empty((1, 3, frames, s * height, s * width), dtype=torch.bfloat16, device=meta) \
                    if stream and not untiled else None
                for tile, state in zip(tiles, states):
                    spec = None if untiled else Tile(*tile, height, self.config)
                    out = DecodePass(dry, self._meta_weights, self.config, LocalRows(height), state, t0 == 0,
                                      spec).run(z[:, t0:t1])
                    if untiled:
                        chunk = dest = torch.empty((1, 3, frames, s * height, s * width), dtype=torch.bfloat16,
                                                   device=meta)
                    else:
                        dest = (chunk if stream else video[:, :, :frames])[..., s * tile[0]:s * tile[1], :]
                    dry.unpatchify_clamp(out, dest, p)
                    del out, dest
                del chunk
            del states
        return tracker.peak

    def most_frames_per_pass(self, latents_shape, tile_rows: int | None, stream: bool, budget: int) -> int | None:
        """The largest of `FRAMES_PER_PASS_CHOICES` whose peak (with `tile_rows`) fits `budget` bytes, None when
        none does. A clip of T latent frames never needs more than T - 1 per pass (the first frame goes alone)."""
        most = max(latents_shape[2] - 1, 1)
        for fpp in FRAMES_PER_PASS_CHOICES:
            if fpp <= most and self.fits(latents_shape, fpp, tile_rows, stream, budget):
                return fpp
        return None

    def largest_tile(self, latents_shape, frames_per_pass: int, stream: bool, budget: int) -> int | None:
        """The largest tile (latent rows) whose peak fits `budget` bytes (None: the untiled decode fits); ValueError
        when even one-row tiles do not fit. Remembered per latent shape."""
        key = (*latents_shape[2:], frames_per_pass, stream, budget)
        if key not in self._plans:
            self._plans[key] = self._largest_tile(tuple(latents_shape), frames_per_pass, stream, budget)
        return self._plans[key]

    def fits(self, latents_shape, frames_per_pass: int, tile_rows: int | None, stream: bool, budget: int) -> bool:
        """Whether the planned peak (x PEAK_HEADROOM) of this decode setting fits `budget` bytes."""
        return self.peak_bytes(latents_shape, frames_per_pass, tile_rows, stream) * PEAK_HEADROOM <= budget

    def retry_plan(self, latents_shape, frames_per_pass: int, tile_rows: int | None, stream: bool,
                   may_tile: bool) -> Plan | None:
        """The plan a decode that ran out of memory at (`frames_per_pass`, `tile_rows`) retries at: among the smaller
        plans (fewer frames per pass at the same tiles; then, at 1 frame per pass and where `may_tile`, smaller
        exact tiles, largest first), the first whose peak is at most RETRY_PEAK_FRACTION of the failed plan's; else
        the smaller plan with the least peak, if that is below the failed plan's; None when no smaller plan is
        left."""
        shape = latents_shape
        failed = self.peak_bytes(shape, frames_per_pass, tile_rows, stream)
        budget = failed * RETRY_PEAK_FRACTION
        most = min(frames_per_pass, max(shape[2] - 1, 1))  # more than T - 1 per pass runs as T - 1
        fewer = [Plan(fpp, tile_rows) for fpp in FRAMES_PER_PASS_CHOICES if fpp < most]
        for plan in fewer:
            if self.peak_bytes(shape, *plan, stream) <= budget:
                return plan
        height = shape[3] if tile_rows is None else tile_rows
        tiles = [] if not may_tile or height < 2 else self._smaller_tiles(shape, height, stream, budget)
        candidates = fewer + [Plan(1, rows) for rows in tiles]
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
        `_largest_streamed_tile`): the largest tile of 2, 3, 4, 6 and 8 tiles (a handful of replays: a streamed
        replay of a large frame is slow)."""
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

    def _largest_tile(self, shape, fpp: int, stream: bool, budget: int) -> int | None:
        height = shape[3]
        if self.fits(shape, fpp, None, stream, budget):
            return None
        if stream:
            return self._largest_streamed_tile(shape, fpp, budget)
        smallest = int(self.peak_bytes(shape, fpp, 1) * PEAK_HEADROOM)
        if smallest > budget:
            raise _too_small(budget, shape, smallest, "even in one-row tiles", self.what)
        lo, hi = 1, height - 1  # the largest tile that fits (tile by tile, peak grows with the tile)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.fits(shape, fpp, mid, False, budget):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _largest_streamed_tile(self, shape, fpp: int, budget: int) -> int:
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
        raise _too_small(budget, shape, min(peaks), "streamed (decode_iter) in any tile size", self.what)


class EncoderPlanner(MemoryPlanner):
    """The encoder's planner: the same plans and rules, in latent frames and rows (a shape is the moments'
    [B, 2 z_dim, T, h, w]), its replay the encoder's passes (`passes.EncodeRunner` on the meta device, `dtype`
    activations; with `reuse_steady`, each stage holding its last input and output as a settled one does). The
    encoder has no streamed form."""

    def __init__(self, weights: dict[str, torch.Tensor], config, device: torch.device, dtype: torch.dtype,
                 remainder: tuple[int, int] = (0, 0), reuse_steady: bool = False) -> None:
        super().__init__(weights, config, device)
        if dtype == torch.float32:  # the first pass's causal convs hold their last tap blocked too (`causal_conv`)
            self.weight_bytes += sum(w.numel() // w.shape[1] * w.element_size() for w in weights.values()
                                     if w.dim() == 5 and w.shape[1] > 1 and w.shape[2] == 3 and ops.held_twice(w))
        self.dtype, self.reuse_steady = dtype, reuse_steady
        self.remainder = remainder  # the video's rows and columns past whole latent pixels (Wan2.1: H = 8h + r)

    what = "encode a video into moments"

    def output_bytes(self, latents_shape) -> int:
        return math.prod(latents_shape) * 4  # the moments, in the VAE's dtype (fp32 at most)

    def _replay(self, latents_shape, frames_per_pass: int, tile_rows: int | None, stream: bool) -> int:
        _, moments, t, height, width = latents_shape
        s = self.config.spatial_scale
        # The first frame, a pass whose history is that frame, then one with the full history: later passes repeat it.
        short = latent_passes(t, frames_per_pass)[:3][-1][1]
        meta = torch.device("meta")
        video = torch.empty((1, 3, 4 * short - 3, s * height + self.remainder[0], s * width + self.remainder[1]),
                            device=meta)
        runner = EncodeRunner(dry_ops(self.device), self._meta_weights, self.config, meta, self.dtype,
                              frames_per_pass, reuse_steady=self.reuse_steady, progress=False)
        with LiveBytes() as tracker:
            out, _ = runner.encode(video, (1, moments, short, height, width), tile_rows)
            del out
        # The clip-long buffers (the moments; tiled, the last level's input too) hold every latent frame, not `short`.
        tiled = tile_rows is not None and tile_rows < height
        per_frame = height * width * (moments + (self.config.dims[-2] if tiled else 0)) * self.dtype.itemsize
        return tracker.peak + (t - short) * per_frame


def _too_small(budget: int, shape, needed: int, how: str, what: str = "decode latents") -> ValueError:
    return ValueError(f"max_memory {format_bytes(budget)} ({budget} bytes) is too small to {what} "
                      f"{list(shape)} {how}: that needs at least {format_bytes(needed)} ({needed} bytes)")
