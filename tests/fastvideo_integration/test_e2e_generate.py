"""End to end on CPU with real FastVideo 0.2.1 and its spawned worker: the tiny PAN2 checkpoint and an EXIF-rotated
first frame in, an mp4 out, through both decode routes (the stock CLI with FastVideo's decode; the demo, i.e. the
Python API, with `vae_decode_kernel=True`, whose save is streamed), and the streamed save against FastVideo's own.
~1 min each on 2 busy cores (two FastVideo imports: parent and worker)."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest
from _pan2_helpers import (E2E_FRAMES, E2E_HEIGHT, E2E_WIDTH, FASTVIDEO_CLI, OFFLINE, exif_rotated_jpeg,
                           fake_flash_attn, last_json_line, run, video_frames_and_size)

pytestmark = pytest.mark.slow  # FastVideo end to end, in worker processes


def test_cli_generate_pipeline_pan2_writes_video_with_4t_minus_3_frames(tiny_ckpt, tmp_path):
    image = exif_rotated_jpeg(tmp_path / "portrait_by_exif.jpg", 192, 128, orientation=6)
    video = tmp_path / "out" / "pan2.mp4"
    proc = run([FASTVIDEO_CLI, "generate", "--pipeline", "pan2", "--generator.model_path", str(tiny_ckpt),
                "--request.prompt", "a cat on a sofa", "--request.inputs.image_path", str(image),
                "--request.sampling.height", str(E2E_HEIGHT), "--request.sampling.width", str(E2E_WIDTH),
                "--request.sampling.num_frames", str(E2E_FRAMES), "--request.sampling.num_inference_steps", "2",
                "--request.sampling.guidance_scale", "1.0", "--request.output.output_path", str(video)],
               env_extra=OFFLINE)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    frames, size = video_frames_and_size(video)
    # 3 latent frames -> 4 x 3 - 3 video frames; the stored (landscape) pixels, not the EXIF-rotated portrait.
    assert frames == E2E_FRAMES == 4 * 3 - 3
    assert size == (E2E_WIDTH, E2E_HEIGHT)
    log = proc.stdout + proc.stderr
    assert "PAN2 decode: WanVAEDecoder" not in log  # vae_decode_kernel defaults to False: FastVideo's decode
    # Its output on pipes: plain lines (the worker's prefix without FastVideo's colour codes).
    assert "\x1b" not in log and "(Worker pid=" in proc.stdout, log[-3000:]


DEMO_SCRIPT = textwrap.dedent("""
    import sys

    from fastvideo_pan2_ext.demo.pan2 import main

    if __name__ == "__main__":
        sys.exit(main(sys.argv[1:]))
""")
# Every process of the run (the parent and FastVideo's workers, however they are started) pretends to drive an
# sm_100 GPU; flash_attn.cute is a stand-in beside it on PYTHONPATH.
SM100 = "import fastvideo_pan2_ext.attention.fa4 as fa4\nfa4._current_capability = lambda: (10, 0)\n"


def test_demo_uses_the_python_api_with_decode_kernel_and_the_worker_turns_fa4_on_before_loading(tiny_ckpt, tmp_path):
    """`python -m fastvideo_pan2_ext.demo` is `VideoGenerator.from_config(...)` with
    `PAN2PipelineConfig(vae_decode_kernel=True)` + `generate(request)`: run it on the tiny checkpoint."""
    script = tmp_path / "demo.py"
    script.write_text(DEMO_SCRIPT)
    stand_in = fake_flash_attn(tmp_path / "stand_in")
    (stand_in / "sitecustomize.py").write_text(SM100)
    out = tmp_path / "demo"
    path = os.pathsep.join([str(stand_in), os.environ.get("PYTHONPATH", "")])
    proc = run([sys.executable, str(script), "--checkpoint", str(tiny_ckpt), "--out", str(out), "--height",
                str(E2E_HEIGHT), "--width", str(E2E_WIDTH), "--frames", str(E2E_FRAMES), "--steps", "2",
                "--frames-per-pass", "2"], env_extra={"PYTHONPATH": path, "TQDM_DELAY": "0", **OFFLINE}, cwd=tmp_path)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    # On pipes: plain lines, no colour codes, and no decoder bar (TQDM_DELAY=0 would draw it at once) redrawn with \r.
    assert "\x1b" not in log and "(Worker pid=" in proc.stdout and "VAE decode:" not in log, log[-3000:]
    video = out / "pan2_demo.mp4"
    assert video_frames_and_size(video) == (E2E_FRAMES, (E2E_WIDTH, E2E_HEIGHT))  # the shipped image is 3:2
    assert (out / "pan2_demo_frames.png").is_file()
    report = proc.stdout[proc.stdout.index("video:"):]
    assert f"video:         {video}  ({E2E_FRAMES} frames, {E2E_WIDTH}x{E2E_HEIGHT}, 24 fps)" in report
    for stage in ("start workers, load models", "input_validation_stage", "denoising_stage", "decoding_stage",
                  "total"):
        assert stage in report, stage
    assert "decoder:       WanVAEDecoder (fastvideo_pan2_ext), the mp4 written while decoding" in report
    assert "fast VAE decoder: backend torch, frames_per_pass 2, tile_rows None, max_memory None, one rank on cpu" in log
    assert "fast VAE decoder: latents [1, 48, 3, 4, 6]: 2 latent frame(s) per pass, untiled" in log
    assert f"PAN2 decode: wrote {E2E_FRAMES} frames to {video} while decoding" in log
    # Decided in the worker, where its attention is about to be chosen: before it loaded any model.
    assert ("PAN2 attention policy: FASTVIDEO_FA4=1 (set here); "
            "FastVideo modules that read it already loaded: none") in log


STREAM_SCRIPT = textwrap.dedent("""
    import json, sys
    from fastvideo import VideoGenerator
    from fastvideo_pan2_ext import PAN2PipelineConfig

    if __name__ == "__main__":
        checkpoint, image, out, height, width, frames = sys.argv[1:]
        generator = VideoGenerator.from_pretrained(checkpoint, num_gpus=1,
                                                   pipeline_config=PAN2PipelineConfig(vae_decode_kernel=True))
        results = {}
        try:
            # Same request twice: returning frames makes FastVideo save the video itself; saving only streams it.
            for name, return_frames in (("fastvideo", True), ("streamed", False)):
                result = generator.generate_video(
                    prompt="a cat", image_path=image, height=int(height), width=int(width), num_frames=int(frames),
                    num_inference_steps=2, guidance_scale=1.0, seed=3, output_path=f"{out}/{name}.mp4",
                    save_video=True, return_frames=return_frames)
                results[name] = {"video_path": result["video_path"], "size": list(result["size"]),
                                 "frames": None if result["frames"] is None else len(result["frames"])}
        finally:
            generator.shutdown()
        print(json.dumps(results))
""")


def test_streamed_save_through_the_python_api_is_fastvideos_save(tiny_ckpt, tmp_path):
    """One generator, the same seeded request twice: FastVideo's save (frames returned) and the streamed save
    (video only saved) write byte-identical files and report the same size; only the second streams."""
    script = tmp_path / "stream.py"
    script.write_text(STREAM_SCRIPT)
    image = exif_rotated_jpeg(tmp_path / "first.jpg", 192, 128, orientation=6)
    proc = run([sys.executable, str(script), str(tiny_ckpt), str(image), str(tmp_path), str(E2E_HEIGHT),
                str(E2E_WIDTH), str(E2E_FRAMES)], env_extra=OFFLINE, cwd=tmp_path)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    results = last_json_line(proc.stdout)
    fastvideo, streamed = tmp_path / "fastvideo.mp4", tmp_path / "streamed.mp4"
    assert results["fastvideo"] == {"video_path": str(fastvideo), "size": [E2E_HEIGHT, E2E_WIDTH, E2E_FRAMES],
                                    "frames": E2E_FRAMES}
    assert results["streamed"] == {"video_path": str(streamed), "size": [E2E_HEIGHT, E2E_WIDTH, E2E_FRAMES],
                                   "frames": None}
    assert streamed.read_bytes() == fastvideo.read_bytes()
    assert f"wrote {E2E_FRAMES} frames to {streamed} while decoding" in log
    assert f"to {fastvideo} while decoding" not in log


def _renamed(tiny_ckpt, tmp_path):
    """The tiny checkpoint in a folder whose name says nothing: PAN2 is recognised by its files."""
    import shutil

    folder = tmp_path / "some-model"
    shutil.copytree(tiny_ckpt, folder)
    return folder


def test_cli_text_to_video_from_a_folder_named_anything(tiny_ckpt, tmp_path):
    video = tmp_path / "t2v.mp4"
    proc = run([FASTVIDEO_CLI, "generate", "--pipeline", "pan2", "--generator.model_path",
                str(_renamed(tiny_ckpt, tmp_path)), "--request.prompt", "a lighthouse in a storm",
                "--request.sampling.height", str(E2E_HEIGHT), "--request.sampling.width", str(E2E_WIDTH),
                "--request.sampling.num_frames", str(E2E_FRAMES), "--request.sampling.num_inference_steps", "2",
                "--request.output.output_path", str(video)], env_extra=OFFLINE)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert video_frames_and_size(video) == (E2E_FRAMES, (E2E_WIDTH, E2E_HEIGHT))
    assert "PAN2 attention policy" in proc.stdout + proc.stderr  # the worker built PAN2's pipeline


API_SCRIPT = textwrap.dedent("""
    import json, sys
    from fastvideo import VideoGenerator

    if __name__ == "__main__":
        checkpoint, out, height, width, frames = sys.argv[1:]
        generator = VideoGenerator.from_pretrained(checkpoint, num_gpus=1)  # no PAN2 config: found by its files
        try:
            result = generator.generate_video(
                prompt="a lighthouse in a storm", negative_prompt="blurry", guidance_scale=3.0, height=int(height),
                width=int(width), num_frames=int(frames), num_inference_steps=2, seed=5, output_path=out,
                save_video=True, return_frames=False)
        finally:
            generator.shutdown()
        config = type(generator.fastvideo_args.pipeline_config).__name__
        print(json.dumps({"video_path": result["video_path"], "config": config}))
""")


def test_python_api_text_to_video_finds_pan2_by_its_files(tiny_ckpt, tmp_path):
    script = tmp_path / "t2v.py"
    script.write_text(API_SCRIPT)
    video = tmp_path / "api-t2v.mp4"
    proc = run([sys.executable, str(script), str(_renamed(tiny_ckpt, tmp_path)), str(video), str(E2E_HEIGHT),
                str(E2E_WIDTH), str(E2E_FRAMES)], env_extra=OFFLINE, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert last_json_line(proc.stdout) == {"video_path": str(video), "config": "PAN2PipelineConfig"}
    assert video_frames_and_size(video) == (E2E_FRAMES, (E2E_WIDTH, E2E_HEIGHT))
