"""CUTLASS's own verdict, on the host and without a GPU, on every CUTLASS problem the decoders and encoders give the
compiled kernels: `can_implement` of the implicit-GEMM conv and of the Winograd batched GEMMs is host code on the
problem's shape (TMA alignment of the extents, im2col padding and corner limits, the epilogue's), so the built
extension answers it through `conv3d_can_implement` / `winograd_products_can_implement` with no driver.

The problems are not listed by hand: every op signature the real decoders and encoders use
(`selfcheck.op_signatures`: Wan2.2 and Wan2.1 at their real channel counts; but the encoders' conv_in, whose 3 or 12
input channels the kernels never take: portable by design, as in the self-check) is run through the real compiled op
table (`kernels.make_ops`, direct and Winograd) over an extension that records the kernel calls it is given, so the
conv each op becomes (conv_out's 12 channels widened to 16, the sub-pixel conv's 2x2 kernel of 4 x Co channels, the
Winograd GEMMs' taps) is the one the table really issues. Each is checked at the self-check's extents and at a 720p
frame (1280 x 720, 4 frames).

What this cannot check (it needs a GPU; docs/design/compiled-backend.md, "The compiled backend"): the TMA descriptor
encodes (driver calls in `initialize`; their rules are checked by our own code before it), shared-memory and launch
limits, and the results.
"""

from __future__ import annotations

import os

import pytest
import torch

from fastvideo_pan2_ext.vae_kernel.compiled import build, extension, kernels, selfcheck

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800),
              pytest.mark.skipif(build.cuda_home() is None, reason="no CUDA toolkit (nvcc) on this machine")]

FRAME_ROWS, FRAME_WIDTH, FRAMES = 720, 1280, 4  # the large extents every problem is checked at, too


class KernelCallRecorder:
    """The extension's Python API, recording the CUTLASS problems it is handed (and computing nothing)."""

    def __init__(self) -> None:
        self.convs: list[tuple[tuple, tuple, tuple, tuple]] = []  # (x sizes, w sizes, pad_lo, pad_hi)
        self.products: list[tuple[tuple, tuple]] = []  # (v sizes, u sizes)

    def arch(self) -> str:
        return "recorder"

    def conv3d(self, x, w, b, out, residual, pad_lo, pad_hi) -> None:
        self.convs.append((tuple(x.shape), tuple(w.shape), tuple(pad_lo), tuple(pad_hi)))

    def winograd_products(self, v, u, m) -> None:
        self.products.append((tuple(v.shape), tuple(u.shape)))

    def subpixel_scatter(self, *args) -> None: ...
    def rms_norm_silu(self, *args) -> None: ...
    def winograd_input_transform(self, *args) -> None: ...
    def winograd_output_transform(self, *args) -> None: ...


def _recorded_problems():
    """(signature, recorder) for every op signature of the real decoders and encoders the kernels take, through the
    direct and the Winograd table."""
    g = torch.Generator().manual_seed(0)
    recorded = []
    for sig in sorted(selfcheck.op_signatures()):
        if sig.op == "rms_norm_silu" or sig.ci % kernels.CHANNEL_MULTIPLE:
            continue  # no CUTLASS kernel; a conv_in the kernels never take (portable by design)
        name, run, _ = selfcheck._case(sig, torch.device("cpu"), g)
        for winograd in (False, True):
            recorder = KernelCallRecorder()
            table = kernels.make_ops(recorder, winograd_convs=winograd)
            with torch.no_grad():
                run(table)
            assert not table.fallbacks, (name, dict(table.fallbacks))  # the compiled path takes every signature
            recorded.append((f"{name}{' (Winograd)' * winograd}", recorder))
    return recorded


def _large_conv(x, w, pad_lo, pad_hi):
    """The same conv over a 720p frame: FRAMES output frames, FRAME_ROWS output rows, FRAME_WIDTH wide."""
    n, _, _, _, c = x
    _, kt, kh, _, _ = w
    return (n, FRAMES + kt - 1 - pad_lo[0] - pad_hi[0], FRAME_ROWS + kh - 1 - pad_lo[1] - pad_hi[1], FRAME_WIDTH, c)


def _large_products(v, u):
    kt = u[0]
    return (16, FRAMES + kt - 1, (FRAME_ROWS // 2) * (FRAME_WIDTH // 2), v[3])


@pytest.fixture(scope="module")
def problems():
    return _recorded_problems()


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_cutlass_can_implement_every_problem_of_the_real_decoders(arch, problems, compile_cache):
    os.environ.setdefault("MAX_JOBS", "1")
    ext = extension.build_extension(arch, root=compile_cache)  # built without a GPU (or loaded): the run's one cache
    signatures = {s for s in selfcheck.op_signatures()
                  if s.op != "rms_norm_silu" and not s.ci % kernels.CHANNEL_MULTIPLE}
    assert len(problems) == 2 * len(signatures) and len(signatures) > 50  # decoders' and encoders' convs, both tables
    refused, checked = [], 0
    for name, recorder in problems:
        assert recorder.convs or recorder.products, name  # every op reached a CUTLASS kernel
        for x, w, pad_lo, pad_hi in recorder.convs:
            for sizes in (x, _large_conv(x, w, pad_lo, pad_hi)):
                checked += 1
                reason = ext.conv3d_can_implement(list(sizes), list(w), list(pad_lo), list(pad_hi))
                if reason is not None:
                    refused.append((name, sizes, w, reason))
        for v, u in recorder.products:
            for sizes in (v, _large_products(v, u)):
                checked += 1
                reason = ext.winograd_products_can_implement(list(sizes), list(u))
                if reason is not None:
                    refused.append((name, sizes, u, reason))
    print(f"\n{arch}: CUTLASS can implement {checked - len(refused)} of {checked} problems "
          f"({len(signatures)} op signatures, direct and Winograd)")
    assert not refused, refused


@pytest.mark.parametrize("arch", ["sm_90a"])
def test_can_implement_refuses_what_the_kernels_cannot_take(arch, compile_cache):
    """The answers are CUTLASS's and the shape checks', not a constant: problems outside the kernels' rules are
    refused with the reason."""
    os.environ.setdefault("MAX_JOBS", "1")
    ext = extension.build_extension(arch, root=compile_cache)
    assert ext.conv3d_can_implement([1, 3, 5, 13, 64], [64, 3, 3, 3, 64], [0, 0, 1], [0, 0, 1]) is None
    assert "multiples of 8" in ext.conv3d_can_implement([1, 3, 5, 13, 12], [64, 3, 3, 3, 12], [0, 0, 1], [0, 0, 1])
    assert "empty output" in ext.conv3d_can_implement([1, 2, 5, 13, 64], [64, 3, 3, 3, 64], [0, 0, 1], [0, 0, 1])
    # im2col TMA: a 3-D conv's padding is limited to 16 (CUTLASS's own rule, not ours)
    assert "CUTLASS cannot implement" in ext.conv3d_can_implement([1, 3, 5, 40, 64], [64, 3, 3, 3, 64], [0, 0, 17],
                                                                  [0, 0, 17])
    assert ext.winograd_products_can_implement([16, 3, 21, 64], [3, 16, 64, 64]) is None
    assert "multiples of 8" in ext.winograd_products_can_implement([16, 3, 21, 12], [3, 16, 64, 12])
    assert "empty problem" in ext.winograd_products_can_implement([16, 2, 21, 64], [3, 16, 64, 64])
