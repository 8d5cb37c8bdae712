"""One fallback policy (docs/design/worker.md, "One fallback policy"; `vae_kernel.fallback`): where a fast worker cannot
serve a call, the stock method runs after one warning per VAE and reason, in both integrations and for both routes.
The diffusers routes' and FastVideo's encode's cases are tested with them (test_diffusers_decode.py,
test_diffusers_encode.py, test_fast_encode.py); here FastVideo's decode route, which takes the same policy."""

from __future__ import annotations

import logging

import fastvideo.logger  # noqa: F401 - its import configures logging (the root's handlers, caplog's among them)
import torch
from _vae_helpers import fastvideo_wan_vae_of, make_wan22_vae, random_latents

LOGGER = "fastvideo_pan2_ext.fastvideo_integration.fast_decode"


def _fastvideo_decode(vae, z):
    """FastVideo's own decode, under the plugin's route."""
    from fastvideo.models.vaes.wanvae import AutoencoderKLWan

    return AutoencoderKLWan.decode.__wrapped__(vae, z)


def test_a_weight_the_fastvideo_decoder_cannot_take_is_fastvideos_decode_after_one_warning(caplog):
    from fastvideo_pan2_ext.fastvideo_integration import fast_decode

    vae = fastvideo_wan_vae_of(make_wan22_vae(seed=0), decode_kernel=True).requires_grad_(False)
    z = random_latents((1, 8, 1, 2, 3), seed=1)
    with torch.no_grad():
        vae.decode(z)
        decoder = fast_decode._decoders[vae][1]  # the fast decoder served it
        weight = vae.decoder.conv_in.weight
        kept = weight.clone()
        weight[0, 0, 0, 0, 0] = float("nan")
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            results = [vae.decode(z) for _ in range(2)]
        for video in results:
            torch.testing.assert_close(video, _fastvideo_decode(vae, z), rtol=0, atol=0, equal_nan=True)
        lines = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
        assert len(lines) == 1 and lines[0].startswith("fast VAE decoder: the fast decoder cannot take this VAE's "
                                                       "decoder weights (state_dict['decoder.conv_in.weight'] has "
                                                       "non-finite values)"), lines
        assert lines[0].endswith("; decoding with FastVideo's own decode")
        assert not decoder.weights  # off the device while FastVideo's decode runs
        weight.copy_(kept)
        decoder.last_plan = None
        vae.decode(z)
        assert fast_decode._decoders[vae][1] is decoder and decoder.last_plan is not None  # the fast decoder again
