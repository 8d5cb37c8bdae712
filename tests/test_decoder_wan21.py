"""WanVAEDecoder on Wan2.1-layout weights (`is_residual=False`, no patchify, 8x spatial): the allowance against the
fp32 reference (release = diffusers bf16), frames_per_pass, exact tiles and their margins, two gloo ranks, and
`decode_iter`.

Narrow seeded random-weight diffusers models (base_dim 8, z_dim 8) on CPU; the oracle decodes are cached per latents.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _decoder_allowance import Oracle, check_allowance, latents
from _vae_helpers import make_wan21_vae
from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder
from fastvideo_pan2_ext.vae_kernel.portable import network
from fastvideo_pan2_ext.vae_kernel.compiled import selfcheck
from fastvideo_pan2_ext.vae_kernel.definitions.architecture import WAN21_CONFIG, WanVAEConfig

Z_DIM = 8
TILED_SHAPE = (2, Z_DIM, 3, 9, 2)  # batch 2, an odd frame height, several passes
MARGIN_SHAPE = (1, Z_DIM, 1, 19, 1)  # tall enough that a 2-row tile has a cut edge within every margin


@pytest.fixture(scope="module")
def wan21_vae():
    return make_wan21_vae(seed=0)


@pytest.fixture(scope="module")
def wan21_state_dict(wan21_vae):
    return {name: tensor.detach().clone() for name, tensor in wan21_vae.state_dict().items()}


@pytest.fixture(scope="module")
def oracle(wan21_vae, wan21_state_dict):
    return Oracle(wan21_vae, wan21_state_dict)


def _decoder(state_dict, frames_per_pass=2, **options):
    return WanVAEDecoder(state_dict, device="cpu", frames_per_pass=frames_per_pass, backend="torch", **options)


@pytest.fixture(scope="module")
def plain_decodes(wan21_state_dict):
    """latents shape -> (latents, untiled single-rank decode), computed once."""
    cache = {}

    def get(shape):
        if shape not in cache:
            z = latents(shape, seed=sum(shape))
            cache[shape] = z, _decoder(wan21_state_dict).decode(z)
        return cache[shape]

    return get


def test_decoder_reads_the_wan21_layout_from_the_diffusers_module(wan21_vae, wan21_state_dict):
    decoder = WanVAEDecoder(wan21_vae, device="cpu", backend="torch")
    assert decoder.config == WanVAEConfig(z_dim=Z_DIM, decoder_base_dim=8, dim_mult=(1, 2, 4, 4), num_res_blocks=2,
                                          temperal_upsample=(True, True, False), out_channels=3, patch_size=1,
                                          residual=False)
    z = latents((1, Z_DIM, 2, 2, 3), seed=1)
    assert torch.equal(decoder.decode(z), _decoder(wan21_state_dict, 4).decode(z))


@pytest.mark.parametrize(
    "shape, frames_per_pass",
    [
        ((1, Z_DIM, 1, 3, 5), 1),  # one latent frame -> one video frame; odd, non-square
        ((1, Z_DIM, 2, 5, 3), 1),  # the first later frame (the time convs' zero history)
        ((2, Z_DIM, 5, 3, 4), 2),  # batch 2
        ((1, Z_DIM, 5, 3, 4), 4),  # a pass shorter than frames_per_pass at the end
        ((1, Z_DIM, 2, 1, 1), 1),  # a single latent pixel
    ],
)
def test_wan21_decode_matches_reference_within_allowance(wan21_state_dict, oracle, shape, frames_per_pass):
    z = latents(shape, seed=sum(shape))
    ref32, release = oracle.decodes(z, shape)
    video = _decoder(wan21_state_dict, frames_per_pass).decode(z)
    b, _, t, h, w = shape
    assert video.shape == (b, 3, 4 * t - 3, 8 * h, 8 * w) and video.dtype == torch.bfloat16
    check_allowance(video, ref32, release)


def test_wan21_frames_per_pass_gives_bit_identical_videos(wan21_state_dict):
    z = latents((1, Z_DIM, 6, 2, 3), seed=2)
    videos = [_decoder(wan21_state_dict, fp).decode(z) for fp in (1, 2, 4)]
    assert torch.equal(videos[0], videos[1]) and torch.equal(videos[0], videos[2])


@pytest.mark.parametrize("tile_rows", [3, 4])
def test_wan21_tiled_decode_is_the_plain_decode(wan21_state_dict, plain_decodes, tile_rows):
    z, expected = plain_decodes(TILED_SHAPE)
    assert torch.equal(_decoder(wan21_state_dict, tile_rows=tile_rows).decode(z), expected)


def test_wan21_max_memory_picks_exact_tiles(wan21_state_dict, plain_decodes):
    z, expected = plain_decodes(TILED_SHAPE)
    probe = _decoder(wan21_state_dict)
    budget = int(probe.peak_bytes(TILED_SHAPE, tile_rows=3) * 1.31)  # the planner's headroom is 1.3
    decoder = _decoder(wan21_state_dict, max_memory=budget)
    assert decoder.plan(TILED_SHAPE).tile_rows in range(3, TILED_SHAPE[3])
    assert torch.equal(decoder.decode(z), expected)


def test_tile_margins_of_the_wan21_decoder():
    assert network.tile_margins(WAN21_CONFIG) == (15, [13, 12, 10, 7])


@pytest.mark.parametrize("short", ["mid", 0, 1, 2, 3])
def test_every_wan21_tile_margin_is_needed(wan21_state_dict, plain_decodes, monkeypatch, short):
    """The exact margins give the plain decode; one row less at any one level lets a cut edge's zero rows reach the
    video (so the derived margins are exactly what the Wan2.1 network needs)."""
    z, expected = plain_decodes(MARGIN_SHAPE)
    exact = network.tile_margins
    assert torch.equal(_decoder(wan21_state_dict, tile_rows=2).decode(z), expected)

    def one_short(config):
        mid, margins = exact(config)
        if short == "mid":
            return mid - 1, margins
        return mid, [m - (i == short) for i, m in enumerate(margins)]

    monkeypatch.setattr(network, "tile_margins", one_short)
    assert not torch.equal(_decoder(wan21_state_dict, tile_rows=2).decode(z), expected)


def test_wan21_decode_iter_yields_the_decode_in_consecutive_chunks(wan21_state_dict, plain_decodes):
    z, expected = plain_decodes(TILED_SHAPE)
    for options in ({}, {"tile_rows": 4}):
        next_frame = {0: 0, 1: 0}
        for b, frame, chunk in _decoder(wan21_state_dict, **options).decode_iter(z):
            assert frame == next_frame[b]
            assert torch.equal(chunk, expected[b:b + 1, :, frame:frame + chunk.shape[2]])
            next_frame[b] = frame + chunk.shape[2]
        assert next_frame == {0: 9, 1: 9}


def _banded_worker(rank: int, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        decoder = WanVAEDecoder(torch.load(f"{tmp}/state_dict.pt"), device="cpu", frames_per_pass=2, backend="torch")
        torch.save(decoder.decode(torch.load(f"{tmp}/latents.pt")), f"{tmp}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_wan21_banded_decode_over_two_gloo_ranks_is_the_single_rank_decode(tmp_path, wan21_state_dict, oracle,
                                                                           plain_decodes):
    shape = (1, Z_DIM, 3, 5, 3)  # 5 latent rows over 2 ranks
    z, single = plain_decodes(shape)
    torch.save(wan21_state_dict, tmp_path / "state_dict.pt")
    torch.save(z, tmp_path / "latents.pt")
    mp.spawn(_banded_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    video = torch.load(tmp_path / "rank0.pt")
    assert torch.load(tmp_path / "rank1.pt") is None, "ranks other than 0 must return None"
    assert torch.equal(video, single)
    check_allowance(video, *oracle.decodes(z, shape))


def test_the_self_check_covers_every_op_shape_of_the_wan21_decoder():
    signatures = {str(s) for s in selfcheck.op_signatures()}
    for shape in ("conv3d 16 -> 384 k3x3x3",  # conv_in: 16 latent channels
                  "conv3d 96 -> 3 k3x3x3",  # conv_out: plain RGB
                  "conv3d 384 -> 768 k3x1x1",  # the time conv (2C)
                  "conv3d 192 -> 384 k1x1x1",  # the one shortcut (up block 1 reads the halved width)
                  "upsample2x_conv3x3 384 -> 192 k1x3x3", "upsample2x_conv3x3 192 -> 96 k1x3x3",  # halving upsamplers
                  "rms_norm_silu 96 -> 96 into a strided window"):
        assert shape in signatures, sorted(signatures)
    assert len(signatures) == 48  # Wan2.2's 25 and Wan2.1's 23
