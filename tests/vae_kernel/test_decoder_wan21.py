"""WanVAEDecoder on Wan2.1-layout weights (`is_residual=False`, no patchify, 8x spatial): the layout read from the
weights, its tile margins and the self-check's coverage of its op shapes. The decode itself (allowance, frames per
pass, tiles, ranks, `decode_iter`, every margin needed) is the shared suite, tests/vae_kernel/test_decoder_variants.py, run for
both layouts and both conv algorithms.
"""

from __future__ import annotations

import torch

from _decoder_allowance import latents
from _vae_helpers import make_wan21_vae
from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder
from fastvideo_pan2_ext.vae_kernel.portable import network
from fastvideo_pan2_ext.vae_kernel.compiled import selfcheck
from fastvideo_pan2_ext.vae_kernel.definitions.architecture import WAN21_CONFIG, narrow

Z_DIM = 8


def test_decoder_reads_the_wan21_layout_from_the_diffusers_module():
    vae = make_wan21_vae(seed=0)
    state_dict = {name: tensor.detach().clone() for name, tensor in vae.state_dict().items()}
    decoder = WanVAEDecoder(vae, device="cpu", backend="torch")
    assert decoder.config == narrow(WAN21_CONFIG, 8, z_dim=Z_DIM)  # read from diffusers' weights
    z = latents((1, Z_DIM, 2, 2, 3), seed=1)
    assert torch.equal(decoder.decode(z), WanVAEDecoder(state_dict, device="cpu", backend="torch").decode(z))


def test_tile_margins_of_the_wan21_decoder():
    assert network.tile_margins(WAN21_CONFIG) == (15, [13, 12, 10, 7])


def test_the_self_check_covers_every_op_shape_of_the_wan21_decoder():
    signatures = {str(s) for s in selfcheck.op_signatures(selfcheck.SUPPORTED_CONFIGS)}
    for shape in ("conv3d 16 -> 384 k3x3x3",  # conv_in: 16 latent channels
                  "conv3d 96 -> 3 k3x3x3",  # conv_out: plain RGB
                  "conv3d 384 -> 768 k3x1x1",  # the time conv (2C)
                  "conv3d 192 -> 384 k1x1x1",  # the one shortcut (up block 1 reads the halved width)
                  "upsample2x_conv3x3 384 -> 192 k1x3x3", "upsample2x_conv3x3 192 -> 96 k1x3x3",  # halving upsamplers
                  "rms_norm_silu 96 -> 96 into a strided window"):
        assert shape in signatures, sorted(signatures)
    assert len(signatures) == 48  # Wan2.2's 25 and Wan2.1's 23
