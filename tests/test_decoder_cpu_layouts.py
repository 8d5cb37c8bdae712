"""The CPU compute layout (`weights.to_compute_layout`): on a CPU that computes in fp32, fp32 weights holding the bf16
values, the wide 3x3 convs channels first; on one with AMX-BF16, the weights as prepared (bf16, channels last). A
decoder wide enough to run both fp32 layouts stays within the allowance and gives the same video, to one bf16 step,
for every frames_per_pass and tile size, on either kind of CPU."""

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


AMX_BF16 = ops.cpu_has_amx_bf16()  # this CPU's own answer (the `cpu_compute` fixture replaces the probe)


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_cpu_weights_are_held_in_the_compute_dtype_wide_3x3_convs_channels_first_in_fp32(cpu_compute):
    wide, narrow = CPU_CHANNELS_FIRST_MIN, CPU_CHANNELS_FIRST_MIN // 2
    cases = {"wide 3x3": ((wide, wide, 3, 3, 3), True), "narrow in": ((wide, narrow, 3, 3, 3), False),
             "wide 1x1": ((wide, wide, 1, 1, 1), False), "wide time conv": ((wide, wide, 3, 1, 1), False)}
    for what, (shape, channels_first) in cases.items():
        bf16 = prepare("c.weight", _bf16(*shape, seed=1))  # [Co, kt, kh, kw, Ci] bf16
        cpu = to_compute_layout(bf16)
        if cpu_compute == torch.bfloat16:  # AMX-BF16: bf16 channels last is the fastest at every shape
            assert cpu is bf16, what
            continue
        assert cpu.dtype == torch.float32 and cpu.shape == bf16.shape and torch.equal(cpu, bf16.float()), what
        assert ops.computes_channels_first(cpu) == channels_first, what
        if not channels_first:
            assert cpu.is_contiguous(), what
    gamma = torch.rand(8)
    assert to_compute_layout(gamma) is gamma  # fp32 tensors are left as prepared


def test_conv3d_gives_the_same_result_from_either_weight_layout_and_dtype_within_rounding(cpu_compute):
    x = _bf16(1, 4, 5, 6, 64, seed=2)
    w = prepare("c.weight", _bf16(32, 64, 3, 3, 3, seed=3) / 40)
    b = torch.randn(32, generator=torch.Generator().manual_seed(4))
    residual = _bf16(1, 2, 3, 6, 32, seed=5)
    layouts = {"as prepared (bf16, as on a GPU)": w, "fp32 channels last": w.float(),
               "fp32 channels first": w.permute(0, 4, 1, 2, 3).float().contiguous().permute(0, 2, 3, 4, 1)}
    exact = torch.nn.functional.conv3d(x.double().permute(0, 4, 1, 2, 3), w.double().permute(0, 4, 1, 2, 3),
                                       b.double(), padding=(0, 0, 1)).permute(0, 2, 3, 4, 1) + residual.double()
    for what, weight in layouts.items():  # each converted to the compute dtype where it is not in it
        out = torch.empty(1, 2, 3, 6, 32, dtype=torch.bfloat16)
        ops.conv3d(x, weight, b, out, residual)
        # one rounding on store, and in bf16 one more: the conv's result before the residual is added
        torch.testing.assert_close(out.double(), exact, rtol=2 ** -7 if cpu_compute == torch.float32 else 2 ** -6,
                                   atol=2 ** -6, msg=what)


@pytest.fixture(scope="module")
def wide_model():
    """A decoder of widths 512 (mid block, up blocks 0-1: channels first on CPU), 256 and 128 (channels last)."""
    sd = random_wan22_decoder_weights(seed=11, z_dim=4, decoder_base_dim=CPU_CHANNELS_FIRST_MIN // 4)
    z = torch.randn((1, 4, 3, 3, 2), generator=torch.Generator().manual_seed(12))
    return sd, z, reference.decode(z, sd, torch.float32), reference.decode(z.to(torch.bfloat16), sd, torch.bfloat16)


def test_wide_decoder_runs_its_layouts_within_the_allowance_for_every_pass_and_tile(wide_model, cpu_compute):
    if cpu_compute == torch.bfloat16 and not AMX_BF16:
        pytest.skip("a CPU without AMX-BF16 never decodes in bf16 (and its bf16 convs take minutes here)")
    sd, z, ref32, release = wide_model
    _, prepared = load(sd, torch.device("cpu"), cpu_compute_layout=True)
    convs = {n: t for n, t in prepared.items() if n.endswith(".weight") and n != "post_quant_conv.weight"}
    assert all(t.dtype == cpu_compute for t in convs.values())
    channels_first = {n for n, t in convs.items() if t.dim() == 5 and ops.computes_channels_first(t)}
    if cpu_compute == torch.float32:
        assert "decoder.mid_block.resnets.0.conv1.weight" in channels_first
        assert not channels_first & {"decoder.conv_out.weight", "decoder.up_blocks.3.resnets.0.conv1.weight"}
    else:
        assert not channels_first
    videos = {fp: WanVAEDecoder(sd, device="cpu", frames_per_pass=fp, backend="torch").decode(z) for fp in (1, 4)}
    videos["tiles"] = WanVAEDecoder(sd, device="cpu", frames_per_pass=2, backend="torch", tile_rows=1).decode(z)
    for what, video in videos.items():
        check_allowance(video, ref32, release)
        diff = (video.float() - videos[1].float()).abs().max().item()
        assert diff <= 2 ** -7, f"{what} differs from the frame-by-frame decode by {diff}"
