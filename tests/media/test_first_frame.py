"""PAN2's first-frame reading: bit-identical to the reference on awkward real files, and one-line errors."""

from __future__ import annotations

import pytest
import torch
from _pan2_helpers import (decompression_bomb_png, exif_rotated_jpeg, make_signoff_images, truncated_png)

from fastvideo_pan2_ext import reference
from fastvideo_pan2_ext.media import image
from fastvideo_pan2_ext.media.image import ImageInputError, load_first_frame, load_image

SIZES = [(256, 384), (704, 1248)]


@pytest.fixture(scope="module")
def signoff_images(tmp_path_factory):
    return make_signoff_images(tmp_path_factory.mktemp("signoff"))


@pytest.mark.parametrize("height,width", SIZES)
def test_first_frame_is_bit_identical_to_reference(signoff_images, height, width):
    for path in signoff_images:
        ours = load_first_frame(path, height, width)
        ref = reference.load_first_frame(path, height, width)
        assert ours.dtype == torch.float32 and ours.shape == ref.shape, path.name
        assert torch.equal(ours, ref), path.name


def test_first_frame_ignores_exif_orientation(tmp_path):
    path = exif_rotated_jpeg(tmp_path / "rot.jpg", 192, 128, orientation=6)
    assert load_image(path).size == (192, 128)  # stored pixels: landscape
    assert load_image(path, exif_transpose=True).size == (128, 192)  # what FastVideo's load_image would give
    frame = load_first_frame(path, 64, 96)
    assert frame.shape == (1, 3, 1, 64, 96)
    assert float(frame.min()) >= -1.0 and float(frame.max()) <= 1.0


def test_first_frame_fills_the_requested_canvas_whatever_the_images_shape(tmp_path):
    for w, h in ((1280, 720), (720, 1280), (100, 100), (198, 128)):
        path = exif_rotated_jpeg(tmp_path / f"{w}x{h}.jpg", w, h, orientation=1)
        assert load_first_frame(path, 704, 1248).shape == (1, 3, 1, 704, 1248)
    assert image.cover_size(1280, 720, 704, 1248) == (1252, 704)  # scale 704 / 720: 1251.6 px wide, rounded
    assert image.cover_size(198, 128, 64, 96) == (99, 64)


@pytest.mark.parametrize("height,width", [(63, 96), (64, 100), (0, 96), (64, -32), (64.0, 96), (True, 96)])
def test_size_not_multiple_of_32_is_one_clear_error(tmp_path, height, width):
    path = exif_rotated_jpeg(tmp_path / "a.jpg")
    with pytest.raises(ImageInputError, match=r"(height|width) must be a positive multiple of 32; got"):
        load_first_frame(path, height, width)


def test_missing_file_is_one_clear_error(tmp_path):
    with pytest.raises(ImageInputError, match=r"image file not found: '.*nope\.png'"):
        load_image(tmp_path / "nope.png")


def test_truncated_image_is_one_clear_error(tmp_path):
    path = truncated_png(tmp_path / "cut.png")
    with pytest.raises(ImageInputError, match=r"cannot read image '.*cut\.png'"):
        load_image(path)


def test_non_image_file_is_one_clear_error(tmp_path):
    path = tmp_path / "notes.png"
    path.write_text("not an image\n")
    with pytest.raises(ImageInputError, match=r"not a recognised image format"):
        load_image(path)


@pytest.mark.parametrize("width,height,message", [
    (10000, 10000, r"is 10000x10000 = 100 MP, over the 89 MP limit \(decompression-bomb guard\)"),
    (20000, 20000, r"refused as a decompression bomb"),  # Pillow itself refuses at twice its limit
])
def test_decompression_bomb_is_refused_before_decoding(tmp_path, width, height, message):
    path = decompression_bomb_png(tmp_path / "bomb.png", width, height)
    assert path.stat().st_size < 1000
    with pytest.raises(ImageInputError, match=message):
        load_image(path)


def test_a_sliver_whose_cover_resize_would_be_a_bomb_is_one_clear_error(tmp_path):
    path = exif_rotated_jpeg(tmp_path / "sliver.png", 4000, 2, orientation=1)
    with pytest.raises(ImageInputError, match=r"aspect ratio 4000x2 is too extreme for a 704x1248 frame: covering "
                                              r"it takes a 1408000x704 resize"):
        load_first_frame(path, 704, 1248)


def test_errors_are_single_lines(tmp_path):
    cases = [lambda: load_image(tmp_path / "missing.jpg"), lambda: load_image(truncated_png(tmp_path / "t.png")),
             lambda: load_first_frame(exif_rotated_jpeg(tmp_path / "x.jpg"), 70, 96)]
    for case in cases:
        with pytest.raises(ImageInputError) as info:
            case()
        assert "\n" not in str(info.value)
