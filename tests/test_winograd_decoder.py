"""`WanVAEDecoder(conv_algorithm=...)`: Winograd F(2x2, 3x3) for the 3x3 convs, on every route of the decoder. Within
the allowance against the fp32 reference, and as exact as the direct path about how the work is split: frames per
pass, tiles, bands over ranks and streaming all give the same video, bit for bit (bands and tiles start on even rows,
where Winograd's 2x2 output tiles line up with the whole frame's)."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _decoder_allowance import Oracle, check_allowance, latents
from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder
from fastvideo_pan2_ext.vae_kernel.distributed.bands import split_rows

SHAPE = (1, 8, 3, 5, 3)  # odd latent height (5 rows: bands and tiles of odd sizes), 9 video frames


@pytest.fixture(scope="module")
def winograd_video(wan22_state_dict):
    return WanVAEDecoder(wan22_state_dict, device="cpu", backend="torch", conv_algorithm="winograd",
                         frames_per_pass=1).decode(latents(SHAPE, seed=31))


def test_winograd_decode_is_within_the_allowance(wan22_vae, wan22_state_dict, winograd_video):
    ref32, release = Oracle(wan22_vae, wan22_state_dict).decodes(latents(SHAPE, seed=31), ("winograd", SHAPE))
    figures = check_allowance(winograd_video, ref32, release)
    direct = WanVAEDecoder(wan22_state_dict, device="cpu", backend="torch", conv_algorithm="direct")
    assert not torch.equal(direct.decode(latents(SHAPE, seed=31)), winograd_video)  # really another algorithm
    assert figures["rms_err"] > 0


@pytest.mark.parametrize("frames_per_pass", [2, 4])
def test_winograd_frames_per_pass_gives_the_same_video(wan22_state_dict, winograd_video, frames_per_pass):
    decoder = WanVAEDecoder(wan22_state_dict, device="cpu", backend="torch", conv_algorithm="winograd",
                            frames_per_pass=frames_per_pass)
    assert torch.equal(decoder.decode(latents(SHAPE, seed=31)), winograd_video)


@pytest.mark.parametrize("tile_rows", [1, 2, 3])
def test_winograd_tiles_give_the_same_video(wan22_state_dict, winograd_video, tile_rows):
    decoder = WanVAEDecoder(wan22_state_dict, device="cpu", backend="torch", conv_algorithm="winograd",
                            frames_per_pass=1, tile_rows=tile_rows)
    assert torch.equal(decoder.decode(latents(SHAPE, seed=31)), winograd_video)
    streamed = torch.cat([chunk for _, _, chunk in decoder.decode_iter(latents(SHAPE, seed=31))], dim=2)
    assert torch.equal(streamed, winograd_video)


def test_bands_start_on_multiples_of_the_ops_row_multiple():
    assert split_rows(5, 3, 2) == [(0, 2), (2, 4), (4, 5)]
    assert split_rows(5, 2, 2) == [(0, 4), (4, 5)]
    assert split_rows(3, 4, 2) == [(0, 2), (2, 3)]
    assert split_rows(44, 4, 2) == [(0, 12), (12, 24), (24, 34), (34, 44)]
    assert split_rows(5, 2) == [(0, 3), (3, 5)]  # direct convs: near-equal bands as before


def _rank(rank: int, world: int, tmp: str, state_dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        decoder = WanVAEDecoder(state_dict, device="cpu", backend="torch", conv_algorithm="winograd",
                                frames_per_pass=1)
        video = decoder.decode(latents(SHAPE, seed=31))
        if rank == 0:
            torch.save(video, f"{tmp}/video.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_winograd_bands_over_ranks_give_the_same_video(wan22_state_dict, winograd_video, tmp_path, world):
    mp.spawn(_rank, args=(world, str(tmp_path), wan22_state_dict), nprocs=world, join=True)
    assert torch.equal(torch.load(tmp_path / "video.pt"), winograd_video)


def test_an_unknown_conv_algorithm_is_refused(wan22_state_dict):
    with pytest.raises(ValueError, match=r"conv_algorithm must be one of \['auto', 'direct', 'winograd'\]; got"):
        WanVAEDecoder(wan22_state_dict, device="cpu", conv_algorithm="fft")


def test_auto_is_direct_on_cpu(wan22_state_dict):
    assert WanVAEDecoder(wan22_state_dict, device="cpu", conv_algorithm="auto").backend == "torch"
    assert WanVAEDecoder(wan22_state_dict, device="cpu", conv_algorithm="winograd").backend == "torch+winograd-f2x2"
