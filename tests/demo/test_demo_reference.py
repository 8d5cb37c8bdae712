"""`python -m fastvideo_pan2_ext.demo.reference_decoder`: reference decode -> mp4 + PNG contact sheet."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from fastvideo_pan2_ext import reference
from fastvideo_pan2_ext.demo import reference_decoder as demo
from fastvideo_pan2_ext.vae_kernel.definitions.architecture import expected_shapes, infer_config
from fastvideo_pan2_ext.media.video_io import to_uint8_frames


def _read_mp4(path):
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    frames = np.stack([np.frombuffer(f, np.uint8).reshape(meta["size"][1], meta["size"][0], 3) for f in reader])
    return meta, frames


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    result = subprocess.run(
        [sys.executable, "-m", "fastvideo_pan2_ext.demo.reference_decoder", "--out", str(out / "clip"), "--frames", "9",
         "--height", "64", "--width", "96", "--seed", "3", "--fps", "8"],
        cwd=out, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out / "clip", result.stdout


@pytest.mark.slow
def test_demo_writes_an_mp4_of_4t_minus_3_frames_at_the_requested_size(demo_run):
    out, stdout = demo_run
    mp4 = out / "reference_decode.mp4"
    assert f"video:         {mp4}" in stdout
    meta, frames = _read_mp4(mp4)
    assert tuple(meta["size"]) == (96, 64)
    assert frames.shape == (9, 64, 96, 3)  # 3 latent frames -> 4 * 3 - 3 video frames
    assert meta["fps"] == 8


def test_demo_writes_a_contact_sheet_of_every_frame(demo_run):
    out, stdout = demo_run
    sheet = out / "reference_decode_frames.png"
    assert f"contact sheet: {sheet}" in stdout
    with Image.open(sheet) as image:
        # 9 frames -> 3 x 3 tiles of 96 x 64, each with a 12-pixel label under it, 4-pixel gaps, a caption band
        assert image.format == "PNG" and image.mode == "RGB"
        assert image.size == (3 * (96 + 4) + 4, 24 + 3 * (64 + 12 + 4) + 4)
        sheet_pixels = np.asarray(image)
    frames = to_uint8_frames(reference.decode(demo.moving_wave_latents(3, 4, 6, seed=3), demo.demo_state_dict(3)))
    for i, frame in enumerate(frames):  # lossless: every tile is its decoded frame, in order, labelled
        top, left = 24 + (i // 3) * (64 + 12 + 4), 4 + (i % 3) * (96 + 4)
        assert np.array_equal(sheet_pixels[top : top + 64, left : left + 96], frame)
        assert sheet_pixels[top + 64 : top + 76, left : left + 96].max() > 100  # the label's text
    assert sheet_pixels[:24].max() > 100  # the caption


def test_demo_mp4_is_the_reference_decode_of_its_latents(demo_run):
    out, _ = demo_run
    _, frames = _read_mp4(out / "reference_decode.mp4")
    video = reference.decode(demo.moving_wave_latents(3, 4, 6, seed=3), demo.demo_state_dict(3))
    expected = to_uint8_frames(video).astype(int)
    other_seed = to_uint8_frames(
        reference.decode(demo.moving_wave_latents(3, 4, 6, seed=4), demo.demo_state_dict(4))).astype(int)
    error = np.abs(frames.astype(int) - expected).mean()
    # yuv420p halves the colour resolution, which costs about 10 / 255 on this fine-grained clip; another seed's
    # video is about 50 / 255 away.
    assert error < 16, f"mean |mp4 - decode| = {error:.2f} / 255"
    assert np.abs(frames.astype(int) - other_seed).mean() > 3 * error


def test_demo_weights_are_a_complete_seeded_wan22_decoder():
    weights = demo.demo_state_dict(0)
    inferred = infer_config(weights)
    assert expected_shapes(inferred) == expected_shapes(demo.demo_config())
    assert (inferred.z_dim, inferred.decoder_base_dim, inferred.patch_size) == (48, 8, 2)
    assert set(weights) == set(expected_shapes(demo.demo_config()))
    again, other = demo.demo_state_dict(0), demo.demo_state_dict(1)
    assert all(torch.equal(weights[k], again[k]) for k in weights)
    assert not any(torch.equal(weights[k], other[k]) for k in weights)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--frames", "8"], "must be 4k + 1"),
        (["--frames", "0"], "must be >= 1"),
        (["--frames", "many"], "must be an integer"),
        (["--height", "100"], "must be a multiple of 16"),
        (["--height", "0"], "must be >= 1"),
        (["--width", "4096"], "must be a multiple of 16 between 16 and 2048"),
        (["--fps", "0"], "must be a positive number"),
        (["--fps", "nan"], "must be a positive number"),
        (["--fps", "fast"], "must be a number"),
        (["--dtype", "float16"], "invalid choice"),
        (["--seed", "1.5"], "invalid int value"),
    ],
)
def test_demo_rejects_bad_arguments_with_a_clear_message(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        demo.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_refuses_an_output_path_that_is_a_file(capsys, tmp_path):
    not_a_folder = tmp_path / "file.txt"
    not_a_folder.write_text("x")
    with pytest.raises(SystemExit) as exit_info:
        demo.parse_args(["--out", str(not_a_folder)])
    assert exit_info.value.code == 2
    assert "--out must be a folder" in capsys.readouterr().err
