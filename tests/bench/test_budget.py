"""bench/budget.py counts what the decoder computes: its FLOPs, with the upsample counted as convolving the 2x frame,
are the FLOPs torch's own counter sees in the reference decoder (diffusers' op order) on the same latents."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from fastvideo_pan2_ext import reference
from fastvideo_pan2_ext.vae_kernel.definitions.architecture import WAN21_CONFIG, narrow
from fastvideo_pan2_ext.vae_kernel.compiled.selfcheck import DECODE_CHECK_CONFIG, random_weights
from bench import budget

NARROW_WAN21 = narrow(WAN21_CONFIG, 8)


@pytest.mark.parametrize("config", [DECODE_CHECK_CONFIG, NARROW_WAN21], ids=["wan22", "wan21"])
@pytest.mark.parametrize("fpp", [1, 2])
def test_counted_flops_are_the_reference_decoders(config, fpp):
    frames, h, w = 4, 3, 5
    counts = budget.decode_budget(frames, h * config.spatial_scale, w * config.spatial_scale, fpp, config)
    upsample = counts["flops"].pop("upsample: 4 sub-pixel 2x2 convs")
    ours = sum(counts["flops"].values()) + upsample * 9 / 4  # as a 3x3 conv over the upsampled frame

    z = torch.randn(1, config.z_dim, frames, h, w, generator=torch.Generator().manual_seed(0))
    # The math attention backend runs as matmuls, which the counter counts (the CPU's fused kernel it does not).
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        reference.decode(z, random_weights(config))
    assert ours == counter.get_total_flops()
    assert counts["winograd_flops"] < ours  # and fewer by Winograd
    assert all(v > 0 for v in counts["bytes"].values())
