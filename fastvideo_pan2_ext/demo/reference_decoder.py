"""Demo: decode a latent clip with the reference Wan2.2 VAE decoder and write an mp4 plus a PNG contact sheet.

    python -m fastvideo_pan2_ext.demo.reference_decoder [--out out/demo] [--frames 17] [--height 256]
        [--width 256] [--seed 0] [--dtype float32|bfloat16] [--fps 12]

No checkpoint is needed: the weights are a seeded random Wan2.2-layout decoder (48 latent channels, 16x spatial and
4x temporal upsampling, patch size 2) at a narrow width, and the latents are smooth moving waves. Plain random conv
kernels turn any input into noise, so the kernels are drawn the way trained decoders tend to look: a random channel
mix times a small blur over space (and a present-heavy causal filter over time), plus a little noise; the output conv
shares its weights across the 2x2 sub-pixels. The video is smooth, moves, and holds together from frame to frame; the
first two frames differ most, as the causal decoder has no history yet. About 20 s on 2 CPU cores at the defaults.

Only torch, numpy, Pillow and imageio-ffmpeg are used (no diffusers, no FastVideo).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from fastvideo_pan2_ext import reference
from fastvideo_pan2_ext.vae_kernel.definitions.architecture import WanVAEConfig, expected_shapes, latent_frames
from fastvideo_pan2_ext.media.video_io import to_uint8_frames, write_video_stream

Z_DIM = 48  # Wan2.2 / PAN2 latent channels
DECODER_BASE_DIM = 8  # the real decoder has 256; 8 keeps the demo at seconds on a CPU
SPATIAL = 16  # the Wan2.2 VAE's spatial compression


def demo_config() -> WanVAEConfig:
    return WanVAEConfig(z_dim=Z_DIM, decoder_base_dim=DECODER_BASE_DIM, dim_mult=(1, 2, 4, 4), num_res_blocks=2,
                        temperal_upsample=(True, True, False), out_channels=12, patch_size=2)


def demo_state_dict(seed: int) -> dict[str, torch.Tensor]:
    """Seeded random weights for every tensor `reference.decode` reads, with smooth kernels (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    blur = torch.tensor([0.25, 0.5, 0.25])  # over space
    causal = torch.tensor([0.0, 0.25, 0.75])  # over time (frames t-2, t-1, t): mostly the present, so things move

    def randn(*shape):
        return torch.randn(shape, generator=g)

    def smooth_kernel(shape):
        cout, cin, *kernel = shape
        profile = torch.ones(())
        for axis, size in enumerate(kernel):
            taps = (causal if axis == 0 and len(kernel) == 3 else blur) if size == 3 else torch.ones(1)
            profile = profile[..., None] * taps
        mix = randn(cout, cin) / math.sqrt(cin)
        return 3.0 * mix.view(cout, cin, *[1] * len(kernel)) * profile + 0.2 * randn(*shape) / math.sqrt(
            math.prod(shape[1:]))

    weights = {}
    for name, shape in expected_shapes(demo_config()).items():
        if name.endswith(".gamma"):
            weights[name] = 1.0 + 0.1 * randn(*shape)
        elif name.endswith(".bias"):
            weights[name] = 0.05 * randn(*shape)
        elif name.endswith("time_conv.weight"):  # its two output frames start out alike: no flicker
            half = smooth_kernel((shape[0] // 2, *shape[1:]))
            weights[name] = torch.cat([half, half + 0.05 * randn(*half.shape)])
        elif name == "decoder.conv_out.weight":  # one RGB mix for all 2x2 sub-pixels, zero-mean over features
            rgb = 0.5 * smooth_kernel((3, *shape[1:]))
            rgb = rgb - rgb.mean(dim=1, keepdim=True)
            weights[name] = rgb.repeat_interleave(shape[0] // 3, dim=0) + 0.02 * randn(*shape)
        elif len(shape) >= 4 and shape[-1] == 3:
            weights[name] = smooth_kernel(shape)
        else:
            weights[name] = randn(*shape) / math.sqrt(math.prod(shape[1:]))
    return weights


def moving_wave_latents(latent_frames: int, latent_height: int, latent_width: int, seed: int) -> torch.Tensor:
    """[1, 48, T, h, w]: each channel a low-frequency plane wave drifting at its own speed and direction."""
    g = torch.Generator().manual_seed(seed + 1)
    t = torch.arange(latent_frames, dtype=torch.float32)[:, None, None]
    y = torch.linspace(0, 1, latent_height)[None, :, None]
    x = torch.linspace(0, 1, latent_width)[None, None, :]
    z = torch.empty(1, Z_DIM, latent_frames, latent_height, latent_width)
    for c in range(Z_DIM):
        fx, fy = (1.2 * torch.randn(2, generator=g)).tolist()
        phase = 2 * math.pi * torch.rand((), generator=g).item()
        speed = 2.0 * torch.randn((), generator=g).item()
        z[0, c] = 1.5 * torch.sin(2 * math.pi * (fx * x + fy * y) + phase + speed * t)
    return z


def write_contact_sheet(frames: np.ndarray, path: Path, fps: float, caption: str, columns: int | None = None,
                        gap: int = 4) -> None:
    """Every frame, left to right and top to bottom, on a dark background, each labelled with its index and time,
    under a caption that says what the video is."""
    from PIL import Image, ImageDraw

    label = 12  # pixels of text under each frame (PIL's default bitmap font)
    count, height, width = frames.shape[:3]
    columns = columns or math.ceil(math.sqrt(count))
    rows = math.ceil(count / columns)
    cell_h = height + label + gap
    sheet = Image.new("RGB", (columns * (width + gap) + gap, 2 * label + rows * cell_h + gap), (24, 24, 24))
    draw = ImageDraw.Draw(sheet)
    draw.text((gap, gap // 2), caption, fill=(230, 230, 230))
    for i, frame in enumerate(frames):
        top, left = 2 * label + (i // columns) * cell_h, gap + (i % columns) * (width + gap)
        sheet.paste(Image.fromarray(frame), (left, top))
        draw.text((left, top + height), f"frame {i}  t={i / fps:.2f} s", fill=(200, 200, 200))
    sheet.save(path)


# --- command line ---------------------------------------------------------------------------------------------------


def _frame_count(text: str) -> int:
    value = _positive_int(text)
    try:
        latent_frames(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _pixel_size(text: str) -> int:
    value = _positive_int(text)
    if value % SPATIAL or value > 2048:
        raise argparse.ArgumentTypeError(f"must be a multiple of {SPATIAL} between 16 and 2048; got {value}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number; got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number; got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m fastvideo_pan2_ext.demo.reference_decoder",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out/demo"), help="output folder (default: out/demo)")
    parser.add_argument("--frames", type=_frame_count, default=17, help="video frames, 4k+1 (default: 17)")
    parser.add_argument("--height", type=_pixel_size, default=256, help="pixels, a multiple of 16 (default: 256)")
    parser.add_argument("--width", type=_pixel_size, default=256, help="pixels, a multiple of 16 (default: 256)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and latents (default: 0)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="decode precision (default: float32)")
    parser.add_argument("--fps", type=_positive_float, default=12.0, help="mp4 frame rate (default: 12)")
    args = parser.parse_args(argv)
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out must be a folder; {str(args.out)!r} is a file")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    latent_shape = (latent_frames(args.frames), args.height // SPATIAL, args.width // SPATIAL)

    start = time.perf_counter()
    weights = demo_state_dict(args.seed)
    latents = moving_wave_latents(*latent_shape, seed=args.seed)
    made = time.perf_counter()
    video = reference.decode(latents, weights, getattr(torch, args.dtype))
    decoded = time.perf_counter()
    frames = to_uint8_frames(video)
    mp4, sheet = args.out / "reference_decode.mp4", args.out / "reference_decode_frames.png"
    write_video_stream([video], mp4, args.fps)  # the project's one mp4 writer (atomic)
    write_contact_sheet(frames, sheet, args.fps,
                        f"reference decode of a moving wave, random weights (seed {args.seed})")
    written = time.perf_counter()

    print(f"latents {[1, Z_DIM, *latent_shape]} -> video {list(video.shape)} ({args.dtype}, "
          f"{torch.get_num_threads()} threads)")
    print(f"weights + latents {made - start:.2f} s, reference decode {decoded - made:.2f} s, "
          f"mp4 + png {written - decoded:.2f} s")
    print(f"video:         {mp4}")
    print(f"contact sheet: {sheet}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
