"""The same video whatever the ranks, at the real models' widths, on either kind of CPU (`cpu_compute`).

The mid block's attention is the one op whose every band reads the whole frame: each rank's call holds only its band's
queries. torch's CPU attention picks its GEMMs by the number of queries in a call, so the portable attention computes
fixed blocks of `ops.CPU_QUERY_BLOCK` queries whatever the call holds (`ops.attention`). A latent width of 33 gives
bands whose query counts end in tails of 1-4 queries past a block of 32, the calls where the choice differs. The
latents' seed is one whose video, with one attention call per band, differed over 4 ranks on a CPU computing either
way (AMD EPYC with AVX-512: in 17,196 (bf16) and 18,182 (fp32) values).

oneDNN's fp32 convs choose their blocking by a call's extents too, so on a CPU computing in fp32 every conv runs in
calls of one image and a fixed number of rows (`ops._conv`). The Wan2.2 layout over ranks: at the real decoder's widths
(1024 down to 256 channels), and at half of them, where a 128-channel layer at this frame's last level summed a band's
rows in another order than the whole frame's before.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _ranks import run_ranks
from _threads import RANK_THREADS, torch_threads
from _vae_helpers import random_latents

from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder
from fastvideo_pan2_ext.vae_kernel.compiled.selfcheck import random_weights
from fastvideo_pan2_ext.vae_kernel.definitions.architecture import WAN21_CONFIG, WAN22_CONFIG
from fastvideo_pan2_ext.vae_kernel.distributed.bands import split_rows
from fastvideo_pan2_ext.vae_kernel.portable import ops

MID_WIDTHS = {"wan2.1": 4 * WAN21_CONFIG.decoder_base_dim, "wan2.2": 4 * WAN22_CONFIG.decoder_base_dim}  # 384, 1024
WAN21_LATENTS = (1, WAN21_CONFIG.z_dim, 1, 7, 33)
AMX_BF16 = ops.cpu_has_amx_bf16()  # this CPU's own answer (the `cpu_compute` fixture replaces the probe)


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize("layout", MID_WIDTHS)
def test_attention_gives_each_query_the_same_result_in_every_band_and_pass(layout, cpu_compute):
    channels, (frames, rows, width) = MID_WIDTHS[layout], (2, 7, 33)
    q, kv = _bf16(frames, rows * width, channels, seed=channels + rows), _bf16(frames, rows * width, 2 * channels,
                                                                                seed=channels + rows + 1)
    with torch_threads():
        whole = torch.empty_like(q)
        ops.attention(q, kv, whole)
        differ = {}
        for world in (2, 3, 4):
            for start, stop in split_rows(rows, world):
                band = torch.empty(frames, (stop - start) * width, channels, dtype=torch.bfloat16)
                ops.attention(q[:, start * width:stop * width].contiguous(), kv, band)
                differ[f"{world} ranks, rows {start}-{stop}"] = band != whole[:, start * width:stop * width]
        one_frame = torch.empty_like(q[1:])  # a pass of one frame
        ops.attention(q[1:], kv[1:], one_frame)
        differ["one frame"] = one_frame != whole[1:]
    assert not {what: int(d.sum()) for what, d in differ.items() if d.any()}


def _wan21_decode(rank: int, world: int, tmp: str, compute: torch.dtype) -> torch.Tensor | None:
    ops.cpu_has_amx_bf16 = lambda: compute == torch.bfloat16  # this rank runs as the test's kind of CPU
    decoder = WanVAEDecoder(random_weights(WAN21_CONFIG, seed=1), device="cpu", frames_per_pass=1, backend="torch")
    return decoder.decode(random_latents(WAN21_LATENTS, seed=4))


@pytest.mark.slow
def test_bands_over_gloo_ranks_give_the_same_video_at_wan21s_real_widths(tmp_path, cpu_compute):
    with torch_threads():
        single = _wan21_decode(0, 1, str(tmp_path), cpu_compute)
    for world in (2, 3, 4):
        (tmp_path / f"{world}").mkdir()
        videos = run_ranks(_wan21_decode, world, tmp_path / f"{world}", cpu_compute, threads=RANK_THREADS)
        assert all(video is None for video in videos[1:])
        assert torch.equal(videos[0], single), f"{world} ranks: {int((videos[0] != single).sum())} values differ"


WAN22_LATENTS = (1, WAN22_CONFIG.z_dim, 3, 3, 2)


def _wan22_decode(rank: int, world: int, tmp: str, compute: torch.dtype, base: int, frames_per_pass: int = 2,
                  tile_rows: int | None = None) -> torch.Tensor | None:
    ops.cpu_has_amx_bf16 = lambda: compute == torch.bfloat16  # this rank runs as the test's kind of CPU
    config = dataclasses.replace(WAN22_CONFIG, decoder_base_dim=base)
    decoder = WanVAEDecoder(random_weights(config, seed=1), device="cpu", frames_per_pass=frames_per_pass,
                            backend="torch", tile_rows=tile_rows)
    return decoder.decode(random_latents(WAN22_LATENTS, seed=4))


@pytest.mark.slow
@pytest.mark.parametrize("base", [WAN22_CONFIG.decoder_base_dim // 2, WAN22_CONFIG.decoder_base_dim])
def test_passes_tiles_and_bands_over_gloo_ranks_give_the_same_video_at_wan22s_widths(tmp_path, cpu_compute, base):
    if cpu_compute == torch.bfloat16 and not AMX_BF16:
        pytest.skip("a CPU without AMX-BF16 never decodes in bf16 (and its bf16 convs at these widths take minutes)")
    with torch_threads():
        single = _wan22_decode(0, 1, str(tmp_path), cpu_compute, base)
        for frames_per_pass, tile_rows in [(1, None), (4, None), (2, 1)]:  # passes and tiles of one rank
            video = _wan22_decode(0, 1, str(tmp_path), cpu_compute, base, frames_per_pass, tile_rows)
            assert torch.equal(video, single), f"{frames_per_pass} frames per pass, tiles of {tile_rows}"
    for world in (2, 3, 4):
        (tmp_path / f"{world}").mkdir()
        videos = run_ranks(_wan22_decode, world, tmp_path / f"{world}", cpu_compute, base, threads=RANK_THREADS)
        assert all(video is None for video in videos[1:])
        assert torch.equal(videos[0], single), f"{world} ranks: {int((videos[0] != single).sum())} values differ"
