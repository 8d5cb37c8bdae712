"""`reference.load_first_frame` on real image files, against code this project did not write: FastVideo 0.2.1's own
TI2V preprocessing (`InputValidationStage.forward`, run here as FastVideo runs it, with `fastvideo.utils.best_output_size`,
"adapted from Wan2.2's wan/utils/utils.py").

Wan2.2's sampler (`wan/textimage2video.py`, `wan/image2video.py`) opens the image with `Image.open(path).convert("RGB")`,
picks the output size with `best_output_size(iw, ih, 32, 32, area)`, LANCZOS-resizes to cover it, centre-crops and maps
`to_tensor(img)` to [-1, 1] with `sub_(0.5).div_(0.5)`. FastVideo's stage does the same, with two differences, each
stated and tested here:
- the area is always 480 x 832 (the request's height and width are ignored): so the pixels are compared at that area,
  and other areas through FastVideo's `best_output_size` with the sizes it gives written out;
- it reads the image with `ImageOps.exif_transpose` (FastVideo's `load_image`): so on a file with an EXIF orientation
  FastVideo's frame is the reference's frame of the turned pixels, not of the stored ones Wan2.2 (and PAN2) use.
Everything is elementwise after Pillow's resize and crop (the same Pillow calls), so the frames are equal bit for bit.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from fastvideo_pan2_ext import reference

EXIF_ORIENTATION = 0x0112
FASTVIDEO_AREA = (480, 832)  # height, width: InputValidationStage's fixed max_area for Wan TI2V


# --- FastVideo's preprocessing --------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _fastvideo():
    from fastvideo.configs.pipelines.wan import Wan2_2_TI2V_5B_Config
    from fastvideo.fastvideo_args import FastVideoArgs
    from fastvideo.pipelines import ForwardBatch
    from fastvideo.pipelines.stages.input_validation import InputValidationStage

    args = FastVideoArgs(model_path="unused", pipeline_config=Wan2_2_TI2V_5B_Config())
    # What FastVideo reads from Wan2.2-TI2V-5B's vae/config.json (the config class defaults to Wan2.1's 8): the
    # stage's size step is then patch 2 x 16 = 32, Wan2.2's.
    args.pipeline_config.vae_config.arch_config.scale_factor_spatial = 16
    return args, ForwardBatch, InputValidationStage()


def fastvideo_first_frame(path) -> torch.Tensor:
    """The first frame FastVideo's TI2V input stage makes of the image at `path` ([1, 3, 1, H, W])."""
    args, forward_batch, stage = _fastvideo()
    batch = forward_batch(data_type="video", prompt="x", image_path=str(path), seed=0, height=704, width=1248,
                          num_frames=5)
    batch = stage.forward(batch, args)
    assert batch.pil_image.shape[3:] == (batch.height, batch.width)
    return batch.pil_image


def assert_is_first_frame(frame: torch.Tensor, expected: torch.Tensor) -> None:
    assert frame.dtype == torch.float32
    assert frame.shape == expected.shape
    assert frame.shape[:3] == (1, 3, 1) and frame.shape[3] % 32 == 0 and frame.shape[4] % 32 == 0
    assert frame.min() >= -1 and frame.max() <= 1
    assert torch.equal(frame, expected), f"max |diff| = {(frame - expected).abs().max().item()}"


def assert_fastvideo_agrees(path) -> torch.Tensor:
    """reference.load_first_frame at FastVideo's area is FastVideo's frame of the same file; returns it."""
    frame = reference.load_first_frame(path, *FASTVIDEO_AREA)
    assert_is_first_frame(frame, fastvideo_first_frame(path))
    return frame


def random_rgb(width: int, height: int, seed: int) -> np.ndarray:
    """Smooth colour gradients plus noise: every rotation or flip of it is a different image."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 200 // max(width, 1), y * 200 // max(height, 1), (x + 2 * y) % 256], axis=-1)
    return np.clip(base + rng.integers(0, 56, (height, width, 3)), 0, 255).astype(np.uint8)


# --- EXIF orientation: the stored pixels are used -------------------------------------------------------------------


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_first_frame_ignores_exif_orientation_where_fastvideo_applies_it(tmp_path, orientation):
    path = tmp_path / f"orientation{orientation}.jpg"
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = orientation
    Image.fromarray(random_rgb(320, 180, seed=orientation)).save(path, quality=95, exif=exif)
    with Image.open(path) as stored:
        assert stored.getexif()[EXIF_ORIENTATION] == orientation
        ImageOps.exif_transpose(stored).convert("RGB").save(tmp_path / "turned.png")  # lossless: the same pixels

    frame = reference.load_first_frame(path, *FASTVIDEO_AREA)
    assert frame.shape[3:] == FASTVIDEO_AREA  # landscape, as stored
    fastvideo = fastvideo_first_frame(path)  # FastVideo turns the image first
    assert_is_first_frame(fastvideo, reference.load_first_frame(tmp_path / "turned.png", *FASTVIDEO_AREA))
    assert fastvideo.shape != frame.shape or not torch.equal(fastvideo, frame)


def test_the_sample_image_is_read_as_stored_and_fastvideo_turns_it(tmp_path):
    """The packaged sample (fastvideo_pan2_ext/assets/, stored 384x256 landscape with EXIF orientation 6)."""
    from importlib.resources import files

    path = files("fastvideo_pan2_ext") / "assets" / "sample_exif_rotated.jpg"
    with Image.open(path) as stored:
        assert stored.size == (384, 256) and stored.getexif()[EXIF_ORIENTATION] == 6
        ImageOps.exif_transpose(stored).convert("RGB").save(tmp_path / "turned.png")
    assert reference.load_first_frame(path, *FASTVIDEO_AREA).shape[3:] == (512, 768)  # landscape
    fastvideo = fastvideo_first_frame(path)
    assert fastvideo.shape[3:] == (768, 512)  # portrait
    assert_is_first_frame(fastvideo, reference.load_first_frame(tmp_path / "turned.png", *FASTVIDEO_AREA))


# --- colour modes ---------------------------------------------------------------------------------------------------


def test_rgba_png_uses_the_colour_channels_and_drops_alpha(tmp_path):
    rgba = np.concatenate([random_rgb(200, 150, seed=1), np.zeros((150, 200, 1), np.uint8)], axis=-1)
    rgba[::2, :, 3] = 255  # half the rows opaque, half fully transparent (colour underneath still stored)
    path = tmp_path / "rgba.png"
    Image.fromarray(rgba).save(path)
    with Image.open(path) as stored:
        assert stored.mode == "RGBA"

    frame = assert_fastvideo_agrees(path)
    Image.fromarray(rgba[..., :3]).save(tmp_path / "rgb.png")  # the colour channels alone
    assert torch.equal(frame, reference.load_first_frame(tmp_path / "rgb.png", *FASTVIDEO_AREA))


def test_grayscale_png_gives_three_equal_channels(tmp_path):
    gray = random_rgb(150, 200, seed=2)[..., 1]
    path = tmp_path / "gray.png"
    Image.fromarray(gray).save(path)
    with Image.open(path) as stored:
        assert stored.mode == "L"

    frame = assert_fastvideo_agrees(path)
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

    frame = assert_fastvideo_agrees(path)
    Image.fromarray(rgb).save(tmp_path / "rgb.png")  # Pillow's CMYK -> RGB, written out
    assert torch.equal(frame, reference.load_first_frame(tmp_path / "rgb.png", *FASTVIDEO_AREA))


def test_16_bit_png_is_read_with_pillows_clipping_to_8_bits(tmp_path):
    rng = np.random.default_rng(4)
    deep = rng.integers(0, 400, (100, 140), dtype=np.uint16)  # about a third above 255
    path = tmp_path / "deep.png"
    Image.fromarray(deep).save(path)
    with Image.open(path) as stored:
        assert stored.mode == "I;16"
        assert np.array_equal(np.asarray(stored), deep)
    clipped = np.clip(deep, 0, 255).astype(np.uint8)

    frame = assert_fastvideo_agrees(path)
    Image.fromarray(clipped).save(tmp_path / "clipped.png")
    assert torch.equal(frame, reference.load_first_frame(tmp_path / "clipped.png", *FASTVIDEO_AREA))


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

    frame = assert_fastvideo_agrees(path)
    Image.fromarray(palette[indices]).save(tmp_path / "rgb.png")
    assert torch.equal(frame, reference.load_first_frame(tmp_path / "rgb.png", *FASTVIDEO_AREA))


# --- sizes ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "image_size, expected_hw",
    [((4000, 100), (128, 5920)), ((90, 3000), (5408, 160))],
    ids=["4000x100", "90x3000"],
)
def test_extreme_aspect_ratios_follow_wan22s_size_rule(tmp_path, image_size, expected_hw):
    path = tmp_path / "extreme.png"
    Image.fromarray(random_rgb(*image_size, seed=6)).save(path)

    from fastvideo.utils import best_output_size

    frame = reference.load_first_frame(path, 704, 1248)
    assert best_output_size(*image_size, 32, 32, 704 * 1248)[::-1] == expected_hw
    assert frame.shape[3:] == expected_hw
    assert_fastvideo_agrees(path)
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

    from fastvideo.utils import best_output_size

    frame = reference.load_first_frame(path, height, width)
    assert best_output_size(*image_size, 32, 32, height * width)[::-1] == expected_hw
    assert frame.shape == (1, 3, 1, *expected_hw)
    if (height, width) == FASTVIDEO_AREA:
        assert_fastvideo_agrees(path)


def test_image_already_at_the_output_size_keeps_its_exact_pixels(tmp_path):
    pixels = random_rgb(1248, 704, seed=8)
    path = tmp_path / "exact.png"
    Image.fromarray(pixels).save(path)

    frame = reference.load_first_frame(path, 704, 1248)
    expected = (torch.from_numpy(pixels).permute(2, 0, 1).float() / 255 - 0.5) / 0.5
    assert torch.equal(frame, expected[None, :, None])


def test_output_size_rule_matches_fastvideos_copy_of_wan22s_on_many_shapes():
    # The size rule alone, on a spread of image shapes and requested areas (no images needed).
    from fastvideo.utils import best_output_size

    rng = np.random.default_rng(9)
    for _ in range(2000):
        iw, ih = (int(v) for v in rng.integers(16, 5000, 2))
        height, width = (int(v) for v in rng.integers(8, 60, 2) * 32)
        if max(iw / ih, ih / iw) * 32 * 32 > height * width / 4:
            continue  # too extreme for this area: see the test below
        assert reference.best_output_size(iw, ih, 32, 32, height * width) == best_output_size(iw, ih, 32, 32, height * width)


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
