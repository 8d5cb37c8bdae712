"""Every entry point of the compiled extension (csrc/binding.cpp) refuses a tensor the kernels cannot take — a
pointer off 16-byte alignment (an offset view), a stride that is not a whole number of 16-byte vectors, a layout that
is not packed where a kernel assumes it — with the tensor, its sizes and strides and the rule, and does so before
any CUDA call: the real extension, built here without a GPU, is called with CPU tensors, so a check that came after
a CUDA call (or was missing) would surface as "must be a CUDA tensor" instead. A call that breaks no rule gets
exactly that device error. The emulated extension (the CPU stand-in) applies the same layout rules.
"""

from __future__ import annotations

import os

import pytest
import torch

from fastvideo_pan2_ext.vae_kernel.compiled import build, extension
from gpu_check.emulated_extension import EmulatedExtension

bf16, f32 = torch.bfloat16, torch.float32
ALIGNED = r"must start at a 16-byte aligned address"


def _offset(*shape, dtype=bf16, by=1):
    """A contiguous tensor of `shape` that starts `by` elements into its storage: not 16-byte aligned."""
    n = 1
    for s in shape:
        n *= s
    return torch.zeros(n + by, dtype=dtype)[by:].view(shape)


def _strided(*shape, dtype=bf16, pad=4):
    """A tensor of `shape` whose rows are `pad` elements longer than its channels: strides not multiples of 16 B."""
    return torch.zeros(*shape[:-1], shape[-1] + pad, dtype=dtype)[..., :shape[-1]]


# conv3d: x [1, 3, 3, 8, 8] * w [8, 3, 3, 3, 8], padding (0, 0, 1) each side -> out [1, 1, 1, 8, 8]
def _conv(x=None, w=None, b=None, out=None, residual=None):
    return ("conv3d", (torch.zeros(1, 3, 3, 8, 8, dtype=bf16) if x is None else x,
                       torch.zeros(8, 3, 3, 3, 8, dtype=bf16) if w is None else w,
                       torch.zeros(8) if b is None else b,
                       torch.zeros(1, 1, 1, 8, 8, dtype=bf16) if out is None else out, residual, [0, 0, 1], [0, 0, 1]))


def _norm(x=None, gamma=None, out=None):
    return ("rms_norm_silu", (torch.zeros(1, 2, 3, 4, 16, dtype=bf16) if x is None else x,
                              torch.ones(16) if gamma is None else gamma,
                              torch.zeros(1, 2, 3, 4, 16, dtype=bf16) if out is None else out, True, 1e-12))


# subpixel_scatter: y [2, 3, 5, 4, 8] -> out [2, 4, 8, 8]
def _scatter(y=None, out=None):
    return ("subpixel_scatter", (torch.zeros(2, 3, 5, 4, 8, dtype=bf16) if y is None else y,
                                 torch.zeros(2, 4, 8, 8, dtype=bf16) if out is None else out))


# Winograd: x [2, 6, 5, 8] (2 frames, 2 tile rows of 3 tiles) -> v [16, 2, 6, 8]; u [1, 16, 8, 8] -> m [16, 2, 6, 8]
def _input(x=None, v=None):
    return ("winograd_input_transform", (torch.zeros(2, 6, 5, 8, dtype=bf16) if x is None else x,
                                         torch.zeros(16, 2, 6, 8, dtype=bf16) if v is None else v))


def _products(v=None, u=None, m=None):
    return ("winograd_products", (torch.zeros(16, 2, 6, 8, dtype=bf16) if v is None else v,
                                  torch.zeros(1, 16, 8, 8, dtype=bf16) if u is None else u,
                                  torch.zeros(16, 2, 6, 8, dtype=f32) if m is None else m))


def _output(m=None, b=None, out=None, residual=None):  # out [2, 4, 5, 8]: 2 x 3 tiles per frame
    return ("winograd_output_transform", (torch.zeros(16, 2, 6, 8, dtype=f32) if m is None else m,
                                          torch.zeros(8) if b is None else b,
                                          torch.zeros(2, 4, 5, 8, dtype=bf16) if out is None else out, residual))


VALID = [_conv(), _conv(residual=torch.zeros(1, 1, 1, 8, 8, dtype=bf16)), _norm(), _scatter(), _input(), _products(),
         _output(), _output(residual=torch.zeros(2, 4, 5, 8, dtype=bf16))]

REFUSED = {
    "conv3d x misaligned": (_conv(x=_offset(1, 3, 3, 8, 8)), rf"x {ALIGNED}"),
    "conv3d x not contiguous": (_conv(x=torch.zeros(1, 3, 8, 3, 8, dtype=bf16).transpose(2, 3)),
                                r"x must be a contiguous \[N, T, H, W, C\]"),
    "conv3d w misaligned": (_conv(w=_offset(8, 3, 3, 3, 8)), rf"w {ALIGNED}"),
    "conv3d b misaligned": (_conv(b=_offset(8, dtype=f32)), rf"b {ALIGNED}"),
    "conv3d out misaligned": (_conv(out=_offset(1, 1, 1, 8, 8)), rf"out {ALIGNED}"),
    "conv3d out strides": (_conv(out=_strided(1, 1, 1, 8, 8)),
                           r"out's strides must be multiples of 8 elements \(16 bytes\).*strides \[96, 96, 96, 12, 1\]"),
    "conv3d out channel stride": (_conv(out=torch.zeros(1, 1, 1, 8, 8, dtype=bf16).transpose(3, 4)),
                                  r"out must have unit channel stride"),
    "conv3d residual misaligned": (_conv(residual=_offset(1, 1, 1, 8, 8, by=4)), rf"residual {ALIGNED}"),
    "conv3d residual strides": (_conv(residual=_strided(1, 1, 1, 8, 8, pad=2)), r"residual's strides must be multiples"),
    "conv3d channels": (_conv(x=torch.zeros(1, 3, 3, 8, 4, dtype=bf16), w=torch.zeros(8, 3, 3, 3, 4, dtype=bf16)),
                        r"channel counts must be multiples of 8"),
    "rms_norm_silu x misaligned": (_norm(x=_offset(1, 2, 3, 4, 16)), rf"x {ALIGNED}"),
    "rms_norm_silu out strides": (_norm(out=_strided(1, 2, 3, 4, 16, pad=4)), r"out's strides must be multiples of 8"),
    "rms_norm_silu gamma misaligned": (_norm(gamma=_offset(16, dtype=f32)), rf"gamma {ALIGNED}"),
    "subpixel_scatter y misaligned": (_scatter(y=_offset(2, 3, 5, 4, 8)), rf"y {ALIGNED}"),
    "subpixel_scatter out misaligned": (_scatter(out=_offset(2, 4, 8, 8)), rf"out {ALIGNED}"),
    "subpixel_scatter out frame stride": (_scatter(out=torch.zeros(2 * 4 * 8 * 8 + 4, dtype=bf16)
                                                   .as_strided((2, 4, 8, 8), (260, 64, 8, 1))),
                                          r"out's strides must be multiples of 8"),
    "winograd_input_transform x misaligned": (_input(x=_offset(2, 6, 5, 8)), rf"x {ALIGNED}"),
    "winograd_input_transform x strides": (_input(x=_strided(2, 6, 5, 8)), r"x's strides must be multiples of 8"),
    "winograd_input_transform v misaligned": (_input(v=_offset(16, 2, 6, 8)), rf"v {ALIGNED}"),
    "winograd_products v misaligned": (_products(v=_offset(16, 2, 6, 8)), rf"v {ALIGNED}"),
    "winograd_products u misaligned": (_products(u=_offset(1, 16, 8, 8, by=2)), rf"u {ALIGNED}"),
    "winograd_products m misaligned": (_products(m=_offset(16, 2, 6, 8, dtype=f32)), rf"m {ALIGNED}"),
    "winograd_output_transform m misaligned": (_output(m=_offset(16, 2, 6, 8, dtype=f32, by=2)), rf"m {ALIGNED}"),
    "winograd_output_transform b misaligned": (_output(b=_offset(8, dtype=f32)), rf"b {ALIGNED}"),
    "winograd_output_transform out strides": (_output(out=_strided(2, 4, 5, 8)),
                                              r"out's strides must be multiples of 8"),
    "winograd_output_transform residual misaligned": (_output(residual=_offset(2, 4, 5, 8)), rf"residual {ALIGNED}"),
}


@pytest.fixture(scope="module")
def built(compile_cache):
    """The real extension (sm_90a), built without a GPU (or loaded) through the build cache (the test run's one)."""
    if build.cuda_home() is None:
        pytest.skip("no CUDA toolkit (nvcc) on this machine")
    os.environ.setdefault("MAX_JOBS", "1")
    return extension.build_extension("sm_90a", root=compile_cache)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("case", list(REFUSED), ids=list(REFUSED))
def test_the_compiled_binding_refuses_the_layout_before_any_cuda_call(built, case):
    (function, args), message = REFUSED[case]
    with pytest.raises(RuntimeError, match=message):
        getattr(built, function)(*args)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("call", VALID, ids=[f"{c[0]}-{i}" for i, c in enumerate(VALID)])
def test_a_call_that_breaks_no_layout_rule_reaches_the_device_check(built, call):
    function, args = call
    with pytest.raises(RuntimeError, match="must be a CUDA tensor; got device cpu"):
        getattr(built, function)(*args)


@pytest.mark.parametrize("case", list(REFUSED), ids=list(REFUSED))
def test_the_emulated_extension_applies_the_same_layout_rules(case):
    (function, args), message = REFUSED[case]
    if "contiguous" in message:
        pytest.skip("the emulated extension words its contiguity check its own way")
    with pytest.raises(RuntimeError, match=message):
        getattr(EmulatedExtension(), function)(*args)


@pytest.mark.parametrize("call", VALID, ids=[f"{c[0]}-{i}" for i, c in enumerate(VALID)])
def test_the_emulated_extension_runs_every_valid_call(call):
    function, args = call
    getattr(EmulatedExtension(), function)(*args)
