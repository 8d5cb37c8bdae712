"""Peak memory of the whole PAN2 pipeline when it saves a long video: FastVideo's save (the worker hands the decoded
video to the parent, which quantises and saves it) versus PAN2's streamed save (the worker's decoding stage writes
the mp4 while it decodes), both with `vae_decode_kernel=True`, on the tiny checkpoint, CPU.

    python bench/pipeline_save_memory.py --frames 481 --height 256 --width 384 --out bench/results/x.jsonl

Each mode runs in its own process: the parent's peak RSS is its ru_maxrss, the worker's is RUSAGE_CHILDREN's after
FastVideo's shutdown has joined it. The baseline turns the streamed save off by making `stream_save.streams` answer
False in the parent, so FastVideo's own save runs on the same decoder. Prints (and appends) one JSON line per mode.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def run_mode(mode: str, frames: int, height: int, width: int) -> dict:
    from fastvideo import VideoGenerator

    from fastvideo_pan2_ext import PAN2PipelineConfig, stream_save
    from fastvideo_pan2_ext.demo import SAMPLE_IMAGE, default_cache_dir, ensure_tiny_checkpoint
    from fastvideo_pan2_ext.media.video_io import mp4_size

    if mode == "fastvideo-save":
        stream_save.streams = lambda *args: False
    checkpoint, _ = ensure_tiny_checkpoint(default_cache_dir())
    generator = VideoGenerator.from_pretrained(str(checkpoint), num_gpus=1,
                                               pipeline_config=PAN2PipelineConfig(vae_decode_kernel=True))
    parent_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "out.mp4"
        start = time.perf_counter()
        try:
            generator.generate_video(prompt="a calm lake", image_path=str(SAMPLE_IMAGE), height=height, width=width,
                                     num_frames=frames, num_inference_steps=1, guidance_scale=1.0, seed=0,
                                     output_path=str(path), save_video=True, return_frames=False)
            seconds = time.perf_counter() - start
            size = mp4_size(path)
            mp4_bytes = path.stat().st_size
        finally:
            generator.shutdown()
    parent_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    worker_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return {"mode": mode, "video": {"frames": size[2], "height": size[0], "width": size[1]},
            "generate_s": round(seconds, 1), "parent_peak_gib": round(parent_peak / 2**30, 3),
            "parent_peak_before_generate_gib": round(parent_before / 2**30, 3),
            "worker_peak_gib": round(worker_peak / 2**30, 3), "mp4_bytes": mp4_bytes}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=481, help="video frames, 4T-3 (default 481: 20 s at 24 fps)")
    parser.add_argument("--height", type=int, default=256)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--out", type=Path, default=None, help="append the JSON lines to this file")
    parser.add_argument("--mode", choices=("streamed", "fastvideo-save"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.frames < 1 or (args.frames - 1) % 4:
        parser.error(f"--frames must be 4T-3 (1, 5, 9, ...); got {args.frames}")
    if args.mode is not None:  # the child
        print(json.dumps(run_mode(args.mode, args.frames, args.height, args.width)))
        return 0
    for mode in ("fastvideo-save", "streamed"):
        proc = subprocess.run([sys.executable, __file__, "--mode", mode, "--frames", str(args.frames), "--height",
                               str(args.height), "--width", str(args.width)], env={**os.environ, **OFFLINE},
                              capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-3000:] + proc.stderr[-6000:], file=sys.stderr)
            return proc.returncode
        record = json.loads(next(line for line in reversed(proc.stdout.splitlines()) if line.startswith("{")))
        record.update(date=time.strftime("%Y-%m-%d"), machine=f"{platform.machine()} {os.cpu_count()} cores, no GPU",
                      command=" ".join(["python", "bench/pipeline_save_memory.py", *(argv or sys.argv[1:])]))
        line = json.dumps(record)
        print(line)
        if args.out is not None:
            with args.out.open("a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
