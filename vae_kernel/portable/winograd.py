"""Winograd F(m x m, 3x3) for the decoder's causal (kt, 3, 3) convs: the portable definition CUDA kernels mirror.

A 3x3 conv over an m x m output tile reads an a x a input tile (a = m + 2). Winograd computes it as
Y = A^T [ sum_t (G g_t G^T) * (B^T d_t B) ] A, with t the time taps: per tile, a^2 products instead of 9 m^2, i.e.
2.25x fewer MACs for F(2x2, 3x3) (m = 2, 16 components) and 4x for F(4x4, 3x3) (m = 4, 36 components). The a^2
elementwise products over channels are a^2 GEMMs [tiles x Ci] x [Ci x Co], which is what a tensor-core kernel runs.

Rounding points (exactly these; a CUDA kernel must round at the same places and nowhere else):
1. Weights: U = G g G^T per time tap, computed in fp32 from the bf16 weights, rounded to bf16 once
   (`winograd_weights`, layout [kt, a^2, Ci, Co]).
2. Inputs: V = B^T d B per input frame and tile, computed in fp32 from the bf16 inputs, rounded to bf16 once
   (to U's dtype: bf16 in the decoder; an fp32 U makes the whole algorithm fp32, which the tests use to check the
   transforms).
3. Products: M = sum over time taps t of V_t U_t, one GEMM per component and tap, products and accumulation in fp32
   (taps accumulated in fp32 too).
4. Output: Y = A^T M A in fp32, + bias (fp32) + residual (bf16 read as fp32), no clamp, rounded to out's dtype
   (bf16) once, on store.

The GEMMs run in fp32 on the rounded operands on every device: products of bf16 values are exact in fp32 (and in
TF32), so this equals a bf16 tensor-core GEMM with fp32 accumulation, and CPUs have no fast bf16 GEMM. The
transforms are written as explicit fp32 adds and scalings, never matmuls, so TF32 cannot touch them.

`winograd_ops(base_ops, tile)` returns an op table whose conv3d runs the 3x3 spatial convs this way (weights
transformed once per layer and cached) and every other conv, and every layer shape listed in `keep_direct`, through
the base table's conv3d. The CUDA path (csrc/winograd.cu behind `kernels.CompiledKernels.winograd_conv3d`) computes
the same U in the GEMM's K-major layout [kt, a^2, Co, Ci] (F(2x2) only) and shares `WinogradConv3d`'s dispatch and
cache. Only torch is imported here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakTensorKeyDictionary

# The Lavin-Gray matrices (interpolation points 0, +-1 for m = 2; 0, +-1, +-2 for m = 4; plus infinity).
_B_T = {
    2: ((1, 0, -1, 0),
        (0, 1, 1, 0),
        (0, -1, 1, 0),
        (0, 1, 0, -1)),
    4: ((4, 0, -5, 0, 1, 0),
        (0, -4, -4, 1, 1, 0),
        (0, 4, -4, -1, 1, 0),
        (0, -2, -1, 2, 1, 0),
        (0, 2, -1, -2, 1, 0),
        (0, 4, 0, -5, 0, 1)),
}
_G = {
    2: ((1, 0, 0),
        (1 / 2, 1 / 2, 1 / 2),
        (1 / 2, -1 / 2, 1 / 2),
        (0, 0, 1)),
    4: ((1 / 4, 0, 0),
        (-1 / 6, -1 / 6, -1 / 6),
        (-1 / 6, 1 / 6, -1 / 6),
        (1 / 24, 1 / 12, 1 / 6),
        (1 / 24, -1 / 12, 1 / 6),
        (0, 0, 1)),
}
_A_T = {
    2: ((1, 1, 1, 0),
        (0, 1, -1, -1)),
    4: ((1, 1, 1, 1, 1, 0),
        (0, 1, -1, 2, -2, 0),
        (0, 1, 1, 4, 4, 0),
        (0, 1, -1, 8, -8, 1)),
}
TILES = tuple(_B_T)

# fp32 elements per temporary (about 64 MiB): a conv runs in bands of tile rows so its transforms stay this size.
_CHUNK = 1 << 24


def _check_tile(tile: int) -> int:
    if tile not in TILES:
        raise ValueError(f"tile must be one of {TILES}; got {tile!r}")
    return tile + 2


def _apply(matrix, x: torch.Tensor, dim: int) -> torch.Tensor:
    """matrix @ x along `dim`, as fp32 adds and scalings (zeros skipped, +-1 as adds): exact-order elementwise math
    on any device, untouched by TF32."""
    parts = x.unbind(dim)
    rows = []
    for coefficients in matrix:
        acc = None
        for c, part in zip(coefficients, parts):
            if c == 0:
                continue
            if acc is None:
                acc = part * c if c != 1 else part.clone()
            elif c == 1:
                acc = acc.add_(part)
            elif c == -1:
                acc = acc.sub_(part)
            else:
                acc = acc.add_(part, alpha=c)
        rows.append(acc)
    return torch.stack(rows, dim)


def winograd_weights(w: torch.Tensor, tile: int = 2, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Prepared conv weights [Co, kt, 3, 3, Ci] -> U = G g G^T, [kt, a^2, Ci, Co] (a = tile + 2; component index
    = row * a + column of the a x a transform), computed in fp32 and rounded to `dtype` once.

    Per (time tap, component) a contiguous [Ci, Co] matrix: the B operand of that component's GEMM."""
    alpha = _check_tile(tile)
    co, kt, kh, kw, ci = w.shape
    if (kh, kw) != (3, 3):
        raise ValueError(f"Winograd F({tile}x{tile}, 3x3) needs 3x3 spatial kernels; got w {list(w.shape)}")
    u = torch.empty((kt, alpha * alpha, ci, co), dtype=dtype, device=w.device)
    for t in range(kt):  # one tap at a time bounds the fp32 temporaries
        g = w[:, t].permute(1, 2, 3, 0).float().contiguous()  # [3, 3, Ci, Co]
        u[t] = _apply(_G[tile], _apply(_G[tile], g, 0), 1).reshape(alpha * alpha, ci, co)
    return u


def conv3d_winograd(x: torch.Tensor, u: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                    residual: torch.Tensor | None = None, tile: int = 2) -> None:
    """ops.conv3d for (kt, 3, 3) kernels by Winograd F(tile x tile, 3x3), rounding as the module docstring says.

    x [N, Ti, Hi, W, Ci] (contiguous); u = winograd_weights(w, tile) [kt, a^2, Ci, Co]; b [Co] fp32;
    out [N, Ti - kt + 1, Hi - 2, W, Co] (its last three dims packed, the rest any strides); residual None or out's
    shape. Valid in time and rows, zero padding 1 each side in width. Rows and width need not be multiples of the
    tile: the tile grid is zero-padded and the extra outputs are never stored.
    """
    check_conv3d_args(x, u, out, residual, tile)
    alpha = tile + 2
    n, ti, hi, width, ci = x.shape
    kt, components, _, co = u.shape
    frames, rows = ti - kt + 1, hi - 2
    tiles_h, tiles_w = math.ceil(rows / tile), math.ceil(width / tile)
    # Zero padding: one column left (the conv's 'same' padding), then up to the tile grid's extent right and below.
    xp = F.pad(x, (0, 0, 1, tiles_w * tile + 1 - width, 0, tiles_h * tile + 2 - hi))
    bias = b.float()
    band = max(1, _CHUNK // (components * tiles_w * max(ti * ci, frames * co)))  # tile rows per band
    for i in range(n):
        for r0 in range(0, tiles_h, band):
            r1 = min(r0 + band, tiles_h)
            v = input_transform(xp[i, :, r0 * tile:r1 * tile + 2], tile, u.dtype)  # [a^2, Ti, tiles, Ci]
            m = winograd_products(v, u)
            y = output_transform(m.view(alpha, alpha, frames, r1 - r0, tiles_w, co), tile)
            y0, y1 = r0 * tile, min(r1 * tile, rows)
            y = y[:, :y1 - y0, :width].add_(bias)
            if residual is not None:
                y = y.add_(residual[i, :, y0:y1])
            out[i, :, y0:y1].copy_(y)


def winograd_products(v: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Rounding point 3: V [a^2, Ti, tiles, Ci], U [kt, a^2, Ci, Co] -> M [a^2, frames * tiles, Co] fp32, the
    products summed over channels and time taps in fp32 (one batched GEMM per tap, every output frame at once)."""
    components, ti, _, ci = v.shape
    kt = u.shape[0]
    frames = ti - kt + 1
    v = v.float()
    m = v.new_zeros((components, frames * v.shape[2], u.shape[-1]))
    for t in range(kt):
        m.baddbmm_(v[:, t:t + frames].reshape(components, -1, ci), u[t].float())
    return m


def check_conv3d_args(x: torch.Tensor, u: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None,
                      tile: int = 2) -> None:
    """conv3d_winograd's shape rules (u [kt, a^2, Ci, Co]), raising ValueError naming what was expected."""
    alpha = _check_tile(tile)
    n, ti, hi, width, ci = x.shape
    kt, components, u_ci, co = u.shape
    frames, rows = ti - kt + 1, hi - 2
    if components != alpha * alpha or u_ci != ci:
        raise ValueError(f"u {list(u.shape)} is not F({tile}x{tile}, 3x3) weights for x {list(x.shape)}")
    if frames < 1 or rows < 1 or tuple(out.shape) != (n, frames, rows, width, co):
        raise ValueError(f"out must be [{n}, {frames}, {rows}, {width}, {co}] for x {list(x.shape)} and "
                         f"{kt} time taps; got {list(out.shape)}")
    if residual is not None and residual.shape != out.shape:
        raise ValueError(f"residual must have out's shape {list(out.shape)}; got {list(residual.shape)}")


def input_transform(d: torch.Tensor, tile: int, dtype: torch.dtype) -> torch.Tensor:
    """Padded input rows [Ti, rows, Wp, Ci] -> V = B^T d B per tile, [a^2, Ti, tiles, Ci], rounded to `dtype`,
    returned in fp32 (the GEMM's operand)."""
    alpha = tile + 2
    windows = d.unfold(1, alpha, tile).unfold(2, alpha, tile)  # [Ti, tiles_h, tiles_w, Ci, a, a]
    d32 = windows.permute(4, 5, 0, 1, 2, 3).to(torch.float32, memory_format=torch.contiguous_format)
    v = _apply(_B_T[tile], _apply(_B_T[tile], d32, 0), 1)  # [a, a, Ti, tiles_h, tiles_w, Ci]
    return v.reshape(alpha * alpha, d.shape[0], -1, d.shape[-1]).to(dtype).float()


def output_transform(m: torch.Tensor, tile: int) -> torch.Tensor:
    """M [a, a, frames, tiles_h, tiles_w, Co] -> Y = A^T M A as pixels [frames, tiles_h * m, tiles_w * m, Co]."""
    y = _apply(_A_T[tile], _apply(_A_T[tile], m, 0), 1)  # [m, m, frames, tiles_h, tiles_w, Co]
    frames, tiles_h, tiles_w, co = y.shape[2:]
    return y.permute(2, 3, 0, 4, 1, 5).reshape(frames, tiles_h * tile, tiles_w * tile, co)


# --------------------------------------------------------------------------------------------------------------------
# The op table
# --------------------------------------------------------------------------------------------------------------------

LayerShape = tuple[int, int, int]  # (Co, Ci, kt) of a conv


class WinogradConv3d:
    """ops.conv3d with (kt, 3, 3) convs by Winograd and everything else by `direct` (the base table's conv3d).

    `keep_direct`: layer shapes (Co, Ci, kt) that stay direct, or a predicate on them (e.g. where a tile size is
    outside the error allowance). Transformed weights are computed once per weight tensor and kept as long as it
    lives (a weak reference), with its version (an in-place update recomputes them).

    `conv(x, u, b, out, residual)` runs the Winograd conv on `u = transform(w)`: by default this module's
    `conv3d_winograd` and `winograd_weights` for `tile`; the compiled path passes its kernels and their weight
    layout (`kernels.CompiledKernels.winograd_conv3d`), so both share this dispatch and cache."""

    def __init__(self, direct: Callable[..., None], tile: int = 2,
                 keep_direct: Iterable[LayerShape] | Callable[[int, int, int], bool] = (),
                 conv: Callable[..., None] | None = None,
                 transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        _check_tile(tile)
        self.direct = direct
        self.tile = tile
        self.conv = conv or functools.partial(conv3d_winograd, tile=tile)
        self.transform = transform or functools.partial(winograd_weights, tile=tile)
        if callable(keep_direct):
            self.keep_direct = keep_direct
        else:
            shapes = frozenset(tuple(s) for s in keep_direct)
            self.keep_direct = lambda co, ci, kt: (co, ci, kt) in shapes
        self.cache: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # weight -> (its version, transformed)

    def uses_winograd(self, w: torch.Tensor) -> bool:
        co, kt, kh, kw, ci = w.shape
        return kh == kw == 3 and not self.keep_direct(co, ci, kt)

    def transformed(self, w: torch.Tensor) -> torch.Tensor:
        # An inference tensor (made under torch.inference_mode, e.g. the planner's meta copy of the weights) has no
        # version counter: it is transformed once, as it can change only inside inference mode, where nothing here
        # changes weights in place.
        version = None if w.is_inference() else w._version
        entry = self.cache.get(w)
        if entry is None or entry[0] != version:
            entry = self.cache[w] = (version, self.transform(w))
        return entry[1]

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                 residual: torch.Tensor | None = None) -> None:
        if not self.uses_winograd(w):
            return self.direct(x, w, b, out, residual)
        return self.conv(x.contiguous(), self.transformed(w), b, out, residual)


def winograd_ops(base_ops, tile: int = 2,
                 keep_direct: Iterable[LayerShape] | Callable[[int, int, int], bool] = (),
                 conv: Callable[..., None] | None = None,
                 transform: Callable[[torch.Tensor], torch.Tensor] | None = None):
    """`base_ops` (an ops.Ops) with its conv3d replaced by
    `WinogradConv3d(base_ops.conv3d, tile, keep_direct, conv, transform)`."""
    conv = WinogradConv3d(base_ops.conv3d, tile, keep_direct, conv, transform)
    return dataclasses.replace(base_ops, row_multiple=tile, name=f"{base_ops.name}+winograd-f{tile}x{tile}",
                               conv3d=conv)


def winograd_conv(table) -> WinogradConv3d | None:
    """An op table's Winograd conv (its tile and layers), None where its convs are direct."""
    return table.conv3d if isinstance(table.conv3d, WinogradConv3d) else None
