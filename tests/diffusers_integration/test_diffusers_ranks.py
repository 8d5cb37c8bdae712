"""A real diffusers WanPipeline on every rank of a gloo group (real processes, CPU) with
`enable_fast_decode(pipe, pg=...)`: the ranks split the rows of the decode, every rank's pipeline returns the video
(broadcast from rank 0; diffusers' post-processing runs on each), and it is the single-rank fast video of the same
latents, computed in the same process at the same thread count."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _ranks import run_ranks

pytestmark = pytest.mark.slow

LAYOUT, HEIGHT, WIDTH = "wan2.1", 80, 48  # 10 latent rows: not a multiple of 3 ranks (diffusers wants 16 | H)


def _rank(rank: int, world: int, tmp: str) -> dict:
    from _diffusers_pipelines import call_kwargs, tiny_pipeline

    from fastvideo_pan2_ext import enable_fast_decode

    pipe = tiny_pipeline(LAYOUT)
    pipe.set_progress_bar_config(disable=True)
    enable_fast_decode(pipe, pg=dist.group.WORLD)
    banded = pipe(**call_kwargs(LAYOUT, HEIGHT, WIDTH)).frames
    banded_np = pipe(**call_kwargs(LAYOUT, HEIGHT, WIDTH, output_type="np")).frames  # post-processing on each
    ran = pipe.vae.__dict__["_pan2_fast_decode"].worker.pg is not None
    enable_fast_decode(pipe)  # this rank alone
    alone = pipe(**call_kwargs(LAYOUT, HEIGHT, WIDTH)).frames
    return {"banded": banded, "np_shape": banded_np.shape, "split": ran, "equal_to_alone": torch.equal(banded, alone)}


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_single_rank_video(tmp_path, world):
    results = run_ranks(_rank, world, tmp_path)
    assert all(r["split"] and r["equal_to_alone"] for r in results)
    assert all(torch.equal(r["banded"], results[0]["banded"]) for r in results)
    assert all(r["np_shape"] == (1, 9, HEIGHT, WIDTH, 3) for r in results)
