"""A failed decode keeps the latents, end to end with the real `fastvideo generate` CLI on the tiny PAN2 checkpoint:
the failure is injected from the test (a `sitecustomize` on PYTHONPATH wraps `WanVAEDecoder.decode_iter` in every
process, the spawned worker included), never by a switch in the product. The run ends with one line naming the kept
file and the decode command; that command turns the file into the video, with the requested frames, within the
allowance against the fp32 decode of an undisturbed run's latents."""

from __future__ import annotations

import os
import shlex
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _pan2_helpers import E2E_FRAMES, E2E_HEIGHT, E2E_WIDTH, FASTVIDEO_CLI, OFFLINE, REPO, exif_rotated_jpeg, run, \
    video_frames_and_size

pytestmark = pytest.mark.slow  # FastVideo end to end, in worker processes

# PAN2_TEST_DECODE=fail: every decode_iter yields its first chunk, then raises. =record:PATH: every decode_iter passes
# its chunks through and, when done, saves {latents it got, the video it yielded} to PATH. =disk-full: the mp4 writer
# raises ENOSPC at its second frame.
SITECUSTOMIZE = textwrap.dedent("""
    import os

    _mode = os.environ.get("PAN2_TEST_DECODE", "")
    if _mode.startswith(("fail", "record:")):
        import torch
        from fastvideo_pan2_ext.vae_kernel import decoder as _decoder

        _original = _decoder.WanVAEDecoder.decode_iter

        def decode_iter(self, latents):
            chunks = _original(self, latents)
            if _mode == "fail":
                def failing():
                    yield next(iter(chunks))
                    raise RuntimeError("injected decode failure")
                return failing()

            def recording():
                video = []
                for item in chunks:
                    video.append(item[2])
                    yield item
                torch.save({"latents": latents.cpu(), "video": torch.cat(video, 2)}, _mode.split(":", 1)[1])
            return recording()

        _decoder.WanVAEDecoder.decode_iter = decode_iter
    if _mode == "disk-full":  # the mp4 writer's disk fills up after the first frame
        import errno
        from fastvideo_pan2_ext import video_io

        _append = video_io._Mp4.append

        def append(self, frame, images):
            if self.frames:
                raise OSError(errno.ENOSPC, "No space left on device")
            _append(self, frame, images[:1])

        video_io._Mp4.append = append
""")


def _env(tmp_path: Path, mode: str) -> dict[str, str]:
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return {**OFFLINE, "PYTHONPATH": os.pathsep.join([str(hook), str(REPO)]), "PAN2_TEST_DECODE": mode}


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


@pytest.mark.timeout(1800)  # three real runs: two of FastVideo (parent + worker each), one decode command
def test_a_failed_decode_keeps_the_latents_and_the_decode_command_makes_the_video(tiny_ckpt, tmp_path):
    from fastvideo_pan2_ext import latents_file
    from fastvideo_pan2_ext import reference
    from fastvideo_pan2_ext.vae_kernel.definitions.allowance import compare_to_reference

    image = exif_rotated_jpeg(tmp_path / "first.jpg", 192, 128, orientation=6)

    # An undisturbed run, recording the latents its decoder got and the video it made.
    undisturbed = tmp_path / "undisturbed.pt"
    ok = _generate(tiny_ckpt, image, tmp_path / "ok" / "v.mp4", _env(tmp_path, f"record:{undisturbed}"))
    assert ok.returncode == 0, (ok.stdout + ok.stderr)[-4000:]
    assert video_frames_and_size(tmp_path / "ok" / "v.mp4") == (E2E_FRAMES, (E2E_WIDTH, E2E_HEIGHT))

    # The same request with a decode that always fails (after its first chunk was written).
    out = tmp_path / "failed"
    failed = _generate(tiny_ckpt, image, out / "v.mp4", _env(tmp_path, "fail"))
    log = failed.stdout + failed.stderr
    kept_path = out / "v.latents.safetensors"
    command = f"python -m fastvideo_pan2_ext.decode {kept_path}"
    assert failed.returncode == 1, log[-4000:]
    assert "Traceback" not in log, log[-4000:]
    endings = [line for line in failed.stderr.splitlines() if line.startswith("fastvideo generate:")]
    assert endings == [f"fastvideo generate: the decode failed (RuntimeError: injected decode failure); the latents "
                       f"are kept in {kept_path}; make the video with: {command}"], log[-4000:]
    assert failed.stderr.rstrip().splitlines()[-1] == endings[0]
    assert sorted(p.name for p in out.iterdir()) == [kept_path.name]  # no video, no partial file

    kept = latents_file.read(kept_path)
    recorded = torch.load(undisturbed)
    assert kept.normalized is False and kept.vae == str(tiny_ckpt) and kept.layout == "wan2.2"
    assert kept.output == str(out / "v.mp4") and kept.frames == E2E_FRAMES
    assert kept.decoder_options == {"frames_per_pass": 2, "tile_rows": None, "max_memory": None, "backend": "auto",
                                    "conv_algorithm": "auto"}  # every option of vae_kernel/options.py
    # The same seeded request on the same machine: the latents the failed decode was given are the undisturbed ones.
    torch.testing.assert_close(kept.latents, recorded["latents"].float(), rtol=1e-5, atol=1e-5)

    # The command the line names, as printed (with this interpreter), and nothing else.
    decoded = tmp_path / "decoded.pt"
    argv = shlex.split(command)
    proc = run([sys.executable, *argv[1:]], env_extra=_env(tmp_path, f"record:{decoded}"), cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert video_frames_and_size(out / "v.mp4") == (E2E_FRAMES, (E2E_WIDTH, E2E_HEIGHT))
    assert f"wrote {E2E_FRAMES} frames to {out / 'v.mp4'}" in proc.stdout

    # Its video meets the allowance against the fp32 decode of the undisturbed run's latents.
    video = torch.load(decoded)["video"]
    state_dict = _vae_state_dict(tiny_ckpt)
    z = recorded["latents"].float()
    fp32 = reference.decode(z, state_dict, dtype=torch.float32)
    bf16 = reference.decode(z, state_dict, dtype=torch.bfloat16)
    report = compare_to_reference("decode command vs undisturbed fp32", video, fp32, bf16, unit_range=True)
    assert report.ok, str(report)
    report = compare_to_reference("undisturbed run vs fp32", recorded["video"], fp32, bf16, unit_range=True)
    assert report.ok, str(report)


@pytest.mark.timeout(1200)  # one real FastVideo run (parent + worker) on a possibly busy machine
def test_a_full_disk_at_the_streamed_save_keeps_the_latents(tiny_ckpt, tmp_path):
    from fastvideo_pan2_ext import latents_file

    image = exif_rotated_jpeg(tmp_path / "first.jpg", 192, 128, orientation=6)
    out = tmp_path / "full"
    failed = _generate(tiny_ckpt, image, out / "v.mp4", _env(tmp_path, "disk-full"))
    log = failed.stdout + failed.stderr
    kept_path = out / "v.latents.safetensors"
    assert failed.returncode == 1 and "Traceback" not in log, log[-4000:]
    assert failed.stderr.rstrip().splitlines()[-1] == (
        f"fastvideo generate: the decode failed (OSError: [Errno 28] No space left on device); the latents are kept "
        f"in {kept_path}; make the video with: python -m fastvideo_pan2_ext.decode {kept_path}"), log[-4000:]
    assert sorted(p.name for p in out.iterdir()) == [kept_path.name]  # the partial mp4 is gone
    assert latents_file.read(kept_path).frames == E2E_FRAMES
