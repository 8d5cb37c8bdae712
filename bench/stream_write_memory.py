"""Peak CPU memory of saving a decoded clip to mp4: whole (decode, then save every frame, as FastVideo's save step
does) versus streamed (`decode_iter` -> `write_video_stream`, frames written as they come).

    python bench/stream_write_memory.py --frames 17 --latent-hw 22 39        # runs both modes, each in a child

Each mode runs in its own process (peak RSS = the child's ru_maxrss); weights are seeded random, narrow widths
(decoder_base_dim 8), so the video and its conversions, not the decoder, dominate. Prints one JSON line per mode.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _rss_now() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def run_mode(mode: str, frames: int, hw: tuple[int, int], threads: int) -> dict:
    import imageio
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from _vae_helpers import random_wan22_decoder_weights

    from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder
    from fastvideo_pan2_ext.media.video_io import to_uint8_frames, write_video_stream

    torch.set_num_threads(threads)
    decoder = WanVAEDecoder(random_wan22_decoder_weights(), device="cpu", backend="torch", frames_per_pass=4)
    z = torch.randn((1, 8, frames, *hw), generator=torch.Generator().manual_seed(0))
    before = _rss_now()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "out.mp4"
        if mode == "whole":
            video = decoder.decode(z)
            imageio.mimsave(path, list(to_uint8_frames(video)), fps=24, format="mp4")
        else:
            write_video_stream(decoder.decode_iter(z), path, fps=24)
        size = path.stat().st_size
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"mode": mode, "latent": [1, 8, frames, *hw], "video_frames": 4 * frames - 3,
            "video_hw": [16 * hw[0], 16 * hw[1]], "seconds": round(time.perf_counter() - start, 1),
            "rss_before_gib": round(before / 2**30, 3), "peak_rss_gib": round(peak / 2**30, 3),
            "peak_increase_gib": round((peak - before) / 2**30, 3), "mp4_bytes": size}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frames", type=int, default=17, help="latent frames T (video: 4T - 3)")
    p.add_argument("--latent-hw", type=int, nargs=2, default=(22, 39))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--mode", choices=["whole", "stream"], help="run one mode in this process (used by the parent)")
    args = p.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args.mode, args.frames, tuple(args.latent_hw), args.threads)))
        return
    for mode in ("whole", "stream"):
        cmd = [sys.executable, __file__, "--mode", mode, "--frames", str(args.frames), "--latent-hw",
               *map(str, args.latent_hw), "--threads", str(args.threads)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
        print(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
