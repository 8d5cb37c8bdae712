"""The compiled extension's kernels behind the op signatures of `ops.py`: the compiled op table.

`make_ops(ext)` is `ops.TORCH_OPS` with conv3d, rms_norm_silu and upsample2x_conv3x3 replaced by the extension's
kernels (channels-last bf16, destination passing, the current CUDA stream). `ext` is the built extension or anything
with its functions (on CPU, the stand-in `gpu_check/emulated_extension.py`). A call the kernels do not cover (not bf16, a
layout the TMA alignment rules out) goes to the portable op, so the table is total, and is counted in the table's
`fallbacks` (op and reason): a fallback is never silent. `make_ops(ext, winograd_convs=True)` runs the (kt, 3, 3)
convs by the Winograd F(2x2, 3x3) kernels instead (`winograd.WinogradConv3d`'s dispatch and per-layer weight cache;
fallback: the portable `winograd.conv3d_winograd`, same rounding points). The encoder's ops the kernels do not
implement (`conv3d_strided`, `patchify_into`) and its conv_in, whose 3 or 12 input channels are not a multiple of 8,
run portable by design and are counted too (`BY_DESIGN` in the reason).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import weakref
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from ..portable import ops, winograd


CHANNEL_MULTIPLE = 8  # the kernels' input channels are a multiple of this (a TMA row of 16 bytes of bf16)
BY_DESIGN = "portable by design"  # in the reason of a fallback the kernels were never meant to take


def winograd_kernel_weights(w: torch.Tensor) -> torch.Tensor:
    """Prepared conv weights [Co, kt, 3, 3, Ci] -> U = G g G^T in the kernels' layout [kt, 16, Co, Ci] (K-major: the
    GEMM's B operand), bf16: `winograd.winograd_weights` (torch, on w's device, once per layer) transposed."""
    return winograd.winograd_weights(w, 2).transpose(-1, -2).contiguous()


def _tma_ok(t: torch.Tensor | None) -> bool:
    """The kernels' layout preconditions: bf16, unit channel stride, 16-byte aligned base and strides."""
    return t is None or (t.dtype == torch.bfloat16 and t.stride(-1) == 1 and t.data_ptr() % 16 == 0
                         and all(s % 8 == 0 for s in t.stride()[:-1]))


def _operand(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as a contiguous, 16-byte aligned `dtype` tensor (the kernels' rule for weights, biases and gammas): t itself
    if it is one, else a fresh copy (a view into a shared or memory-mapped buffer may start anywhere)."""
    if t.dtype == dtype and t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.to(dtype, memory_format=torch.contiguous_format, copy=True)


class CompiledKernels:
    """The extension's functions as op-table entries; `fallbacks` counts the calls that ran the portable op."""

    # Bytes of the Winograd temporaries (V bf16 + M fp32) per band of tile rows: a conv runs band by band.
    winograd_band_bytes = 256 << 20

    def __init__(self, ext, fallbacks: collections.Counter) -> None:
        self.ext = ext
        self.fallbacks = fallbacks
        # id(bias) -> (weak reference to the bias, its version, the bias per phase); see _bias_per_phase
        self._bias4: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}

    def _fallback(self, op: str, reason: str) -> None:
        self.fallbacks[f"{op}: {reason}"] += 1

    def conv3d(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
               residual: torch.Tensor | None = None) -> None:
        """out = conv(x, w) + b (+ residual): valid in time and rows, zero padding kw//2 in width (ops.conv3d)."""
        kw, co = w.shape[3], w.shape[0]
        reason = None
        if w.dtype != torch.bfloat16 or out.dtype != torch.bfloat16:
            reason = "not bf16"
        elif x.shape[-1] % CHANNEL_MULTIPLE:  # the encoder's conv_in: 3 (Wan2.1) or 12 (Wan2.2) input channels
            reason = f"{x.shape[-1]} input channels, {BY_DESIGN}"
        elif not x.is_contiguous() or not _tma_ok(x):
            reason = f"x [.., {x.shape[-1]}] not contiguous and aligned"
        elif kw % 2 == 0:
            reason = f"even kernel width {kw}"
        elif co % 8 == 0 and not (_tma_ok(out) and _tma_ok(residual)):
            reason = "out or residual not 16-byte aligned"
        if reason is not None:
            self._fallback("conv3d", reason)
            return ops.conv3d(x, w, b, out, residual)
        b = _operand(b, torch.float32)
        pad_lo, pad_hi = [0, 0, kw // 2], [0, 0, kw // 2]
        if co % 8 == 0:
            self.ext.conv3d(x, _operand(w, torch.bfloat16), b, out, residual, pad_lo, pad_hi)
            return None
        # e.g. conv_out's 12 channels: compute 16 (zero filters), keep 12
        extra = 8 - co % 8
        wide = out.new_empty((*out.shape[:4], co + extra))
        self.ext.conv3d(x, F.pad(w, (0, 0) * 4 + (0, extra)).contiguous(), F.pad(b, (0, extra)), wide, None,
                        pad_lo, pad_hi)
        out.copy_(wide[..., :co] if residual is None else wide[..., :co] + residual)
        return None

    def winograd_conv3d(self, x: torch.Tensor, u: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                        residual: torch.Tensor | None = None) -> None:
        """ops.conv3d of a (kt, 3, 3) conv by Winograd F(2x2, 3x3) on pre-transformed weights
        u = winograd_kernel_weights(w) [kt, 16, Co, Ci]: winograd.conv3d_winograd's rounding points and shape rules.
        Each sample and band of tile rows: input transform, kt batched GEMMs, output transform (into out)."""
        portable_u = u.transpose(-1, -2)  # winograd.py's [kt, 16, Ci, Co]: same values
        winograd.check_conv3d_args(x, portable_u, out, residual)
        ci, co = x.shape[-1], out.shape[-1]
        reason = None
        if any(t is not None and t.dtype != torch.bfloat16 for t in (x, u, out, residual)):
            reason = "not bf16"
        elif ci % CHANNEL_MULTIPLE:
            reason = f"{ci} input channels, {BY_DESIGN}"
        elif not x.is_contiguous() or not _tma_ok(x):
            reason = f"x [.., {ci}] not contiguous and aligned"
        elif co % 8 == 0 and not (_tma_ok(out) and _tma_ok(residual)):
            reason = "out or residual not 16-byte aligned"
        if reason is not None:
            self._fallback("winograd_conv3d", reason)
            # contiguous: the portable table's own operands, so the fallback runs its GEMMs, not a transposed variant
            return winograd.conv3d_winograd(x.contiguous(), portable_u.contiguous(), b, out, residual, tile=2)
        b = _operand(b, torch.float32)
        if co % 8 == 0:
            return self._winograd_bands(x, _operand(u, torch.bfloat16), b, out, residual)
        # e.g. conv_out's 12 channels: compute 16 (zero filters, zero residual channels), keep 12
        extra = 8 - co % 8
        wide = out.new_empty((*out.shape[:4], co + extra))
        self._winograd_bands(x, F.pad(u, (0, 0, 0, extra)), F.pad(b, (0, extra)), wide,
                             None if residual is None else F.pad(residual, (0, extra)))
        out.copy_(wide[..., :co])
        return None

    def _winograd_bands(self, x: torch.Tensor, u: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                        residual: torch.Tensor | None) -> None:
        n, ti, hi, width, ci = x.shape
        kt, components, co, _ = u.shape
        frames, rows = ti - kt + 1, hi - 2
        tiles_h, tiles_w = math.ceil(rows / 2), math.ceil(width / 2)
        row_bytes = components * tiles_w * (ti * ci * 2 + frames * co * 4)  # V and M of one tile row
        bands = math.ceil(tiles_h / max(1, self.winograd_band_bytes // row_bytes))
        band = math.ceil(tiles_h / bands)  # equal bands: no thin last GEMM
        v_all = x.new_empty(components * ti * band * tiles_w * ci)
        m_all = torch.empty(components * frames * band * tiles_w * co, dtype=torch.float32, device=x.device)
        for i in range(n):  # one sample at a time: the GEMMs' rows never mix the frames of two samples
            for r0 in range(0, tiles_h, band):
                r1 = min(r0 + band, tiles_h)
                tiles = (r1 - r0) * tiles_w
                v = v_all[:components * ti * tiles * ci].view(components, ti, tiles, ci)
                m = m_all[:components * frames * tiles * co].view(components, frames, tiles, co)
                self.ext.winograd_input_transform(x[i, :, 2 * r0:2 * r1 + 2], v)
                self.ext.winograd_products(v, u, m)
                y0, y1 = 2 * r0, min(2 * r1, rows)
                self.ext.winograd_output_transform(m, b, out[i, :, y0:y1],
                                                   None if residual is None else residual[i, :, y0:y1])

    def rms_norm_silu(self, x: torch.Tensor, gamma: torch.Tensor, out: torch.Tensor, silu: bool = True) -> None:
        """out = silu?(x / max(||x||_C, 1e-12) * gamma), one fused pass (ops.rms_norm_silu)."""
        if x.shape[-1] % 8 or x.shape[-1] > 2048 or not (_tma_ok(x) and _tma_ok(out)):
            self._fallback("rms_norm_silu", f"{x.shape[-1]} channels or an unaligned layout")
            return ops.rms_norm_silu(x, gamma, out, silu)
        gamma = _operand(gamma, torch.float32)
        self.ext.rms_norm_silu(x, gamma.reshape(-1), out, silu, ops.RMS_EPS)
        return None

    def upsample2x_conv3x3(self, x: torch.Tensor, w_sub: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        """ops.upsample2x_conv3x3: one CUTLASS 2x2 conv computing all four phases (4 x Co channels, bias in the
        epilogue) over x's valid rows, then one pass interleaving the phases into out."""
        m, hi, width, ci = x.shape
        co = w_sub.shape[2]
        if (w_sub.dtype != torch.bfloat16 or not x.is_contiguous() or ci % 8 or co % 8 or not _tma_ok(x)
                or not _tma_ok(out) or out.stride(-2) != co or out.stride(-3) != 2 * width * co):
            self._fallback("upsample2x_conv3x3", f"{ci} -> {co} channels or a layout the kernels cannot take")
            return ops.upsample2x_conv3x3(x, w_sub, b, out)
        if out.shape != (m, 2 * (hi - 2), 2 * width, co):
            raise ValueError(f"out must be [{m}, {2 * (hi - 2)}, {2 * width}, {co}] for x {list(x.shape)}; "
                             f"got {list(out.shape)}")
        y = x.new_empty((m, 1, hi - 1, width + 1, 4 * co))
        self.ext.conv3d(x.view(m, 1, hi, width, ci), _operand(w_sub.reshape(4 * co, 1, 2, 2, ci), torch.bfloat16),
                        self._bias_per_phase(b), y, None, [0, 0, 1], [0, 0, 1])
        self.ext.subpixel_scatter(y.view(m, hi - 1, width + 1, 4, co), out)
        return None

    def _bias_per_phase(self, b: torch.Tensor) -> torch.Tensor:
        """b repeated for the four phases (fp32), derived once per bias tensor. The table is shared by every decoder
        of the process, so an entry must never outlive its bias: it holds a weak reference (checked by identity, and
        b's version for in-place changes) and is dropped when the bias is freed, so another model's bias that lands
        at the freed address can never hit it. Nothing here keeps a model's weights alive."""
        entry = self._bias4.get(id(b))
        if entry is not None and entry[0]() is b and entry[1] == b._version:
            return entry[2]
        cache, key = self._bias4, id(b)
        bias4 = b.float().repeat(4).contiguous()
        cache[key] = (weakref.ref(b, lambda _: cache.pop(key, None)), b._version, bias4)
        return bias4

def make_ops(ext, name: str = "compiled", winograd_convs: bool = False,
             keep_direct: Iterable[winograd.LayerShape] | Callable[[int, int, int], bool] = ()) -> ops.Ops:
    """The decoder's op table with `ext`'s kernels in place of the portable hot ops. `winograd_convs`: the (kt, 3, 3)
    convs (but the layer shapes in `keep_direct`) run by the Winograd F(2x2, 3x3) kernels, weights transformed once
    per layer; the table's name gets winograd_ops' suffix."""
    fallbacks: collections.Counter = collections.Counter()
    kernels = CompiledKernels(ext, fallbacks)

    def portable(op: str) -> Callable[..., None]:  # an encoder op no kernel implements: counted, then portable
        run = getattr(ops.TORCH_OPS, op)

        def counted(*args, **kwargs) -> None:
            fallbacks[f"{op}: {BY_DESIGN}"] += 1
            run(*args, **kwargs)

        return counted

    table = dataclasses.replace(ops.TORCH_OPS, name=name, conv3d=kernels.conv3d, rms_norm_silu=kernels.rms_norm_silu,
                                upsample2x_conv3x3=kernels.upsample2x_conv3x3,
                                conv3d_strided=portable("conv3d_strided"), patchify_into=portable("patchify_into"),
                                fallbacks=fallbacks, cpu_compute_layout=False)  # bf16 channels-last weights
    if winograd_convs:
        table = winograd.winograd_ops(table, 2, keep_direct, conv=kernels.winograd_conv3d,
                                      transform=winograd_kernel_weights)
    return table
