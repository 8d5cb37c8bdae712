"""End to end on CPU with real FastVideo 0.2.1 and its spawned worker: the tiny PAN2 checkpoint and an EXIF-rotated
first frame in, an mp4 out, through both decode routes (the stock CLI with FastVideo's decode; the Python API with
`vae_decode_kernel=True`). ~1-1.5 min each on 2 busy cores (two FastVideo imports: the CLI and its worker)."""

from __future__ import annotations

import sys
import textwrap

from _pan2_helpers import (E2E_FRAMES, E2E_HEIGHT, E2E_WIDTH, FASTVIDEO_CLI, OFFLINE, exif_rotated_jpeg,
                           fake_flash_attn, last_json_line, run, video_frames_and_size)


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


API_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from fastvideo_pan2_ext.attention import fa4

    fa4._current_capability = lambda: (10, 0)  # this parent pretends to drive an sm_100 GPU (flash_attn.cute: stand-in)

    if __name__ == "__main__":
        from fastvideo import VideoGenerator
        from fastvideo_pan2_ext import PAN2PipelineConfig

        checkpoint, image, video = sys.argv[1:4]
        config = PAN2PipelineConfig(vae_decode_kernel=True, vae_frames_per_pass=2)
        parent_fa4 = os.environ.get("FASTVIDEO_FA4")
        generator = VideoGenerator.from_pretrained(checkpoint, pipeline_config=config, num_gpus=1)
        generator.generate_video(prompt="a cat on a sofa", image_path=image, height=HEIGHT, width=WIDTH,
                                 num_frames=FRAMES, num_inference_steps=2, guidance_scale=1.0, output_path=video,
                                 save_video=True)
        generator.shutdown()
        print(json.dumps({"parent_fa4": parent_fa4}))
""").replace("HEIGHT", str(E2E_HEIGHT)).replace("WIDTH", str(E2E_WIDTH)).replace("FRAMES", str(E2E_FRAMES))


def test_python_api_with_decode_kernel_writes_video_and_workers_inherit_fa4(tiny_ckpt, tmp_path):
    image = exif_rotated_jpeg(tmp_path / "portrait_by_exif.jpg", 192, 128, orientation=6)
    video = tmp_path / "api.mp4"
    script = tmp_path / "generate.py"
    script.write_text(API_SCRIPT)
    stand_in = fake_flash_attn(tmp_path / "stand_in")
    proc = run([sys.executable, str(script), str(tiny_ckpt), str(image), str(video)],
               env_extra={"PYTHONPATH": str(stand_in), **OFFLINE})
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    frames, size = video_frames_and_size(video)
    assert (frames, size) == (E2E_FRAMES, (E2E_WIDTH, E2E_HEIGHT))
    assert "PAN2 decode: WanVAEDecoder (backend torch, frames_per_pass 2) on cpu" in log
    # Decided in the parent before the worker started; the worker had it before it loaded any model.
    assert last_json_line(proc.stdout) == {"parent_fa4": "1"}
    assert ("PAN2 attention policy: FASTVIDEO_FA4=1 (inherited or left as is); "
            "FastVideo modules that read it already loaded: none") in log
