"""The fast decoder for diffusers users, measured: diffusers' `AutoencoderKLWan.decode` (fp32 and bf16, untiled and
under `enable_tiling()`) against the same VAE with `fastvideo_pan2_ext.enable_fast_decode` (untiled and under
`enable_tiling()`), on the same seeded latents.

    python bench/diffusers_bench.py --threads 2 --repeats 3        # writes bench/results/diffusers-cpu-<date>.json

Each method runs in its own child process (so its peak memory is its own): the VAE and latents are made, then the
decode runs `--repeats` times; recorded are the median wall time, the peak RSS added by the first decode (ru_maxrss
after it minus before it), and, against diffusers' untiled fp32 video of the same latents, max|d| and RMS(d); a
tiled method is also compared with its own untiled video (the seam error: diffusers' blended tiles against its
untiled decode; the fast decoder's exact tiles against its own untiled decode, zero by construction). diffusers' tile
arguments are its defaults (256 x 256 sample pixels, stride 192), and the video is larger than one tile in both
directions, so diffusers' tiling does tile. The VAE is the Wan2.1 layout at narrow widths with seeded random weights
(`--base-dim`): CPU numbers of a narrow model, not the real one's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # `python bench/diffusers_bench.py`: import the repository's package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import cpu_name  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent.parent / "bench" / "results"
# name -> (VAE dtype, diffusers' enable_tiling(), the fast decoder)
METHODS = {
    "diffusers fp32": (torch.float32, False, False),
    "diffusers fp32, enable_tiling()": (torch.float32, True, False),
    "diffusers bf16": (torch.bfloat16, False, False),
    "diffusers bf16, enable_tiling()": (torch.bfloat16, True, False),
    "fast decoder": (torch.float32, False, True),
    "fast decoder, enable_tiling()": (torch.float32, True, True),
}
UNTILED = {"diffusers fp32, enable_tiling()": "diffusers fp32", "diffusers bf16, enable_tiling()": "diffusers bf16",
           "fast decoder, enable_tiling()": "fast decoder"}


def make_vae(base_dim: int, seed: int = 0):
    """A Wan2.1-layout AutoencoderKLWan, every parameter seeded noise by the seeded-weight rule
    (`selfcheck.seeded_parameter`)."""
    from diffusers import AutoencoderKLWan

    from fastvideo_pan2_ext.vae_kernel.compiled.selfcheck import seeded_parameter

    vae = AutoencoderKLWan(base_dim=base_dim, z_dim=16)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in vae.named_parameters():
            p.copy_(seeded_parameter(name, p.shape, generator))
    return vae.eval().requires_grad_(False)


def run_method(args) -> None:
    """The child process: one method, `--repeats` decodes; its figures and its video go to `--out`."""
    from fastvideo_pan2_ext import enable_fast_decode
    from fastvideo_pan2_ext.vae_kernel.definitions.precision import exact_fp32

    torch.set_num_threads(args.threads)
    dtype, tiling, fast = METHODS[args.method]
    vae = make_vae(args.base_dim).to(dtype)
    if tiling:
        vae.enable_tiling()  # diffusers' defaults: 256 x 256 sample pixels, stride 192
    if fast:
        enable_fast_decode(vae, frames_per_pass=args.frames_per_pass)
    ratio = vae.config.scale_factor_spatial
    z = torch.randn(1, 16, args.latent_frames, args.height // ratio, args.width // ratio,
                    generator=torch.Generator().manual_seed(1)).to(dtype)
    times = []
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.no_grad(), exact_fp32():
        for i in range(args.repeats):
            start = time.perf_counter()
            video = vae.decode(z).sample
            times.append(time.perf_counter() - start)
            if i == 0:
                peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    torch.save(video.float(), Path(args.out) / "video.pt")
    (Path(args.out) / "figures.json").write_text(json.dumps({
        "median_s": statistics.median(times), "times_s": times, "peak_rss_added_mib": peak_kib / 1024}))



def _difference(video: torch.Tensor, reference: torch.Tensor) -> dict:
    d = (video.double() - reference.double())
    return {"max_abs": float(d.abs().max()), "rms": float(d.pow(2).mean().sqrt())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--height", type=int, default=320)
    parser.add_argument("--width", type=int, default=320)
    parser.add_argument("--latent-frames", type=int, default=3)
    parser.add_argument("--base-dim", type=int, default=8)
    parser.add_argument("--frames-per-pass", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--method", choices=list(METHODS), help=argparse.SUPPRESS)  # the child's
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.frames_per_pass != "auto":
        args.frames_per_pass = int(args.frames_per_pass)
    if args.method:
        run_method(args)
        return 0
    if args.height <= 256 or args.width <= 256:
        parser.error("--height and --width must exceed diffusers' 256-pixel tile, or its tiling does not tile")

    results, videos = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for method in METHODS:
            out = Path(tmp) / str(len(results))
            out.mkdir()
            child = [sys.executable, str(Path(__file__).resolve()), "--method", method, "--out", str(out),
                     *[f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                       if k not in ("method", "out", "output")]]
            subprocess.run(child, check=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
            results[method] = json.loads((out / "figures.json").read_text())
            videos[method] = torch.load(out / "video.pt")
            print(f"{method}: {results[method]['median_s']:.2f} s, +{results[method]['peak_rss_added_mib']:.0f} MiB",
                  flush=True)
    reference = videos["diffusers fp32"]
    for method, figures in results.items():
        figures["vs_untiled_fp32"] = _difference(videos[method], reference)
        if method in UNTILED:
            figures["seam_error_vs_own_untiled"] = _difference(videos[method], videos[UNTILED[method]])
    date = datetime.date.today().isoformat()
    record = {
        "date": date, "machine": f"{cpu_name()}, {os.cpu_count()} cores, no GPU", "threads": args.threads,
        "torch": torch.__version__, "diffusers": __import__("diffusers").__version__,
        "command": "python bench/diffusers_bench.py " + " ".join(sys.argv[1:]),
        "vae": f"AutoencoderKLWan (Wan2.1 layout), base_dim {args.base_dim}, z_dim 16, seeded random weights",
        "video": [1, 3, 4 * args.latent_frames - 3, args.height, args.width],
        "diffusers_tiles": "enable_tiling() defaults: 256 x 256 sample pixels, stride 192",
        "fast_decoder_tiles": "exact tiles of 256 // 8 = 32 latent rows, the whole width",
        "repeats": args.repeats, "methods": results,
    }
    output = args.output or RESULTS_DIR / f"diffusers-cpu-{date}.json"
    output.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
