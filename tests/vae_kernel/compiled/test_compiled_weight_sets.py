"""One compiled op table serves every decoder of a process (loader.py caches it), so nothing it derives from one
model's weights may leak into another's decode. Several different random-weight models are decoded one after the
other through ONE compiled table (the emulated extension: the compiled table's own Python, kernels in torch on CPU),
each model's weights freed before the next is loaded (so the allocator hands the next model the same addresses), and
each video is compared with the same model decoded through a fresh table.
"""

from __future__ import annotations

import gc

import pytest
import torch

from fastvideo_pan2_ext.vae_kernel.compiled import kernels
from fastvideo_pan2_ext.vae_kernel.portable import weights
from fastvideo_pan2_ext.vae_kernel.definitions.architecture import video_shape
from fastvideo_pan2_ext.vae_kernel.distributed.bands import LocalRows
from gpu_check.emulated_extension import EmulatedExtension
from fastvideo_pan2_ext.vae_kernel.portable.passes import PassRunner, collect
from fastvideo_pan2_ext.vae_kernel.compiled.selfcheck import DECODE_CHECK_CONFIG as CONFIG
from fastvideo_pan2_ext.vae_kernel.compiled.selfcheck import random_weights

# The self-check's narrow Wan2.2-layout decoder: its three sub-pixel convs are where the table derives a 4x bias.
LATENTS = (1, CONFIG.z_dim, 2, 2, 3)
MODELS = 8


def _decode(table, state_dict, z):
    config, prepared = weights.load(state_dict, torch.device("cpu"), table.cpu_compute_layout)
    runner = PassRunner(table, prepared, config, torch.device("cpu"), frames_per_pass=2)
    with torch.no_grad():
        return collect(runner.iter_bands(z, LocalRows(z.shape[3])), video_shape(config, z.shape), torch.device("cpu"))


@pytest.mark.slow
def test_one_table_decodes_every_model_with_its_own_weights():
    z = torch.randn(LATENTS, generator=torch.Generator().manual_seed(1))
    shared = kernels.make_ops(EmulatedExtension())
    wrong = []
    for seed in range(MODELS):
        state_dict = random_weights(CONFIG, seed=seed)
        # the bias differs by model far beyond bf16 rounding, so a stale one shows
        video = _decode(shared, state_dict, z)
        fresh = _decode(kernels.make_ops(EmulatedExtension()), state_dict, z)
        if not torch.equal(video, fresh):  # same kernels, same process and threads: only stale state can differ
            wrong.append((seed, (video.float() - fresh.float()).abs().max().item()))
        del state_dict, video, fresh
        gc.collect()
    assert not shared.fallbacks, dict(shared.fallbacks)  # the compiled path (the sub-pixel conv) really ran
    assert not wrong, f"models decoded with another model's state by the shared table (seed, max error): {wrong}"


def test_a_bias_changed_in_place_is_derived_again():
    ext = EmulatedExtension()
    table = kernels.make_ops(ext)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, 5, 8, generator=g).to(torch.bfloat16)
    w_sub = weights.subpixel_weights(torch.randn(8, 8, 3, 3, generator=g) / 8)
    b = torch.randn(8, generator=g)
    out = torch.empty(2, 4, 10, 8, dtype=torch.bfloat16)
    table.upsample2x_conv3x3(x, w_sub, b, out)
    b.add_(1.0)
    table.upsample2x_conv3x3(x, w_sub, b, out)
    expected = torch.empty_like(out)
    kernels.make_ops(EmulatedExtension()).upsample2x_conv3x3(x, w_sub, b, expected)
    assert torch.equal(out, expected)
    assert ("conv3d", (2, 1, 3, 6, 32)) in ext.calls  # the compiled 2x2 conv of all four phases
