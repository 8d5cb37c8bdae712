"""The CPU compute layout (`weights.to_compute_layout`): fp32 weights holding the bf16 values, the wide 3x3 convs
channels first; a decoder wide enough to run both layouts stays within the allowance and gives the same video for
every frames_per_pass and tile size."""

from __future__ import annotations

import pytest
import torch
from _decoder_allowance import check_allowance
from _vae_helpers import random_wan22_decoder_weights

from fastvideo_pan2_ext import reference
from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder
from fastvideo_pan2_ext.vae_kernel.portable import ops
from fastvideo_pan2_ext.vae_kernel.portable.weights import (
    CPU_CHANNELS_FIRST_MIN,
    load,
    prepare,
    to_compute_layout,
)


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_cpu_weights_are_fp32_of_the_same_values_wide_3x3_convs_channels_first():
    wide, narrow = CPU_CHANNELS_FIRST_MIN, CPU_CHANNELS_FIRST_MIN // 2
    cases = {"wide 3x3": ((wide, wide, 3, 3, 3), True), "narrow in": ((wide, narrow, 3, 3, 3), False),
             "wide 1x1": ((wide, wide, 1, 1, 1), False), "wide time conv": ((wide, wide, 3, 1, 1), False)}
    for what, (shape, channels_first) in cases.items():
        bf16 = prepare("c.weight", _bf16(*shape, seed=1))  # [Co, kt, kh, kw, Ci] bf16
        cpu = to_compute_layout(bf16)
        assert cpu.dtype == torch.float32 and cpu.shape == bf16.shape and torch.equal(cpu, bf16.float()), what
        assert ops.computes_channels_first(cpu) == channels_first, what
        if not channels_first:
            assert cpu.is_contiguous(), what
    gamma = torch.rand(8)
    assert to_compute_layout(gamma) is gamma  # fp32 tensors are left as prepared


def test_conv3d_gives_the_same_result_from_either_weight_layout_within_rounding():
    x = _bf16(1, 4, 5, 6, 64, seed=2)
    w = prepare("c.weight", _bf16(32, 64, 3, 3, 3, seed=3) / 40)
    b = torch.randn(32, generator=torch.Generator().manual_seed(4))
    residual = _bf16(1, 2, 3, 6, 32, seed=5)
    outs = []
    for layout in (w.float(), w.permute(0, 4, 1, 2, 3).float().contiguous().permute(0, 2, 3, 4, 1)):
        out = torch.empty(1, 2, 3, 6, 32, dtype=torch.bfloat16)
        ops.conv3d(x, layout, b, out, residual)
        outs.append(out.float())
    plain = torch.empty(1, 2, 3, 6, 32, dtype=torch.bfloat16)
    ops.conv3d(x, w, b, plain, residual)  # bf16 weights (as on a GPU): converted per call, the same arithmetic
    for out in outs:
        torch.testing.assert_close(out, plain.float(), rtol=2 ** -7, atol=2 ** -6)


@pytest.fixture(scope="module")
def wide_model():
    """A decoder of widths 512 (mid block, up blocks 0-1: channels first on CPU), 256 and 128 (channels last)."""
    sd = random_wan22_decoder_weights(seed=11, z_dim=4, decoder_base_dim=CPU_CHANNELS_FIRST_MIN // 4)
    z = torch.randn((1, 4, 3, 3, 2), generator=torch.Generator().manual_seed(12))
    return sd, z, reference.decode(z, sd, torch.float32), reference.decode(z.to(torch.bfloat16), sd, torch.bfloat16)


def test_wide_decoder_runs_both_layouts_within_the_allowance_for_every_pass_and_tile(wide_model):
    sd, z, ref32, release = wide_model
    _, prepared = load(sd, torch.device("cpu"), cpu_compute_layout=True)
    assert all(t.dtype == torch.float32 for t in prepared.values())
    channels_first = {n for n, t in prepared.items() if t.dim() == 5 and ops.computes_channels_first(t)}
    assert "decoder.mid_block.resnets.0.conv1.weight" in channels_first
    assert not channels_first & {"decoder.conv_out.weight", "decoder.up_blocks.3.resnets.0.conv1.weight"}
    videos = {fp: WanVAEDecoder(sd, device="cpu", frames_per_pass=fp, backend="torch").decode(z) for fp in (1, 4)}
    videos["tiles"] = WanVAEDecoder(sd, device="cpu", frames_per_pass=2, backend="torch", tile_rows=1).decode(z)
    for what, video in videos.items():
        check_allowance(video, ref32, release)
        diff = (video.float() - videos[1].float()).abs().max().item()
        assert diff <= 2 ** -7, f"{what} differs from the frame-by-frame decode by {diff}"
