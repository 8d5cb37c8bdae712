"""PAN2 over several ranks through FastVideo's own executor, as users run it: `VideoGenerator` and `fastvideo generate`
with `num_gpus: 2` and `sp_size: 2` (gloo ranks on this CPU), the DiT in fp32, guidance 3.0, at a size whose video
tokens do not divide by 2 (96x96, 9 frames: 3 x 3 x 3 = 27 tokens): the final latents and the frames are the one-rank
run's, to fp32 rounding. Sequence parallelism splits the video tokens over the ranks (padded to 28), the text
replicated; FastVideo 0.2.1 has no way to run the two guidance branches on different ranks (no CFG-parallel group), so
PAN2 runs them in turn on every rank."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from _pan2_helpers import FASTVIDEO_CLI, OFFLINE, run

pytestmark = pytest.mark.slow  # three FastVideo runs, four worker processes

REQUEST = {"height": 96, "width": 96, "num_frames": 9, "num_inference_steps": 2, "guidance_scale": 3.0, "seed": 5}

SCRIPT = textwrap.dedent("""
    import sys, numpy, torch
    from fastvideo import VideoGenerator
    from fastvideo_pan2_ext import PAN2PipelineConfig

    if __name__ == "__main__":
        checkpoint, ranks, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
        config = PAN2PipelineConfig(dit_precision="fp32")
        generator = VideoGenerator.from_pretrained(checkpoint, num_gpus=ranks, sp_size=ranks, pipeline_config=config)
        try:
            result = generator.generate_video(prompt="a fox", negative_prompt="blurry", output_path=out + ".mp4",
                                              save_video=True, return_frames=True, return_trajectory_latents=True,
                                              **REQUEST)
        finally:
            generator.shutdown()
        torch.save({"latents": result["trajectory"], "frames": torch.from_numpy(numpy.stack(result["frames"]))},
                   out + ".pt")
""").replace("**REQUEST", ", ".join(f"{k}={v!r}" for k, v in REQUEST.items()))


def _api(tiny_ckpt, tmp_path, ranks):
    script = tmp_path / "sp.py"
    script.write_text(SCRIPT)
    out = tmp_path / f"api-{ranks}"
    proc = run([sys.executable, str(script), str(tiny_ckpt), str(ranks), str(out)], env_extra=OFFLINE, cwd=tmp_path)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    saved = torch.load(f"{out}.pt")
    return saved["latents"], saved["frames"], (tmp_path / f"api-{ranks}.mp4").read_bytes(), log


def test_two_sequence_parallel_ranks_make_the_one_rank_video(tiny_ckpt, tmp_path):
    one, one_frames, _, _ = _api(tiny_ckpt, tmp_path, 1)
    two, two_frames, two_video, log = _api(tiny_ckpt, tmp_path, 2)
    assert "world_size=2" in log and "Warming up sequence parallel communication (SP=2)" in log
    assert one.shape == two.shape == (1, 2, 48, 3, 6, 6)  # [batch, steps, C, T', h, w]
    assert one.abs().max() > 0.5
    torch.testing.assert_close(two, one, rtol=0, atol=1e-5 * one.abs().max().item())
    # The ranks' linears sum over other row blocks than one rank's: equal to fp32 rounding, so the 8-bit frames may
    # differ by a level where a value sits on a rounding edge (on this CPU they are identical).
    assert one_frames.shape == two_frames.shape == (9, 96, 96, 3)
    assert (one_frames.int() - two_frames.int()).abs().max() <= 1

    video = tmp_path / "cli-2.mp4"
    cli = [FASTVIDEO_CLI, "generate", "--pipeline", "pan2", "--generator.model_path", str(tiny_ckpt),
           "--generator.engine.num_gpus", "2", "--generator.engine.parallelism.sp_size", "2",
           "--generator.pipeline.experimental.dit_precision", "fp32", "--request.prompt", "a fox",
           "--request.negative_prompt", "blurry", "--request.output.output_path", str(video),
           *[arg for key, value in REQUEST.items() for arg in (f"--request.sampling.{key}", str(value))]]
    proc = run(cli, env_extra=OFFLINE)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert video.read_bytes() == two_video  # the CLI's two ranks run what the API's two ranks ran
