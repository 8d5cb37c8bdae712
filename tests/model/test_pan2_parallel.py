"""PAN2 over several ranks through FastVideo's own executor, as users run it: `VideoGenerator` and `fastvideo generate`
with `num_gpus: 2` and `sp_size: 2` (gloo ranks on this CPU), the DiT in fp32, guidance 3.0, at a size whose video
tokens do not divide by 2 (96x96, 9 frames: 3 x 3 x 3 = 27 tokens): the final latents and the frames are the one-rank
run's, to fp32 rounding. Sequence parallelism splits the video tokens over the ranks (padded to 28), the text
replicated; FastVideo 0.2.1 has no way to run the two guidance branches on different ranks (no CFG-parallel group), so
PAN2 runs them in turn on every rank. FSDP (`use_fsdp_inference`) over two gloo ranks is held to the one-rank run the
same way, in bf16 (its test says why)."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _pan2_helpers import FASTVIDEO_CLI, OFFLINE, run

pytestmark = pytest.mark.slow  # three FastVideo runs per test, two of them with two worker processes

SAMPLE = Path(__file__).resolve().parents[2] / "fastvideo_pan2_ext" / "assets" / "sample_exif_rotated.jpg"
REQUEST = {"height": 96, "width": 96, "num_frames": 9, "num_inference_steps": 2, "guidance_scale": 3.0, "seed": 5}

SCRIPT = textwrap.dedent("""
    import sys, numpy, torch
    from fastvideo import VideoGenerator
    from fastvideo_pan2_ext import PAN2PipelineConfig

    if __name__ == "__main__":
        checkpoint, ranks, sp_size, fsdp, precision, image, out = sys.argv[1:]
        kernels = image != "-"  # image-to-video with the fast encoder and decoder
        config = PAN2PipelineConfig(dit_precision=precision, vae_decode_kernel=kernels, vae_encode_kernel=kernels)
        generator = VideoGenerator.from_pretrained(checkpoint, num_gpus=int(ranks), sp_size=int(sp_size),
                                                   use_fsdp_inference=fsdp == "fsdp", pipeline_config=config)
        try:
            result = generator.generate_video(prompt="a fox", negative_prompt="blurry", output_path=out + ".mp4",
                                              save_video=True, return_frames=True, return_trajectory_latents=True,
                                              image_path=image if kernels else None, **REQUEST)
        finally:
            generator.shutdown()
        torch.save({"latents": result["trajectory"], "frames": torch.from_numpy(numpy.stack(result["frames"]))},
                   out + ".pt")
""").replace("**REQUEST", ", ".join(f"{k}={v!r}" for k, v in REQUEST.items()))


def _api(tiny_ckpt, tmp_path, ranks, sp_size=None, fsdp=False, precision="fp32", image=None):
    script = tmp_path / "api.py"
    script.write_text(SCRIPT)
    out = tmp_path / f"api-{ranks}{'-fsdp' if fsdp else ''}{'-i2v' if image else ''}"
    proc = run([sys.executable, str(script), str(tiny_ckpt), str(ranks), str(ranks if sp_size is None else sp_size),
                "fsdp" if fsdp else "-", precision, str(image or "-"), str(out)], env_extra=OFFLINE, cwd=tmp_path)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    saved = torch.load(f"{out}.pt")
    return saved["latents"], saved["frames"], Path(f"{out}.mp4").read_bytes(), log


def _cli(tiny_ckpt, video, *args):
    cli = [FASTVIDEO_CLI, "generate", "--pipeline", "pan2", "--generator.model_path", str(tiny_ckpt), *args,
           "--request.prompt", "a fox", "--request.negative_prompt", "blurry", "--request.output.output_path",
           str(video), *[arg for key, value in REQUEST.items() for arg in (f"--request.sampling.{key}", str(value))]]
    proc = run(cli, env_extra=OFFLINE)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return video.read_bytes()


def test_two_sequence_parallel_ranks_split_the_fast_encode_and_decode_and_make_the_one_rank_video(tiny_ckpt, tmp_path):
    """Image-to-video with the fast encoder and decoder on two sequence-parallel ranks: the video tokens split over the
    ranks, and inside the request FastVideo's executor handed both workers the first frame's encode and the video's
    decode each split bands of rows over them (`compat.executor.request_group`). The latents and frames are the
    one-rank run's, and the CLI's two ranks run what the API's two ranks ran."""
    one, one_frames, _, one_log = _api(tiny_ckpt, tmp_path, 1, image=SAMPLE)
    two, two_frames, two_video, log = _api(tiny_ckpt, tmp_path, 2, image=SAMPLE)
    assert "world_size=2" in log and "Warming up sequence parallel communication (SP=2)" in log
    for worker in ("encoder", "decoder"):
        assert re.search(rf"fast VAE {worker}: .* one rank on cpu", one_log), (worker, one_log[-3000:])
        assert len(re.findall(rf"fast VAE {worker}: .* rows split over the ranks on cpu", log)) == 2, worker
    assert one.shape == two.shape == (1, 2, 48, 3, 6, 6)  # [batch, steps, C, T', h, w]
    assert one.abs().max() > 0.5
    torch.testing.assert_close(two, one, rtol=0, atol=1e-5 * one.abs().max().item())
    # The ranks' linears sum over other row blocks than one rank's: equal to fp32 rounding, so the 8-bit frames may
    # differ by a level where a value sits on a rounding edge (on this CPU they are identical).
    assert one_frames.shape == two_frames.shape == (9, 96, 96, 3)
    assert (one_frames.int() - two_frames.int()).abs().max() <= 1

    cli = _cli(tiny_ckpt, tmp_path / "cli-2.mp4", "--generator.engine.num_gpus", "2",
               "--generator.engine.parallelism.sp_size", "2", "--generator.pipeline.experimental.dit_precision", "fp32",
               *[arg for kernel in ("vae_encode_kernel", "vae_decode_kernel")
                 for arg in (f"--generator.pipeline.experimental.{kernel}", "true")],
               "--request.inputs.image_path", str(SAMPLE))
    assert cli == two_video  # the CLI's two ranks run what the API's two ranks ran


def _dit_shares(log: str) -> list[tuple[int, int]]:
    return [(int(held), int(total)) for held, total in
            re.findall(r"PAN2 DiT: this rank holds (\d+) of its (\d+) parameters", log)]


def test_fsdp_over_two_ranks_makes_the_one_rank_video(tiny_ckpt, tmp_path):
    """`use_fsdp_inference` over two gloo ranks (sp_size 1: FSDP alone), each rank holding about half the DiT, gives
    the one-rank run's latents and video. In bf16, PAN2's default: FastVideo 0.2.1's FSDP inference all-gathers the
    DiT's weights in bf16 whatever dit_precision says (TransformerLoader's MixedPrecisionPolicy), so an fp32 run
    without FSDP is not its reference."""
    one, one_frames, _, one_log = _api(tiny_ckpt, tmp_path, 1, precision="bf16")
    two, two_frames, two_video, log = _api(tiny_ckpt, tmp_path, 2, sp_size=1, fsdp=True, precision="bf16")
    [(held, total)] = _dit_shares(one_log)
    assert held == total
    shares = _dit_shares(log)
    assert "world_size=2" in log and len(shares) == 2
    assert all(total == shares[0][1] and 0.4 < held / total < 0.6 for held, total in shares), shares
    assert one.shape == two.shape == (1, 2, 48, 3, 6, 6) and one.abs().max() > 0.5
    torch.testing.assert_close(two, one, rtol=0, atol=1e-5 * one.abs().max().item())
    assert (one_frames.int() - two_frames.int()).abs().max() <= 1

    cli = _cli(tiny_ckpt, tmp_path / "cli-fsdp.mp4", "--generator.engine.num_gpus", "2",
               "--generator.engine.parallelism.sp_size", "1", "--generator.engine.use_fsdp_inference", "true")
    assert cli == two_video  # the CLI's two FSDP ranks run what the API's ran
