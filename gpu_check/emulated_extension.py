"""The compiled extension's Python API (vae_kernel/compiled/csrc/binding.cpp) implemented with torch on any device: the
stand-in for the GPU where there is none (CPU rehearsals of the GPU check, tests of the op-table adaptor, the
self-check and the loader). Not part of the package: tests and the GPU check's dry run hand it to the loader
(`stand_in(variant)`, an `ExtensionSource` that the self-check child opens again).

Same functions, argument order, checks that matter to the caller (contiguity, channel multiples of 8, the 16-byte
alignment of every tensor and of its strides, explicit per-side padding, strided destinations) and rounding points (fp32 accumulation, one rounding to bf16 on store). It can
also misbehave on purpose, to prove that a wrong or crashing build is caught: `conv_error` / `norm_error` perturb the
results, `abort=True` kills the process at the first kernel call (what a faulting kernel does to its CUDA context).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from fastvideo_pan2_ext.vae_kernel.compiled.extension import ExtensionSource
from fastvideo_pan2_ext.vae_kernel.portable import winograd

REPO = Path(__file__).resolve().parents[1]  # where `gpu_check` imports from

# The stand-ins: a correct one, one outside the allowance, one whose first kernel call kills its process.
VARIANTS = {"emulated": {}, "emulated-wrong": {"conv_error": 0.05}, "emulated-abort": {"abort": True}}


def open_variant(variant: str) -> "EmulatedExtension":
    return EmulatedExtension(variant, **VARIANTS[variant])


def stand_in(variant: str = "emulated") -> ExtensionSource:
    """The source of the stand-in `variant` (`VARIANTS`), to hand to `loader.load_ops(device, source=...)`."""
    if variant not in VARIANTS:
        raise ValueError(f"no stand-in {variant!r}; choose one of {sorted(VARIANTS)}")
    return ExtensionSource(__name__, open_variant.__name__, (variant,), str(REPO))


def _check_aligned(**tensors: torch.Tensor | None) -> None:
    """csrc/binding.cpp's layout rule: every tensor 16-byte aligned, every stride but the unit channel one (of a dim
    longer than 1) a multiple of 16 bytes."""
    for name, t in tensors.items():
        if t is None:
            continue
        per16 = 16 // t.element_size()
        if t.data_ptr() % 16:
            raise RuntimeError(f"{name} must start at a 16-byte aligned address; got sizes {list(t.shape)}, strides "
                               f"{list(t.stride())}, storage offset {t.storage_offset()}")
        if any(n > 1 and s % per16 for n, s in zip(t.shape[:-1], t.stride()[:-1])):
            raise RuntimeError(f"{name}'s strides must be multiples of {per16} elements (16 bytes) in every dim "
                               f"longer than 1; got sizes {list(t.shape)}, strides {list(t.stride())}")


class EmulatedExtension:
    """Stands in for the built extension module (`kernels.make_ops(EmulatedExtension())`)."""

    def __init__(self, name: str = "emulated", conv_error: float = 0.0, norm_error: float = 0.0,
                 abort: bool = False) -> None:
        self.name, self.conv_error, self.norm_error, self.abort = name, conv_error, norm_error, abort
        self.calls: list[tuple[str, tuple]] = []  # (kernel, output shape): proves the kernel path was taken

    def arch(self) -> str:
        return self.name

    def _enter(self, kernel: str, out: torch.Tensor) -> None:
        if self.abort:
            os.abort()
        self.calls.append((kernel, tuple(out.shape)))

    def conv3d(self, x, w, b, out, residual, pad_lo, pad_hi) -> None:
        if not (x.is_contiguous() and w.is_contiguous() and out.stride(-1) == 1):
            raise RuntimeError("x and w must be contiguous and out must have unit channel stride")
        if x.shape[-1] % 8 or w.shape[0] % 8:
            raise RuntimeError("conv3d: channel counts must be multiples of 8")
        _check_aligned(x=x, w=w, b=b, out=out, residual=residual)
        self._enter("conv3d", out)
        xp = F.pad(x.float(), (0, 0, pad_lo[2], pad_hi[2], pad_lo[1], pad_hi[1], pad_lo[0], pad_hi[0]))
        y = F.conv3d(xp.permute(0, 4, 1, 2, 3), w.float().permute(0, 4, 1, 2, 3), b.float()).permute(0, 2, 3, 4, 1)
        if residual is not None:
            y = y + residual.float()
        if self.conv_error:
            y = y + self.conv_error * y.abs().mean() * torch.randn_like(y)
        out.copy_(y)

    def subpixel_scatter(self, y, out) -> None:
        _check_aligned(y=y, out=out)
        self._enter("subpixel_scatter", out)
        rows_plus_1, w_plus_1 = y.shape[1], y.shape[2]
        for a in (0, 1):
            for c in (0, 1):
                out[:, a::2, c::2].copy_(y[:, a:a + rows_plus_1 - 1, c:c + w_plus_1 - 1, 2 * a + c])

    def rms_norm_silu(self, x, gamma, out, silu, eps) -> None:
        _check_aligned(x=x, gamma=gamma, out=out)
        self._enter("rms_norm_silu", out)
        xf = x.float()
        y = xf / xf.norm(dim=-1, keepdim=True).clamp_min(eps) * gamma
        y = F.silu(y) if silu else y
        out.copy_(y * (1 + self.norm_error))

    # Winograd F(2x2, 3x3) (csrc/winograd.cu): the three steps, by winograd.py's own transforms and GEMM order.

    def winograd_input_transform(self, x, v) -> None:
        frames, rows, width, ci = x.shape
        tiles_h, tiles_w = math.ceil((rows - 2) / 2), math.ceil(width / 2)
        if x.stride(-1) != 1 or ci % 8:
            raise RuntimeError("x must have unit channel stride and channels a multiple of 8")
        if not v.is_contiguous() or tuple(v.shape) != (16, frames, tiles_h * tiles_w, ci):
            raise RuntimeError(f"v must be a contiguous [16, {frames}, {tiles_h * tiles_w}, {ci}] tensor")
        _check_aligned(x=x, v=v)
        self._enter("winograd_input_transform", v)
        xp = F.pad(x, (0, 0, 1, 2 * tiles_w + 1 - width, 0, 2 * tiles_h + 2 - rows))
        v.copy_(winograd.input_transform(xp, 2, v.dtype))

    def winograd_products(self, v, u, m) -> None:
        _, ti, tiles, ci = v.shape
        kt, _, co, u_ci = u.shape
        frames = ti - kt + 1
        if not (v.is_contiguous() and u.is_contiguous() and m.is_contiguous()) or m.dtype != torch.float32:
            raise RuntimeError("v, u and m must be contiguous, m float32")
        if u_ci != ci or ci % 8 or co % 8 or tuple(m.shape) != (16, frames, tiles, co):
            raise RuntimeError(f"v {list(v.shape)}, u {list(u.shape)}, m {list(m.shape)} do not fit")
        _check_aligned(v=v, u=u, m=m)
        self._enter("winograd_products", m)
        # The extension's U is K-major [kt, a^2, Co, Ci]; the products are rounding point 3's.
        m.copy_(winograd.winograd_products(v, u.transpose(-1, -2).contiguous()).view_as(m))

    def winograd_output_transform(self, m, b, out, residual) -> None:
        frames, rows, width, co = out.shape
        tiles_h, tiles_w = math.ceil(rows / 2), math.ceil(width / 2)
        if out.stride(-1) != 1 or co % 8:
            raise RuntimeError("out must have unit channel stride and channels a multiple of 8")
        if not m.is_contiguous() or tuple(m.shape) != (16, frames, tiles_h * tiles_w, co):
            raise RuntimeError(f"m must be a contiguous [16, {frames}, {tiles_h * tiles_w}, {co}] tensor")
        if residual is not None and residual.shape != out.shape:
            raise RuntimeError("residual must have out's shape")
        _check_aligned(m=m, b=b, out=out, residual=residual)
        self._enter("winograd_output_transform", out)
        y = winograd.output_transform(m.view(4, 4, frames, tiles_h, tiles_w, co), 2)[:, :rows, :width].add_(b)
        if residual is not None:
            y = y.add_(residual)
        if self.conv_error:
            y = y + self.conv_error * y.abs().mean() * torch.randn_like(y)
        out.copy_(y)
