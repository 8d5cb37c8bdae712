"""The FLOP and byte budget of one real Wan2.2 decode, and the H200 time it implies (docs/design/decoder.md, "The FLOP
and byte budget"). Counted, not estimated by hand: the decoder's own network runs on the meta device with an op table
that records every hot call's FLOPs and bytes, and a dispatch mode counts the bytes every other tensor op (the glue:
history windows, copies, padding) reads and writes.

    python bench/budget.py [--frames 49] [--height 704] [--width 1248] [--fpp 4 1]

Per op: FLOPs are 2 x MACs; bytes are each input read once and each output written once (weights included), the least
any kernel moves. Winograd F(2x2, 3x3) FLOPs are its 16 component GEMMs per 2x2 output tile (transforms not counted:
they are bytes). The implied times use measured H200 rates (docs/benchmarks.md, "The speed goal, by arithmetic"): a
lower bound for a decoder that runs its GEMMs at 790 TFLOP/s and moves every byte at 4.3 TB/s, one after the other.
Writes bench/results/budget-<date>.json.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import math
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, installed or not

from fastvideo_pan2_ext.vae_kernel.definitions.architecture import WAN22_CONFIG, expected_shapes  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.distributed.bands import LocalRows  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.portable.network import CausalState, DecodePass  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.portable.ops import Ops  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.portable.weights import prepare  # noqa: E402

GEMM_FLOPS = 790e12  # bf16 8192^3 matmul on an H200 (docs/design/decoder.md, "The FLOP and byte budget")
COPY_BYTES = 4.3e12  # device-to-device copy, bytes read + written, same machine


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class Budget:
    """FLOPs and bytes by kind of work, for the passes run under it."""

    def __init__(self) -> None:
        self.flops = collections.Counter()
        self.bytes = collections.Counter()
        self.winograd_flops = 0  # the 3x3 convs' FLOPs had they run by Winograd F(2x2, 3x3)

    def ops(self) -> Ops:
        def conv3d(x, w, b, out, residual=None):
            co, kt, kh, kw, ci = w.shape
            n, frames, rows, cols, _ = out.shape
            kind = f"conv {kt}x{kh}x{kw}"
            self.flops[kind] += 2 * out.numel() * ci * kt * kh * kw
            self.bytes[kind] += nbytes(x, w, b, out, residual, residual)  # residual read, out written
            if kh == 3:
                self.winograd_flops += 2 * n * frames * math.ceil(rows / 2) * math.ceil(cols / 2) * 16 * co * ci * kt
            else:
                self.winograd_flops += 2 * out.numel() * ci * kt * kh * kw

        def rms_norm_silu(x, gamma, out, silu=True):
            self.bytes["rms norm (+ silu)"] += nbytes(x, gamma, out)

        def upsample2x_conv3x3(x, w_sub, b, out):
            ci = x.shape[-1]
            self.flops["upsample: 4 sub-pixel 2x2 convs"] += 2 * out.numel() * ci * 4
            self.winograd_flops += 2 * out.numel() * ci * 4  # stays direct
            self.bytes["upsample: 4 sub-pixel 2x2 convs"] += nbytes(x, w_sub, b, out)

        def attention(q, kv, out):
            self.flops["mid-block attention"] += 4 * q.shape[0] * q.shape[1] * kv.shape[1] * q.shape[2]
            self.bytes["mid-block attention"] += nbytes(q, kv, out)

        def dup_up_add(x, out, factor_t, skip):
            self.bytes["DupUp shortcut add"] += nbytes(x, out, out)

        def unpatchify_clamp(x, out, patch_size):
            self.bytes["unpatchify + clamp"] += nbytes(x, out)

        return Ops("budget", conv3d, rms_norm_silu, upsample2x_conv3x3, attention, dup_up_add, unpatchify_clamp)


class GlueBytes(TorchDispatchMode):
    """Bytes read and written by every tensor op outside the op table (views move nothing and are skipped)."""

    def __init__(self, budget: Budget) -> None:
        super().__init__()
        self.budget = budget

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if not func.is_view and func.overloadpacket not in (torch.ops.aten.empty, torch.ops.aten.empty_strided):
            moved = nbytes(*args, *(kwargs or {}).values()) + nbytes(*(result if isinstance(result, (tuple, list))
                                                                         else (result,)))
            self.budget.bytes["glue: " + func.overloadpacket.__name__] += moved
        return result


def decode_budget(frames: int, height: int, width: int, fpp: int, config=WAN22_CONFIG) -> dict:
    """FLOPs and bytes by kind of work for one decode of latents [1, z_dim, frames, height / s, width / s]."""
    meta = torch.device("meta")
    weights = {name: prepare(name, torch.empty(shape, device=meta)) for name, shape in expected_shapes(config).items()}
    h, w = height // config.spatial_scale, width // config.spatial_scale
    budget, state = Budget(), CausalState(meta)
    ops = budget.ops()
    passes = [1] + [min(fpp, frames - 1 - start) for start in range(0, frames - 1, fpp)]
    with GlueBytes(budget), FlopCounterMode(display=False) as glue_flops:
        for index, count in enumerate(passes):
            z = torch.empty((config.z_dim, count, h, w), device=meta)
            DecodePass(ops, weights, config, LocalRows(h), state, index == 0).run(z)
    budget.flops["glue: post_quant_conv (fp32 matmul)"] = glue_flops.get_total_flops()
    return {"flops": dict(budget.flops), "bytes": dict(budget.bytes),
            "winograd_flops": budget.winograd_flops + glue_flops.get_total_flops()}


def summarize(counts: dict) -> dict:
    flops, moved = counts["flops"], counts["bytes"]
    total_flops = sum(flops.values())
    direct_3x3x3 = sum(v for k, v in flops.items() if k.endswith("x3x3"))
    upsample_direct = flops.get("upsample: 4 sub-pixel 2x2 convs", 0) * 9 / 4
    hot = {k: v for k, v in moved.items() if not k.startswith("glue: ")}
    glue = {k: v for k, v in moved.items() if k.startswith("glue: ")}
    return {
        "pflop": {"decoder as run (sub-pixel upsample)": total_flops / 1e15,
                  "had the upsample convolved the 2x frame": (total_flops - flops.get(
                      "upsample: 4 sub-pixel 2x2 convs", 0) + upsample_direct) / 1e15,
                  "with Winograd F(2x2, 3x3) on every 3x3 conv": counts["winograd_flops"] / 1e15,
                  "3x3 convs' share of the decoder as run": direct_3x3x3 / total_flops},
        "gb": {"op table (each tensor once)": sum(hot.values()) / 1e9, "glue (copies, windows, padding)":
               sum(glue.values()) / 1e9},
        "h200_lower_bound_s": {
            "direct": total_flops / GEMM_FLOPS + sum(moved.values()) / COPY_BYTES,
            "winograd": counts["winograd_flops"] / GEMM_FLOPS + sum(moved.values()) / COPY_BYTES,
            "winograd, no glue bytes": counts["winograd_flops"] / GEMM_FLOPS + sum(hot.values()) / COPY_BYTES,
        },
    }


def per_later_frame(clip: dict, first: dict, frames: int) -> dict:
    """What each latent frame after the first adds, on average: (the clip's counts - the first frame's) / (T - 1)."""
    def split(counts):
        hot = sum(v for k, v in counts["bytes"].items() if not k.startswith("glue: "))
        return (sum(counts["flops"].values()), counts["winograd_flops"], hot, sum(counts["bytes"].values()) - hot)

    names = ("tflop", "tflop_winograd", "gb_op_table", "gb_glue")
    scale = (1e12, 1e12, 1e9, 1e9)
    return {name: (a - b) / (frames - 1) / unit for name, a, b, unit in zip(names, split(clip), split(first), scale)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=49, help="latent frames T (video: 4T - 3)")
    parser.add_argument("--height", type=int, default=704)
    parser.add_argument("--width", type=int, default=1248)
    parser.add_argument("--fpp", type=int, nargs="+", default=[4, 1],
                        help="latent frames per pass, one budget each (default: 4, and 1: what frames_per_pass='auto' "
                             "picks for this video)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "bench" / "results")
    args = parser.parse_args(argv)
    if any(fpp < 1 for fpp in args.fpp):
        parser.error(f"--fpp values must be >= 1; got {args.fpp}")
    if args.frames < 2:
        parser.error(f"--frames must be >= 2 (a budget per later latent frame needs one); got {args.frames}")
    first = decode_budget(1, args.height, args.width, 1)
    by_fpp = {}
    for fpp in args.fpp:
        counts = decode_budget(args.frames, args.height, args.width, fpp)
        by_fpp[fpp] = {"summary": summarize(counts), "per_later_latent_frame": per_later_frame(counts, first,
                                                                                               args.frames),
                       "tflop_by_kind": {k: v / 1e12 for k, v in sorted(counts["flops"].items())},
                       "gb_by_kind": {k: v / 1e9 for k, v in sorted(counts["bytes"].items(), key=lambda kv: -kv[1])}}
    date = datetime.date.today().isoformat()
    result = {"command": "python bench/budget.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": date, "config": "Wan2.2 (real widths)", "latent_frames": args.frames,
              "video": [4 * args.frames - 3, args.height, args.width],
              "rates": {"gemm_tflops": GEMM_FLOPS / 1e12, "copy_tb_s": COPY_BYTES / 1e12},
              "by_frames_per_pass": by_fpp}
    print(json.dumps(result, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"budget-{date}.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
