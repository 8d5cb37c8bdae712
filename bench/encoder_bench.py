"""The fast encoder measured on a CPU at the real widths, against diffusers' encode in the same run.

    python bench/encoder_bench.py --threads 2 --repeats 3     # writes bench/results/encoder-cpu-<date>.json and .png

Three measurements, each on real-width Wan VAEs with seeded random weights (the architecture sets the cost; the
weights' values do not):
1. Time: diffusers' `AutoencoderKLWan.encode` in fp32 against `WanVAEEncoder(precision="fp32")` on the same video
   (Wan2.1 and Wan2.2, a short clip), and on image-to-video's input (an image and zero frames) with the steady reuse
   on and off; each repeat runs the three in turn after a warm-up, and the speedups are medians of the repeats'
   ratios (the times, medians of `--repeats`); each method's moments compared with diffusers' (max|d|).
2. FLOPs: every encode counted on the meta device (`torch.utils.flop_counter`; diffusers' modules and the fast
   encoder's network alike), per layout and resolution, and the FLOPs the steady reuse skips on the image-to-video
   input (the stages it reused, from a real run, times their FLOPs per pass).
3. Peak memory at a real size, replayed on the meta device (`planning.memory.LiveBytes`: the storages created):
   diffusers' untiled and `enable_tiling()` encode against the fast encoder untiled and in exact tiles.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

if __package__ in (None, ""):  # `python bench/encoder_bench.py`: import the repository's package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fastvideo_pan2_ext.vae_kernel.definitions.architecture import (  # noqa: E402
    WAN21_ENCODER_CONFIG, WAN22_ENCODER_CONFIG, diffusers_encoder_arguments, encoded_shape)
from fastvideo_pan2_ext.vae_kernel.encoder import WanVAEEncoder  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.planning.memory import LiveBytes  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.portable import encoder_network  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.portable.ops import TORCH_OPS  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.portable.passes import EncodeRunner  # noqa: E402
from bench.machine import cpu_name  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent.parent / "bench" / "results"
LAYOUTS = {"wan21": WAN21_ENCODER_CONFIG, "wan22": WAN22_ENCODER_CONFIG}
# (layout, frames, height, width): what the budget counts (the real sizes of each pipeline).
BUDGET_SIZES = [("wan21", 81, 480, 832), ("wan21", 81, 720, 1280), ("wan22", 121, 704, 1280),
                ("wan22", 121, 704, 1248), ("wan22", 1, 704, 1248)]


@functools.cache
def make_vae(layout: str, device="cpu", seed: int = 0):
    from diffusers import AutoencoderKLWan

    from fastvideo_pan2_ext.vae_kernel.compiled.selfcheck import seeded_parameter

    vae = AutoencoderKLWan(**diffusers_encoder_arguments(LAYOUTS[layout]))
    if device == "meta":
        return vae.to("meta").eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in vae.named_parameters():
            param.copy_(seeded_parameter(name, param.shape, generator))
    return vae.eval()


def image_to_video(frames: int, height: int, width: int, seed: int = 1) -> torch.Tensor:
    video = torch.zeros((1, 3, frames, height, width))
    video[:, :, :1] = torch.rand((1, 3, 1, height, width), generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return video


def time_encodes(layout: str, video: torch.Tensor, repeats: int) -> dict:
    """diffusers' fp32 encode and the fast encoder's, reuse on and off, in turn in each repeat (the machine's speed
    drifts: a ratio is taken within a repeat); medians of the times and of the ratios."""
    vae = make_vae(layout)
    encoders = {"fast_fp32": WanVAEEncoder(vae, precision="fp32", reuse_steady=True),
                "fast_fp32_no_reuse": WanVAEEncoder(vae, precision="fp32", reuse_steady=False)}
    runs = {"diffusers_fp32": lambda: vae.encode(video).latent_dist.parameters,
            **{key: functools.partial(encoder.encode, video) for key, encoder in encoders.items()}}
    times: dict[str, list[float]] = {key: [] for key in runs}
    with torch.no_grad():
        outs = {key: run() for key, run in runs.items()}  # a warm-up each (fp32 CPU convs block weights at first use)
        for _ in range(repeats):
            for key, run in runs.items():
                start = time.perf_counter()
                run()
                times[key].append(time.perf_counter() - start)
    row = {"layout": layout, "video": list(video.shape), "diffusers_fp32_s": statistics.median(times["diffusers_fp32"])}
    for key, encoder in encoders.items():
        row[key + "_s"] = statistics.median(times[key])
        row[key + "_max_abs_diff"] = float((outs[key] - outs["diffusers_fp32"]).abs().max())
        row[key + "_plan"] = str(encoder.last_plan)
    row["reused_passes"] = {stage: list(p) for stage, p in encoders["fast_fp32"].last_reuse.items()}
    for key, name in (("fast_fp32", "speedup"), ("fast_fp32_no_reuse", "speedup_no_reuse")):
        row[name] = statistics.median(d / f for d, f in zip(times["diffusers_fp32"], times[key]))
    row["times_s"] = times
    return row


def flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def stage_flops(layout: str, video_shape, frames_per_pass: int) -> dict[str, list[int]]:
    """stage -> FLOPs of each pass, the fast encoder's network on the meta device (no reuse)."""
    encoder = WanVAEEncoder(make_vae(layout), precision="fp32")
    meta = torch.device("meta")
    runner = EncodeRunner(TORCH_OPS, {k: v.to(meta) for k, v in encoder.weights.items()}, encoder.config, meta,
                          torch.float32, frames_per_pass, reuse_steady=False, progress=False)
    per_stage: dict[str, list[int]] = {}
    original = encoder_network.EncodePass.stage

    def counted(self, key, x, run):
        with FlopCounterMode(display=False) as counter:
            out = original(self, key, x, run)
        per_stage.setdefault(key, []).append(counter.get_total_flops())
        return out

    encoder_network.EncodePass.stage = counted
    try:
        runner.encode(torch.empty(video_shape, device=meta), encoded_shape(encoder.config, video_shape), None)
    finally:
        encoder_network.EncodePass.stage = original
    return per_stage


def budget() -> list[dict]:
    rows = []
    for layout, frames, height, width in BUDGET_SIZES:
        shape = (1, 3, frames, height, width)
        vae = make_vae(layout, "meta")
        with torch.no_grad():
            theirs = flops(lambda: vae.encode(torch.empty(shape, device="meta")))
        ours = sum(sum(p) for p in stage_flops(layout, shape, 1).values())
        rows.append({"layout": layout, "video": list(shape), "diffusers_tflop": theirs / 1e12,
                     "fast_encoder_tflop": ours / 1e12})
    return rows


def reuse_savings(layout: str, video_shape, reused: dict) -> dict:
    per_stage = stage_flops(layout, video_shape, 1)
    total = sum(sum(p) for p in per_stage.values())
    skipped = sum(per_stage[stage][i] for stage, passes in reused.items() for i in passes)
    return {"layout": layout, "video": list(video_shape), "tflop": total / 1e12, "skipped_tflop": skipped / 1e12,
            "fraction_run": 1 - skipped / total}


def peak_memory(layout: str, shape, tile_rows: int) -> dict:
    """Storages created by each encode, replayed on the meta device."""
    vae = make_vae(layout, "meta")
    video = torch.empty(shape, device="meta")
    row = {"layout": layout, "video": list(shape)}
    for tiling in (False, True):
        if tiling:
            vae.enable_tiling()
        with torch.no_grad(), LiveBytes() as tracker:
            vae._encode(video)
        row["diffusers_tiled_bytes" if tiling else "diffusers_bytes"] = tracker.peak
    for rows in (None, tile_rows):
        encoder = WanVAEEncoder(make_vae(layout), precision="fp32", frames_per_pass=1, tile_rows=rows,
                                reuse_steady=False)
        latent = encoded_shape(encoder.config, shape)
        row["fast_tiled_bytes" if rows else "fast_bytes"] = encoder._planner(shape).peak_bytes(latent, 1, rows)
    row["tile_rows"] = tile_rows
    return row


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["time"]
    labels = [f"{r['layout']} {'x'.join(map(str, r['video'][2:]))}" + (" i2v" if r.get("i2v") else "") for r in rows]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    x = range(len(rows))
    for offset, key, name in ((-0.27, "diffusers_fp32_s", "diffusers fp32"),
                              (0.0, "fast_fp32_no_reuse_s", "fast encoder fp32, no reuse"),
                              (0.27, "fast_fp32_s", "fast encoder fp32")):
        ax.bar([i + offset for i in x], [r[key] for r in rows], width=0.27, label=name)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("seconds (median)")
    ax.set_title(f"Wan VAE encode, real widths, {result['machine']['cpu']}, {result['machine']['threads']} threads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {"machine": {"cpu": cpu_name(), "threads": args.threads, "torch": torch.__version__},
              "date": datetime.date.today().isoformat(), "repeats": args.repeats, "time": []}
    result["time"].append(time_encodes("wan21", torch.rand((1, 3, 9, 160, 256),
                                                            generator=torch.Generator().manual_seed(2)) * 2 - 1,
                                       args.repeats))
    result["time"].append(time_encodes("wan22", torch.rand((1, 3, 9, 256, 256),
                                                            generator=torch.Generator().manual_seed(2)) * 2 - 1,
                                       args.repeats))
    i2v = image_to_video(81, 80, 128)
    row = time_encodes("wan21", i2v, args.repeats)
    row["i2v"] = True
    result["time"].append(row)
    result["reuse_flops"] = [reuse_savings("wan21", tuple(i2v.shape), row["reused_passes"]),
                             reuse_savings("wan21", (1, 3, 81, 480, 832),
                                           _reused_at_length("wan21", 81))]
    result["budget"] = budget()
    result["memory"] = [peak_memory("wan21", (1, 3, 17, 720, 1280), 16),
                        peak_memory("wan22", (1, 3, 17, 704, 1280), 11)]
    out = args.out or RESULTS_DIR / f"encoder-cpu-{result['date']}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(json.dumps(result, indent=1))
    return 0


def _reused_at_length(layout: str, frames: int) -> dict:
    """The passes the steady reuse skips on an image-to-video input of `frames` frames: it depends on the frame count
    only (the causal histories), so a tiny frame of the real widths shows it."""
    encoder = WanVAEEncoder(make_vae(layout), precision="fp32", frames_per_pass=1)
    encoder.encode(image_to_video(frames, 16, 16))
    return encoder.last_reuse


if __name__ == "__main__":
    sys.exit(main())
