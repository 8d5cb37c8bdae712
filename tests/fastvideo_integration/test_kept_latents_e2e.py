"""A failed decode keeps the latents, end to end with the real `fastvideo generate` CLI on the tiny PAN2 checkpoint:
the failure is injected from the test (a `sitecustomize` on PYTHONPATH wraps `WanVAEDecoder.decode_iter` in every
process, the spawned worker included), never by a switch in the product. The run ends with one line naming the kept
file and the decode command; that command, run exactly as printed, makes bit for bit the video the failed decode
would have made, and that video is within the allowance of the fp32 decode. (FastVideo cannot run a bf16 VAE on a CPU
(its encode meets fp32 input): test_kept_latents_reproduce.py covers the bf16 VAE and the hub id through the decoding
stage in process.)"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _pan2_helpers import E2E_FRAMES, E2E_HEIGHT, E2E_WIDTH, FASTVIDEO_CLI, decode_hook_env, exif_rotated_jpeg, run, \
    video_frames_and_size

pytestmark = pytest.mark.slow  # FastVideo end to end, in worker processes

def _generate(tiny_ckpt, image: Path, video: Path, env: dict[str, str]):
    return run([FASTVIDEO_CLI, "generate", "--pipeline", "pan2", "--generator.model_path", str(tiny_ckpt),
                "--request.prompt", "a cat on a sofa", "--request.inputs.image_path", str(image),
                "--request.sampling.height", str(E2E_HEIGHT), "--request.sampling.width", str(E2E_WIDTH),
                "--request.sampling.num_frames", str(E2E_FRAMES), "--request.sampling.num_inference_steps", "2",
                "--request.sampling.guidance_scale", "1.0", "--request.sampling.seed", "7",
                "--request.output.output_path", str(video),
                "--generator.pipeline.experimental.vae_decode_kernel", "true",
                "--generator.pipeline.experimental.vae_decode_frames_per_pass", "2"], env_extra=env)


def _vae_state_dict(tiny_ckpt: Path) -> dict:
    from safetensors.torch import load_file

    (weights,) = (tiny_ckpt / "vae").glob("*.safetensors")
    return load_file(str(weights))


def _printed_command(stderr: str, kept_path: Path, error: str = "RuntimeError: injected decode failure") -> str:
    """The decode command of the run's last line (which names `error` and `kept_path`), checked to be this file's,
    run by the job's interpreter (the venv's python, by whichever path the `fastvideo` script names it)."""
    ending = stderr.rstrip().splitlines()[-1]
    head = (f"fastvideo generate: the decode failed ({error}); the latents are kept in {kept_path}; make the video "
            "with: ")
    assert ending.startswith(head), stderr[-4000:]
    command = ending[len(head):]
    interpreter, *argv = shlex.split(command)
    assert argv == ["-m", "fastvideo_pan2_ext.decode", str(kept_path)] and os.path.samefile(interpreter,
                                                                                            sys.executable), command
    return command


@pytest.mark.timeout(1800)  # two real runs: FastVideo (parent + worker), then the decode command
def test_a_failed_decode_keeps_latents_that_the_printed_command_makes_into_the_same_video(tiny_ckpt, tmp_path):
    from fastvideo_pan2_ext.media import latents_file
    from fastvideo_pan2_ext import reference
    from fastvideo_pan2_ext.vae_kernel.definitions.allowance import compare_to_reference

    image = exif_rotated_jpeg(tmp_path / "first.jpg", 192, 128, orientation=6)
    out = tmp_path / "failed"
    job = tmp_path / "job.pt"  # the latents the job's decoder got and the video it made, before it failed
    failed = _generate(tiny_ckpt, image, out / "v.mp4", decode_hook_env(tmp_path, f"record-then-fail:{job}"))
    log = failed.stdout + failed.stderr
    kept_path = out / "v.latents.safetensors"
    assert failed.returncode == 1, log[-4000:]
    assert "Traceback" not in log, log[-4000:]
    command = _printed_command(failed.stderr, kept_path)
    assert sorted(p.name for p in out.iterdir()) == [kept_path.name]  # no video, no partial file

    kept = latents_file.read(kept_path)
    recorded = torch.load(job)
    assert kept.normalized is False and kept.vae == str(tiny_ckpt) and kept.vae_revision is None
    assert kept.vae_dtype == "float32" and kept.layout == "wan2.2"
    assert kept.output == str(out / "v.mp4") and kept.frames == E2E_FRAMES and kept.fps == 24.0
    assert kept.decoder_options == {"frames_per_pass": 2, "tile_rows": None, "max_memory": None, "backend": "auto",
                                    "conv_algorithm": "auto"}  # every option of vae_kernel/options.py
    assert torch.equal(kept.latents, recorded["latents"])  # what the decoder was given

    # The command as printed, pasted into a shell elsewhere: the same video, bit for bit.
    decoded = tmp_path / "decoded.pt"
    env = {**os.environ, **decode_hook_env(tmp_path, f"record:{decoded}")}
    proc = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert f"wrote {E2E_FRAMES} frames to {out / 'v.mp4'}" in proc.stdout
    assert video_frames_and_size(out / "v.mp4") == (E2E_FRAMES, (E2E_WIDTH, E2E_HEIGHT))
    assert torch.equal(torch.load(decoded)["video"], recorded["video"])

    # And that video is within the allowance of the fp32 decode.
    state_dict = _vae_state_dict(tiny_ckpt)
    z = kept.latents.float()
    fp32 = reference.decode(z, state_dict, dtype=torch.float32)
    bf16 = reference.decode(z, state_dict, dtype=torch.bfloat16)
    report = compare_to_reference("decode command vs fp32", recorded["video"], fp32, bf16, unit_range=True)
    assert report.ok, str(report)


@pytest.mark.timeout(1200)  # one real FastVideo run (parent + worker) on a possibly busy machine
def test_a_full_disk_at_the_streamed_save_keeps_the_latents(tiny_ckpt, tmp_path):
    from fastvideo_pan2_ext.media import latents_file

    image = exif_rotated_jpeg(tmp_path / "first.jpg", 192, 128, orientation=6)
    out = tmp_path / "full"
    failed = _generate(tiny_ckpt, image, out / "v.mp4", decode_hook_env(tmp_path, "disk-full"))
    log = failed.stdout + failed.stderr
    kept_path = out / "v.latents.safetensors"
    assert failed.returncode == 1 and "Traceback" not in log, log[-4000:]
    _printed_command(failed.stderr, kept_path, "OSError: [Errno 28] No space left on device")
    assert sorted(p.name for p in out.iterdir()) == [kept_path.name]  # the partial mp4 is gone
    assert latents_file.read(kept_path).frames == E2E_FRAMES
