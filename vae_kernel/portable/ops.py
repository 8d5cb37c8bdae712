"""The decoder's op table: the seam where compiled kernels replace the portable PyTorch ops.

`WanVAEDecoder` runs every hot step of the Wan2.2 decoder as one call into an `Ops` table. Each op works on
channels-last (NDHWC / NHWC) bf16 activations and writes into a destination tensor the decoder owns (destination
passing), so a compiled kernel can replace any single op without touching the rest. `TORCH_OPS` is the portable
table (CPU and any CUDA GPU); a compiled backend builds its table with `dataclasses.replace(TORCH_OPS, conv3d=...)`
and `loader.load_ops(device)` returns it (`backends.select_ops` chooses between the two).

Layout rules every op may rely on (and every replacement must honour):
- Activations are bf16, channels last. The last three dims of every activation (rows, width, channels) form one
  packed slab: stride(-1) == 1, stride(-2) == C, stride(-3) == W * C. The dims in front of them (batch, frames) may
  have any strides: the decoder writes a norm's output straight into the interior rows of a haloed window
  (`window[:, 2:, 1:-1]`), whose frames are `(rows + 2) * W * C` apart. Inputs `x` of conv3d and
  upsample2x_conv3x3 are fully contiguous.
- Rows are *valid* (the caller supplies the halo rows: zeros at the image edge, a neighbour's rows inside a band),
  time is *valid* (the caller puts the causal history frames in front), width is *same* (zero padding inside the op).
  That is what makes ranks, bands and tiles one mechanism: an op never knows whether its rows are the whole frame.
- Weights come prepared once by `weights.prepare` (layouts documented there): conv weights bf16 [Co, kt, kh, kw, Ci],
  biases fp32 [Co], RMS-norm gammas fp32 [C] already multiplied by sqrt(C), sub-pixel upsample weights bf16
  [2, 2, Co, 2, 2, Ci]. On a CPU that computes in fp32 (`compute_dtype`) `weights.load` holds them as fp32 of the
  same values (converted once), the wide 3x3 convs channels first (`weights.to_compute_layout`); on one computing in
  bf16 it prepacks them for oneDNN (`prepack`); the portable ops take every form.
- Accumulation and statistics are fp32; each op rounds to bf16 once, when it stores (a conv computing in bf16 that
  adds a residual: twice, its result then the sum).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import itertools
import logging
import math
import os
import re
from types import MappingProxyType
from typing import Callable, Mapping

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakTensorKeyDictionary

from ..errors import first_line

logger = logging.getLogger(__name__)

RMS_EPS = 1e-12  # F.normalize's eps, as Wan's RMS_norm uses it
_NORM_CHUNK = 1 << 25  # elements per fp32 temporary of the portable RMS norm (128 MiB)
_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}
_CHANNELS_SECOND = (0, 4, 1, 2, 3)  # [N, T, H, W, C] (the ops' activations) -> the conv's [N, C, T, H, W] view


# ONEDNN_MAX_CPU_ISA values that cap oneDNN below its AMX kernels, in lower case, aliases included (oneDNN's dispatcher
# control: it lower-cases the value; "all", "default", the AMX levels and values it does not know set no cap).
_ISA_CAPS_WITHOUT_AMX = frozenset({
    "sse41", "avx", "avx2", "avx2_vnni", "avx2_vnni_2", "avx512_core", "avx512_core_vnni", "avx512_core_bf16",
    "avx10_1_512", "avx512_core_fp16", "avx10_2", "avx10_2_512"})


def _onednn_isa_cap() -> str:
    """The ISA cap oneDNN reads once per process, at its first use: ONEDNN_MAX_CPU_ISA, else the older
    DNNL_MAX_CPU_ISA (an empty value counts as unset), in lower case; "" where neither is set."""
    return (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").lower()


@functools.cache
def cpu_has_amx_bf16() -> bool:
    """Whether oneDNN runs this CPU's bf16 convs on AMX tiles: the CPU has AMX-BF16 (Intel Xeon 4th generation,
    Sapphire Rapids, and later) and ONEDNN_MAX_CPU_ISA, where set, does not cap oneDNN below AMX (capped, oneDNN runs
    them on the kernels of a CPU without AMX, so the decoder computes in fp32 as on such a CPU). Tests that need the
    other kind of CPU replace this probe."""
    if not torch.backends.mkldnn.is_available() or not torch.cpu.get_capabilities().get("amx_bf16", False):
        return False
    granted = getattr(torch.cpu, "_is_amx_tile_supported", None)  # and the kernel lets this process use its tiles
    if granted is not None and not granted():
        return False
    return _onednn_isa_cap() not in _ISA_CAPS_WITHOUT_AMX


def compute_dtype(device: torch.device) -> torch.dtype:
    """The dtype the convs and attention compute in (products of bf16 values, fp32 accumulation, one rounding on
    store either way): bf16 on a GPU and on a CPU with AMX-BF16, where oneDNN's bf16 conv is 2-9x faster than its fp32
    one at each conv shape of the real decoder (bench/results/cpu-real-width-amx-2026-12-01.json); fp32 on other
    CPUs, whose bf16 convs get no AMX kernel (and without AVX-512 torch has no oneDNN bf16 conv at all)."""
    return torch.bfloat16 if device.type != "cpu" or cpu_has_amx_bf16() else torch.float32


# How torch's CPU allocator reports running out of memory: a RuntimeError, not torch.OutOfMemoryError (c10's
# alloc_cpu: "can't allocate memory" where posix_memalign fails, "not enough memory" on Windows and Android).
_CPU_ALLOCATOR_OUT_OF_MEMORY = re.compile(
    r"DefaultCPUAllocator: (?:can't allocate memory|not enough memory): you tried to allocate \d+ bytes")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocator running out of memory: torch.OutOfMemoryError (a GPU's, and torch's own
    subclasses), or the RuntimeError torch's CPU allocator raises. Any other error is not."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and _CPU_ALLOCATOR_OUT_OF_MEMORY.search(str(error)) is not None)


def _is_channels_first(w: torch.Tensor) -> bool:
    """w [Co, Ci, k...] laid out channels first: its input channels outside its kernel's columns (a 1x1 kernel's
    weight is both layouts at once: channels last). Told by strides, not density, so that a view of one tap of a
    prepared weight (`encoder_network.EncodePass.causal_conv_call`) keeps its weight's layout."""
    return w.stride(1) > w.stride(-1)


def computes_channels_first(w: torch.Tensor) -> bool:
    """Whether the CPU conv3d runs with prepared weights w [Co, kt, kh, kw, Ci] channels first (`_conv`)."""
    return _is_channels_first(w.permute(0, 4, 1, 2, 3))


def _as(t: torch.Tensor, dtype: torch.dtype, layout: torch.memory_format) -> torch.Tensor:
    """t in `dtype` and `layout`: t itself where it is both (a weight prepared so), else one copy. (`Tensor.to` with a
    memory format copies a 1x1 kernel's weight, which is both layouts at once, on every call.)"""
    return t.to(dtype) if t.is_contiguous(memory_format=layout) else t.to(dtype, memory_format=layout)


# oneDNN runs a bf16 conv whose output image has at most 4 pixels on AVX512-BF16 instead of AMX (measured), and the two
# sum in different orders: rows computed in such a call (a one-row band of a narrow frame) would differ from the same
# rows computed in a bigger call. So a CPU bf16 conv is never called on fewer output pixels per image than this.
MIN_BF16_CPU_PIXELS = 64

# oneDNN's fp32 convs choose their blocking from a call's extents (frames, rows and pixels per call), and the blockings
# sum in different orders: a 128-channel 3x3x3 conv over 24 x 16 pixels gave other sums for one frame of 4 rows than
# for 8 frames of 24 rows (measured on AMD EPYC), so tiles, passes and bands of a decode differed by a bf16 step. So a
# CPU computing in fp32 runs every conv as calls of one image (one frame of one sample) and exactly `fp32_call_rows`
# output rows, the last block of a band filled up with zero rows: every output row of a layer comes from a call of the
# same extents whatever the band, tile or pass (its place in the call does not change its sums: measured). About this
# many output pixels per call (fewer, bigger calls run faster; a block is never longer than the frame). The decoder's:
# on a narrow frame a bigger block spans the frame, and its tiles would no longer lower its peak
# (tests/vae_kernel/test_decoder_memory.py).
FP32_CPU_CALL_PIXELS = 512
# The encoder's (`passes.EncodeRunner`): its fp32 convs are most of a CPU encode, and bigger calls copy fewer halo
# rows and run faster; its peak is held by the wide first levels, where a block is a few rows whatever this size.
FP32_CPU_ENCODE_CALL_PIXELS = 2048
# Set around a pass by whoever runs it (`frame_shape`): the frame's (rows, cols) at the latent scale (a layer's row
# block is at most the frame's rows at that layer, so that a short frame is not padded to a long block) and the output
# pixels per call.
_FRAME_SHAPE: contextvars.ContextVar[tuple[int, int, int] | None] = contextvars.ContextVar("pan2_frame_shape",
                                                                                           default=None)


@contextlib.contextmanager
def frame_shape(rows: int, cols: int, call_pixels: int | None = None):
    """Inside: the convs run over a frame of this shape (`rows` x `cols` at some scale: only the ratio counts), which
    sizes their fp32 CPU row blocks (`fp32_call_rows`), for about `call_pixels` output pixels per call (default
    FP32_CPU_CALL_PIXELS). Every pass of one decode or encode must say the same."""
    token = _FRAME_SHAPE.set((rows, cols, call_pixels or FP32_CPU_CALL_PIXELS))
    try:
        yield
    finally:
        _FRAME_SHAPE.reset(token)


def fp32_call_rows(cols: int) -> int:
    """The output rows of each call of an fp32 CPU conv whose output is `cols` pixels wide: enough for the call's
    pixels (`frame_shape`'s, else FP32_CPU_CALL_PIXELS), at least 1; inside `frame_shape`, the frame's rows at this
    width split into that many blocks of equal rows (the last one filled up), so that a frame is not padded to a
    longer block."""
    frame = _FRAME_SHAPE.get()
    rows = -(-(FP32_CPU_CALL_PIXELS if frame is None else frame[2]) // cols)
    if frame is not None:
        frame_rows = -(-frame[0] * cols // frame[1])
        rows = -(-frame_rows // -(-frame_rows // rows))
    return max(rows, 1)


def tiny_call_rows(out_spatial, device: torch.device) -> int:
    """The output rows of zero input that `_conv` adds below a conv on `device` whose output image has extents
    `out_spatial` ([frames,] rows, cols; it appends that many input rows times the conv's row stride): on a CPU
    computing in bf16, as many as give the call MIN_BF16_CPU_PIXELS output pixels per image (their outputs are
    dropped); else, and for any call as big as that, 0."""
    if device.type != "cpu" or compute_dtype(device) != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return 0
    rows = out_spatial[-2]
    per_row = math.prod(out_spatial) // rows
    return max(0, -(-MIN_BF16_CPU_PIXELS // per_row) - rows)


# A prepared CPU conv weight -> (its version, oneDNN's blocked copy of it: `prepack`), so that its conv does not reorder
# the weight on every call (bench/onednn_calls.py measures both). An entry lives as its weight does. What keeps it
# sound is that a prepared weight is never written after it is made (a changed VAE weight is prepared into a new
# tensor: `weights.PreparedWeights`); the version only catches an in-place op on the weight itself, not a write through
# `.data` (which bypasses the counter), nor anything on an inference tensor (which has none).
_PACKED = WeakTensorKeyDictionary()
# torch's private oneDNN ops behind the prepacked convs carry no API promise: the first of them missing or refusing its
# arguments turns them off for the process, with one warning, and the convs run from the prepared weights through
# torch.mkldnn_convolution (reordering the weight on every call, as without `prepack`).
_private_onednn_usable = True


def _private_onednn(name: str, *args) -> torch.Tensor | None:
    """torch.ops.mkldnn.<name>(*args), or None where that op is missing or refuses the arguments (or an earlier one
    did). An allocator out of memory is raised as it is: the decode retries it."""
    global _private_onednn_usable
    if not _private_onednn_usable:
        return None
    try:
        return getattr(torch.ops.mkldnn, name)(*args)
    except Exception as exc:  # whatever a changed private op raises
        if is_out_of_memory(exc):
            raise
        _private_onednn_usable = False
        _PACKED.clear()
        reason = first_line(exc, with_type=True)
        logger.warning("torch %s: torch.ops.mkldnn.%s is missing or refuses its arguments (%s); the CPU convs run "
                       "through torch.mkldnn_convolution from now on, reordering their weights on every call",
                       torch.__version__, name, reason)
        return None


def _conv3d_weight(w: torch.Tensor) -> torch.Tensor:
    """A prepared conv3d weight [Co, kt, kh, kw, Ci] as the conv's [Co, Ci, kt, kh, kw] view."""
    return w.permute(0, 4, 1, 2, 3)


def _subpixel_weight(w_sub: torch.Tensor) -> torch.Tensor:
    """The sub-pixel weights [2, 2, Co, 2, 2, Ci] as one 2x2 conv's [4 Co, Ci, 2, 2] view (see upsample2x_conv3x3)."""
    return w_sub.reshape(4 * w_sub.shape[2], 2, 2, -1).permute(0, 3, 1, 2)


def _padding(w: torch.Tensor) -> list[int]:
    return [0, 1] if w.dim() == 6 else [0, 0, w.shape[3] // 2]


def prepack(w: torch.Tensor) -> None:
    """On a CPU computing in bf16, keep oneDNN's blocked copy of a prepared conv weight (conv3d's or the upsample's:
    `weights.load` calls this) for the convs to use instead of reordering it on every call (oneDNN's own log of a
    real-width decode: 78 reorders before, 11 after, the same video bit for bit; docs/benchmarks.md). The blocking
    is chosen for a nominal input; where a call's primitive wants another, oneDNN reorders as before. `w` must not be
    written afterwards (the decoder's prepared weights never are): the copy serves it as long as it lives (an in-place
    op on `w` itself drops it; a write through `w.data` cannot be seen). An inference tensor, which has no version
    counter, is not prepacked."""
    view = _subpixel_weight(w) if w.dim() == 6 else _conv3d_weight(w)
    if (w.device.type != "cpu" or not torch.backends.mkldnn.is_available()
            or view.dtype != torch.bfloat16 or compute_dtype(w.device) != torch.bfloat16 or w.is_inference()):
        return  # measured on bf16 only (an fp32 conv from packed weights runs another kernel: other sums)
    padding = _padding(w)
    ones = [1] * len(padding)
    nominal = [1, view.shape[1], *(k + 15 for k in view.shape[2:])]
    packed = _private_onednn("_reorder_convolution_weight", view, padding, ones, ones, 1, nominal)
    if packed is not None:
        _PACKED[w] = (w._version, packed)


def _packed(w: torch.Tensor) -> torch.Tensor | None:
    entry = _PACKED.get(w)
    return entry[1] if entry is not None and entry[0] == w._version else None


def prepacked(w: torch.Tensor) -> bool:
    """Whether the convs use a blocked copy of the prepared conv weight w (`prepack`)."""
    return _packed(w) is not None


def held_twice(w: torch.Tensor) -> bool:
    """Whether the convs hold oneDNN's blocked copy of the prepared weight w beside it: a prepacked bf16 conv weight
    (`prepack`), or a conv weight a CPU computes with in fp32 (`_fp32_packed`, made at its first call)."""
    fp32_conv = w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() >= 5
    return prepacked(w) or (fp32_conv and torch.backends.mkldnn.is_available() and _private_onednn_usable)


def activation_compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """The dtype an op computes in for activations like `x`: fp32 activations (the encoder's fp32 precision) in fp32,
    bf16 ones in `compute_dtype` of their device."""
    return torch.float32 if x.dtype == torch.float32 else compute_dtype(x.device)


def _conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, padding: list[int], out: torch.Tensor,
          residual: torch.Tensor | None = None, packed: torch.Tensor | None = None,
          stride: list[int] | None = None) -> None:
    """out = conv(x, w) + b (+ residual): a conv (stride 1 unless `stride`; rows valid) of views x [N, C, ...],
    w [Co, C, ...] (as the ops pass them: channels last) into the view `out` [N, Co, ...] (any layout; `residual` as
    out), computing in `activation_compute_dtype(x)` and rounding to out's dtype once (a conv computing in bf16 that
    adds a residual: twice, its result then the sum). On CPU it computes in the weight's layout: channels first where
    `weights.to_compute_layout` laid w out so (its strides carry the per-shape choice), else channels last; on a GPU
    channels last.

    On CPU this calls oneDNN directly: torch's heuristics send small-batch 3-D convs to its slow im2col path even
    with oneDNN present (measured 2-20x slower here, and it returns channels-first output). There `packed`, w's
    prepacked copy (`prepack`), replaces w (while torch's private oneDNN op serves: `_private_onednn`); a bf16 call
    too small for AMX is padded (`tiny_call_rows`); an fp32 conv runs in calls of one image and a fixed number of
    rows (`fp32_call_rows`), each written into `out` as it is done.
    """
    dtype = activation_compute_dtype(x)
    stride = stride or [1] * len(padding)
    if x.device.type == "cpu" and torch.backends.mkldnn.is_available():
        layout = torch.contiguous_format if _is_channels_first(w) else _CHANNELS_LAST[x.dim()]
        if dtype == torch.float32:
            _fp32_row_blocks(x, _as(w, dtype, layout), b.to(dtype), padding, stride, layout, out, residual)
            return
        out_spatial = out.shape[2:]
        rows = out_spatial[-2]
        extra = tiny_call_rows(out_spatial, x.device) if dtype == torch.bfloat16 else 0
        padded = None
        if extra:  # a channels-last copy of x with zero rows below, for `extra` more output rows
            added = extra * stride[-2]
            padded = x.new_zeros((x.shape[0], *x.shape[2:-2], x.shape[-2] + added, x.shape[-1], x.shape[1]))
            padded.movedim(-1, 1)[..., :-added, :].copy_(x)
            x = padded.movedim(-1, 1)
        x, ones = _as(x, dtype, layout), [1] * len(padding)
        y = None if packed is None else \
            _private_onednn("_convolution_pointwise", x, packed, b.to(dtype), padding, ones, ones, 1, "none", [], "")
        if y is None:
            y = torch.mkldnn_convolution(x, _as(w, dtype, layout), b.to(dtype), padding, stride, ones, 1)
        y = y[..., :rows, :] if extra else y
        del x, padded  # the input's copies are gone when the residual is added
    else:
        conv = F.conv3d if x.dim() == 5 else F.conv2d
        y = conv(x.to(dtype), w.to(dtype), b.to(dtype), padding=padding, stride=stride)
    if residual is not None:
        y = y.add_(residual) if y.dtype == torch.float32 else y + residual
    out.copy_(y)


# A prepared fp32 CPU conv weight -> (its version, {the calls' shapes: oneDNN's copy of it blocked for such a call}):
# every call of a layer has one shape (`_fp32_row_blocks`), so oneDNN reorders the weight once, not on every call. As
# with `prepack`, the prepared weight is never written after it is made; every call of a layer runs from the same
# copy, so its sums stay the same.
_FP32_PACKED = WeakTensorKeyDictionary()


def _fp32_packed(w: torch.Tensor, input_size: list[int], padding: list[int],
                 stride: list[int]) -> torch.Tensor | None:
    """oneDNN's blocked copy of the fp32 conv weight w (a view of a prepared weight, as the ops pass it) for calls
    on inputs of `input_size`, made at the first such call; None where the private op does not serve."""
    base = w if w._base is None else w._base
    if base.is_inference():
        return None
    key = (tuple(w.shape), tuple(w.stride()), w.storage_offset(), tuple(input_size), tuple(padding), tuple(stride))
    version, copies = _FP32_PACKED.get(base, (None, {}))
    if version != base._version:
        copies = {}
    if key not in copies:
        packed = _private_onednn("_reorder_convolution_weight", w, padding, stride, [1] * len(padding), 1, input_size)
        if packed is None:
            return None
        copies[key] = packed
    _FP32_PACKED[base] = (base._version, copies)
    return copies[key]


def _strides(sizes: list[int], layout: torch.memory_format) -> list[int]:
    """The strides of a tensor of `sizes` [N, C, ...] in `layout` (contiguous, or channels last)."""
    order = list(range(len(sizes)))[::-1] if layout == torch.contiguous_format else \
        [1, *range(len(sizes) - 1, 1, -1), 0]  # the innermost dim first
    strides, step = [0] * len(sizes), 1
    for dim in order:
        strides[dim], step = step, step * sizes[dim]
    return strides


def fp32_writes_into_out(w: torch.Tensor) -> bool:
    """Whether an fp32 CPU conv with the prepared weight w has oneDNN add its results into an fp32 channels-last
    destination (`_fp32_row_blocks`): while torch's private oneDNN ops serve, for a weight made outside inference
    mode (`_fp32_packed`)."""
    base = w if w._base is None else w._base
    return _private_onednn_usable and not base.is_inference()


def _fp32_row_blocks(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, padding: list[int], stride: list[int],
                     layout: torch.memory_format, out: torch.Tensor, residual: torch.Tensor | None) -> None:
    """`_conv` on a CPU computing in fp32: one oneDNN call per image and block of `fp32_call_rows` output rows, from
    a copy of its input rows in fp32 (zero rows past the input's last), each block's result (+ residual) written into
    out [N, Co, *out_spatial] as it is done. Channels last, one copy of a block's input rows serves every frame (a
    3-D conv's call reads kt consecutive frames of it, a contiguous view), and an fp32 out takes each result where it
    belongs: oneDNN adds it to the block of out, which holds zeros or the residual (`_fp32_block_into`); channels
    first, each call copies its own input and result."""
    assert padding[-2] == 0 and (x.dim() == 4 or padding[0] == 0), "row blocks take valid rows and frames"
    out_spatial = list(out.shape[2:])
    rows, block = out_spatial[-2], fp32_call_rows(out_spatial[-1])
    kt, st = (w.shape[2], stride[0]) if x.dim() == 5 else (1, 1)
    frames = out_spatial[0] if x.dim() == 5 else 1
    held = (block - 1) * stride[-2] + w.shape[-2]  # the input rows of one block
    call = [1, x.shape[1], *([kt] if x.dim() == 5 else []), held, x.shape[-1]]  # every call's input
    channels_last = layout == _CHANNELS_LAST[x.dim()]
    shared = x.dim() == 5 and channels_last
    # Channels last, a block's input rows of every frame the convs read; else one call's.
    span = (frames - 1) * st + kt if shared else kt
    part = torch.empty(call[:2] + ([span] if x.dim() == 5 else []) + call[-2:], dtype=torch.float32, device=x.device,
                       memory_format=layout)
    call_stride = _strides(call, layout)
    packed = _fp32_packed(w, call, padding, stride)
    # Where oneDNN writes each block's result: out itself (fp32, channels last), a spare block where out's block is
    # short (the frame's last rows); None: a new tensor, copied into out.
    into_out = packed is not None and channels_last and out.dtype == torch.float32  # fp32_writes_into_out
    spare = torch.empty([1, w.shape[0], *([1] if x.dim() == 5 else []), block, out.shape[-1]], dtype=torch.float32,
                        device=x.device, memory_format=layout) if into_out and rows % block else None
    for n in range(x.shape[0]):
        for r in range(0, rows, block):
            done = min(block, rows - r)
            for t in range(frames):
                if t == 0 or not shared:
                    first = 0 if shared else t * st
                    image = x[n:n + 1, :, first:first + span] if x.dim() == 5 else x[n:n + 1]
                    given = image[..., r * stride[-2]:r * stride[-2] + held, :]
                    part[..., :given.shape[-2], :].copy_(given)
                    part[..., given.shape[-2]:, :].zero_()
                source = part[:, :, t * st:t * st + kt] if shared else part
                # Every call's input has one memory descriptor, whatever the frames around it (a size-1 batch's
                # stride is free).
                source = source.as_strided(call, call_stride, source.storage_offset())
                index = (slice(n, n + 1), slice(None), *([slice(t, t + 1)] if x.dim() == 5 else []),
                         slice(r, r + done))
                _fp32_block_into(out[index], None if residual is None else residual[index], source, w, packed, b,
                                 padding, stride, spare if into_out and done < block else None, into_out)


def _fp32_block_into(dest: torch.Tensor, residual: torch.Tensor | None, source: torch.Tensor, w: torch.Tensor,
                     packed: torch.Tensor | None, b: torch.Tensor, padding: list[int], stride: list[int],
                     spare: torch.Tensor | None, into_out: bool) -> None:
    """dest = the conv of one call's input `source` (+ residual), its rows the first of the call's output rows.
    `into_out`: oneDNN adds the result to its target (dest, or `spare` where dest holds fewer rows than the call),
    which holds the residual or zeros: (result + bias) + residual, as added otherwise."""
    ones = [1] * len(padding)
    if into_out:
        target = dest if spare is None else spare
        rows = dest.shape[-2]
        if residual is None:
            target.zero_()
        else:
            target[..., :rows, :].copy_(residual)  # (a spare block's other rows are dropped)
        if _private_onednn("_convolution_pointwise_", target, source, packed, b, padding, stride, ones, 1, "add",
                           None, None, [], None) is not None:
            if spare is not None:
                dest.copy_(spare[..., :rows, :])
            return
    result = None if packed is None else _private_onednn(
        "_convolution_pointwise", source, packed, b, padding, stride, ones, 1, "none", [], "")
    if result is None:
        result = torch.mkldnn_convolution(source, w, b, padding, stride, ones, 1)
    result = result[..., :dest.shape[-2], :]
    if residual is not None:
        result = result.add_(residual)
    dest.copy_(result)


# --------------------------------------------------------------------------------------------------------------------
# The portable ops
# --------------------------------------------------------------------------------------------------------------------


def conv3d(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
           residual: torch.Tensor | None = None) -> None:
    """out = conv(x, w) + b (+ residual).

    x [N, Ti, Hi, W, Ci] bf16 (contiguous); w [Co, kt, kh, kw, Ci] bf16; b [Co] fp32;
    out [N, Ti - kt + 1, Hi - kh + 1, W, Co] bf16; residual: None or the shape of out (bf16).
    Valid in time and rows, zero 'same' padding (kw // 2 each side) in width, stride 1. Covers the causal 3x3x3 convs,
    the (3,1,1) time conv of the temporal upsampler and the 1x1x1 convs (shortcuts, attention projections).
    """
    _conv(x.permute(_CHANNELS_SECOND), _conv3d_weight(w), b, _padding(w), out.permute(_CHANNELS_SECOND),
          None if residual is None else residual.permute(_CHANNELS_SECOND), _packed(w))


def rms_norm_silu(x: torch.Tensor, gamma: torch.Tensor, out: torch.Tensor, silu: bool = True) -> None:
    """out = silu(x / max(||x||_2 over C, 1e-12) * gamma), statistics in fp32, one rounding to bf16.

    x, out [..., C] bf16 of one shape (out may be a strided view, see the module rules), or both fp32 (the encoder's
    fp32 precision: computed in out, no rounding); gamma [C] fp32, already scaled by sqrt(C). silu=False gives the
    plain RMS norm (the mid-block attention's).
    """
    if x.dtype == out.dtype == torch.float32:  # the encoder's fp32: computed in out, no temporary
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min_(RMS_EPS)
        torch.div(x, norm, out=out).mul_(gamma)
        if silu:
            F.silu(out, inplace=True)
        return
    if x.numel() > _NORM_CHUNK and x.dim() > 2 and x.shape[1] > 1:  # bound the fp32 temporaries (frame by frame)
        for x_part, out_part in zip(x.split(1, dim=1), out.split(1, dim=1)):
            rms_norm_silu(x_part, gamma, out_part, silu)
        return
    xf = x.to(torch.float32, copy=True)  # scaled in place
    norm = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).clamp_min_(RMS_EPS)
    y = xf.div_(norm).mul_(gamma)
    out.copy_(F.silu(y, inplace=True) if silu else y)


def upsample2x_conv3x3(x: torch.Tensor, w_sub: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out = conv3x3(nearest_upsample_2x(x)) + b, computed as four 2x2 sub-pixel convs on the low-resolution x.

    x [M, Hi, W, C] bf16 (M = frames; rows include one halo row above and below); w_sub [2, 2, Co, 2, 2, Ci] bf16
    (phase row, phase col, Co, tap row, tap col, Ci; see weights.subpixel_weights); b [Co] fp32;
    out [M, 2 * (Hi - 2), 2 * W, Co] bf16. Output pixel (2i + a, 2j + c) = sum over taps (r, s) of
    w_sub[a, c, :, r, s] . x[i + a + r, j - 1 + c + s] (x rows counted from the halo row, width zero-padded).
    Exact math with 2.25x fewer MACs than convolving the upsampled frame.
    """
    m, hi, width, _ = x.shape
    co = w_sub.shape[2]
    rows = hi - 2
    # One 2x2 conv with 4*Co outputs (one group per phase) over x padded by one column each side; phase (a, c) of
    # output pixel (i, j) is that conv's output at position (i + a, j + c).
    y = torch.empty((m, rows + 1, width + 1, 4 * co), dtype=activation_compute_dtype(x), device=x.device)
    _conv(x.permute(0, 3, 1, 2), _subpixel_weight(w_sub), b.repeat(4), _padding(w_sub), y.permute(0, 3, 1, 2),
          packed=_packed(w_sub))
    y = y.view(m, rows + 1, width + 1, 2, 2, co)
    for a in range(2):
        for c in range(2):
            out[:, a::2, c::2, :].copy_(y[:, a:a + rows, c:c + width, a, c])


# torch's CPU attention picks its GEMMs by the number of queries in a call (its query split; its small-GEMM paths; on
# AMX a packed path from 64 queries on, depending on the batch and thread count too), so the queries of a band would be
# summed in another order than the same queries of the whole frame. On a CPU every call therefore computes blocks of
# exactly this many queries (under 64: never packed), each block one head over the same keys and values.
CPU_QUERY_BLOCK = 32


def attention_queries(queries: int, device: torch.device) -> int:
    """How many queries `attention` computes for `queries` on `device`: on a CPU rounded up to whole blocks of
    CPU_QUERY_BLOCK (zero queries, their outputs dropped), elsewhere as many as given."""
    return -(-queries // CPU_QUERY_BLOCK) * CPU_QUERY_BLOCK if device.type == "cpu" else queries


def attention(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor) -> None:
    """Single-head softmax attention over whole frames (the mid block's), scale 1/sqrt(C).

    q [M, Lq, C] bf16 (this band's pixels); kv [M, L, 2C] bf16 (k then v, every pixel of the frame);
    out [M, Lq, C] bf16. M = frames. Each query's result is the same whatever else the call holds (bands, tiles and
    passes of any size): on a CPU through blocks of CPU_QUERY_BLOCK queries.
    """
    dtype = activation_compute_dtype(q)
    m, queries, c = q.shape
    k, v = kv.to(dtype).split(c, dim=-1)
    if q.device.type != "cpu":
        o = F.scaled_dot_product_attention(q.to(dtype).unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1))
        out.copy_(o.squeeze(1))
        return
    padded = attention_queries(queries, q.device)
    blocks = padded // CPU_QUERY_BLOCK
    q_blocks = q.new_zeros((m, blocks, CPU_QUERY_BLOCK, c), dtype=dtype)
    q_blocks.view(m, padded, c)[:, :queries].copy_(q)
    heads = (m, blocks, k.shape[1], c)  # every block a head over the same keys and values (expanded, not copied)
    o = F.scaled_dot_product_attention(q_blocks, k.unsqueeze(1).expand(heads), v.unsqueeze(1).expand(heads))
    out.copy_(o.reshape(m, padded, c)[:, :queries])


def dup_up_add(x: torch.Tensor, out: torch.Tensor, factor_t: int, skip: int) -> None:
    """out += DupUp(x): the up block's parameter-free shortcut (repeat channels, fold them into time and space).

    x [N, T, H, W, Ci] bf16 (the up block's input); out [N, T * factor_t - skip, 2H, 2W, Co] bf16.
    Channel block ((o * factor_t + a) * 2 + dy) * 2 + dx of the repeated input lands at output (o, frame
    t * factor_t + a, row 2h + dy, column 2w + dx); `skip` drops the first output frames (the first chunk keeps only
    the last of its factor_t frames).
    """
    n, t, h, width, ci = x.shape
    co = out.shape[-1]
    repeats = co * factor_t * 4 // ci
    src = x.unsqueeze(-1).expand(n, t, h, width, ci, repeats).reshape(n, t, h, width, co, factor_t, 2, 2)
    src = src.permute(0, 1, 5, 2, 6, 3, 7, 4).reshape(n, t * factor_t, 2 * h, 2 * width, co)
    out.add_(src[:, skip:])


def unpatchify_clamp(x: torch.Tensor, out: torch.Tensor, patch_size: int) -> None:
    """The decoder's last step: fold the patch channels into pixels and clamp to [-1, 1].

    x [N, F, H, W, 3 * p * p] bf16 (channel = c * p * p + dx * p + dy, diffusers' order); out [N, 3, F, p * H, p * W]
    (any strides, typically a slice of the whole video in NCDHW).
    """
    n, f, h, width, _ = x.shape
    p = patch_size
    y = x.view(n, f, h, width, 3, p, p).permute(0, 4, 1, 2, 6, 3, 5).reshape(n, 3, f, h * p, width * p)
    out.copy_(y.clamp(-1.0, 1.0))


def conv3d_strided(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                   stride: tuple[int, int, int]) -> None:
    """out = conv(x, w) + b with `stride` (frames, rows, columns), valid in every dim: the encoder's downsamples, a
    3x3 conv of stride (1, 2, 2) after the zero row and column its caller puts below and right of the frame, and the
    (3, 1, 1) time conv of stride (2, 1, 1) after the caller's history frame.

    x [N, Ti, Hi, Wi, Ci] (contiguous); w [Co, kt, kh, kw, Ci] (prepared); b [Co] fp32; out [N, To, Ho, Wo, Co] with
    To = (Ti - kt) // st + 1 and so on.
    """
    _conv(x.permute(_CHANNELS_SECOND), _conv3d_weight(w), b, [0, 0, 0], out.permute(_CHANNELS_SECOND),
          stride=list(stride))


def avg_down_add(x: torch.Tensor, out: torch.Tensor, factor_t: int, factor_s: int) -> None:
    """out += AvgDown3D(x): the encoder's parameter-free down-block shortcut (the mirror of `dup_up_add`).

    x [N, T, H, W, Ci] (the down block's input); out [N, ceil(T / factor_t), H / factor_s, W / factor_s, Co]. A pass
    whose frame count is not a multiple of factor_t gets zero frames in front (the first frame alone: its average
    with a zero frame). Channel ((c * factor_t + a) * factor_s + dy) * factor_s + dx of the folded input is frame
    t * factor_t + a, row h * factor_s + dy, column w * factor_s + dx of channel c; output channel o is the mean of
    folded channels [o * g, (o + 1) * g), g = Ci * factor_t * factor_s^2 / Co (in fp32, added with one rounding).
    """
    n, t, h, width, ci = x.shape
    co = out.shape[-1]
    pad = -t % factor_t
    if pad:
        x = torch.cat([x.new_zeros((n, pad, h, width, ci)), x], dim=1)
    t_out, h_out, w_out = (t + pad) // factor_t, h // factor_s, width // factor_s
    # Where a group is the last dims of (m whole input channels, a, dy, dx) (m > 1 where Co < Ci: every Wan2.2 level
    # has m = 1), its members are strided views of x, summed in fp32 in one order whatever the extents; else (a
    # width ratio diffusers allows but no Wan VAE has) one refolded copy of x and its mean.
    sizes = (1, factor_t, factor_s, factor_s)
    group = ci * math.prod(sizes) // co
    sizes = (max(1, group // math.prod(sizes)), *sizes[1:])
    kept = len(sizes)
    while kept > 0 and math.prod(sizes[kept:]) < group:
        kept -= 1
    if math.prod(sizes[kept:]) != group:
        folded = x.view(n, t_out, factor_t, h_out, factor_s, w_out, factor_s, ci).permute(0, 1, 3, 5, 7, 2, 4, 6)
        out.add_(folded.reshape(n, t_out, h_out, w_out, co, group).float().mean(dim=-1))
        return
    folded = x.view(n, t_out, factor_t, h_out, factor_s, w_out, factor_s, ci // sizes[0], sizes[0]).permute(
        0, 1, 3, 5, 7, 8, 2, 4, 6)  # [n, t, h, w, c, m, a, dy, dx]
    total = None
    for member in itertools.product(*(range(size) for size in sizes[kept:])):
        view = folded[(..., *member)]
        total = view.to(torch.float32, copy=True) if total is None else total.add_(view)
    out.view(n, t_out, h_out, w_out, ci // sizes[0], *sizes[:kept]).add_(total.div_(group))


def patchify_into(video: torch.Tensor, dest: torch.Tensor, patch_size: int) -> None:
    """The encoder's first step (the mirror of `unpatchify_clamp`): pixels folded into patch channels.

    video [N, 3, F, p * H, p * W] (any strides, any float dtype); dest [N, F, H, W, 3 * p * p] (channel
    c * p * p + dx * p + dy, diffusers' order), in dest's dtype.
    """
    n, c, f, hp, wp = video.shape
    p = patch_size
    y = video.reshape(n, c, f, hp // p, p, wp // p, p).permute(0, 2, 3, 5, 1, 6, 4)
    dest.copy_(y.reshape(n, f, hp // p, wp // p, c * p * p))


# --------------------------------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Ops:
    """The decoder's hot ops (signatures as the portable functions above). `name` says which backend it is;
    `fallbacks` counts, per op and reason, the calls a compiled table handed to the portable op (empty here);
    `row_multiple`: bands and tiles must start on a multiple of this many rows at every level for the ops to give
    the same result as on the whole frame (Winograd pairs output rows into 2x2 tiles counted from the frame's top;
    direct convs do not care); `cpu_compute_layout`: on a CPU the table takes its weights in the form the portable
    convs compute with (`weights.to_compute_layout`, `prepack`); compiled tables take them as prepared (bf16,
    channels last)."""

    name: str
    conv3d: Callable[..., None]
    rms_norm_silu: Callable[..., None]
    upsample2x_conv3x3: Callable[..., None]
    attention: Callable[..., None]
    dup_up_add: Callable[..., None]
    unpatchify_clamp: Callable[..., None]
    conv3d_strided: Callable[..., None] = conv3d_strided  # the encoder's: portable in every table so far
    avg_down_add: Callable[..., None] = avg_down_add
    patchify_into: Callable[..., None] = patchify_into
    fallbacks: Mapping[str, int] = dataclasses.field(default_factory=lambda: MappingProxyType({}), compare=False)
    row_multiple: int = 1
    cpu_compute_layout: bool = False


TORCH_OPS = Ops("torch", conv3d, rms_norm_silu, upsample2x_conv3x3, attention, dup_up_add, unpatchify_clamp,
                cpu_compute_layout=True)
