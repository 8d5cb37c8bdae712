"""`WanVAEDecoder(conv_algorithm=...)`: the option's checks and what "auto" chooses. Where bands start with Winograd
F(2x2, 3x3) (on even rows, where its 2x2 output tiles line up with the whole frame's) is tests/vae_kernel/test_multirank.py's
`test_rows_split_into_near_equal_bands_starting_on_the_ops_row_multiple`. The Winograd decode itself (allowance,
frames per pass, tiles, ranks, streaming) is the shared suite, tests/vae_kernel/test_decoder_variants.py.
"""

from __future__ import annotations

import pytest
import torch

from _decoder_allowance import latents
from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder, backends


def test_an_unknown_conv_algorithm_is_refused(wan22_state_dict):
    with pytest.raises(ValueError, match=r"conv_algorithm must be one of \['auto', 'direct', 'winograd'\]; got"):
        WanVAEDecoder(wan22_state_dict, device="cpu", conv_algorithm="fft")


def test_auto_is_direct_on_cpu_even_where_a_gpu_measured_winograd_faster(wan22_state_dict, monkeypatch):
    """"auto" follows the GPU check's measurements (`backends.MEASURED_WINOGRAD_LAYERS`) on that GPU only: on CPU,
    where the portable Winograd conv is slower, every conv stays direct whatever was measured."""
    every_layer = frozenset((co, ci, kt) for co in (8, 16, 32, 12) for ci in (8, 16, 32) for kt in (1, 3))
    monkeypatch.setattr(backends, "MEASURED_WINOGRAD_LAYERS", {"NVIDIA H200": every_layer})
    auto = WanVAEDecoder(wan22_state_dict, device="cpu", conv_algorithm="auto")
    direct = WanVAEDecoder(wan22_state_dict, device="cpu", conv_algorithm="direct")
    winograd = WanVAEDecoder(wan22_state_dict, device="cpu", conv_algorithm="winograd")
    assert (auto.backend, winograd.backend) == ("torch", "torch+winograd-f2x2")
    z = latents((1, 8, 2, 2, 3), seed=3)
    video = auto.decode(z)
    assert torch.equal(video, direct.decode(z)) and not torch.equal(video, winograd.decode(z))
