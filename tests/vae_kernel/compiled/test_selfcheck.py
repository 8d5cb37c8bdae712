"""The compiled backend's op layer, runtime self-check and loader, on CPU.

The CUDA kernels cannot run here, so the extension is `EmulatedExtension`: the binding's functions in torch, same
argument order, checks and rounding points. Everything above it is the real code: `kernels.make_ops` (sub-pixel
upsample as one 4-phase conv, channel padding, counted fallbacks), the self-check's production-shape cases, the
allowance, the child-process verification and the loader's once-per-process memory behind "auto" and "cuda".
"""

from __future__ import annotations

import collections
import dataclasses
import os
import subprocess
import sys
import warnings

import pytest
import torch

from fastvideo_pan2_ext.vae_kernel.compiled import loader, selfcheck, verification
from fastvideo_pan2_ext.vae_kernel.portable import ops, weights
from fastvideo_pan2_ext.vae_kernel.definitions.allowance import compare_to_reference
from fastvideo_pan2_ext.vae_kernel.definitions.architecture import WAN22_CONFIG
from gpu_check.emulated_extension import EmulatedExtension, stand_in
from fastvideo_pan2_ext.vae_kernel.compiled.extension import CompiledUnavailable
from fastvideo_pan2_ext.vae_kernel.compiled.kernels import CompiledKernels, make_ops

CPU = torch.device("cpu")
# One op shape per kind, narrow: the loader tests judge tables, not shapes (the full set is proven below).
NARROW = (selfcheck.DECODE_CHECK_CONFIG,)


def test_the_self_check_covers_every_op_shape_of_the_real_decoder():
    signatures = {str(s) for s in selfcheck.op_signatures((WAN22_CONFIG,))}
    for shape in ("conv3d 48 -> 1024 k3x3x3",  # conv_in: 48 latent channels
                  "conv3d 256 -> 12 k3x3x3",  # conv_out: 12 outputs, padded to 16 by the adaptor
                  "conv3d 1024 -> 1024 k3x3x3 + residual", "conv3d 1024 -> 2048 k3x1x1",  # the time conv
                  "conv3d 1024 -> 512 k1x1x1",  # a shortcut
                  "upsample2x_conv3x3 1024 -> 1024 k1x3x3", "upsample2x_conv3x3 512 -> 512 k1x3x3",
                  "rms_norm_silu 1024 -> 1024 no silu", "rms_norm_silu 256 -> 256 into a strided window"):
        assert shape in signatures, sorted(signatures)
    assert len(signatures) == 25


def test_the_self_check_covers_every_op_shape_of_the_real_encoders_but_conv_in():
    decoders = selfcheck.op_signatures(selfcheck.SUPPORTED_CONFIGS, ())
    encoders = {str(s) for s in selfcheck.op_signatures((), selfcheck.SUPPORTED_ENCODER_CONFIGS)}
    assert {str(s) for s in selfcheck.op_signatures()} == {str(s) for s in decoders} | encoders
    for shape in ("conv3d 160 -> 160 k3x3x3 + residual", "conv3d 320 -> 640 k3x3x3",  # Wan2.2's widths
                  "conv3d 640 -> 1280 k1x1x1",  # the attention's keys and values
                  "conv3d 384 -> 32 k3x3x3",  # Wan2.1's conv_out: mean and logvar of 16 channels
                  "rms_norm_silu 640 -> 640 no silu", "rms_norm_silu 160 -> 160 into a strided window"):
        assert shape in encoders, sorted(encoders)
    # conv_in's 12 (Wan2.2) and 3 (Wan2.1) input channels: recorded, and skipped by the self-check (portable)
    assert {"conv3d 12 -> 160 k3x3x3", "conv3d 3 -> 96 k3x3x3"} <= encoders


@pytest.mark.slow
def test_every_production_case_runs_on_the_kernels_within_the_allowance():
    ext = EmulatedExtension()
    results = selfcheck.self_check(make_ops(ext), CPU, keep_going=True)
    # every decoder and encoder signature (but the encoder's conv_in, portable by design), a decode, an encode
    assert len(results) == 76 and results[-2].report.name.startswith("decode")
    assert results[-1].report.name.startswith("encode")
    assert all(r.ok for r in results), "\n".join(map(str, results))
    assert not any(r.fallbacks for r in results), [r.fallbacks for r in results if r.fallbacks]
    kinds = {kind for kind, _ in ext.calls}
    assert kinds == {"conv3d", "rms_norm_silu", "subpixel_scatter"}
    # The cases are not trivial: the bf16 baseline really differs from the fp32 definition.
    assert all(r.report.baseline_rms_err > 0 for r in results)


def test_subpixel_upsample_equals_nearest_upsample_then_conv_in_fp32(fp32_cpu):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 7, 16, generator=g)  # 2 frames, 4 rows + 2 halo rows
    w = torch.randint(-8, 9, (8, 16, 3, 3), generator=g).float()  # small integers: the bf16 folded taps are exact
    b = torch.randn(8, generator=g)
    w_sub = weights.subpixel_weights(w).float()
    kernels = CompiledKernels(EmulatedExtension(), collections.Counter())
    out = torch.empty(2, 8, 14, 8)
    # fp32 tensors take the portable op; check the kernel path's layout logic in fp32 by calling its steps directly
    y = torch.empty(2, 1, 5, 8, 32)
    kernels.ext.conv3d(x.view(2, 1, 6, 7, 16), w_sub.reshape(32, 1, 2, 2, 16), kernels._bias_per_phase(b), y, None,
                       [0, 0, 1], [0, 0, 1])
    kernels.ext.subpixel_scatter(y.view(2, 5, 8, 4, 8), out)
    torch.testing.assert_close(out, selfcheck.reference_upsample2x_conv3x3(x, w, b), rtol=1e-4, atol=1e-4)
    portable = torch.empty_like(out)
    ops.upsample2x_conv3x3(x, w_sub, b, portable)
    torch.testing.assert_close(portable, out, rtol=1e-4, atol=1e-4)


def test_output_channels_not_a_multiple_of_8_are_padded_and_cropped():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 3, 4, 6, 16, generator=g).bfloat16()
    w = torch.randn(12, 3, 3, 3, 16, generator=g).bfloat16()
    b = torch.randn(12, generator=g)
    out = torch.empty(1, 1, 2, 6, 12, dtype=torch.bfloat16)
    ext = EmulatedExtension()
    table = make_ops(ext)
    table.conv3d(x, w, b, out)
    assert ext.calls == [("conv3d", (1, 1, 2, 6, 16))] and not table.fallbacks
    expected = selfcheck.reference_conv3d(x.float(), w.float(), b)
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


def test_layouts_the_kernels_cannot_take_go_to_the_portable_op_and_are_counted():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 3, 4, 6, 16, generator=g).bfloat16()
    w = torch.randn(8, 3, 3, 3, 16, generator=g).bfloat16()
    b = torch.randn(8, generator=g)
    flat = torch.zeros(1 + 2 * 6 * 8, dtype=torch.bfloat16)
    misaligned = flat[1:].view(1, 1, 2, 6, 8)  # base 2 bytes past an allocation: no 16-byte TMA access
    ext = EmulatedExtension()
    table = make_ops(ext)
    table.conv3d(x, w, b, misaligned)
    table.conv3d(x, w, b, misaligned)
    assert ext.calls == [] and table.fallbacks == {"conv3d: out or residual not 16-byte aligned": 2}
    expected = torch.empty(1, 1, 2, 6, 8, dtype=torch.bfloat16)
    ops.conv3d(x, w, b, expected)
    assert torch.equal(misaligned, expected)
    assert ops.TORCH_OPS.fallbacks == {}, "the portable table's counter must stay empty"


def test_allowance_rule_is_three_times_the_bf16_baseline_in_max_and_rms():
    reference = torch.zeros(1000, dtype=torch.float64)
    baseline = torch.full_like(reference, 0.01)
    assert compare_to_reference("x", reference + 0.029, reference, baseline).ok
    assert not compare_to_reference("x", reference + 0.031, reference, baseline).ok
    spike = reference + 0.001
    spike[3] = 0.05  # RMS fine, max too large
    report = compare_to_reference("x", spike, reference, baseline)
    assert report.rms_err < 0.03 and not report.ok
    nan = reference.clone()
    nan[0] = float("nan")
    assert not compare_to_reference("x", nan, reference, baseline).finite
    assert not compare_to_reference("v", reference + 1.5, reference + 1.5, baseline, unit_range=True).ok
    with pytest.raises(ValueError, match="shapes differ"):
        compare_to_reference("x", reference[:10], reference, baseline)


@pytest.mark.parametrize("ext", [EmulatedExtension(conv_error=0.05), EmulatedExtension(norm_error=0.02)],
                         ids=["conv-off-by-5%-noise", "norm-off-by-2%"])
def test_a_mismatching_build_is_refused_and_stays_disabled_for_the_process(ext, caplog, monkeypatch):
    monkeypatch.setattr(selfcheck, "SUPPORTED_CONFIGS", NARROW)
    calls = []

    def factory(device):
        calls.append(device)
        return make_ops(ext)

    with pytest.raises(CompiledUnavailable, match="OUTSIDE THE ALLOWANCE"):
        loader.load_ops(CPU, factory=factory)
    with pytest.raises(CompiledUnavailable, match="failed the runtime self-check"):
        loader.load_ops(CPU, factory=factory)
    assert len(calls) == 1, "a failed build must stay disabled for the process, not be retried"
    assert any("disabled for this process" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)


def test_cuda_backend_raises_when_the_self_check_fails(monkeypatch):
    monkeypatch.setattr(selfcheck, "SUPPORTED_CONFIGS", NARROW)
    with pytest.raises(CompiledUnavailable, match="failed the runtime self-check"):
        loader.load_ops(CPU, factory=lambda device: make_ops(EmulatedExtension(conv_error=0.05)))


def test_a_passing_build_is_loaded_once_and_reused(monkeypatch):
    monkeypatch.setattr(selfcheck, "SUPPORTED_CONFIGS", NARROW)
    calls = []

    def factory(device):
        calls.append(device)
        return make_ops(EmulatedExtension())

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = loader.load_ops(CPU, factory=factory)
    assert first is not None and loader.load_ops(CPU, factory=factory) is first
    assert len(calls) == 1


def test_load_ops_without_a_gpu_says_why():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(CompiledUnavailable, match="needs a CUDA GPU"):
        loader.load_ops("cuda")
    with pytest.raises(CompiledUnavailable, match="needs a CUDA device"):
        loader.load_ops("cpu")


@pytest.mark.slow
def test_the_isolated_verification_catches_a_wrong_and_a_crashing_build_and_remembers_a_good_one(tmp_path,
                                                                                                  monkeypatch):
    """The path a built extension takes (open it, self-check it in a child process, remember a pass), with the
    emulated variants standing in for builds."""
    monkeypatch.setenv("WAN22_VAE_DECODE_BUILD_DIR", str(tmp_path))
    with pytest.raises(CompiledUnavailable, match="OUTSIDE THE ALLOWANCE"):
        loader.load_ops(CPU, source=stand_in("emulated-wrong"))
    with pytest.raises(CompiledUnavailable, match=r"crashed \(exit -6\)"):
        loader.load_ops(CPU, source=stand_in("emulated-abort"))
    table = loader.load_ops(CPU, source=stand_in("emulated"))
    assert table.name == "compiled" and list((tmp_path / "verdicts").glob("selfcheck-*.json"))
    results = verification.verify_build_isolated(stand_in("emulated"), CPU)  # the remembered verdict, no child
    assert all(r.ok for r in results)


@pytest.mark.slow
def test_the_verification_child_imports_this_package_whatever_its_working_directory(tmp_path):
    decoy = tmp_path / "fastvideo_pan2_ext"  # a checkout's package folder without vae_kernel, in the cwd
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise ImportError('the decoy was imported')\n")
    source = stand_in("emulated")
    argv = verification.child_command("fastvideo_pan2_ext.vae_kernel.compiled.verification", "cpu", "0",
                                      *source.to_argv(), path=source.path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["WAN22_VAE_DECODE_BUILD_DIR"] = str(tmp_path / "cache")
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SELF_CHECK_JSON" in done.stdout
    assert argv[0] == sys.executable


def test_a_case_that_fell_back_to_the_portable_op_fails_the_self_check(monkeypatch):
    """A table whose rms_norm_silu hands every call to the portable op (counted, as kernels.py counts a layout the
    kernels cannot take): its numbers are the definition's, yet the case fails, the check stops there, and the loader
    refuses the table."""
    monkeypatch.setattr(selfcheck, "SUPPORTED_CONFIGS", NARROW)
    table = make_ops(EmulatedExtension())

    def portable_norm(x, gamma, out, silu=True):
        table.fallbacks["rms_norm_silu: injected by the test"] += 1
        ops.rms_norm_silu(x, gamma, out, silu)

    fell_back = dataclasses.replace(table, rms_norm_silu=portable_norm)
    results = selfcheck.self_check(fell_back, CPU)
    last = results[-1]
    assert last.report.name.startswith("rms_norm_silu") and last.report.ok, "the numbers are within the allowance"
    assert not last.ok and last.fallbacks == {"rms_norm_silu: injected by the test": 1}
    assert "FAILED: fell back to the portable op" in str(last)
    assert all(r.ok for r in results[:-1]) and not any(r.report.name.startswith("decode") for r in results)
    assert len(selfcheck.self_check(fell_back, CPU, keep_going=True)) > len(results)
    with pytest.raises(CompiledUnavailable, match="fell back to the portable op"):
        loader.load_ops(CPU, factory=lambda device: fell_back)
