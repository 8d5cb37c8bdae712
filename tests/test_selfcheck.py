"""The compiled backend's runtime self-check and its Python op layer, on CPU.

The CUDA kernels cannot run here, so the extension is replaced by `TorchKernels`, a torch implementation of the
binding's documented contract (explicit per-side padding, strided destination, fp32 accumulation rounded once to
bf16, the sub-pixel phase interleave). Everything above it is the real code: `make_ops`/`CompiledKernels` (sub-pixel
upsample as one 4-phase conv, channel padding, fallbacks), the self-check cases, the allowance comparison, and the
once-per-process failure memory behind "auto" and "cuda".
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from fastvideo_pan2_ext.vae_kernel import compiled, ops, weights

CPU = torch.device("cpu")


class TorchKernels:
    """Stands in for the built extension (same functions, same argument order, same rounding points)."""

    def __init__(self, conv_error: float = 0.0, norm_error: float = 0.0):
        self.conv_error = conv_error
        self.norm_error = norm_error
        self.calls: list[tuple[str, tuple]] = []  # (kernel, output shape): proves the kernel path was taken

    def arch(self) -> str:
        return "torch-stand-in"

    def conv3d(self, x, w, b, out, residual, pad_lo, pad_hi):
        assert x.is_contiguous() and w.is_contiguous() and out.stride(-1) == 1
        assert x.shape[-1] % 8 == 0 and w.shape[0] % 8 == 0, "the kernel contract needs channel multiples of 8"
        self.calls.append(("conv3d", tuple(out.shape)))
        xp = F.pad(x.float(), (0, 0, pad_lo[2], pad_hi[2], pad_lo[1], pad_hi[1], pad_lo[0], pad_hi[0]))
        y = F.conv3d(xp.permute(0, 4, 1, 2, 3), w.float().permute(0, 4, 1, 2, 3), b.float()).permute(0, 2, 3, 4, 1)
        if residual is not None:
            y = y + residual.float()
        y = y + self.conv_error * y.abs().mean() * torch.randn_like(y)  # a forced mismatch when asked
        out.copy_(y)

    def subpixel_scatter(self, y, out):
        self.calls.append(("subpixel_scatter", tuple(out.shape)))
        m, rows_plus_1, w_plus_1, _, co = y.shape
        for a in (0, 1):
            for c in (0, 1):
                out[:, a::2, c::2].copy_(y[:, a:a + rows_plus_1 - 1, c:c + w_plus_1 - 1, 2 * a + c])

    def rms_norm_silu(self, x, gamma, out, silu, eps):
        self.calls.append(("rms_norm_silu", tuple(out.shape)))
        xf = x.float()
        y = xf / xf.norm(dim=-1, keepdim=True).clamp_min(eps) * gamma
        y = F.silu(y) if silu else y
        out.copy_(y * (1 + self.norm_error))


def test_self_check_passes_a_correct_op_table_on_every_case():
    kernels = TorchKernels()
    table = compiled.make_ops(kernels)
    assert isinstance(table, ops.Ops) and table.name == "compiled"
    reports = compiled.self_check(table, CPU)
    # every case ran on the kernels, not on a portable fallback: 5 conv cases + the upsample's 4-phase conv, ...
    kinds = [kind for kind, _ in kernels.calls]
    assert kinds[:8].count("conv3d") == 6 and "rms_norm_silu" in kinds[:8] and "subpixel_scatter" in kinds[:8]
    names = " ".join(r.name for r in reports)
    assert all(op in names for op in ("rms_norm_silu", "upsample2x_conv3x3", "conv3d 3x3x3 to 12 channels"))
    assert all(r.ok for r in reports), "\n".join(map(str, reports))
    # The cases are not trivial: the bf16 baseline really differs from the fp32 reference.
    assert all(r.baseline_rms_err > 0 for r in reports)


def test_subpixel_upsample_equals_nearest_upsample_then_conv_in_fp32():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 7, 16, generator=g)  # 2 frames, 4 rows + 2 halo rows
    w = torch.randint(-8, 9, (8, 16, 3, 3), generator=g).float()  # small integers: the bf16 folded taps are exact
    b = torch.randn(8, generator=g)
    w_sub = weights.subpixel_weights(w).float()
    kernels = compiled.CompiledKernels(TorchKernels())
    out = torch.empty(2, 8, 14, 8)
    # fp32 tensors take the portable op; check the kernel path's layout logic in fp32 by calling its steps directly
    y = torch.empty(2, 1, 5, 8, 32)
    kernels.ext.conv3d(x.view(2, 1, 6, 7, 16), w_sub.reshape(32, 1, 2, 2, 16), kernels._bias_per_phase(b), y, None,
                       [0, 0, 1], [0, 0, 1])
    kernels.ext.subpixel_scatter(y.view(2, 5, 8, 4, 8), out)
    torch.testing.assert_close(out, compiled.reference_upsample2x_conv3x3(x, w, b), rtol=1e-4, atol=1e-4)
    # and the portable op agrees with the same definition
    portable = torch.empty_like(out)
    ops.upsample2x_conv3x3(x, w_sub, b, portable)
    torch.testing.assert_close(portable, out, rtol=1e-4, atol=1e-4)


def test_output_channels_not_a_multiple_of_8_are_padded_and_cropped():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 3, 4, 6, 16, generator=g).bfloat16()
    w = torch.randn(12, 3, 3, 3, 16, generator=g).bfloat16()
    b = torch.randn(12, generator=g)
    out = torch.empty(1, 1, 2, 6, 12, dtype=torch.bfloat16)
    kernels = TorchKernels()
    compiled.make_ops(kernels).conv3d(x, w, b, out)
    assert kernels.calls == [("conv3d", (1, 1, 2, 6, 16))]
    expected = compiled.reference_conv3d(x.float(), w.float(), b)
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


def test_allowance_rule_is_three_times_the_bf16_baseline_in_max_and_rms():
    reference = torch.zeros(1000, dtype=torch.float64)
    baseline = torch.full_like(reference, 0.01)
    assert compiled.compare_to_reference("x", reference + 0.029, reference, baseline).ok
    assert not compiled.compare_to_reference("x", reference + 0.031, reference, baseline).ok
    spike = reference + 0.001
    spike[3] = 0.05  # RMS fine, max too large
    report = compiled.compare_to_reference("x", spike, reference, baseline)
    assert report.rms_err < 0.03 and not report.ok
    nan = reference.clone()
    nan[0] = float("nan")
    assert not compiled.compare_to_reference("x", nan, reference, baseline).finite
    assert not compiled.compare_to_reference("v", reference + 1.5, reference + 1.5, baseline, unit_range=True).ok
    with pytest.raises(ValueError, match="shapes differ"):
        compiled.compare_to_reference("x", reference[:10], reference, baseline)


@pytest.mark.parametrize("kernels", [TorchKernels(conv_error=0.05), TorchKernels(norm_error=0.02)],
                         ids=["conv-off-by-5%-noise", "norm-off-by-2%"])
def test_auto_backend_disables_a_mismatching_build_with_a_warning_once_per_process(kernels, caplog):
    calls = []

    def make_ops(device):
        calls.append(device)
        return compiled.make_ops(kernels)

    with pytest.warns(RuntimeWarning, match="OUTSIDE THE ALLOWANCE"):
        assert compiled.load_ops_or_none(CPU, make_ops=make_ops) is None
    with pytest.warns(RuntimeWarning, match="failed the runtime self-check"):
        assert compiled.load_ops_or_none(CPU, make_ops=make_ops) is None
    assert len(calls) == 1, "a failed build must stay disabled for the process, not be retried"
    assert any("disabled for this process" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)


def test_cuda_backend_raises_when_the_self_check_fails():
    def make_ops(device):
        return compiled.make_ops(TorchKernels(conv_error=0.05))

    with pytest.raises(compiled.CompiledUnavailable, match="failed the runtime self-check"):
        compiled.load_ops(CPU, make_ops=make_ops)


def test_a_passing_build_is_loaded_once_and_reused():
    calls = []

    def make_ops(device):
        calls.append(device)
        return compiled.make_ops(TorchKernels())

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = compiled.load_ops_or_none(CPU, make_ops=make_ops)
    assert first is not None and compiled.load_ops(CPU, make_ops=make_ops) is first
    assert len(calls) == 1


def test_load_ops_without_a_gpu_says_why():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(compiled.CompiledUnavailable, match="needs a CUDA GPU"):
        compiled.load_ops("cuda")
    with pytest.raises(compiled.CompiledUnavailable, match="needs a CUDA device"):
        compiled.load_ops("cpu")


def test_layouts_the_kernels_cannot_take_go_to_the_portable_op_with_the_same_result():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 3, 4, 6, 16, generator=g).bfloat16()
    w = torch.randn(8, 3, 3, 3, 16, generator=g).bfloat16()
    b = torch.randn(8, generator=g)
    flat = torch.zeros(1 + 2 * 6 * 8, dtype=torch.bfloat16)
    misaligned = flat[1:].view(1, 1, 2, 6, 8)  # base 2 bytes past an allocation: no 16-byte TMA access
    kernels = TorchKernels()
    compiled.make_ops(kernels).conv3d(x, w, b, misaligned)
    assert kernels.calls == []
    expected = torch.empty(1, 1, 2, 6, 8, dtype=torch.bfloat16)
    ops.conv3d(x, w, b, expected)
    assert torch.equal(misaligned, expected)
