"""The CPU compute layout (`weights.to_compute_layout`): on a CPU that computes in fp32, fp32 weights holding the bf16
values, the wide 3x3 convs channels first, every conv run in calls of one image and a fixed number of rows; on one
with AMX-BF16, the weights as prepared (bf16, channels last) and prepacked for oneDNN, every conv on AMX however
small. A decoder wide enough to run both fp32 layouts stays within the allowance and gives the same video bit for
bit for every frames_per_pass and tile size. An AMX-BF16 CPU whose oneDNN is capped below AMX (ONEDNN_MAX_CPU_ISA)
computes in fp32; without torch's private oneDNN ops the bf16 convs run unpacked, with one warning."""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _decoder_allowance import Oracle, check_allowance
from _threads import torch_threads
from _vae_helpers import random_wan22_decoder_weights

from fastvideo_pan2_ext import reference
from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder
from fastvideo_pan2_ext.vae_kernel.portable import ops
from fastvideo_pan2_ext.vae_kernel.portable.weights import (
    CPU_CHANNELS_FIRST_MIN,
    load,
    prepare,
    subpixel_weights,
    to_compute_layout,
)


REPO = Path(__file__).resolve().parents[2]
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


def test_load_prepacks_every_conv_weight_where_the_cpu_computes_in_bf16(wan22_state_dict, cpu_compute):
    _, prepared = load(wan22_state_dict, torch.device("cpu"), cpu_compute_layout=True)
    convs = [name for name, t in prepared.items() if t.dim() >= 5 and name != "post_quant_conv.weight"]
    assert len(convs) > 30 and any(prepared[name].dim() == 6 for name in convs)  # the upsamplers' sub-pixel weights
    assert [name for name in convs if ops.prepacked(prepared[name])] == (convs if cpu_compute == torch.bfloat16 else [])
    assert not ops.prepacked(prepared["post_quant_conv.weight"])  # applied by the decoder itself, in fp32


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


@pytest.mark.slow
def test_wide_decoder_gives_the_same_video_within_the_allowance_for_every_pass_and_tile(wide_model, cpu_compute):
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
    for what, video in videos.items():  # before fp32 row blocks: 11,060 values (4 frames per pass) one bf16 step off
        check_allowance(video, ref32, release)
        assert torch.equal(video, videos[1]), f"{what}: {int((video != videos[1]).sum())} values differ"


def test_tiny_call_rows_pad_a_cpu_bf16_conv_to_the_minimum_pixels(cpu_compute):
    cpu, rows = torch.device("cpu"), ops.tiny_call_rows
    if cpu_compute == torch.float32:
        assert rows((1, 1, 3), cpu) == 0
        return
    assert rows((1, 1, 3), cpu) == 21 and (1 + 21) * 3 >= ops.MIN_BF16_CPU_PIXELS  # 22 rows of 3 pixels
    assert rows((2, 3, 4), cpu) == 5  # 2 frames x 8 rows x 4 pixels = 64
    assert rows((2, 8, 4), cpu) == 0 and rows((7, 13), cpu) == 0  # big enough already (one image of 91 pixels)
    assert rows((1, 1, 3), torch.device("meta")) == 0  # a GPU (or the planner's meta tensors) never pads


def test_fp32_call_rows_give_a_block_of_about_512_pixels_splitting_the_frame_evenly():
    assert ops.fp32_call_rows(100) == 6 and ops.fp32_call_rows(600) == 1 and ops.fp32_call_rows(3) == 171
    with ops.frame_shape(4, 50):  # a frame 4 x 50 latents: 8 x 100 pixels at the level 100 pixels wide
        assert ops.fp32_call_rows(100) == 4 and ops.fp32_call_rows(10) == 1  # 8 rows: two blocks of 4, not 6 + 2
        with ops.frame_shape(2, 50):  # 4 x 100 pixels: one block of the frame's 4 rows
            assert ops.fp32_call_rows(100) == 4 and ops.fp32_call_rows(3) == 1
        with ops.frame_shape(10, 16):  # 20 x 32 pixels: two blocks of 10 rows, not 16 + 16 (12 of them zeros)
            assert ops.fp32_call_rows(32) == 10
        with ops.frame_shape(9, 16):  # 18 x 32 pixels: two blocks of 9 rows, not 16 + 16
            assert ops.fp32_call_rows(32) == 9
        assert ops.fp32_call_rows(100) == 4
    assert ops.fp32_call_rows(100) == 6  # the frame's shape holds inside its block only


@pytest.mark.slow
@pytest.mark.parametrize("activations", [torch.bfloat16, torch.float32], ids=["bf16 (decoder)", "fp32 (encoder)"])
def test_an_fp32_cpu_conv_gives_every_row_the_same_sums_whatever_frames_and_rows_its_call_holds(fp32_cpu,
                                                                                               activations):
    """oneDNN's fp32 conv chooses its blocking from a call's extents: on AMD EPYC a 128-channel 3x3x3 conv over 24 x 16
    pixels summed some rows of a call of one frame of 4 rows, or of 8 frames of 24 rows, in another order than the same
    rows of other calls (before row blocks, three of the calls below gave rows a bf16 step apart). In row blocks of one
    image each (`ops._conv`) every call of the layer has the same extents. With fp32 activations (the encoder's) oneDNN
    adds each block straight into the destination, a frame's last, short block through a spare one, with the
    residual in it: the rows are the same whichever way they came, and the sum is the residual added to the conv."""
    channels, frames, rows, width = 128, 6, 24, 16
    x = _bf16(1, frames + 2, rows + 2, width, channels, seed=21).to(activations)
    w = prepare("c.weight", _bf16(channels, channels, 3, 3, 3, seed=22) / (27 * channels) ** 0.5)
    b = torch.randn(channels, generator=torch.Generator().manual_seed(23))
    residual = _bf16(1, frames, rows, width, channels, seed=24).to(activations)
    differ = {}
    # One block of 24 rows per call; blocks of 5 and of 1 row, several per call (a frame 5 or 1 rows per 16 columns).
    for frame in [None, (5, 16), (1, 16)]:
        with torch_threads(), ops.frame_shape(*frame) if frame else contextlib.nullcontext():
            whole = torch.empty(1, frames, rows, width, channels, dtype=activations)
            ops.conv3d(x, to_compute_layout(w), b, whole)
            summed = torch.empty_like(whole)
            ops.conv3d(x, to_compute_layout(w), b, summed, residual)
            assert torch.equal(summed, (whole.float() + residual.float()).to(activations)) or activations != \
                torch.float32, frame
            for (t0, t1), (r0, r1) in itertools.product([(0, 1), (2, 3), (1, 4), (0, 6), (3, 6)],
                                                        [(0, 1), (5, 6), (0, 4), (3, 11), (8, 24), (17, 24), (0, 24)]):
                part = torch.empty(1, t1 - t0, r1 - r0, width, channels, dtype=activations)
                ops.conv3d(x[:, t0:t1 + 2, r0:r1 + 2].contiguous(), to_compute_layout(w), b, part)
                if not torch.equal(part, whole[:, t0:t1, r0:r1]):
                    differ[(frame, t0, t1, r0, r1)] = int((part != whole[:, t0:t1, r0:r1]).sum())
                ops.conv3d(x[:, t0:t1 + 2, r0:r1 + 2].contiguous(), to_compute_layout(w), b, part,
                           residual[:, t0:t1, r0:r1].contiguous())
                if not torch.equal(part, summed[:, t0:t1, r0:r1]):
                    differ[(frame, t0, t1, r0, r1, "residual")] = int((part != summed[:, t0:t1, r0:r1]).sum())
    assert not differ


@pytest.mark.skipif(not AMX_BF16, reason="a CPU without AMX-BF16 computes in fp32 and never pads a call")
def test_a_one_row_band_of_a_narrow_frame_gives_the_rows_the_whole_frame_gives():
    """oneDNN runs a bf16 conv of at most 4 output pixels per image on AVX512-BF16 instead of AMX, which sums in
    another order; padded to MIN_BF16_CPU_PIXELS, every tiny call takes the AMX kernel, so bands and passes of any
    size give the whole frame's rows bit for bit, at every conv shape of the decoder (3x3x3, time conv, 1x1, the
    sub-pixel upsample)."""
    for ci, co, (kt, kh, kw) in [(16, 16, (3, 3, 3)), (64, 64, (3, 3, 3)), (32, 64, (3, 1, 1)), (32, 64, (1, 1, 1)),
                                 (16, 12, (3, 3, 3))]:
        for width in (1, 3):
            x = _bf16(1, 4 + kt - 1, 8 + kh - 1, width, ci, seed=ci + width)
            w = prepare("c.weight", _bf16(co, ci, kt, kh, kw, seed=co) / (ci * kt * kh * kw) ** 0.5)
            ops.prepack(w)  # as `weights.load` does
            b = torch.randn(co, generator=torch.Generator().manual_seed(3))
            whole = torch.empty(1, 4, 8, width, co, dtype=torch.bfloat16)
            ops.conv3d(x, w, b, whole)
            for frames, rows in [(1, 1), (1, 2), (2, 1), (3, 4)]:
                part = torch.empty(1, frames, rows, width, co, dtype=torch.bfloat16)
                ops.conv3d(x[:, :frames + kt - 1, :rows + kh - 1].contiguous(), w, b, part)
                assert torch.equal(part, whole[:, :frames, :rows]), (ci, co, kt, kh, width, frames, rows)
    w_sub = subpixel_weights(_bf16(64, 64, 3, 3, seed=5).float() / 24)
    ops.prepack(w_sub)
    x, b = _bf16(4, 10, 2, 64, seed=6), torch.randn(64, generator=torch.Generator().manual_seed(7))
    whole = torch.empty(4, 16, 4, 64, dtype=torch.bfloat16)
    ops.upsample2x_conv3x3(x, w_sub, b, whole)
    for frames, (r0, r1) in [(1, (0, 1)), (2, (3, 4)), (4, (2, 6))]:
        part = torch.empty(frames, 2 * (r1 - r0), 4, 64, dtype=torch.bfloat16)
        ops.upsample2x_conv3x3(x[:frames, r0:r1 + 2].contiguous(), w_sub, b, part)
        assert torch.equal(part, whole[:frames, 2 * r0:2 * r1]), (frames, r0, r1)


@pytest.mark.skipif(not AMX_BF16, reason="a CPU without AMX-BF16 computes in fp32 and never pads a call")
def test_a_narrow_frame_gives_the_same_video_frame_by_frame_and_two_frames_per_pass():
    """The padding's purpose at the scale of a decode (the test above checks single convs, where few channels and
    rounding luck can hide another kernel): a frame one latent pixel wide, decoded two frames per pass (8 output
    pixels per call at the latent level) and frame by frame (4: oneDNN's AVX512-BF16 kernel, were it not padded),
    gives one video bit for bit at decoder width 32 (128-channel layers)."""
    sd = random_wan22_decoder_weights(seed=3, z_dim=4, decoder_base_dim=32)
    z = torch.randn((1, 4, 3, 4, 1), generator=torch.Generator().manual_seed(4))
    whole = WanVAEDecoder(sd, device="cpu", frames_per_pass=2, backend="torch").decode(z)
    frame_by_frame = WanVAEDecoder(sd, device="cpu", frames_per_pass=1, backend="torch").decode(z)
    assert torch.equal(frame_by_frame, whole)


_EVERY_CONV_OF_A_BANDED_DECODE = """
import torch
from _threads import torch_threads
from _vae_helpers import random_wan22_decoder_weights
from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder
torch.set_num_threads(1)
sd = random_wan22_decoder_weights(seed=3, z_dim=4, decoder_base_dim=16)
z = torch.randn((1, 4, 2, 3, 1), generator=torch.Generator().manual_seed(4))
WanVAEDecoder(sd, device="cpu", frames_per_pass=1, backend="torch", tile_rows=1).decode(z)
"""


@pytest.mark.skipif(not AMX_BF16, reason="a CPU without AMX-BF16 computes in fp32 and never pads a call")
def test_every_conv_of_a_one_row_banded_decode_takes_onednns_amx_kernel():
    """The mechanism behind the test above, which rounding luck could pass: oneDNN names the kernel of every conv it
    runs (ONEDNN_VERBOSE). Decoded in 1-row tiles of a frame 1 latent pixel wide, frame by frame, every call is as
    small as a decode makes them, and each must still run on AMX."""
    env = {**os.environ, "ONEDNN_VERBOSE": "1", "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    run = subprocess.run([sys.executable, "-c", _EVERY_CONV_OF_A_BANDED_DECODE], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    kernels = collections.Counter(line.split(",")[6] for line in run.stdout.splitlines()
                                  if line.startswith("onednn_verbose") and ",exec,cpu,convolution," in line)
    assert sum(kernels.values()) > 50, kernels
    assert all("amx" in kernel for kernel in kernels), kernels


def test_a_prepacked_weight_changed_in_place_is_used_as_it_now_is(cpu_compute):
    x = _bf16(1, 4, 5, 6, 32, seed=8)
    w = prepare("c.weight", _bf16(32, 32, 3, 3, 3, seed=9) / 30)
    b = torch.zeros(32)
    ops.prepack(w)
    assert ops.prepacked(w) == (cpu_compute == torch.bfloat16)
    w.mul_(-1)  # the same tensor, new values: a stale blocked copy would give the old result
    flipped, negated = (torch.empty(1, 2, 3, 6, 32, dtype=torch.bfloat16) for _ in range(2))
    ops.conv3d(x, w, b, flipped)
    ops.conv3d(x, w.clone(), b, negated)  # a fresh tensor of the same values, never prepacked
    assert not ops.prepacked(w) and torch.equal(flipped, negated)


_COMPUTE_DTYPE_WITH_AMX_BF16 = """
import torch
capabilities = {**torch.cpu.get_capabilities(), "amx_tile": True, "amx_bf16": True}
torch.cpu.get_capabilities = lambda: capabilities  # this CPU, given the AMX-BF16 of a 4th-generation Xeon
torch.cpu._is_amx_tile_supported = lambda: True  # ... which its kernel lets this process use
from fastvideo_pan2_ext.vae_kernel.portable import ops
print(ops.compute_dtype(torch.device("cpu")))
"""
_ISA_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


@pytest.mark.slow
@pytest.mark.parametrize("cap, computes", [
    ({}, torch.bfloat16),
    ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, torch.float32),  # the level just below AMX
    ({"ONEDNN_MAX_CPU_ISA": "avx2"}, torch.float32),  # oneDNN takes either case
    ({"DNNL_MAX_CPU_ISA": "AVX10_1_512"}, torch.float32),  # the older name
    ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX", "DNNL_MAX_CPU_ISA": "AVX2"}, torch.bfloat16),  # the new name wins
], ids=["uncapped", "avx512_core_bf16", "avx2", "dnnl-avx10_1_512", "amx"])
def test_an_amx_cpu_whose_onednn_is_capped_below_amx_computes_in_fp32(cap, computes):
    """oneDNN reads ONEDNN_MAX_CPU_ISA once per process: each setting gets a process of its own."""
    env = {k: v for k, v in os.environ.items() if k not in _ISA_VARIABLES}
    env.update(cap, PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-c", _COMPUTE_DTYPE_WITH_AMX_BF16], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-1] == str(computes)


class _OpsWithout:
    """torch.ops.mkldnn as a torch release without the op `missing` would have it."""

    def __init__(self, namespace, missing: str) -> None:
        self._namespace, self._missing = namespace, missing

    def __getattr__(self, name: str):
        if name == self._missing:
            raise AttributeError(f"'_OpNamespace' 'mkldnn' object has no attribute '{name}'")
        return getattr(self._namespace, name)


@pytest.fixture
def private_onednn_restored(monkeypatch):
    """Whatever the test takes away, the process gets torch's private oneDNN ops back afterwards."""
    monkeypatch.setattr(ops, "_private_onednn_usable", True)


@pytest.fixture(scope="module")
def prepacked_decode(wan22_vae, wan22_state_dict):
    """Latents, their fp32 reference and release decodes, and the portable decode as an AMX-BF16 CPU runs it."""
    z = torch.randn((1, 8, 3, 3, 4), generator=torch.Generator().manual_seed(23))
    ref32, release = Oracle(wan22_vae, wan22_state_dict).decodes(z, ())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ops, "cpu_has_amx_bf16", lambda: True)
        video = WanVAEDecoder(wan22_state_dict, device="cpu", frames_per_pass=2, backend="torch").decode(z)
    return z, ref32, release, video


@pytest.mark.parametrize("op, taken", [("_reorder_convolution_weight", "missing"),
                                       ("_convolution_pointwise", "refusing its arguments")])
def test_without_torchs_private_onednn_ops_the_bf16_convs_run_unpacked_with_one_warning(
        wan22_state_dict, amx_bf16_cpu, prepacked_decode, private_onednn_restored, monkeypatch, caplog, op, taken):
    z, ref32, release, prepacked = prepacked_decode
    if taken == "missing":
        monkeypatch.setattr(torch.ops, "mkldnn", _OpsWithout(torch.ops.mkldnn, op))
    else:  # the real op, called as a torch release that changed its arguments would be: one argument short
        real = getattr(torch.ops.mkldnn, op)
        monkeypatch.setattr(torch.ops.mkldnn, op, lambda *args: real(*args[:-1]))
    ops.logger.addHandler(caplog.handler)  # whatever logging setup an earlier test left behind
    try:
        with caplog.at_level(logging.WARNING):
            decoder = WanVAEDecoder(wan22_state_dict, device="cpu", frames_per_pass=2, backend="torch")
            video = decoder.decode(z)
    finally:
        ops.logger.removeHandler(caplog.handler)
    warnings = {id(r): r.getMessage() for r in caplog.records if r.name == ops.logger.name}
    [warning] = warnings.values()
    assert f"torch.ops.mkldnn.{op} is missing or refuses its arguments" in warning, warning
    assert not any(ops.prepacked(w) for w in decoder.weights.values())
    check_allowance(prepacked, ref32, release)
    check_allowance(video, ref32, release)


def test_an_amx_cpu_whose_kernel_withholds_the_tiles_computes_in_fp32(monkeypatch):
    """AMX-BF16 in the CPU's flags is not enough: the kernel must let the process use the tiles (a kernel or sandbox
    that does not leaves oneDNN on its kernels of a CPU without AMX)."""
    capabilities = {**torch.cpu.get_capabilities(), "amx_tile": True, "amx_bf16": True}
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: capabilities)
    for variable in _ISA_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    probe = ops.cpu_has_amx_bf16.__wrapped__  # uncached: the test's own answers
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert probe() is False
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert probe() is torch.backends.mkldnn.is_available()
