"""Winograd F(2x2, 3x3) / F(4x4, 3x3) (vae_kernel/portable/winograd.py): the transforms are exact in fp32, the bf16 rounding
points keep F(2x2) inside the decoder's allowance op by op, and the op table dispatches and caches as documented (a
whole decode by Winograd, both layouts: tests/vae_kernel/test_decoder_variants.py). The error study behind the numbers is
bench/winograd_error.py."""

from __future__ import annotations

import gc


import pytest
import torch

from _vae_helpers import winograd_out, winograd_problem

from fastvideo_pan2_ext.vae_kernel.definitions.allowance import compare_to_reference
from fastvideo_pan2_ext.vae_kernel.portable.ops import TORCH_OPS
from fastvideo_pan2_ext.vae_kernel.compiled.selfcheck import reference_conv3d
from fastvideo_pan2_ext.vae_kernel.portable.winograd import conv3d_winograd, winograd_ops, winograd_weights

bf16 = torch.bfloat16


# (N, Ti, Hi, W, Ci, Co, kt): odd rows and widths (tile grid padded, crop on store), a 1-column frame, kt = 1,
# Ci not a multiple of 8, the 12-channel conv_out.
SHAPES = [(1, 4, 9, 7, 5, 6, 3), (2, 3, 3, 1, 3, 4, 1), (1, 5, 8, 10, 16, 12, 3), (1, 3, 7, 13, 12, 20, 3)]


@pytest.mark.parametrize("tile", [2, 4])
@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_winograd_equals_the_direct_conv(tile, shape):
    """With fp32 operands (fp32 U, so V stays fp32 too) the algorithm is the conv up to fp32 rounding: this checks
    the B, G, A matrices, the tiling, padding and cropping, the time taps, bias and residual."""
    x, w, b, res = (t.float() for t in winograd_problem(*shape, seed=1, residual=True))
    expected = reference_conv3d(x.double(), w.double(), b.double(), res.double())
    out = torch.empty(expected.shape)
    conv3d_winograd(x, winograd_weights(w, tile, torch.float32), b, out, res, tile)
    rel = ((out.double() - expected).abs().max() / expected.abs().max()).item()
    assert rel < 1e-5, rel


@pytest.mark.parametrize("case", ["residual", "strided out", "plain"])
@pytest.mark.parametrize("shape", SHAPES[::2] + SHAPES[3:])
def test_bf16_f2_meets_the_allowance_against_the_direct_bf16_conv(shape, case, fp32_cpu):
    """The single op with its bf16 rounding points (U and V rounded once, fp32 GEMMs, one rounding on store) against
    the fp32 conv of the same bf16 operands; baseline: the direct conv of bf16 operands, rounded once (the portable op
    on a CPU computing in fp32). Its extra error must be real (the rounding points are there) and inside 3x the
    baseline's max and RMS."""
    x, w, b, res = winograd_problem(*shape, seed=2, residual=case == "residual")
    out = winograd_out(*shape, strided=case == "strided out")
    conv3d_winograd(x, winograd_weights(w, 2), b, out, res, tile=2)
    direct = torch.empty(out.shape, dtype=bf16)
    TORCH_OPS.conv3d(x, w, b, direct, res)
    reference = reference_conv3d(x.float(), w.float(), b, None if res is None else res.float())
    report = compare_to_reference(f"F(2x2) {shape} {case}", out, reference, direct)
    assert report.ok, report
    assert report.max_err > 0 and report.rms_err > 1.2 * report.baseline_rms_err, report


def test_table_runs_3x3_convs_by_winograd_and_the_rest_direct_with_weights_transformed_once():
    table = winograd_ops(TORCH_OPS, tile=2)
    conv = table.conv3d
    x, w, b, _ = winograd_problem(1, 4, 6, 5, 8, 8, 3, seed=3)
    out, direct = torch.empty(1, 2, 4, 5, 8, dtype=bf16), torch.empty(1, 2, 4, 5, 8, dtype=bf16)
    table.conv3d(x, w, b, out)
    TORCH_OPS.conv3d(x, w, b, direct)
    assert not torch.equal(out, direct) and len(conv.cache) == 1  # Winograd ran, its weights cached
    table.conv3d(x, w, b, out)
    assert len(conv.cache) == 1  # no second transform for the same weights

    w.mul_(2)  # an in-place update invalidates the cached transform
    table.conv3d(x, w, b, out)
    TORCH_OPS.conv3d(x, w, b, direct)
    report = compare_to_reference("after w *= 2", out, reference_conv3d(x.float(), w.float(), b), direct)
    assert report.ok, report

    for kt, kh, kw in [(1, 1, 1), (3, 1, 1)]:  # shortcuts, projections, the time conv: the base op, bit for bit
        wk = torch.randn(8, kt, kh, kw, 8, generator=torch.Generator().manual_seed(4)).to(bf16)
        shape = (1, 4 - kt + 1, 6 - kh + 1, 5, 8)
        a, e = torch.empty(shape, dtype=bf16), torch.empty(shape, dtype=bf16)
        table.conv3d(x, wk, b, a)
        TORCH_OPS.conv3d(x, wk, b, e)
        assert torch.equal(a, e)
    assert len(conv.cache) == 1
    del w  # the cache holds no weight alive: its entry goes with the weight
    gc.collect()
    assert len(conv.cache) == 0


@pytest.mark.parametrize("keep_direct", [[(8, 8, 3)], lambda co, ci, kt: ci == 8])
def test_listed_layer_shapes_stay_direct(keep_direct):
    table = winograd_ops(TORCH_OPS, tile=4, keep_direct=keep_direct)
    x, w, b, _ = winograd_problem(1, 4, 6, 5, 8, 8, 3, seed=5)
    out, direct = torch.empty(1, 2, 4, 5, 8, dtype=bf16), torch.empty(1, 2, 4, 5, 8, dtype=bf16)
    table.conv3d(x, w, b, out)
    TORCH_OPS.conv3d(x, w, b, direct)
    assert torch.equal(out, direct) and not table.conv3d.cache
