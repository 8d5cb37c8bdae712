"""`max_memory` and `frames_per_pass="auto"`: the decoder measures its own peak working memory (a replay of its buffers
on the meta device) and picks the largest setting (tile, frames per pass) that fits; the decode stays bit-identical to
the plain decode and really stays in budget."""

from __future__ import annotations

import pytest
import torch

from _decoder_allowance import latents
from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder
from fastvideo_pan2_ext.vae_kernel.planning import memory
from fastvideo_pan2_ext.vae_kernel.planning.memory import LiveBytes, parse_bytes

SHAPE = (2, 8, 3, 7, 2)  # batch 2, an odd frame height, a first pass and a two-frame pass


@pytest.fixture(scope="module")
def decoder(wan22_state_dict):
    return WanVAEDecoder(wan22_state_dict, device="cpu", frames_per_pass=2, backend="torch")


@pytest.fixture(scope="module")
def plain(decoder):
    z = latents(SHAPE, seed=7)
    return z, decoder.decode(z)


def _working_peak(decoder, z, video_bytes):
    """What the decode really allocated beyond its inputs and the returned video, counted op by op."""
    with LiveBytes() as tracker:
        video = decoder.decode(z)
    return video, tracker.peak - video_bytes


@pytest.mark.parametrize("tile_rows", [None, 2])
def test_peak_estimate_tracks_the_real_decodes_allocations(decoder, tile_rows):
    z = latents((1, *SHAPE[1:]), seed=7)
    decoder.disable_tiling() if tile_rows is None else decoder.enable_tiling(tile_rows)
    try:
        _, measured = _working_peak(decoder, z, 2 * torch.Size(decoder.output_shape(z)).numel())
    finally:
        decoder.disable_tiling()
    estimate = decoder.peak_bytes(z.shape, tile_rows=tile_rows)
    assert 0.75 * measured <= estimate <= 1.35 * measured, (tile_rows, estimate, measured)


def test_peak_falls_with_the_tile(decoder):
    peaks = [decoder.peak_bytes(SHAPE, tile_rows=n) for n in (1, 2, 4)]
    # A tile of 4 of the frame's 7 rows reaches, with its margins, over the whole frame: it holds about what the
    # untiled decode holds (within 1%), the smaller tiles less.
    untiled = decoder.peak_bytes(SHAPE)
    assert peaks[0] < peaks[1] < peaks[2] and peaks[1] < untiled and peaks[2] < 1.01 * untiled


# max_memory's choice of the largest tile that fits, its exact video and its measured peak: for both layouts and both
# conv algorithms in tests/vae_kernel/test_decoder_variants.py (`test_max_memory_picks_the_largest_exact_tiles_that_fit`).

# Streamed, every tile's causal history is alive at once and the tiles' margins overlap: tiles save memory only on
# frames much taller than the margins (15 latent rows at the mid block); a CPU computing in bf16 holds smaller
# temporaries than one computing in fp32, so the frame must be taller there.
TALL = (1, 8, 3, 96, 1)


@pytest.mark.slow
def test_max_memory_streams_in_tiles_exactly_and_within_budget(wan22_state_dict, decoder):
    z = latents(TALL, seed=7)
    expected = decoder.decode(z)
    assert decoder.peak_bytes(TALL, tile_rows=16, stream=True) < decoder.peak_bytes(TALL, stream=True)
    budget = int(1.3 * decoder.peak_bytes(TALL, tile_rows=16, stream=True)) + 1
    limited = WanVAEDecoder(wan22_state_dict, device="cpu", frames_per_pass=2, backend="torch", max_memory=budget)
    assert limited.plan(TALL, stream=True).tile_rows is not None
    with LiveBytes() as tracker:
        for b, frame, chunk in limited.decode_iter(z):
            assert torch.equal(chunk, expected[b:b + 1, :, frame:frame + chunk.shape[2]])
            del chunk
    assert tracker.peak <= budget, (tracker.peak, budget)


def test_max_memory_that_fits_the_whole_frame_decodes_untiled(wan22_state_dict, decoder):
    roomy = WanVAEDecoder(wan22_state_dict, device="cpu", frames_per_pass=2, backend="torch", max_memory="1GiB")
    assert roomy.plan(SHAPE).tile_rows is None and roomy.plan(SHAPE, stream=True).tile_rows is None


@pytest.mark.slow
def test_max_memory_too_small_for_one_row_tiles_names_budget_and_minimum(wan22_state_dict, decoder, plain):
    z, _ = plain
    tiny = WanVAEDecoder(wan22_state_dict, device="cpu", frames_per_pass=2, backend="torch", max_memory="64KiB")
    with pytest.raises(ValueError, match=r"max_memory 64\.0 KiB \(65536 bytes\) is too small to decode latents "
                                         r"\[2, 8, 3, 7, 2\] even in one-row tiles: that needs at least [0-9.]+ MiB"):
        tiny.decode(z)
    with pytest.raises(ValueError, match=r"\(65536 bytes\) is too small .* streamed \(decode_iter\) in any tile "
                                         r"size: that needs at least"):
        tiny.decode_iter(z)


def test_max_memory_and_tile_rows_together_are_rejected(wan22_state_dict):
    with pytest.raises(ValueError, match=r"set tile_rows or max_memory, not both"):
        WanVAEDecoder(wan22_state_dict, device="cpu", tile_rows=4, max_memory="1GiB")


@pytest.mark.parametrize("budget", [0, -5, "lots", "2 GiBs", 1.5, True, None])
def test_bad_budgets_are_rejected(budget):
    with pytest.raises(ValueError, match="max_memory must be"):
        parse_bytes(budget)


@pytest.mark.parametrize("text, expected", [("2GiB", 2 * 2**30), ("512 MiB", 512 * 2**20), ("1.5GB", 1_500_000_000),
                                            ("4096", 4096), (123, 123)])
def test_budget_strings_mean_bytes(text, expected):
    assert parse_bytes(text) == expected


# ------------------------------------------------------------------------------------------ frames_per_pass="auto"

LONG = (1, 8, 9, 7, 4)  # nine latent frames: every choice (8, 4, 2, 1) is possible


@pytest.fixture(scope="module")
def auto(wan22_state_dict):
    return WanVAEDecoder(wan22_state_dict, device="cpu", backend="torch")


@pytest.fixture(scope="module")
def long_video(decoder):
    z = latents(LONG, seed=11)
    return z, decoder.decode(z)


def _budget_between(decoder, shape, small: int, large: int) -> int:
    """A budget that the planner says fits frames_per_pass `small` but not `large`."""
    lo, hi = (1.3 * decoder.peak_bytes(shape, n) for n in (small, large))
    assert lo < hi
    return int((lo + hi) / 2)


def test_auto_is_the_default_and_takes_the_most_frames_a_clip_has(auto, plain, long_video):
    assert auto.frames_per_pass == "auto"
    assert auto.plan(LONG) == (8, None)  # a CPU's plan is bounded by DEFAULT_MEMORY_GOAL alone
    assert auto.plan(SHAPE) == (2, None)  # three latent frames: the first alone, then two
    for z, expected in (plain, long_video):
        assert torch.equal(auto.decode(z), expected)


def test_auto_with_max_memory_takes_the_largest_setting_that_fits_untiled(wan22_state_dict, auto, long_video):
    z, expected = long_video
    budget = _budget_between(auto, LONG, 2, 4)
    limited = WanVAEDecoder(wan22_state_dict, device="cpu", backend="torch", max_memory=budget)
    assert limited.plan(LONG) == (2, None)
    video, measured = _working_peak(limited, z, expected.numel() * 2)
    assert torch.equal(video, expected)
    assert measured <= budget, (measured, budget)


@pytest.mark.slow
def test_auto_with_max_memory_below_one_frame_per_pass_tiles_at_one(wan22_state_dict, auto, long_video):
    z, expected = long_video
    budget = int(1.3 * auto.peak_bytes(LONG, 1, 3)) + 1
    limited = WanVAEDecoder(wan22_state_dict, device="cpu", backend="torch", max_memory=budget)
    plan = limited.plan(LONG)
    assert plan.frames_per_pass == 1 and plan.tile_rows is not None and plan.tile_rows >= 3
    video, measured = _working_peak(limited, z, expected.numel() * 2)
    assert torch.equal(video, expected)
    assert measured <= budget, (measured, budget)


# The device's free memory is what only a GPU reports (`memory.free_device_bytes`); these tests stand in for it.

def test_auto_fits_the_free_device_memory(monkeypatch, auto, long_video):
    z, expected = long_video
    video_bytes = expected.numel() * 2
    free = _budget_between(auto, LONG, 4, 8) + video_bytes  # the decode returns the video: it needs room too
    monkeypatch.setattr(memory, "free_device_bytes", lambda device: free)
    assert auto.plan(LONG) == (4, None)
    assert auto.plan(LONG, stream=True).frames_per_pass == 4  # decode_iter returns no whole video


@pytest.mark.slow
def test_auto_tiles_when_one_frame_per_pass_overflows_the_free_memory(monkeypatch, auto, long_video):
    z, expected = long_video
    video_bytes = expected.numel() * 2
    room = int(1.3 * auto.peak_bytes(LONG, 1, 2)) + 1
    monkeypatch.setattr(memory, "free_device_bytes", lambda device: room + video_bytes)
    plan = auto.plan(LONG)
    assert plan.frames_per_pass == 1 and plan.tile_rows is not None and plan.tile_rows >= 2
    video, measured = _working_peak(auto, z, video_bytes)
    assert auto.last_plan == plan and torch.equal(video, expected)
    assert measured <= room, (measured, room)


def test_pan2s_default_video_decodes_at_one_frame_per_pass_within_the_16_gib_goal():
    """The numbers behind the default (bf16 scratch, as on a GPU; `bench/memory_plan.py` prints them): for PAN2's
    default video (241 frames at 704x1248, T = 61), frames_per_pass 1 keeps weights, working memory and video within
    DEFAULT_MEMORY_GOAL (11.8 GiB); 2 does not (17.3 GiB)."""
    from fastvideo_pan2_ext.vae_kernel.definitions.architecture import WAN22_CONFIG, expected_shapes, video_shape
    from fastvideo_pan2_ext.vae_kernel.portable.weights import prepare

    weights = {name: prepare(name, torch.empty(shape, device="meta"))
               for name, shape in expected_shapes(WAN22_CONFIG).items()}
    planner = memory.MemoryPlanner(weights, WAN22_CONFIG, torch.device("cuda"))
    shape = (1, 48, 61, 44, 78)
    fixed = planner.weight_bytes + 2 * torch.Size(video_shape(WAN22_CONFIG, shape)).numel()
    total = {fpp: planner.peak_bytes(shape, fpp) + fixed for fpp in (1, 2)}
    assert total[1] <= memory.DEFAULT_MEMORY_GOAL < total[2], {k: v / 2**30 for k, v in total.items()}


@pytest.mark.parametrize("shape", [(1, 8, 9, 5), (1, 7, 9, 5, 5), (1, 8, 0, 5, 5), (1, 8, 2.0, 5, 5)])
def test_plan_and_peak_bytes_name_a_bad_shape(auto, shape):
    for ask in (auto.plan, auto.peak_bytes):
        with pytest.raises(ValueError, match=r"latents_shape must be \[B, 8, T, h, w\] with every size >= 1; got"):
            ask(shape)
