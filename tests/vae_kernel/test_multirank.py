"""Multi-rank decode with real processes over gloo (CPU): N = 1, 2, 3, 4 ranks, each decoding a band of rows.

Each world runs every scenario in one process group: a latent height not divisible by N, a height smaller than N
(idle ranks), `local=True`, and ranks that disagree about the input (shape, or NaN on one rank), which must raise on
every rank within the group's timeout instead of hanging.
"""

from __future__ import annotations

import pytest
import torch

from _decoder_allowance import Oracle, check_allowance, latents
from _ranks import outcome, run_ranks
from _threads import RANK_THREADS, torch_threads

HEIGHT_NOT_DIVISIBLE = (1, 8, 3, 5, 3)  # 5 latent rows over 2, 3 or 4 ranks
GROUP_TIMEOUT_S = 60


def _outcome(fn):
    return outcome(fn, (ValueError,))


def _worker(rank: int, world: int, tmp: str) -> dict:
    from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder
    from fastvideo_pan2_ext.vae_kernel.planning import memory

    sd = torch.load(f"{tmp}/state_dict.pt")
    z = torch.load(f"{tmp}/latents.pt")
    decoder = WanVAEDecoder(sd, device="cpu", frames_per_pass=2, backend="torch")
    results = {"banded": _outcome(lambda: decoder.decode(z))}
    short = z[:, :, :2, : max(world - 1, 1)]  # fewer latent rows than ranks: the last rank idles
    results["short"] = _outcome(lambda: decoder.decode(short))
    results["local"] = _outcome(lambda: WanVAEDecoder(sd, device="cpu", frames_per_pass=2, local=True,
                                                     backend="torch").decode(short))
    # Exact tiles are a single-rank decode: a group of one rank decodes alone and may tile; a larger one may not.
    results["tiles"] = _outcome(lambda: WanVAEDecoder(sd, device="cpu", backend="torch", tile_rows=2).tile_rows)
    # frames_per_pass="auto": each rank plans for its own free device memory (which only a GPU reports: here the last
    # rank of a group is told it has none, so it plans 1 frame per pass while the others plan 2); the group must
    # decode at the smallest plan (every rank runs the same passes, or the halo exchanges would not pair up).
    auto = WanVAEDecoder(sd, device="cpu", backend="torch")
    if world > 1 and rank == world - 1:
        memory.free_device_bytes = lambda device: 0
    results["auto_plan"] = auto.plan(z.shape).frames_per_pass
    results["auto"] = _outcome(lambda: auto.decode(z))
    results["auto_ran"] = tuple(auto.last_plan)
    if world > 1:
        mine = z[:, :, :2] if rank == world - 1 else z  # the last rank has a different T
        results["shape_mismatch"] = _outcome(lambda: decoder.decode(mine))
        bad = z.clone()
        if rank == world - 1:
            bad[0, 0, 0, 0, 0] = float("nan")
        results["nan_on_one_rank"] = _outcome(lambda: decoder.decode(bad))
    return results


@pytest.fixture(scope="module")
def oracle(wan22_vae, wan22_state_dict):
    return Oracle(wan22_vae, wan22_state_dict)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_banded_decode_over_gloo_ranks(tmp_path, wan22_state_dict, oracle, world):
    from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder

    z = latents(HEIGHT_NOT_DIVISIBLE, seed=5)
    torch.save(wan22_state_dict, tmp_path / "state_dict.pt")
    torch.save(z, tmp_path / "latents.pt")
    results = run_ranks(_worker, world, tmp_path, threads=RANK_THREADS, group_timeout_s=GROUP_TIMEOUT_S)

    single = WanVAEDecoder(wan22_state_dict, device="cpu", frames_per_pass=2, backend="torch")
    ref32, release = oracle.decodes(z, HEIGHT_NOT_DIVISIBLE)
    status, video = results[0]["banded"]
    assert status == "ok", video
    check_allowance(video, ref32, release)
    # Exact halo exchange: the banded decode is the single-rank decode, bit for bit (the same ops on every band,
    # at the ranks' thread count).
    with torch_threads():
        expected, expected_short = single.decode(z), single.decode(z[:, :, :2, : max(world - 1, 1)])
    assert torch.equal(video, expected)
    assert all(r["banded"] == ("ok", None) for r in results[1:]), "ranks other than 0 must return None"

    assert torch.equal(results[0]["short"][1], expected_short)
    assert all(r["short"] == ("ok", None) for r in results[1:])
    for r in results:  # local=True: every rank decodes the whole video itself
        assert r["local"][0] == "ok" and torch.equal(r["local"][1], expected_short)

    assert [r["auto_plan"] for r in results] == [2] * (world - 1) + [1 if world > 1 else 2]
    assert results[0]["auto"][0] == "ok" and torch.equal(results[0]["auto"][1], video)
    assert all(r["auto"] == ("ok", None) for r in results[1:])
    assert all(r["auto_ran"] == (1 if world > 1 else 2, None) for r in results)  # the smallest plan, everywhere
    for r in results:
        assert r["tiles"] == ("ok", 2) if world == 1 else r["tiles"][0] == "ValueError"
        assert world == 1 or "tiled decode runs on one rank" in r["tiles"][1]
    if world > 1:
        for rank, r in enumerate(results):
            status, message = r["shape_mismatch"]
            assert status == "ValueError", f"rank {rank} did not refuse mismatched latents: {r['shape_mismatch']}"
            assert "ranks disagree about the decode" in message
            status, message = r["nan_on_one_rank"]
            assert status == "ValueError"
            expected = "NaN or Inf" if rank == world - 1 else f"rank {world - 1} of the decode group rejected"
            assert expected in message, message


def test_rows_split_into_near_equal_bands_starting_on_the_ops_row_multiple():
    from fastvideo_pan2_ext.vae_kernel.distributed.bands import split_rows

    assert split_rows(5, 2) == [(0, 3), (3, 5)]
    assert split_rows(44, 8) == [(0, 6), (6, 12), (12, 18), (18, 24), (24, 29), (29, 34), (34, 39), (39, 44)]
    assert split_rows(3, 4) == [(0, 1), (1, 2), (2, 3)]
    # Winograd F(2x2, 3x3) (row multiple 2): bands start on even rows, where its 2x2 output tiles line up with the
    # whole frame's.
    assert split_rows(5, 3, 2) == [(0, 2), (2, 4), (4, 5)]
    assert split_rows(5, 2, 2) == [(0, 4), (4, 5)]
    assert split_rows(3, 4, 2) == [(0, 2), (2, 3)]
    assert split_rows(44, 4, 2) == [(0, 12), (12, 24), (24, 34), (34, 44)]
    with pytest.raises(ValueError, match="height >= 1"):
        split_rows(0, 2)
