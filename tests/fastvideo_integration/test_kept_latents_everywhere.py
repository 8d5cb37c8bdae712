"""A failed decode keeps the latents for every PAN2 request with the fast decoder on, not only the streamed ones, and
`VideoGenerator` raises `DecodeFailed` itself (docs/design/outputs.md, "Kept latents and the decode command").

The failure is injected from the test, never by a switch in the product: in this process by wrapping
`WanVAEDecoder.decode` (what FastVideo's own decode calls when the fast decoder is on), in FastVideo's worker
processes by a `sitecustomize` on PYTHONPATH that does the same there.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _pan2_helpers import E2E_FRAMES, E2E_HEIGHT, E2E_WIDTH, OFFLINE, REPO, exif_rotated_jpeg, forward_batch, \
    last_json_line, pan2_fast_decode, run, video_frames_and_size

LATENTS = torch.randn(1, 48, 3, 3, 5, generator=torch.Generator().manual_seed(11))  # 9 frames of 48 x 80


def _denormalized(latents: torch.Tensor, model_path: Path) -> torch.Tensor:
    """`z * std + mean` with the VAE config's own statistics (read here from the checkpoint's file)."""
    config = json.loads((model_path / "vae" / "config.json").read_text())
    mean = torch.tensor(config["latents_mean"]).view(1, -1, 1, 1, 1)
    std = torch.tensor(config["latents_std"]).view(1, -1, 1, 1, 1)
    return latents * std + mean


def test_a_failed_decode_that_fastvideo_would_save_keeps_the_latents(pan2, tiny_ckpt, tmp_path, monkeypatch):
    """No streamed save (FastVideo's own decode and save): the stage keeps the de-normalized latents the decoder was
    given beside the video, hands FastVideo a placeholder, and the parent's check raises the one line. Without a
    keep request (a batch not from the parent's PAN2 path) the error is FastVideo's, unchanged."""
    from fastvideo_pan2_ext.media import latents_file
    from fastvideo_pan2_ext.fastvideo_integration import decode_failure, kept_latents
    from fastvideo_pan2_ext.vae_kernel import decoder as decoder_module

    given = []

    def failing_decode(self, z):
        given.append(z.detach().clone())
        raise RuntimeError("injected decode failure\nsecond line")

    monkeypatch.setattr(decoder_module.WanVAEDecoder, "decode", failing_decode)
    pipeline, args = pan2
    stage = pipeline._stage_name_mapping["decoding_stage"]
    with pan2_fast_decode(args.pipeline_config):
        plain = forward_batch(args, tiny_ckpt, prompt="x", fps=24)
        plain.latents = LATENTS.clone()
        with pytest.raises(RuntimeError, match="injected decode failure"):
            stage(plain, args)

        target = tmp_path / "clip.mp4"
        batch = forward_batch(args, tiny_ckpt, prompt="x", fps=24)
        batch.latents = LATENTS.clone()
        batch.extra[decode_failure.REQUEST_KEY] = decode_failure.KeepLatentsRequest.beside(target, 24)
        batch = stage(batch, args)

    kept_path = tmp_path / "clip.latents.safetensors"
    assert sorted(p.name for p in tmp_path.iterdir()) == [kept_path.name]
    assert batch.output.shape == (1, 3, 0, 48, 80)  # the placeholder FastVideo never reads
    kept = latents_file.read(kept_path)
    assert kept.normalized is False and kept.fps == 24.0 and kept.output == str(target) and kept.frames == 9
    assert kept.vae == str(tiny_ckpt) and kept.layout == "wan2.2" and kept.decoder_options["frames_per_pass"] == 2
    assert len(given) == 2  # the decode without a keep request, then this one
    torch.testing.assert_close(kept.latents, given[-1].float(), rtol=0, atol=0)  # what the decoder was given
    torch.testing.assert_close(kept.latents, _denormalized(LATENTS, tiny_ckpt), rtol=1e-6, atol=1e-6)

    with pytest.raises(decode_failure.DecodeFailed) as raised:
        kept_latents.check_output(batch)  # what the parent runs on the returned batch
    assert str(raised.value) == (
        f"the decode failed (RuntimeError: injected decode failure); the latents are kept in {kept_path}; make the "
        f"video with: {latents_file.decode_command(kept_path)}")


# In FastVideo's worker: PAN2_TEST_DECODE=fail:PATH makes every WanVAEDecoder.decode save the latents it was given
# (all of this process's, in order) to PATH and raise.
SITECUSTOMIZE = textwrap.dedent("""
    import os

    _mode = os.environ.get("PAN2_TEST_DECODE", "")
    if _mode.startswith("fail:"):
        import torch
        from fastvideo_pan2_ext.vae_kernel import decoder as _decoder

        _given = []

        def decode(self, latents):
            _given.append(latents.detach().cpu().clone())
            torch.save(_given, _mode.split(":", 1)[1])
            raise RuntimeError("injected decode failure")

        _decoder.WanVAEDecoder.decode = decode
""")

SCRIPT = textwrap.dedent("""
    import json, sys
    from fastvideo import VideoGenerator
    from fastvideo_pan2_ext import DecodeFailed, PAN2PipelineConfig

    if __name__ == "__main__":
        checkpoint, image, saved, unsaved, height, width, frames = sys.argv[1:]
        config = PAN2PipelineConfig(vae_decode_kernel=True, vae_decode_frames_per_pass=2)
        generator = VideoGenerator.from_pretrained(checkpoint, num_gpus=1, pipeline_config=config)
        results = {}
        try:
            # Frames returned and saved: FastVideo saves in the parent. Frames only: nothing is saved.
            for name, output_path, save_video in (("saved", saved, True), ("unsaved", unsaved, False)):
                try:
                    generator.generate_video(
                        prompt="a cat", image_path=image, height=int(height), width=int(width),
                        num_frames=int(frames), num_inference_steps=2, guidance_scale=1.0, seed=3,
                        output_path=output_path, save_video=save_video, return_frames=True)
                    results[name] = None
                except Exception as exc:
                    results[name] = {"type": type(exc).__name__, "decode_failed": isinstance(exc, DecodeFailed),
                                     "message": str(exc)}
        finally:
            generator.shutdown()
        print(json.dumps(results))
""")


@pytest.mark.slow  # FastVideo end to end (parent + worker), then the decode command
@pytest.mark.timeout(1800)
def test_video_generator_raises_decode_failed_and_the_kept_latents_make_the_video(tiny_ckpt, tmp_path):
    from fastvideo_pan2_ext.media import latents_file

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    given = tmp_path / "given.pt"
    env = {**OFFLINE, "PYTHONPATH": os.pathsep.join([str(hook), str(REPO)]), "PAN2_TEST_DECODE": f"fail:{given}"}
    script = tmp_path / "generate.py"
    script.write_text(SCRIPT)
    image = exif_rotated_jpeg(tmp_path / "first.jpg", 192, 128, orientation=6)
    saved, unsaved = tmp_path / "saved", tmp_path / "unsaved"
    proc = run([sys.executable, str(script), str(tiny_ckpt), str(image), str(saved / "v.mp4"), str(unsaved),
                str(E2E_HEIGHT), str(E2E_WIDTH), str(E2E_FRAMES)], env_extra=env, cwd=tmp_path)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    results = last_json_line(proc.stdout)

    # FastVideo's output path for a request that saves nothing: the folder, named after the prompt.
    kept_paths = {"saved": saved / "v.latents.safetensors", "unsaved": unsaved / "a cat.latents.safetensors"}
    for name, kept_path in kept_paths.items():
        command = latents_file.decode_command(kept_path)
        assert results[name] == {"type": "DecodeFailed", "decode_failed": True, "message": (
            f"the decode failed (RuntimeError: injected decode failure); the latents are kept in {kept_path}; make "
            f"the video with: {command}")}, (name, log[-6000:])
        assert sorted(p.name for p in kept_path.parent.iterdir()) == [kept_path.name]  # no video, no partial file

    decoded = torch.load(given)  # the latents each request's decode was given, in the worker
    assert len(decoded) == 2
    for (name, kept_path), z in zip(kept_paths.items(), decoded):
        kept = latents_file.read(kept_path)
        assert kept.normalized is False and kept.frames == E2E_FRAMES and kept.fps == 24.0, name
        assert kept.output == str(kept_path.parent / kept_path.name.replace(".latents.safetensors", ".mp4")), name
        torch.testing.assert_close(kept.latents, z.float(), rtol=1e-6, atol=1e-6)

    # The command the line names, as printed (with this interpreter), and no injected failure.
    argv = shlex.split(latents_file.decode_command(kept_paths["saved"]))
    proc = run([sys.executable, *argv[1:]], env_extra={**OFFLINE, "PYTHONPATH": str(REPO)}, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert video_frames_and_size(saved / "v.mp4") == (E2E_FRAMES, (E2E_WIDTH, E2E_HEIGHT))
