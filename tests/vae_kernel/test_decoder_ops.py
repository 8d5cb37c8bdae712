"""The op table's contract (ops.py), checked op by op against plain PyTorch on NCDHW tensors, and the weight order.

These are the semantics a compiled op must reproduce: valid rows and time, same width, destination passing,
channels-last bf16 in and out, fp32 accumulation.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastvideo_pan2_ext import reference
from fastvideo_pan2_ext.vae_kernel import TORCH_OPS, WAN22_CONFIG, decoder_weights, weight_names
from fastvideo_pan2_ext.vae_kernel.definitions.architecture import expected_shapes, infer_config
from fastvideo_pan2_ext.vae_kernel.portable.weights import prepare, subpixel_weights

ops = TORCH_OPS


def _bf16(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _to_ndhwc(x):
    return x.permute(0, 2, 3, 4, 1).contiguous()


@pytest.mark.parametrize("kernel", [(3, 3, 3), (3, 1, 1), (1, 1, 1)])
def test_conv3d_is_valid_in_time_and_rows_same_in_width_with_residual(kernel):
    kt, kh, kw = kernel
    x = _bf16(1, 6, 5, 7, 4, seed=1)  # [N, Ci, T, H, W]
    w = (_bf16(10, 6, kt, kh, kw, seed=2) / 10)
    b = torch.randn(10, generator=torch.Generator().manual_seed(3))
    expected = F.conv3d(F.pad(x.double(), (kw // 2, kw // 2)), w.double(), b.double())
    residual = _bf16(*expected.shape, seed=4)
    out = torch.empty(_to_ndhwc(expected).shape, dtype=torch.bfloat16)
    ops.conv3d(_to_ndhwc(x), prepare("c.weight", w), b, out, _to_ndhwc(residual))
    want = _to_ndhwc(expected + residual.double())
    torch.testing.assert_close(out.double(), want, rtol=2 ** -7, atol=1e-2)


def test_rms_norm_silu_writes_through_a_strided_destination():
    x = _bf16(2, 3, 4, 5, 8, seed=5)
    gamma = torch.rand(8) + 0.5
    window = torch.zeros(2, 3, 6, 5, 8, dtype=torch.bfloat16)
    ops.rms_norm_silu(x, gamma, window[:, :, 1:-1])
    xf = x.double()
    expected = F.silu(xf / xf.norm(dim=-1, keepdim=True).clamp_min(1e-12) * gamma.double())
    torch.testing.assert_close(window[:, :, 1:-1].double(), expected, rtol=2 ** -7, atol=1e-3)
    assert window[:, :, 0].abs().sum() == 0 and window[:, :, -1].abs().sum() == 0  # halo rows untouched
    plain = torch.empty_like(x)
    ops.rms_norm_silu(x, gamma, plain, silu=False)
    torch.testing.assert_close(plain.double(), xf / xf.norm(dim=-1, keepdim=True) * gamma.double(),
                               rtol=2 ** -7, atol=1e-3)


def test_subpixel_upsample_equals_nearest_upsample_then_3x3_conv():
    x = _bf16(3, 6, 9, 5, seed=6)  # [M, C, rows incl. one halo row each side, W]
    w = _bf16(4, 6, 3, 3, seed=7) / 5
    b = torch.randn(4, generator=torch.Generator().manual_seed(8))
    up = F.interpolate(x.double(), scale_factor=2.0, mode="nearest")
    # Valid rows of the upsampled frame, minus the halo rows' own outputs: rows 2..2*rows+1 of the 'same' conv.
    full = F.conv2d(up, w.double(), b.double(), padding=1)
    expected = full[:, :, 2:-2].permute(0, 2, 3, 1)
    out = torch.empty(3, 2 * 7, 2 * 5, 4, dtype=torch.bfloat16)
    ops.upsample2x_conv3x3(x.permute(0, 2, 3, 1).contiguous(), subpixel_weights(w), b, out)
    # The sub-pixel kernels are sums of bf16 weights rounded once to bf16: compare at bf16 resolution.
    torch.testing.assert_close(out.double(), expected, rtol=2 ** -6, atol=2e-2)


def test_attention_is_single_head_softmax_over_the_whole_frame():
    q, k, v = _bf16(2, 6, 8, seed=9), _bf16(2, 10, 8, seed=10), _bf16(2, 10, 8, seed=11)
    out = torch.empty(2, 6, 8, dtype=torch.bfloat16)
    ops.attention(q, torch.cat([k, v], dim=-1), out)
    weights = torch.softmax(q.double() @ k.double().transpose(1, 2) / 8 ** 0.5, dim=-1)
    torch.testing.assert_close(out.double(), weights @ v.double(), rtol=2 ** -7, atol=1e-2)


@pytest.mark.parametrize("factor_t, first", [(2, False), (2, True), (1, False), (1, True)])
def test_dup_up_add_matches_the_reference_shortcut(factor_t, first):
    x = _bf16(1, 16, 2 if not first else 1, 3, 4, seed=12)  # NCDHW, 16 -> 8 channels
    expected_shortcut = reference._dup_up(x, 8, factor_t, 2, first_chunk=first)
    base = _bf16(*expected_shortcut.shape, seed=13)
    out = _to_ndhwc(base).clone()
    ops.dup_up_add(_to_ndhwc(x), out, factor_t, factor_t - 1 if first else 0)
    assert torch.equal(out, _to_ndhwc(base + expected_shortcut))


def test_unpatchify_clamp_matches_the_reference():
    x = _bf16(1, 12, 2, 3, 4, seed=14) * 2
    out = torch.empty(1, 3, 2, 6, 8, dtype=torch.bfloat16)
    ops.unpatchify_clamp(_to_ndhwc(x), out, 2)
    assert torch.equal(out, reference._unpatchify(x, 2).clamp(-1, 1))


def test_weight_names_are_the_reference_order_and_decoder_weights_follow_it(wan22_state_dict):
    assert weight_names() == list(expected_shapes(WAN22_CONFIG))
    assert len(weight_names()) == len(set(weight_names()))
    config = infer_config(wan22_state_dict)
    names, tensors = weight_names(config), decoder_weights(wan22_state_dict)
    assert len(names) == len(tensors)
    for name, tensor in zip(names, tensors):
        source = wan22_state_dict[name]
        if name.endswith("upsampler.resample.1.weight"):
            co, ci = source.shape[:2]
            assert tensor.shape == (2, 2, co, 2, 2, ci) and tensor.dtype == torch.bfloat16
        elif name.endswith(".gamma"):
            assert torch.equal(tensor, source.flatten() * source.shape[0] ** 0.5)
        elif name.endswith(".bias"):
            assert tensor.dtype == torch.float32 and torch.equal(tensor, source)
        else:
            w = source if source.dim() == 5 else source[..., None]
            expected = w.permute(0, 2, 3, 4, 1)
            expected = expected.float() if name == "post_quant_conv.weight" else expected.to(torch.bfloat16)
            assert torch.equal(tensor, expected) and tensor.is_contiguous(), name
