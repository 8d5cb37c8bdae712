"""The CUDA path of Winograd F(2x2, 3x3) (csrc/winograd.cu behind kernels.CompiledKernels.winograd_conv3d), on CPU.

- The adaptor (samples one at a time, bands of tile rows, channel padding, strided destinations) over the emulated
  extension against the portable `winograd.conv3d_winograd`: bit for bit where both run the same GEMMs (one band,
  channels a multiple of 8: the same `winograd_products` call on the same shapes); where the adaptor's GEMMs have
  other extents (row bands, 12 channels computed as 16) the BLAS may sum each product's channels in another order,
  so there the bound is what the rounding points allow (`_reassociation_bound`).
- What the kernels cannot take runs the portable conv itself (the same call, on contiguous operands) and is counted.
- The transform kernels' per-thread code (csrc/winograd_tiles.cuh, host-callable) compiled by nvcc as host code and
  run over the whole grid equals the portable transforms bit for bit (indexing, zero padding, cropping, strides,
  the order of the fp32 adds, the bf16 rounding). The GEMMs need a GPU.
- On a GPU only (skipped elsewhere): the built steps against the emulated ones (transforms bit for bit, GEMMs to
  fp32 rounding) and the whole conv against the portable one and the allowance.
"""

from __future__ import annotations

import collections
import math
import subprocess

import numpy
import pytest
import torch

from _vae_helpers import winograd_out, winograd_problem

from fastvideo_pan2_ext import reference
from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder
from fastvideo_pan2_ext.vae_kernel.definitions.architecture import WAN22_CONFIG, narrow
from fastvideo_pan2_ext.vae_kernel.compiled import build, extension
from fastvideo_pan2_ext.vae_kernel.portable import winograd
from fastvideo_pan2_ext.vae_kernel.definitions.allowance import compare_to_reference
from gpu_check.emulated_extension import EmulatedExtension
from fastvideo_pan2_ext.vae_kernel.compiled.kernels import CompiledKernels, make_ops, winograd_kernel_weights
from fastvideo_pan2_ext.vae_kernel.portable.ops import TORCH_OPS
from fastvideo_pan2_ext.vae_kernel.compiled.selfcheck import random_weights, reference_conv3d

bf16 = torch.bfloat16


def _portable(x, w, b, out_shape, residual):
    expected = torch.empty(out_shape, dtype=bf16)
    winograd.conv3d_winograd(x, winograd.winograd_weights(w, 2), b, expected, residual)
    return expected


# (N, Ti, Hi, W, Ci, Co, kt): odd rows and widths (tile grid cropped), two samples, a 1-column frame, kt = 1, the
# 12-channel conv_out (computed as 16).
SHAPES = [(1, 4, 9, 7, 8, 8, 3), (2, 5, 8, 10, 16, 12, 3), (1, 3, 7, 13, 24, 16, 3), (2, 3, 3, 1, 8, 8, 1)]


def _reassociation_bound(x, w, out_a, out_b):
    """The largest difference the rounding points allow between two F(2x2) convs of the same bf16 operands whose
    GEMMs sum each element's K = kt * Ci exact fp32 products in different orders: |dM| <= 2 K 2^-24 S (S = the
    largest sum of |products|, from the same GEMMs on |V| and |U|), Y = A^T M A adds 9 M terms with coefficients
    +-1, and each side's one rounding to bf16 moves it by at most half a bf16 ulp (2^-8 of its magnitude's binade)."""
    kt, ci = w.shape[1], w.shape[-1]
    u = winograd.winograd_weights(w, 2).float().abs()
    xp = torch.nn.functional.pad(x, (0, 0, 1, 2, 0, 2))
    s = max(winograd.winograd_products(winograd.input_transform(xp[i], 2, bf16).abs(), u).max().item()
            for i in range(x.shape[0]))
    magnitude = torch.maximum(out_a.float().abs(), out_b.float().abs())
    half_ulp = torch.exp2(torch.floor(torch.log2(magnitude.clamp_min(2 ** -126))) - 8)
    return 9 * 2 * kt * ci * 2 ** -24 * s + 2 * half_ulp


@pytest.mark.parametrize("band_bytes", [CompiledKernels.winograd_band_bytes, 1], ids=["one band", "row bands"])
@pytest.mark.parametrize("case", ["plain", "residual", "strided out"])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_path_equals_the_portable_winograd(shape, case, band_bytes):
    n, _, hi, _, _, co, _ = shape
    x, w, b, res = winograd_problem(*shape, seed=11, residual=case == "residual")
    out = winograd_out(*shape, strided=case == "strided out")
    ext = EmulatedExtension()
    kernels = CompiledKernels(ext, collections.Counter())
    kernels.winograd_band_bytes = band_bytes
    kernels.winograd_conv3d(x, winograd_kernel_weights(w), b, out, res)
    expected = _portable(x, w, b, out.shape, res)
    if band_bytes > 1 and co % 8 == 0:  # the portable conv's own GEMMs (one band per sample), on the same shapes
        assert torch.equal(out, expected)
    else:
        diff = (out.float() - expected.float()).abs()
        bound = _reassociation_bound(x, w, out, expected)
        assert bool((diff <= bound).all()), f"max |diff| {diff.max().item()}, over the bound by {(diff - bound).max()}"
    assert not kernels.fallbacks
    tiles_h = math.ceil((hi - 2) / 2)
    bands = 1 if band_bytes > 1 else tiles_h
    steps = [kind for kind, _ in ext.calls]
    assert steps == ["winograd_input_transform", "winograd_products", "winograd_output_transform"] * (n * bands)
    if co % 8:  # the GEMM ran on 16 channels
        assert ext.calls[1][1][-1] == 16


def test_layouts_the_kernels_cannot_take_run_the_portable_winograd_and_are_counted(monkeypatch):
    """The fallback is the portable conv itself: the same function on the same (contiguous) operands, hence the same
    GEMMs and the same video bit for bit on any CPU. (A transposed weight view would send the GEMM to another BLAS
    kernel, whose sums may be ordered differently: equal on some CPUs, not on others.)"""
    x, w, b, res = winograd_problem(1, 4, 6, 5, 8, 8, 3, seed=12, residual=True)
    x12, w12, b12, _ = winograd_problem(1, 4, 6, 5, 12, 8, 3, seed=13)  # channels not a multiple of 8
    out_shape = (1, 2, 4, 5, 8)
    expected = _portable(x, w, b, out_shape, res)
    expected32 = torch.empty(out_shape)  # fp32: the portable definition in fp32 operands
    winograd.conv3d_winograd(x.float(), winograd.winograd_weights(w, 2).float(), b, expected32)
    expected12 = _portable(x12, w12, b12, out_shape, None)

    operands = []
    portable_conv = winograd.conv3d_winograd

    def recorded(x, u, *args, **kwargs):
        operands.append((x.is_contiguous(), u.is_contiguous()))
        return portable_conv(x, u, *args, **kwargs)

    monkeypatch.setattr(winograd, "conv3d_winograd", recorded)
    u = winograd_kernel_weights(w)
    flat = torch.zeros(1 + math.prod(out_shape), dtype=bf16)
    misaligned = flat[1:].view(out_shape)  # 2 bytes past an allocation: no 16-byte access
    ext = EmulatedExtension()
    kernels = CompiledKernels(ext, collections.Counter())
    kernels.winograd_conv3d(x, u, b, misaligned, res)
    assert torch.equal(misaligned, expected)

    out32 = torch.empty(out_shape)
    kernels.winograd_conv3d(x.float(), u.float(), b, out32)
    assert torch.equal(out32, expected32)

    out12 = torch.empty(out_shape, dtype=bf16)
    kernels.winograd_conv3d(x12, winograd_kernel_weights(w12), b12, out12)
    assert torch.equal(out12, expected12)

    assert operands == [(True, True)] * 3  # each fallback ran the portable conv on contiguous operands
    assert ext.calls == []
    assert kernels.fallbacks == {
        "winograd_conv3d: out or residual not 16-byte aligned": 1, "winograd_conv3d: not bf16": 1,
        "winograd_conv3d: 12 input channels, portable by design": 1}
    with pytest.raises(ValueError, match=r"out must be \[1, 2, 4, 5, 8\]"):
        kernels.winograd_conv3d(x, u, b, torch.empty(1, 2, 4, 6, 8, dtype=bf16))


def test_the_table_runs_3x3_convs_by_the_kernels_with_weights_transformed_once():
    ext = EmulatedExtension()
    table = make_ops(ext, winograd_convs=True)
    assert table.name == "compiled+winograd-f2x2"
    x, w, b, res = winograd_problem(1, 4, 6, 5, 8, 16, 3, seed=14, residual=True)
    out = torch.empty(1, 2, 4, 5, 16, dtype=bf16)
    for _ in range(2):
        table.conv3d(x, w, b, out, res)
    assert torch.equal(out, _portable(x, w, b, out.shape, res))
    assert len(table.conv3d.cache) == 1 and [k for k, _ in ext.calls].count("winograd_products") == 2

    ext.calls.clear()
    w1 = torch.randn(16, 3, 1, 1, 8, generator=torch.Generator().manual_seed(15)).to(bf16)  # the time conv: direct
    table.conv3d(x, w1, b, torch.empty(1, 2, 6, 5, 16, dtype=bf16))
    assert [k for k, _ in ext.calls] == ["conv3d"] and len(table.conv3d.cache) == 1
    assert not table.fallbacks

    kept = make_ops(EmulatedExtension(), winograd_convs=True, keep_direct=[(16, 8, 3)])
    kept.conv3d(x, w, b, out, res)
    assert not kept.conv3d.cache


def test_a_narrow_decode_through_the_kernel_path_equals_the_portable_winograd_decode():
    """The real decoder, every (3, 3, 3) conv through the kernel path, against the portable Winograd table over the
    same direct kernels: no fallback, within the allowance of the fp32 reference, and the same video bit for bit.
    Both run the same functions on operands of the same layouts and the same reduction lengths; only conv_out's
    GEMM is wider (12 channels computed as 16). Equality thus rests on what the decoder's own frames_per_pass,
    tile and rank equalities rest on (docs/design.md, "Definitions"): a BLAS/oneDNN call's per-element sums do not
    depend on the extents of the dimensions it does not reduce over."""
    config = narrow(WAN22_CONFIG, 8, z_dim=8)
    state_dict = random_weights(config, seed=0)
    z = torch.randn(1, 8, 3, 5, 7, generator=torch.Generator().manual_seed(7))
    kernel_table = make_ops(EmulatedExtension(), winograd_convs=True)
    portable_table = winograd.winograd_ops(make_ops(EmulatedExtension()), tile=2)
    decoders = [WanVAEDecoder(state_dict, device="cpu", local=True, backend=table, frames_per_pass=2)
                for table in (kernel_table, portable_table)]  # alive: the transformed weights live as theirs do
    videos = [decoder.decode(z) for decoder in decoders]
    assert torch.equal(videos[0], videos[1])
    assert not kernel_table.fallbacks and len(kernel_table.conv3d.cache) == 30
    report = compare_to_reference("kernel-path F(2x2) decode", videos[0],
                                  reference.decode(z, state_dict, torch.float32),
                                  reference.decode(z, state_dict, torch.bfloat16), unit_range=True)
    assert report.ok, report


# --------------------------------------------------------------------------------------------------------------------
# The transform kernels' per-thread code, run on the host
# --------------------------------------------------------------------------------------------------------------------

HOST_DRIVER = r"""
// Runs winograd_tiles.cuh's per-thread functions over the whole grid on the host (no GPU).
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "winograd_tiles.cuh"

using namespace wan22;

static std::vector<uint4> load(const char* path) {  // 16-byte aligned storage
  FILE* f = std::fopen(path, "rb");
  std::fseek(f, 0, SEEK_END);
  const long bytes = std::ftell(f);
  std::fseek(f, 0, SEEK_SET);
  std::vector<uint4> data((bytes + 15) / 16);
  if (std::fread(data.data(), 1, bytes, f) != static_cast<size_t>(bytes)) std::exit(2);
  std::fclose(f);
  return data;
}

static void save(const char* path, const std::vector<uint4>& data, long bytes) {
  FILE* f = std::fopen(path, "wb");
  std::fwrite(data.data(), 1, bytes, f);
  std::fclose(f);
}

// a: storage file (loaded by the caller), element offset, frames, rows, width, channels, 3 strides
static Pixels pixels(char** a, std::vector<uint4>& storage) {
  Pixels p;
  p.data = reinterpret_cast<__nv_bfloat16*>(storage.data()) + std::atol(a[1]);
  p.frames = std::atoi(a[2]); p.rows = std::atoi(a[3]); p.width = std::atoi(a[4]); p.channels = std::atoi(a[5]);
  for (int i = 0; i < 3; ++i) p.stride[i] = std::atol(a[6 + i]);
  return p;
}

int main(int argc, char** argv) {
  const std::string mode = argv[1];
  if (mode == "input") {  // input <x pixels (9)> <v file>
    std::vector<uint4> xs = load(argv[2]);
    const Pixels x = pixels(argv + 2, xs);
    const int tiles_w = (x.width + 1) / 2, tiles = (x.rows - 1) / 2 * tiles_w, vecs = x.channels / 8;
    std::vector<uint4> v(16L * x.frames * tiles * vecs);
    for (int frame = 0; frame < x.frames; ++frame)
      for (int q = 0; q < tiles * vecs; ++q)
        winograd::input_transform_vec(x, v.data(), frame, q / vecs, q % vecs, tiles_w, tiles, vecs);
    save(argv[11], v, v.size() * 16);
  } else {  // output <m> <bias> <out pixels (9)> <out storage bytes> <out file> [<residual pixels (9)>]
    const std::vector<uint4> m = load(argv[2]), bias = load(argv[3]);
    std::vector<uint4> os = load(argv[4]);
    const Pixels out = pixels(argv + 4, os);
    std::vector<uint4> rs;
    Pixels residual;
    if (argc > 15) {
      rs = load(argv[15]);
      residual = pixels(argv + 15, rs);
    }
    const int tiles_w = (out.width + 1) / 2, tiles = (out.rows + 1) / 2 * tiles_w, vecs = out.channels / 4;
    for (int frame = 0; frame < out.frames; ++frame)
      for (int q = 0; q < tiles * vecs; ++q)
        winograd::output_transform_vec(reinterpret_cast<const float4*>(m.data()),
                                       reinterpret_cast<const float*>(bias.data()), out, residual, frame, q / vecs,
                                       q % vecs, tiles_w, tiles, vecs);
    save(argv[14], os, std::atol(argv[13]));
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def host_driver(tmp_path_factory):
    home = build.cuda_home()
    if home is None:
        pytest.skip("no CUDA toolkit (nvcc) on this machine")
    root = tmp_path_factory.mktemp("winograd-host")
    (root / "driver.cu").write_text(HOST_DRIVER)
    done = subprocess.run([f"{home}/bin/nvcc", "-x", "cu", "-std=c++17", "-O2", "-I", str(extension.CSRC),
                           str(root / "driver.cu"), "-o", str(root / "driver")], capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return root


def _write(path, t):
    t.contiguous().view(torch.int16 if t.dtype == bf16 else torch.int32).numpy().tofile(path)


def _read(path, shape, dtype):
    raw = torch.from_numpy(numpy.fromfile(path, dtype="int16" if dtype == bf16 else "int32"))
    return raw.view(dtype).reshape(shape)


def _view_args(path, view):
    """A strided view of its base tensor as the driver's pixels arguments (the storage is written to `path`)."""
    _write(path, view._base if view._base is not None else view)
    return [str(path), str(view.storage_offset()), *map(str, view.shape), *map(str, view.stride()[:3])]


def _order_sensitive(shape, g, spread):
    """Values whose fp32 sums depend on the order of the adds, visibly after rounding to bf16: small integers times
    2^-spread, 1 or 2^spread (large terms cancel exactly in one order and swallow the small ones in another), mixed
    with normal values over many binades."""
    scale = torch.exp2(spread * torch.randint(-1, 2, shape, generator=g).float())
    cancelling = torch.randint(-2, 3, shape, generator=g).float() * scale
    wide = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 13, shape, generator=g).float())
    return torch.where(torch.rand(shape, generator=g) < 0.5, cancelling, wide)


@pytest.mark.parametrize("frames, rows, width, channels", [(2, 9, 7, 8), (3, 6, 10, 24), (1, 3, 1, 16)])
def test_input_transform_vec_equals_the_portable_transform_bit_for_bit(host_driver, frames, rows, width, channels):
    g = torch.Generator().manual_seed(rows * width)
    base = _order_sensitive((frames + 1, rows + 2, width + 3, channels), g, 14).to(bf16)
    x = base[1:, 1:rows + 1, 2:width + 2]  # every stride free, base offset a multiple of 8 elements
    tiles_h, tiles_w = math.ceil((rows - 2) / 2), math.ceil(width / 2)
    args = _view_args(host_driver / "x.bin", x)
    subprocess.run([str(host_driver / "driver"), "input", *args, str(host_driver / "v.bin")], check=True, timeout=60)
    v = _read(host_driver / "v.bin", (16, frames, tiles_h * tiles_w, channels), bf16)
    expected = torch.empty_like(v)
    EmulatedExtension().winograd_input_transform(x, expected)
    assert torch.equal(v.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("frames, rows, width, channels", [(2, 7, 7, 8), (1, 4, 10, 24), (3, 1, 1, 16)])
def test_output_transform_vec_equals_the_portable_transform_bit_for_bit(host_driver, frames, rows, width, channels,
                                                                        residual):
    g = torch.Generator().manual_seed(rows * width + residual)
    tiles = math.ceil(rows / 2) * math.ceil(width / 2)
    m = _order_sensitive((16, frames, tiles, channels), g, 24)
    bias = _order_sensitive((channels,), g, 24)
    sentinel = torch.full((frames + 1, rows + 1, width + 2, channels), 7.0, dtype=bf16)
    out = sentinel[1:, :rows, 1:width + 1]
    res = _order_sensitive((frames, rows + 3, width, channels), g, 24).to(bf16)[:, 2:rows + 2] if residual else None
    _write(host_driver / "m.bin", m)
    _write(host_driver / "bias.bin", bias)
    out_args = _view_args(host_driver / "out.bin", out)
    res_args = _view_args(host_driver / "res.bin", res) if residual else []
    subprocess.run([str(host_driver / "driver"), "output", str(host_driver / "m.bin"), str(host_driver / "bias.bin"),
                    *out_args, str(sentinel.numel() * 2), str(host_driver / "out2.bin"), *res_args],
                   check=True, timeout=60)
    stored = _read(host_driver / "out2.bin", sentinel.shape, bf16)
    expected = sentinel.clone()
    EmulatedExtension().winograd_output_transform(m, bias, expected[1:, :rows, 1:width + 1], res)
    assert torch.equal(stored.view(torch.int16), expected.view(torch.int16))  # and nothing outside `out` written


# --------------------------------------------------------------------------------------------------------------------
# On a GPU (skipped elsewhere): the built kernels against the emulated steps and the portable conv
# --------------------------------------------------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def built():
    cuda = torch.device("cuda")
    return extension.build_extension(extension.arch_for_device(cuda))


GPU_SHAPES = SHAPES + [(1, 6, 18, 30, 256, 256, 3), (2, 4, 11, 21, 48, 64, 3)]


@needs_gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_built_steps_equal_the_emulated_steps(built, shape):
    """Transforms bit for bit; the GEMMs (fp32 accumulation in another order) to fp32 rounding."""
    _, ti, hi, width, ci, co, kt = shape
    co += -co % 8
    x, w, _, _ = winograd_problem(1, ti, hi, width, ci, co, kt, seed=21)
    x, u = x[0].cuda(), winograd_kernel_weights(w.cuda())
    tiles = math.ceil((hi - 2) / 2) * math.ceil(width / 2)
    emulated = EmulatedExtension()
    v, v_ref = (torch.empty(16, ti, tiles, ci, dtype=bf16, device="cuda") for _ in range(2))
    built.winograd_input_transform(x, v)
    emulated.winograd_input_transform(x, v_ref)
    assert torch.equal(v.view(torch.int16), v_ref.view(torch.int16))
    m, m_ref = (torch.empty(16, ti - kt + 1, tiles, co, device="cuda") for _ in range(2))
    built.winograd_products(v, u, m)
    emulated.winograd_products(v, u, m_ref)
    torch.testing.assert_close(m, m_ref, rtol=1e-5, atol=1e-5 * m_ref.abs().max().item())
    b = torch.randn(co, device="cuda")
    res = torch.randn(ti - kt + 1, hi - 2, width, co, device="cuda").to(bf16)
    out, out_ref = (torch.empty(ti - kt + 1, hi - 2, width, co, dtype=bf16, device="cuda") for _ in range(2))
    built.winograd_output_transform(m_ref, b, out, res)
    emulated.winograd_output_transform(m_ref, b, out_ref, res)
    assert torch.equal(out.view(torch.int16), out_ref.view(torch.int16))


@needs_gpu
@pytest.mark.parametrize("band_bytes", [CompiledKernels.winograd_band_bytes, 1], ids=["one band", "row bands"])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_built_winograd_conv_meets_the_allowance_and_matches_the_portable_one(built, shape, band_bytes):
    n, ti, hi, width, _, co, kt = shape
    x, w, b, res = (t.cuda() for t in winograd_problem(*shape, seed=22, residual=True))
    out_shape = (n, ti - kt + 1, hi - 2, width, co)
    out = torch.zeros(n, out_shape[1] + 2, *out_shape[2:], dtype=bf16, device="cuda")[:, 2:]  # strided frames
    kernels = CompiledKernels(built, collections.Counter())
    kernels.winograd_band_bytes = band_bytes
    kernels.winograd_conv3d(x, winograd_kernel_weights(w), b, out, res)
    torch.cuda.synchronize()
    assert not kernels.fallbacks
    portable = _portable(x.cpu(), w.cpu(), b.cpu(), out_shape, res.cpu())
    assert (out.cpu().float() - portable.float()).abs().max() <= 2 ** -6 * portable.float().abs().max()
    direct = torch.empty(out_shape, dtype=bf16)
    TORCH_OPS.conv3d(x.cpu(), w.cpu(), b.cpu(), direct, res.cpu())
    fp32 = reference_conv3d(x.cpu().float(), w.cpu().float(), b.cpu(), res.cpu().float())
    report = compare_to_reference(f"built F(2x2) {shape}", out.cpu(), fp32, direct)
    assert report.ok, report
