"""`python -m fastvideo_pan2_ext.demo`'s command line: help, and one clear error per bad argument, before anything
heavy starts. (The demo's run itself is the e2e test in test_e2e_generate.py.)"""

from __future__ import annotations

import sys

import pytest
from _pan2_helpers import decompression_bomb_png, run

from fastvideo_pan2_ext.demo import pan2 as demo


def test_demo_help_lists_its_flags():
    proc = run([sys.executable, "-m", "fastvideo_pan2_ext.demo", "--help"])
    assert proc.returncode == 0
    for flag in ("--checkpoint", "--image", "--out", "--height", "--width", "--frames", "--steps", "--decoder",
                 "--frames-per-pass", "--cache-dir"):
        assert flag in proc.stdout, flag


def test_demo_ships_its_sample_image():
    from fastvideo_pan2_ext.media.image import load_image

    assert demo.SAMPLE_IMAGE.is_file()
    assert load_image(demo.SAMPLE_IMAGE).size == (384, 256)  # stored landscape; its EXIF says rotate 90
    assert load_image(demo.SAMPLE_IMAGE, exif_transpose=True).size == (256, 384)


@pytest.mark.parametrize("argv,message", [
    (["--frames", "10"], "--frames: num_frames must be 4k + 1 (1, 5, 9, ..., 121, ...: one frame from the first "
                         "latent frame, four from each later one); got 10: ask for 9 or 13"),
    (["--steps", "0"], "--steps must be >= 1; got 0"),
    (["--frames-per-pass", "0"], "argument --frames-per-pass: frames_per_pass must be 'auto' or an int >= 1; got 0"),
    (["--height", "100"], "height must be a positive multiple of 32; got 100"),
    (["--width", "1250"], "width must be a positive multiple of 32; got 1250"),
    (["--image", "/nonexistent/x.png"], "image file not found: '/nonexistent/x.png'"),
    (["--decoder", "fast"], "invalid choice: 'fast'"),
])
def test_demo_rejects_bad_arguments_with_one_clear_line(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        demo.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_rejects_bad_files(capsys, tmp_path):
    bomb = decompression_bomb_png(tmp_path / "bomb.png", 12000, 9000)
    not_pan2 = tmp_path / "ckpt"
    not_pan2.mkdir()
    out_file = tmp_path / "out.txt"
    out_file.write_text("x")
    for argv, message in ((["--image", str(bomb)], "12000x9000 = 108 MP, over the 89 MP limit"),
                          (["--checkpoint", str(not_pan2)],
                           "is not a PAN2 checkpoint: it has neither model_index.json nor modular_model_index.json"),
                          (["--out", str(out_file)], "--out must be a folder")):
        with pytest.raises(SystemExit) as info:
            demo.main(argv)
        assert info.value.code == 2, argv
        assert message in capsys.readouterr().err, argv
