"""Reading PAN2's first frame: the stored pixels (no EXIF transpose), resized to cover the canvas, centre-cropped.

`load_first_frame` computes the frame as its definition does (`fastvideo_pan2_ext.reference.load_first_frame`, checked
against it by the tests) and adds the input checks a public entry point needs. Bad input raises `ImageInputError` (a
ValueError) with one line that names the file and the problem.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError


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


def cover_size(image_width: int, image_height: int, height: int, width: int) -> tuple[int, int]:
    """(width, height) the image is resized to before the centre crop: the smallest scaling that covers the canvas,
    each side rounded (PAN2's sampler). ImageInputError where that resize would be a decompression bomb of its own
    (a sliver of an image scaled up to cover the canvas)."""
    scale = max(width / image_width, height / image_height)
    cover_w, cover_h = round(image_width * scale), round(image_height * scale)
    if cover_w * cover_h > MAX_IMAGE_PIXELS:
        raise ImageInputError(f"image aspect ratio {image_width}x{image_height} is too extreme for a {height}x{width} "
                              f"frame: covering it takes a {cover_w}x{cover_h} resize, over the "
                              f"{MAX_IMAGE_PIXELS / 1e6:.0f} MP limit")
    return cover_w, cover_h


def first_frame_from_image(img: Image.Image, height: int, width: int) -> torch.Tensor:
    """An RGB image -> [1, 3, 1, H, W] float32 in [-1, 1]: LANCZOS-resized to cover the height x width canvas,
    centre-cropped to it (offsets rounded half to even, as Python rounds), `2 x / 255 - 1` (docs/design/pan2.md,
    "PAN2's sampler"; its definition is `reference.first_frame_from_image`)."""
    check_size(height, width)
    cover_w, cover_h = cover_size(*img.size, height, width)
    resized = img.resize((cover_w, cover_h), Image.LANCZOS)
    left, top = round((cover_w - width) / 2), round((cover_h - height) / 2)
    pixels = np.asarray(resized.crop((left, top, left + width, top + height)), dtype=np.float32) / 255.0
    frame = torch.from_numpy(2.0 * pixels - 1.0).permute(2, 0, 1)
    return frame[None, :, None].contiguous()


def load_first_frame(path, height: int, width: int) -> torch.Tensor:
    """PAN2's first frame from an image file: [1, 3, 1, H, W] float32 in [-1, 1] (see `first_frame_from_image`)."""
    check_size(height, width)
    return first_frame_from_image(load_image(path), height, width)
