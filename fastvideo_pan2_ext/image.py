"""Reading PAN2's first frame: the stored pixels (no EXIF transpose), Wan2.2's resize-and-crop rule.

`load_first_frame` computes the frame with the reference's own function (`fastvideo_pan2_ext.reference`, its
definition) and adds the input checks a public entry point needs. Bad input raises `ImageInputError` (a
ValueError) with one line that names the file and the problem.
"""

from __future__ import annotations

import os

import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from fastvideo_pan2_ext import reference
from fastvideo_pan2_ext.reference import best_output_size

# Pillow's own decompression-bomb threshold (~89.5 MP); larger images are refused before their pixels are decoded.
MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS or 89_478_485
SIZE_MULTIPLE = 32  # PAN2's spatial granularity: 16x VAE compression x the DiT's 2x2 patches


class ImageInputError(ValueError):
    """An input image that cannot be used, with a one-line reason."""


def _open(path) -> Image.Image:
    if not isinstance(path, (str, os.PathLike)):
        raise ImageInputError(f"image path must be a str or os.PathLike; got {type(path).__name__}")
    if not os.path.exists(path):
        raise ImageInputError(f"image file not found: {os.fspath(path)!r}")
    if not os.path.isfile(path):
        raise ImageInputError(f"image path is not a file: {os.fspath(path)!r}")
    if os.path.getsize(path) == 0:
        raise ImageInputError(f"image file is empty (0 bytes): {os.fspath(path)!r}")
    try:
        img = Image.open(path)
    except UnidentifiedImageError:
        raise ImageInputError(f"cannot read image {os.fspath(path)!r}: not a recognised image format") from None
    except Image.DecompressionBombError as exc:
        raise ImageInputError(f"image {os.fspath(path)!r} refused as a decompression bomb: {exc}") from None
    except OSError as exc:
        raise ImageInputError(f"cannot read image {os.fspath(path)!r}: {exc}") from None
    w, h = img.size
    if w * h > MAX_IMAGE_PIXELS:
        img.close()
        raise ImageInputError(f"image {os.fspath(path)!r} is {w}x{h} = {w * h / 1e6:.0f} MP, over the "
                              f"{MAX_IMAGE_PIXELS / 1e6:.0f} MP limit (decompression-bomb guard)")
    if w < 1 or h < 1:
        raise ImageInputError(f"image {os.fspath(path)!r} has no pixels ({w}x{h})")
    return img


def load_image(path, exif_transpose: bool = False) -> Image.Image:
    """The image at `path` as RGB. By default the stored pixels, ignoring any EXIF orientation (as Wan2.2 reads it);
    `exif_transpose=True` applies the orientation first (what FastVideo's own `load_image` does)."""
    img = _open(path)
    try:
        if exif_transpose:
            img = ImageOps.exif_transpose(img)
        return img.convert("RGB")
    except (OSError, SyntaxError, ValueError) as exc:  # truncated or corrupt pixel data surfaces only here
        raise ImageInputError(f"cannot read image {os.fspath(path)!r}: {exc}") from None


def check_size(height, width) -> None:
    """Raise ImageInputError unless height and width are positive multiples of 32."""
    for name, value in (("height", height), ("width", width)):
        if isinstance(value, bool) or not isinstance(value, int) or value < SIZE_MULTIPLE or value % SIZE_MULTIPLE:
            raise ImageInputError(f"{name} must be a positive multiple of {SIZE_MULTIPLE}; got {value!r}")


def first_frame_size(image_width: int, image_height: int, height: int, width: int) -> tuple[int, int]:
    """(out_width, out_height) of the first frame: Wan2.2's rule, area = the requested height x width."""
    try:
        ow, oh = best_output_size(image_width, image_height, SIZE_MULTIPLE, SIZE_MULTIPLE, height * width)
    except (ValueError, ZeroDivisionError):  # the rule rounds one side down to 0 px
        ow = oh = 0
    if ow < SIZE_MULTIPLE or oh < SIZE_MULTIPLE:
        raise ImageInputError(f"image aspect ratio {image_width}x{image_height} is too extreme for a {height}x{width} "
                              f"frame (one side would be under {SIZE_MULTIPLE} px); request a larger size")
    return ow, oh


def first_frame_from_image(img: Image.Image, height: int, width: int) -> torch.Tensor:
    """An RGB image -> [1, 3, 1, H, W] float32 in [-1, 1], by the reference's rule, after PAN2's input checks."""
    check_size(height, width)
    first_frame_size(*img.size, height, width)  # a one-line error for aspect ratios the rule cannot serve
    return reference.first_frame_from_image(img, height, width)


def load_first_frame(path, height: int, width: int) -> torch.Tensor:
    """PAN2's first frame from an image file: [1, 3, 1, H, W] float32 in [-1, 1] (see `first_frame_from_image`)."""
    check_size(height, width)
    return first_frame_from_image(load_image(path), height, width)
