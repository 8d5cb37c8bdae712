"""Peak working memory of the real Wan2.2 decoder by frames_per_pass, from the planner's replay on the meta device
(no GPU needed; docs/design/decoder.md, "Memory planner").

    python bench/memory_plan.py [--frames 49] [--height 704] [--width 1248] [--fpp 1 2 4 8] [--tile-rows 11 4 2]

The replay counts what the decoder allocates beyond its weights, latents and the returned video, with the portable
ops' scratch at bf16 (what a GPU decode computes in); it writes bench/results/memory-plan-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, installed or not

from fastvideo_pan2_ext.vae_kernel.definitions.architecture import WAN22_CONFIG, expected_shapes, video_shape  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.planning.memory import MemoryPlanner  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.portable.weights import prepare  # noqa: E402

GIB = 2**30


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=49, help="latent frames T (video: 4T - 3)")
    parser.add_argument("--height", type=int, default=704)
    parser.add_argument("--width", type=int, default=1248)
    parser.add_argument("--fpp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--tile-rows", type=int, nargs="+", default=[11, 4, 2],
                        help="exact tiles of this many latent rows, at 4 frames per pass (decode and decode_iter)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "bench" / "results")
    args = parser.parse_args(argv)
    meta = torch.device("meta")
    weights = {name: prepare(name, torch.empty(shape, device=meta)) for name, shape in
               expected_shapes(WAN22_CONFIG).items()}
    s = WAN22_CONFIG.spatial_scale
    shape = (1, WAN22_CONFIG.z_dim, args.frames, args.height // s, args.width // s)
    video_bytes = 2 * torch.Size(video_shape(WAN22_CONFIG, shape)).numel()
    weight_bytes = sum(w.numel() * w.element_size() for w in weights.values())
    planner = MemoryPlanner(weights, WAN22_CONFIG, torch.device("cuda"))  # bf16 scratch, as on a GPU
    rows = []
    for fpp in args.fpp:
        peak = planner.peak_bytes(shape, fpp)
        rows.append({"frames_per_pass": fpp, "working_peak_gib": round(peak / GIB, 2),
                     "with_weights_and_video_gib": round((peak + video_bytes + weight_bytes) / GIB, 2)})
        print(f"frames_per_pass {fpp}: working peak {peak / GIB:.2f} GiB; with the bf16 video "
              f"({video_bytes / GIB:.2f} GiB) and weights ({weight_bytes / GIB:.2f} GiB): "
              f"{(peak + video_bytes + weight_bytes) / GIB:.2f} GiB")
    tiles = []
    for tile_rows in args.tile_rows:
        decode, stream = (planner.peak_bytes(shape, 4, tile_rows, stream) / GIB for stream in (False, True))
        tiles.append({"frames_per_pass": 4, "tile_rows": tile_rows, "decode_working_peak_gib": round(decode, 2),
                      "decode_iter_working_peak_gib": round(stream, 2)})
        print(f"tile_rows {tile_rows}: working peak {decode:.2f} GiB (decode_iter: {stream:.2f} GiB)")
    date = datetime.date.today().isoformat()
    result = {"command": "python bench/memory_plan.py " + " ".join(argv or sys.argv[1:]), "date": date,
              "latents": list(shape), "video_frames": video_shape(WAN22_CONFIG, shape)[2], "rows": rows,
              "tiles": tiles,
              "note": "replay of the portable path's buffers and scratch at bf16 on the meta device; an estimate "
                      "until the GPU check measures it"}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"memory-plan-{date}.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
