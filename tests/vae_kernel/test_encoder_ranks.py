"""`WanVAEEncoder` over real gloo ranks: row bands (halo rows at every conv and at each downsample's row below, the
attention's keys and values gathered) give every rank the moments one rank alone computes, bit for bit (the same ops
on the same rows, at one thread), for both layouts, both precisions, uneven bands, idle ranks and the steady reuse
(skipped by every rank together); and the group's rounds are the decoder's: bad or different input on one rank is a
ValueError on every rank, so are weights that differ (the decoder's too), an error on one rank reaches every rank,
and running out of memory on one rank makes the whole group retry at a smaller plan, with the same moments
(docs/design/encoder.md, "The encoder").
"""

from __future__ import annotations

import dataclasses
import re
import time

import pytest
import torch
from _ranks import outcome, run_ranks
from _threads import torch_threads
from _vae_helpers import make_wan21_vae, make_wan22_vae

from fastvideo_pan2_ext.vae_kernel.encoder import WanVAEEncoder
from fastvideo_pan2_ext.vae_kernel.portable.ops import TORCH_OPS

pytestmark = pytest.mark.slow

SIZES = {"wan21": (45, 59), "wan22": (64, 80)}  # Wan2.1: 5 latent rows plus 5 pixel rows (the last band reads them)
HEARD_WITHIN_S = 10


def _vae(layout: str):
    return make_wan21_vae(seed=3, base_dim=8, z_dim=16) if layout == "wan21" else \
        make_wan22_vae(seed=3, base_dim=8, z_dim=48)


def _video(size, frames: int, seed: int = 0, batch: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand((batch, 3, frames, *size), generator=g) * 2 - 1


def _image_to_video(size, frames: int = 29) -> torch.Tensor:
    video = torch.zeros((1, 3, frames, *size))
    video[:, :, :1] = _video(size, 1, seed=5, batch=1)
    return video


CASES = {  # name -> (layout, video, options)
    "wan21 fp32": ("wan21", lambda: _video(SIZES["wan21"], 9), dict(precision="fp32", frames_per_pass=2)),
    "wan21 bf16": ("wan21", lambda: _video(SIZES["wan21"], 9), dict(precision="bf16", frames_per_pass=3)),
    "wan22 fp32": ("wan22", lambda: _video(SIZES["wan22"], 9), dict(precision="fp32", frames_per_pass=2)),
    "wan22 bf16": ("wan22", lambda: _video(SIZES["wan22"], 9), dict(precision="bf16")),
    "wan22 i2v": ("wan22", lambda: _image_to_video(SIZES["wan22"]), dict(frames_per_pass=1)),
    "wan21 i2v": ("wan21", lambda: _image_to_video(SIZES["wan21"]), dict()),
    "wan22 one latent row": ("wan22", lambda: _video((16, 32), 5), dict()),  # every rank but one idle
}


def _bands(rank: int, world: int, tmp: str) -> dict:
    results = {}
    for name, (layout, video, options) in CASES.items():
        encoder = WanVAEEncoder(_vae(layout), **options)
        results[name] = (encoder.encode(video()), dict(encoder.last_reuse))
    results["tiles refused"] = outcome(lambda: WanVAEEncoder(_vae("wan22"), tile_rows=2))
    return results


@pytest.mark.parametrize("world", [2, 3, 4])
def test_bands_over_ranks_give_every_rank_the_moments_of_one_rank_bit_for_bit(tmp_path, world):
    results = run_ranks(_bands, world, tmp_path)
    with torch_threads(1):
        for name, (layout, video, options) in CASES.items():
            alone = WanVAEEncoder(_vae(layout), **options)
            expected = alone.encode(video())
            for rank, r in enumerate(results):
                moments, reused = r[name]
                assert torch.equal(moments, expected), (name, rank)
                # skipped together, where one rank skips; a rank holding no rows ran nothing
                assert reused == (alone.last_reuse if rank < expected.shape[3] else {}), (name, rank)
            if "i2v" in name:
                assert any(alone.last_reuse.values()), name  # the reuse did happen
    for r in results:
        assert r["tiles refused"][0] == "ValueError" and "local=True" in r["tiles refused"][1]


def _conv_failing(rank_failing: int, rank: int, raised_at: list, *, calls: int | None = None,
                  out_of_memory_above_frames: int | None = None):
    """The portable op table; on `rank_failing`, its conv3d raises at its `calls`-th call, or runs out of memory for
    outputs of more than `out_of_memory_above_frames` frames."""
    count = [0]

    def conv3d(x, w, b, out, residual=None):
        if rank == rank_failing:
            count[0] += 1
            if count[0] == calls or (out_of_memory_above_frames is not None
                                     and out.shape[1] > out_of_memory_above_frames):
                raised_at.append(time.time())
                if calls is not None:
                    raise RuntimeError("injected: encode")
                raise torch.OutOfMemoryError(f"injected: conv3d output {list(out.shape)}")
        TORCH_OPS.conv3d(x, w, b, out, residual)

    return dataclasses.replace(TORCH_OPS, name="injected", conv3d=conv3d)


def _failures(rank: int, world: int, tmp: str) -> dict:
    vae, video = _vae("wan22"), _video(SIZES["wan22"], 9)
    results = {}
    bad = video.clone()
    if rank == 1:
        bad[0, 0, 3, 5, 7] = float("nan")
    results["bad input"] = outcome(lambda: WanVAEEncoder(vae).encode(bad))
    other = _video(SIZES["wan22"], 9, seed=1) if rank == 1 else video
    results["different input"] = outcome(lambda: WanVAEEncoder(vae).encode(other))
    raised_at: list[float] = []
    failing = WanVAEEncoder(vae, frames_per_pass=2, backend=_conv_failing(1, rank, raised_at, calls=40))
    results["error"] = outcome(lambda: failing.encode(video), (BaseException,))
    results["error times"] = (raised_at[0] if raised_at else None, time.time())
    short = WanVAEEncoder(vae, frames_per_pass=2, backend=_conv_failing(0, rank, [], out_of_memory_above_frames=4))
    results["out of memory"] = outcome(lambda: short.encode(video))
    results["retries"] = [tuple(p) for p in short.last_retries]
    results["plan"] = tuple(short.last_plan)
    results["after"] = WanVAEEncoder(vae, frames_per_pass=2).encode(video)
    return results


def test_bad_input_errors_and_running_out_of_memory_on_one_rank_reach_every_rank(tmp_path):
    results = run_ranks(_failures, 2, tmp_path, group_timeout_s=120, hang_limit_s=300)
    r0, r1 = results
    assert r1["bad input"] == ("ValueError", "video contains NaN or Inf")
    assert r0["bad input"] == ("ValueError", "rank 1 of the encode group rejected its video: video contains NaN or Inf")
    for r in results:
        kind, message = r["different input"]
        assert kind == "ValueError" and message.startswith("ranks disagree about the encode: rank 1 has input "), \
            message
    assert r1["error"] == ("RuntimeError", "injected: encode")
    assert r0["error"] == ("RuntimeError", "rank 1 of the encode group failed while encoding: RuntimeError: "
                                           "injected: encode")
    injected_at = r1["error times"][0]
    assert injected_at is not None
    for r in results:
        assert r["error times"][1] - injected_at < HEARD_WITHIN_S
    with torch_threads(1):
        expected = WanVAEEncoder(_vae("wan22"), local=True, frames_per_pass=2).encode(_video(SIZES["wan22"], 9))
    for r in results:  # rank 0 ran out of memory at 2 frames per pass: both retried at 1, with the same moments
        assert r["out of memory"][0] == "ok" and torch.equal(r["out of memory"][1], expected)
        assert r["retries"] == [(2, None)] and r["plan"] == (1, None)
        assert torch.equal(r["after"], expected)  # no rank was left behind in a round


def _different_weights(rank: int, world: int, tmp: str) -> dict:
    import torch.distributed as dist

    from fastvideo_pan2_ext.diffusers_integration.fast_encode import enable_fast_encode
    from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder

    vae, video = _vae("wan22"), _video(SIZES["wan22"], 5, batch=1)
    results = {"same": outcome(lambda: WanVAEEncoder(vae).encode(video))}
    if rank == 1:  # one weight of the decoder and one of the encoder, 1% off (bf16 keeps that)
        with torch.no_grad():
            vae.decoder.conv_out.weight[0].mul_(1.01)
            vae.encoder.conv_out.weight[0].mul_(1.01)
    results["encoder"] = outcome(lambda: WanVAEEncoder(vae).encode(video))
    results["decoder"] = outcome(lambda: WanVAEDecoder(vae, backend="torch").decode(torch.ones(1, 48, 2, 4, 5)))
    enable_fast_encode(vae, pg=dist.group.WORLD)
    with torch.no_grad():
        results["diffusers"] = outcome(lambda: vae.encode(video))
    return results


def test_ranks_whose_weights_differ_each_refuse_the_encode_and_the_decode_in_one_line(tmp_path):
    results = run_ranks(_different_weights, 2, tmp_path)
    for r in results:
        assert r["same"][0] == "ok"  # the same weights: agreed
        for work, part in [("encode", "encoder"), ("decode", "decoder"), ("encode", "diffusers")]:
            kind, message = r[part]
            assert kind == "ValueError" and re.fullmatch(
                rf"ranks disagree about the {work}'s weights: rank 1's {work}r weights have checksum \S+, rank 0's "
                r"\S+; every rank must hold the same VAE weights", message), (part, message)
    assert results[0]["encoder"] == results[1]["encoder"]  # one line, the same on every rank


def _diffusers_vae_over_ranks(rank: int, world: int, tmp: str) -> dict:
    import torch.distributed as dist

    from fastvideo_pan2_ext.diffusers_integration.fast_encode import enable_fast_encode

    vae, video = _vae("wan22"), _video(SIZES["wan22"], 9)
    enable_fast_encode(vae, pg=dist.group.WORLD)
    vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32)  # diffusers would tile: the ranks band
    with torch.no_grad(), pytest.warns(UserWarning, match="split each encode's rows"):
        dist_ = vae.encode(video).latent_dist
    return {"mode": dist_.mode(), "sample": dist_.sample(torch.Generator().manual_seed(7)),
            "refused": outcome(lambda: enable_fast_encode(vae, pg=dist.group.WORLD, tile_rows=2))}


def test_diffusers_encode_over_a_group_gives_every_rank_one_ranks_distribution(tmp_path):
    from fastvideo_pan2_ext.diffusers_integration.fast_encode import enable_fast_encode

    results = run_ranks(_diffusers_vae_over_ranks, 2, tmp_path)
    vae = _vae("wan22")
    enable_fast_encode(vae)
    with torch_threads(1), torch.no_grad():
        alone = vae.encode(_video(SIZES["wan22"], 9)).latent_dist
        mode, sample = alone.mode(), alone.sample(torch.Generator().manual_seed(7))
    for r in results:
        assert torch.equal(r["mode"], mode) and torch.equal(r["sample"], sample)
        kind, message = r["refused"]
        assert kind == "ValueError" and "with a process group of 2 ranks the ranks split the rows" in message
