"""The decoding stage on several ranks, as FastVideo's workers run it: every rank runs the stage with the same latents
inside FastVideo's own distributed environment (initialized by FastVideo's worker entry point, gloo on CPU), the
ranks split the rows of one decode, and rank 0's video (or, for a streamed save, rank 0's mp4) is bit-identical to the
single-rank decode. A rank whose input is bad makes every rank raise; none hangs. Outside a request that FastVideo's
executor handed every worker (a training or preprocessing loop: each rank its own data) each rank decodes alone."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from _pan2_helpers import forward_batch, free_port
from _ranks import run_ranks
from _threads import RANK_THREADS, torch_threads

pytestmark = pytest.mark.slow

# Odd latent height (3 rows over 2 or 3 ranks) and width; 9 video frames.
LATENTS = torch.randn(1, 48, 3, 3, 5, generator=torch.Generator().manual_seed(21))


def _stage_and_args(tiny_ckpt: str):
    """FastVideo's args for the tiny PAN2 checkpoint with the fast decoder on, and a PAN2 decoding stage over
    FastVideo's own Wan VAE module loaded from the checkpoint (the objects a worker's pipeline holds)."""
    from fastvideo.fastvideo_args import FastVideoArgs
    from fastvideo.models.vaes.wanvae import AutoencoderKLWan
    from safetensors.torch import load_file

    from fastvideo_pan2_ext.configs import PAN2PipelineConfig
    from fastvideo_pan2_ext.fastvideo_integration.stages import PAN2DecodingStage

    args = FastVideoArgs.from_kwargs(model_path=tiny_ckpt, num_gpus=1, workload_type="i2v",
                                     pipeline_config=PAN2PipelineConfig(vae_decode_kernel=True,
                                                                        vae_decode_frames_per_pass=2))
    vae_dir = Path(tiny_ckpt) / "vae"
    config = json.loads((vae_dir / "config.json").read_text())
    config.pop("_class_name", None)
    args.pipeline_config.vae_config.update_model_arch(config)
    vae = AutoencoderKLWan(args.pipeline_config.vae_config)
    vae.load_state_dict(load_file(vae_dir / "diffusion_pytorch_model.safetensors"))
    return PAN2DecodingStage(vae=vae.eval()), args


def _rank(rank: int, world: int, tmp: str, port: int, tiny_ckpt: str, case: str) -> dict:
    """One of FastVideo's workers (its own distributed environment, set up as its worker entry point does)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world))
    from fastvideo.distributed.parallel_state import maybe_init_distributed_environment_and_model_parallel

    from fastvideo_pan2_ext.fastvideo_integration import compat, streamed_save

    maybe_init_distributed_environment_and_model_parallel(1, 1, f"tcp://127.0.0.1:{port}")
    stage, args = _stage_and_args(tiny_ckpt)
    batch = forward_batch(args, tiny_ckpt, prompt="x", fps=24)
    batch.latents = LATENTS.clone()
    if case.startswith("bad rank 1") and rank == 1:
        batch.latents[0, 0, 0, 0, 0] = float("inf")  # passes FastVideo's validators, fails ours
    if case == "streamed":
        batch.extra[streamed_save.KEY] = streamed_save.StreamedSaveRequest(f"{tmp}/ranks.mp4", 24)
    try:
        if case.endswith("outside a request"):
            output = stage(batch, args).output
        else:
            with compat.executor.request_scope():  # what FastVideo's Worker.execute_forward runs in
                output = stage(batch, args).output
    except ValueError as exc:
        return {"ok": False, "error": str(exc)}
    if rank == 0:
        torch.save(output, f"{tmp}/ranks.pt")
    return {"ok": True}


def _run(world: int, tiny_ckpt, tmp_path, case: str) -> list[dict]:
    # The single-rank decode it is compared with runs at RANK_THREADS too.
    return run_ranks(_rank, world, tmp_path, free_port(), str(tiny_ckpt), case, threads=RANK_THREADS, group=False)


@pytest.fixture(scope="module")
def single(tiny_ckpt, tmp_path_factory):
    """The single-rank stage output and streamed mp4 for LATENTS (in this process, no distributed environment)."""
    out = tmp_path_factory.mktemp("single")
    with torch_threads():
        return _single(tiny_ckpt, out)


def _single(tiny_ckpt, out):
    from fastvideo_pan2_ext.fastvideo_integration import streamed_save

    stage, args = _stage_and_args(str(tiny_ckpt))
    batch = forward_batch(args, tiny_ckpt, prompt="x", fps=24)
    batch.latents = LATENTS.clone()
    video = stage(batch, args).output
    batch = forward_batch(args, tiny_ckpt, prompt="x", fps=24)
    batch.latents = LATENTS.clone()
    batch.extra[streamed_save.KEY] = streamed_save.StreamedSaveRequest(str(out / "single.mp4"), 24)
    stage(batch, args)
    return video, (out / "single.mp4").read_bytes()


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_decode_one_video_bit_identical_to_one_rank(world, tiny_ckpt, tmp_path, single):
    results = _run(world, tiny_ckpt, tmp_path, "plain")
    assert all(r["ok"] for r in results), results
    assert torch.equal(torch.load(tmp_path / "ranks.pt"), single[0])


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_stream_one_mp4_byte_identical_to_one_rank(world, tiny_ckpt, tmp_path, single):
    results = _run(world, tiny_ckpt, tmp_path, "streamed")
    assert all(r["ok"] for r in results), results
    assert (tmp_path / "ranks.mp4").read_bytes() == single[1]
    assert torch.load(tmp_path / "ranks.pt").shape == (1, 3, 0, 48, 80)  # the frames are in the file


def test_a_rank_with_bad_latents_makes_every_rank_raise(tiny_ckpt, tmp_path):
    results = _run(3, tiny_ckpt, tmp_path, "bad rank 1")
    assert [r["ok"] for r in results] == [False, False, False], results
    assert "latents contain NaN or Inf" in results[1]["error"]
    assert all("rank 1 of the decode group rejected its latents" in r["error"] for r in (results[0], results[2]))


def test_outside_a_request_each_rank_decodes_its_own_latents_alone(tiny_ckpt, tmp_path, single):
    """A training loop's ranks call the VAE with their own latents, not in step: no rank waits for or hears from
    another, so only the rank with bad latents raises."""
    results = _run(3, tiny_ckpt, tmp_path, "bad rank 1, outside a request")
    assert [r["ok"] for r in results] == [True, False, True], results
    assert "latents contain NaN or Inf" in results[1]["error"]
    assert torch.equal(torch.load(tmp_path / "ranks.pt"), single[0])
