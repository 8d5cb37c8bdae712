"""`reference.load_first_frame` on real image files, against an independent computation of Wan2.2's i2v reading.

Wan2.2's sampler (`wan/textimage2video.py`, `wan/image2video.py` with `wan/utils/utils.py::best_output_size`) opens the
image with `Image.open(path).convert("RGB")` (no EXIF transpose), picks the output size with `best_output_size(iw, ih,
32, 32, area)` (multiples of 32, area <= the requested one, the width-first or height-first candidate whose aspect ratio
is closer to the image's, the height-first one on a tie), LANCZOS-resizes to cover that size, centre-crops, and maps
`to_tensor(img)` to [-1, 1] with `sub_(0.5).div_(0.5)`.

The expected tensors here are built independently: the size rule is re-derived below; the pixels come from the arrays
this file wrote (or, for the decoded lossy and 16-bit formats, from Pillow's raw decode plus the colour conversion
written out by hand); the crop is numpy slicing; the tensor conversion is torchvision's `to_tensor`.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from torchvision.transforms.functional import to_tensor

from fastvideo_pan2_ext import reference

EXIF_ORIENTATION = 0x0112


# --- the independent computation ------------------------------------------------------------------------------------


def wan22_output_size(iw: int, ih: int, area: int, step: int = 32) -> tuple[int, int]:
    """(width, height): the two candidates of Wan2.2's rule, the closer aspect ratio wins, height-first on a tie."""
    aspect = iw / ih
    width_first_w = math.floor(math.sqrt(area * aspect) / step) * step
    width_first = (width_first_w, math.floor(area / width_first_w / step) * step)
    height_first_h = math.floor(area / math.sqrt(area * aspect) / step) * step
    height_first = (math.floor(area / height_first_h / step) * step, height_first_h)

    def distortion(size):
        r = size[0] / size[1]
        return max(aspect / r, r / aspect)

    return width_first if distortion(width_first) < distortion(height_first) else height_first


def expected_first_frame(rgb: Image.Image, height: int, width: int) -> torch.Tensor:
    """The first frame of an RGB image as Wan2.2 makes it, computed without reference.py."""
    assert rgb.mode == "RGB"
    ow, oh = wan22_output_size(rgb.width, rgb.height, height * width)
    scale = max(ow / rgb.width, oh / rgb.height)
    resized = np.array(rgb.resize((round(rgb.width * scale), round(rgb.height * scale)), Image.LANCZOS))
    top, left = (resized.shape[0] - oh) // 2, (resized.shape[1] - ow) // 2
    cropped = np.ascontiguousarray(resized[top : top + oh, left : left + ow])
    return to_tensor(cropped).sub_(0.5).div_(0.5).unsqueeze(1).unsqueeze(0)


def assert_is_first_frame(frame: torch.Tensor, expected: torch.Tensor) -> None:
    assert frame.dtype == torch.float32
    assert frame.shape == expected.shape
    assert frame.shape[:3] == (1, 3, 1) and frame.shape[3] % 32 == 0 and frame.shape[4] % 32 == 0
    assert frame.min() >= -1 and frame.max() <= 1
    assert torch.equal(frame, expected), f"max |diff| = {(frame - expected).abs().max().item()}"


def random_rgb(width: int, height: int, seed: int) -> np.ndarray:
    """Smooth colour gradients plus noise: every rotation or flip of it is a different image."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 200 // max(width, 1), y * 200 // max(height, 1), (x + 2 * y) % 256], axis=-1)
    return np.clip(base + rng.integers(0, 56, (height, width, 3)), 0, 255).astype(np.uint8)


# --- EXIF orientation: the stored pixels are used -------------------------------------------------------------------


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_first_frame_ignores_exif_orientation(tmp_path, orientation):
    path = tmp_path / f"orientation{orientation}.jpg"
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = orientation
    Image.fromarray(random_rgb(320, 180, seed=orientation)).save(path, quality=95, exif=exif)
    with Image.open(path) as stored:
        assert stored.getexif()[EXIF_ORIENTATION] == orientation
        stored_rgb = stored.convert("RGB")
        transposed_rgb = ImageOps.exif_transpose(stored).convert("RGB")

    frame = reference.load_first_frame(path, 128, 224)

    assert_is_first_frame(frame, expected_first_frame(stored_rgb, 128, 224))
    assert frame.shape[3:] == (128, 224)  # landscape, as stored; the transposed image would give a portrait frame
    transposed = expected_first_frame(transposed_rgb, 128, 224)
    assert transposed.shape != frame.shape or not torch.equal(transposed, frame)


# --- colour modes ---------------------------------------------------------------------------------------------------


def test_rgba_png_uses_the_colour_channels_and_drops_alpha(tmp_path):
    rgba = np.concatenate([random_rgb(200, 150, seed=1), np.zeros((150, 200, 1), np.uint8)], axis=-1)
    rgba[::2, :, 3] = 255  # half the rows opaque, half fully transparent (colour underneath still stored)
    path = tmp_path / "rgba.png"
    Image.fromarray(rgba).save(path)
    with Image.open(path) as stored:
        assert stored.mode == "RGBA"

    frame = reference.load_first_frame(path, 64, 96)
    assert_is_first_frame(frame, expected_first_frame(Image.fromarray(rgba[..., :3]), 64, 96))


def test_grayscale_png_gives_three_equal_channels(tmp_path):
    gray = random_rgb(150, 200, seed=2)[..., 1]
    path = tmp_path / "gray.png"
    Image.fromarray(gray).save(path)
    with Image.open(path) as stored:
        assert stored.mode == "L"

    frame = reference.load_first_frame(path, 96, 64)
    assert_is_first_frame(frame, expected_first_frame(Image.fromarray(np.stack([gray] * 3, axis=-1)), 96, 64))
    assert torch.equal(frame[:, 0], frame[:, 1]) and torch.equal(frame[:, 1], frame[:, 2])


def test_cmyk_jpeg_is_converted_to_rgb(tmp_path):
    rng = np.random.default_rng(3)
    cmyk = rng.integers(0, 256, (120, 160, 4), dtype=np.uint8)
    path = tmp_path / "cmyk.jpg"
    Image.frombytes("CMYK", (160, 120), cmyk.tobytes()).save(path, quality=95)
    with Image.open(path) as stored:
        assert stored.mode == "CMYK"
        decoded = np.asarray(stored).astype(np.int64)  # the JPEG's CMYK after decoding (lossy)
    rgb = np.rint((255 - decoded[..., :3]) * (255 - decoded[..., 3:]) / 255).astype(np.uint8)

    frame = reference.load_first_frame(path, 96, 128)
    assert_is_first_frame(frame, expected_first_frame(Image.fromarray(rgb), 96, 128))


def test_16_bit_png_is_read_with_pillows_clipping_to_8_bits(tmp_path):
    rng = np.random.default_rng(4)
    deep = rng.integers(0, 400, (100, 140), dtype=np.uint16)  # about a third above 255
    path = tmp_path / "deep.png"
    Image.fromarray(deep).save(path)
    with Image.open(path) as stored:
        assert stored.mode == "I;16"
        assert np.array_equal(np.asarray(stored), deep)
    clipped = np.clip(deep, 0, 255).astype(np.uint8)

    frame = reference.load_first_frame(path, 64, 96)
    assert_is_first_frame(frame, expected_first_frame(Image.fromarray(np.stack([clipped] * 3, axis=-1)), 64, 96))


def test_palette_gif_is_read_through_its_palette(tmp_path):
    rng = np.random.default_rng(5)
    palette = rng.integers(0, 256, (16, 3), dtype=np.uint8)
    indices = rng.integers(0, 16, (90, 130), dtype=np.uint8)
    image = Image.frombytes("P", (130, 90), indices.tobytes())
    image.putpalette(palette.flatten().tolist())
    path = tmp_path / "palette.gif"
    image.save(path)
    with Image.open(path) as stored:
        assert stored.mode == "P"
        stored_indices = np.asarray(stored)
        stored_palette = np.asarray(stored.getpalette(), dtype=np.uint8).reshape(-1, 3)
    assert np.array_equal(stored_palette[stored_indices], palette[indices])  # GIF kept every colour

    frame = reference.load_first_frame(path, 64, 96)
    assert_is_first_frame(frame, expected_first_frame(Image.fromarray(palette[indices]), 64, 96))


# --- sizes ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "image_size, expected_hw",
    [((4000, 100), (128, 5920)), ((90, 3000), (5408, 160))],
    ids=["4000x100", "90x3000"],
)
def test_extreme_aspect_ratios_follow_wan22s_size_rule(tmp_path, image_size, expected_hw):
    path = tmp_path / "extreme.png"
    Image.fromarray(random_rgb(*image_size, seed=6)).save(path)

    frame = reference.load_first_frame(path, 704, 1248)
    with Image.open(path) as stored:
        assert_is_first_frame(frame, expected_first_frame(stored.convert("RGB"), 704, 1248))
    assert frame.shape[3:] == expected_hw
    assert frame.shape[3] * frame.shape[4] <= 704 * 1248


@pytest.mark.parametrize(
    "image_size, height, width, expected_hw",
    [
        ((1920, 1080), 704, 1248, (704, 1248)),  # 16:9 at PAN2's default gives exactly the default
        ((1280, 720), 704, 1248, (704, 1248)),
        ((1080, 1920), 704, 1248, (1248, 704)),  # portrait: the same area, turned
        ((1920, 1080), 480, 832, (480, 832)),  # Wan2.2's 480p area
        ((1000, 1000), 704, 1248, (928, 928)),
    ],
    ids=["1920x1080", "1280x720", "1080x1920", "1920x1080-480p", "square"],
)
def test_output_size_for_common_aspect_ratios(tmp_path, image_size, height, width, expected_hw):
    path = tmp_path / "image.png"
    Image.fromarray(random_rgb(*image_size, seed=7)).save(path)

    frame = reference.load_first_frame(path, height, width)
    with Image.open(path) as stored:
        assert_is_first_frame(frame, expected_first_frame(stored.convert("RGB"), height, width))
    assert frame.shape == (1, 3, 1, *expected_hw)


def test_image_already_at_the_output_size_keeps_its_exact_pixels(tmp_path):
    pixels = random_rgb(1248, 704, seed=8)
    path = tmp_path / "exact.png"
    Image.fromarray(pixels).save(path)

    frame = reference.load_first_frame(path, 704, 1248)
    expected = (torch.from_numpy(pixels).permute(2, 0, 1).float() / 255 - 0.5) / 0.5
    assert torch.equal(frame, expected[None, :, None])


def test_output_size_rule_matches_wan22_on_many_shapes():
    # The size rule alone, on a spread of image shapes and requested areas (no images needed).
    rng = np.random.default_rng(9)
    for _ in range(2000):
        iw, ih = (int(v) for v in rng.integers(16, 5000, 2))
        height, width = (int(v) for v in rng.integers(8, 60, 2) * 32)
        if max(iw / ih, ih / iw) * 32 * 32 > height * width / 4:
            continue  # too extreme for this area: see the test below
        assert reference.best_output_size(iw, ih, 32, 32, height * width) == wan22_output_size(iw, ih, height * width)


# --- bad inputs -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["height", "width"])
@pytest.mark.parametrize("value", [704.0, "704", None, True, 31, 0, -64])
def test_bad_height_or_width_raises_a_clear_value_error(tmp_path, name, value):
    path = tmp_path / "image.png"
    Image.fromarray(random_rgb(64, 64, seed=10)).save(path)
    sizes = {"height": 64, "width": 64, name: value}
    with pytest.raises(ValueError, match=f"{name} must be an int >= 32; got {value!r}"):
        reference.load_first_frame(path, sizes["height"], sizes["width"])


def test_image_too_elongated_for_the_requested_area_raises_a_value_error(tmp_path):
    path = tmp_path / "strip.png"
    Image.fromarray(random_rgb(4000, 100, seed=11)).save(path)
    with pytest.raises(ValueError):
        reference.load_first_frame(path, 32, 32)
