"""The PAN2 demo: one image -> one video through the PAN2 pipeline in a stock FastVideo 0.2.1.

By default it runs on any machine (no GPU, no network): the tiny random-weight PAN2 checkpoint is made on first use
in a cache folder, and the first frame is the sample image shipped in `fastvideo_pan2_ext/assets/` (stored landscape,
with an EXIF tag saying "rotate 90 degrees": PAN2 reads the stored pixels, as Wan2.2 does). Its video is noise-like by
design: the weights are random. Point ``--checkpoint`` at a real PAN2 checkpoint for a real video.

It prints where the video and a contact sheet of its frames are, and how long each stage took.

    python -m fastvideo_pan2_ext.demo [--checkpoint DIR] [--image IMG] [--out out/] [--decoder kernel|fastvideo] ...

(`python -m fastvideo_pan2_ext.demo.reference_decoder` is the other demo: the reference VAE decoder alone, no
FastVideo.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "assets"
SAMPLE_IMAGE = ASSETS / "sample_exif_rotated.jpg"


def default_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "fastvideo_pan2_ext"


def ensure_tiny_checkpoint(cache_dir: Path, seed: int = 0) -> tuple[Path, bool]:
    """The tiny checkpoint in `cache_dir` (made once; a finished folder appears atomically). -> (path, made_now)."""
    from fastvideo_pan2_ext import __version__
    from fastvideo_pan2_ext.demo.tiny_checkpoints import make_tiny_checkpoint

    target = cache_dir / f"pan2-tiny-{__version__}-seed{seed}"
    if (target / "modular_model_index.json").exists():
        return target, False
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = cache_dir / f".{target.name}.partial-{os.getpid()}"
    make_tiny_checkpoint(partial, seed=seed)
    try:
        partial.rename(target)
    except OSError:  # another process published it first
        import shutil

        shutil.rmtree(partial, ignore_errors=True)
    return target, True


def contact_sheet(video: Path, out: Path, caption: str) -> tuple[int, tuple[int, int], float]:
    """Every frame of `video` in a grid, labelled, as one PNG. -> the video's (frame count, (width, height), fps)."""
    import imageio_ffmpeg
    import numpy as np

    from fastvideo_pan2_ext.demo.reference_decoder import write_contact_sheet

    reader = imageio_ffmpeg.read_frames(str(video))
    meta = next(reader)
    width, height = meta["size"]
    frames = np.stack([np.frombuffer(f, dtype=np.uint8).reshape(height, width, 3) for f in reader])
    write_contact_sheet(frames, out, meta["fps"], caption)
    return len(frames), (width, height), meta["fps"]


def _frames_per_pass(text: str) -> int | str:
    from fastvideo_pan2_ext.vae_kernel.options import argparse_type  # imports torch: not for --help

    return argparse_type("frames_per_pass")(text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fastvideo_pan2_ext.demo",
        description="Run the PAN2 image-to-video pipeline in FastVideo on one image and write an mp4 (default: a "
        "tiny random-weight checkpoint and a shipped sample image, CPU-friendly; the video is noise-like).")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="PAN2 checkpoint folder (default: the tiny one, made on first use in --cache-dir)")
    parser.add_argument("--image", type=Path, default=SAMPLE_IMAGE, help="first frame (default: the sample image)")
    parser.add_argument("--prompt", default="a calm lake below green hills, the sun shining, gentle ripples")
    parser.add_argument("--out", type=Path, default=Path("out"), help="output folder (default: out/)")
    parser.add_argument("--height", type=int, default=256, help="multiple of 32 (default 256; PAN2's own: 704)")
    parser.add_argument("--width", type=int, default=384, help="multiple of 32 (default 384; PAN2's own: 1248)")
    parser.add_argument("--frames", type=int, default=17, help="video frames, 4T-3 (default 17; PAN2's own: 121)")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps (default 4; PAN2's own: 50)")
    parser.add_argument("--guidance-scale", type=float, default=1.0, help="CFG scale (default 1.0 = no CFG)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decoder", choices=("kernel", "fastvideo"), default="kernel",
                        help="VAE decode: fastvideo_pan2_ext's WanVAEDecoder (vae_decode_kernel=True, default) or "
                        "FastVideo's own")
    parser.add_argument("--frames-per-pass", type=_frames_per_pass, default="auto",
                        help="latent frames per decoder pass, or auto (default: the largest that fits memory)")
    parser.add_argument("--num-gpus", type=int, default=1)
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help=f"where the tiny checkpoint is kept (default: {default_cache_dir()})")
    return parser


def _check_args(parser: argparse.ArgumentParser, args) -> None:
    from fastvideo_pan2_ext.media.image import ImageInputError, check_size, load_image

    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out must be a folder; {str(args.out)!r} is a file")
    from fastvideo_pan2_ext.vae_kernel.definitions.architecture import latent_frames

    try:
        latent_frames(args.frames)
    except ValueError as exc:
        parser.error(f"--frames: {exc}")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1; got {args.steps}")
    try:
        check_size(args.height, args.width)
        load_image(args.image)
    except ImageInputError as exc:
        parser.error(str(exc))
    if args.checkpoint is not None:
        from fastvideo_pan2_ext.fastvideo_integration.checkpoint import NotPAN2CheckpointError, check_pan2_checkpoint

        try:
            check_pan2_checkpoint(args.checkpoint)
        except NotPAN2CheckpointError as exc:
            parser.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    # FastVideo times each stage only with stage logging on; its workers read this when they start.
    os.environ.setdefault("FASTVIDEO_STAGE_LOGGING", "1")
    timings: list[tuple[str, float]] = []
    start = time.perf_counter()

    checkpoint = args.checkpoint
    if checkpoint is None:
        t = time.perf_counter()
        checkpoint, made = ensure_tiny_checkpoint(args.cache_dir or default_cache_dir())
        timings.append(("tiny checkpoint: " + ("made" if made else "from cache"), time.perf_counter() - t))

    t = time.perf_counter()
    from fastvideo_pan2_ext.fastvideo_integration import compat

    VideoGenerator = compat.symbol("VideoGenerator")

    from fastvideo_pan2_ext.configs import PAN2PipelineConfig

    timings.append(("import FastVideo (+ PAN2 plugin)", time.perf_counter() - t))
    t = time.perf_counter()
    config = PAN2PipelineConfig(vae_decode_kernel=args.decoder == "kernel", vae_decode_frames_per_pass=args.frames_per_pass)
    generator = VideoGenerator.from_config({"model_path": str(checkpoint), "engine": {"num_gpus": args.num_gpus},
                                            "pipeline": {"experimental": {"pipeline_config": config}}})
    timings.append(("start workers, load models", time.perf_counter() - t))

    args.out.mkdir(parents=True, exist_ok=True)
    video = (args.out / "pan2_demo.mp4").resolve()
    if video.exists():
        video.unlink()
    t = time.perf_counter()
    try:
        result = generator.generate({
            "prompt": args.prompt,
            "inputs": {"image_path": str(args.image)},
            "sampling": {"height": args.height, "width": args.width, "num_frames": args.frames, "seed": args.seed,
                         "num_inference_steps": args.steps, "guidance_scale": args.guidance_scale},
            "output": {"output_path": str(video), "save_video": True, "return_frames": False},
        })
    finally:
        generator.shutdown()
    generate_time = time.perf_counter() - t
    stages = result.logging_info.stages if result.logging_info is not None else {}
    for name, info in stages.items():
        if "execution_time" in info:
            timings.append((f"  {name}", info["execution_time"]))
    timings.append(("generate (all stages + save)", generate_time))

    t = time.perf_counter()
    sheet = video.with_name("pan2_demo_frames.png")
    weights = "tiny checkpoint, random weights: a noise-like video" if args.checkpoint is None else str(checkpoint)
    count, (width, height), fps = contact_sheet(video, sheet, f"PAN2 on {args.image.name} ({weights})")
    timings.append(("contact sheet", time.perf_counter() - t))
    timings.append(("total", time.perf_counter() - start))

    print()
    print(f"video:         {video}  ({count} frames, {width}x{height}, {fps:g} fps)")
    print(f"contact sheet: {sheet}")
    note = " (tiny, random weights: a noise-like video)" if args.checkpoint is None else ""
    print(f"checkpoint:    {checkpoint}{note}")
    print(f"first frame:   {args.image} (stored pixels; EXIF orientation is not applied)")
    decoder = "WanVAEDecoder (fastvideo_pan2_ext), the mp4 written while decoding" if config.vae_decode_kernel else (
        "FastVideo")
    print(f"decoder:       {decoder}")
    print("time per stage:")
    for name, seconds in timings:
        print(f"  {name:40s} {seconds:8.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
