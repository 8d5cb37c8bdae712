"""Exact tiled decode (`tile_rows`): the tiling switches, the option's checks, the Wan2.2 margins, a one-rank group.
That tiles of rows decoded one after another give the plain decode bit for bit (tiles of 1 row up to more than the
frame's rows), and that every margin is needed, is checked for both layouts and both conv algorithms by
tests/vae_kernel/test_decoder_variants.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fastvideo_pan2_ext.vae_kernel.portable.network as network
from _decoder_allowance import latents
from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder

SHAPE = (2, 8, 3, 13, 3)  # batch 2, an odd frame height, several passes


@pytest.fixture(scope="module")
def plain(wan22_state_dict):
    z = latents(SHAPE, seed=4)
    return z, WanVAEDecoder(wan22_state_dict, device="cpu", frames_per_pass=2, backend="torch").decode(z)


def test_enable_and_disable_tiling_switch_the_route(wan22_state_dict, plain):
    z, expected = plain
    decoder = WanVAEDecoder(wan22_state_dict, device="cpu", frames_per_pass=2, backend="torch")
    decoder.enable_tiling(5)
    assert decoder.tile_rows == 5 and torch.equal(decoder.decode(z), expected)
    decoder.disable_tiling()
    assert decoder.tile_rows is None


def test_tile_margins_of_the_wan22_decoder():
    from fastvideo_pan2_ext.vae_kernel import WAN22_CONFIG

    assert network.tile_margins(WAN22_CONFIG) == (15, [13, 12, 10, 7])


@pytest.mark.parametrize("tile_rows", [0, -2, 1.5, True])
def test_tile_rows_must_be_a_positive_int(wan22_state_dict, tile_rows):
    with pytest.raises(ValueError, match=r"tile_rows must be an int >= 1"):
        WanVAEDecoder(wan22_state_dict, device="cpu", tile_rows=tile_rows)


def test_a_one_rank_default_group_decodes_alone_and_may_tile(wan22_state_dict, tmp_path):
    """As in a one-GPU FastVideo process, whose default group has one rank (larger groups refuse tiles:
    tests/vae_kernel/test_multirank.py)."""
    own = not dist.is_initialized()  # after the in-process FastVideo tests, their one-rank group is the default
    if own:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        assert dist.get_world_size() == 1
        decoder = WanVAEDecoder(wan22_state_dict, device="cpu", tile_rows=4)
        assert (decoder.pg, decoder.tile_rows) == (None, 4)
    finally:
        if own:
            dist.destroy_process_group()
