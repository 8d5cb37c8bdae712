"""Real diffusers Wan pipelines (tiny seeded random weights, prompt embeddings, CPU) with `enable_fast_decode`: the
pipeline's video meets the allowance against the same pipeline's fp32 video (baseline: the pipeline with its VAE in
bf16), `vae.enable_tiling()` under the fast decoder gives the untiled fast video exactly, `disable_fast_decode`
restores diffusers' video bit for bit, and the outputs have diffusers' types."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _diffusers_pipelines import LAYOUTS, call_kwargs, tiny_pipeline

from fastvideo_pan2_ext import disable_fast_decode, enable_fast_decode
from fastvideo_pan2_ext.vae_kernel.definitions.allowance import compare_to_reference
from fastvideo_pan2_ext.vae_kernel.definitions.precision import exact_fp32

pytestmark = pytest.mark.slow

# These pipelines also encode (the image, the video): diffusers' enable_tiling() tiles that encode too (its own blended
# tiles), so their tiled video differs by the encode, not by the decode.
ENCODES = ("i2v", "v2v")
SIZE = {"wan2.2-ti2v": (64, 64)}  # 16x spatial and the transformer's 2x2 patches; the others are 8x: 64 x 48


def _frames(pipe, layout, output_type="pt"):
    height, width = SIZE.get(layout, (64, 48))
    with exact_fp32():
        return pipe(**call_kwargs(layout, height, width, output_type=output_type)).frames


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pipeline_video_with_the_fast_decoder(layout):
    pipe = tiny_pipeline(layout)
    pipe.set_progress_bar_config(disable=True)
    reference = _frames(pipe, layout)  # diffusers, fp32 VAE

    enable_fast_decode(pipe)
    fast = _frames(pipe, layout)
    assert type(fast) is type(reference) and fast.shape == reference.shape and fast.dtype == reference.dtype

    pipe.vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=16,
                           tile_sample_stride_width=16)
    tiled = _frames(pipe, layout)
    assert pipe.vae.__dict__["_pan2_fast_decode"].worker.last_plan.tile_rows == \
        32 // pipe.vae.config.scale_factor_spatial
    if layout not in ENCODES:
        assert torch.equal(tiled, fast)
    pipe.vae.disable_tiling()

    fast_np = _frames(pipe, layout, output_type="np")
    disable_fast_decode(pipe)
    reference_np = _frames(pipe, layout, output_type="np")
    assert type(fast_np) is type(reference_np) is np.ndarray and fast_np.dtype == reference_np.dtype
    assert fast_np.shape == reference_np.shape
    assert torch.equal(_frames(pipe, layout), reference)  # diffusers' decode restored, bit for bit

    pipe.vae.to(torch.bfloat16)  # last: the round trip through bf16 would change the fp32 weights
    baseline = _frames(pipe, layout)  # diffusers, bf16 VAE: the release way
    # frames are in [0, 1]: back to the VAE's [-1, 1] for the allowance
    report = compare_to_reference(layout, fast * 2 - 1, reference * 2 - 1, baseline * 2 - 1, unit_range=True)
    assert report.ok, str(report)
