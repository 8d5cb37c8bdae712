"""How far Winograd F(2x2, 3x3) and F(4x4, 3x3) move the Wan2.2 decoder from the fp32 reference, per layer and per
whole decode, judged by the decoder's allowance (max|d| and RMS(d) within 3x the bf16 baseline's).

    python -m bench.winograd_error --threads 2      # writes bench/results/winograd-error-2026-11-30.json (+ .md)

Per layer: every distinct (kt, 3, 3) conv shape of the real Wan2.2 decoder (conv_in 48->1024, the 1024/512/256
resnet convs, conv_out 256->12), on a few frames of a small frame, with inputs drawn like the decoder's activations
(RMS-normed, gamma-scaled, SiLU'd noise, magnitude ~1; conv_in reads unit-variance latents), spatially white or
smooth (bilinearly upsampled noise, like image features). Weights randn / sqrt(fan_in), bias 0.1 randn, no residual
(a residual only adds output rounding to the baseline and loosens the bound). Two references:
- "bf16 operands": fp32 conv of exactly the bf16 inputs and bf16 weights every candidate uses: isolates the
  algorithm's own rounding (the self-check's convention, and the strict one);
- "fp32 weights": fp32 conv with the unrounded weights, as the whole-decode reference has them.
The baseline is the direct conv in bf16 (the portable op: fp32 accumulation of bf16 operands, one rounding).

Whole decode: `WanVAEDecoder` (backend torch) with the portable op table (direct) and with Winograd tables, against
`reference.decode` in fp32, baseline the release bf16 decode (`reference.decode(z, sd, torch.bfloat16)`, bit-exact
with diffusers). Weights from `selfcheck.random_weights(config, seed)`, and stressed: the (kt, 3, 3) convs' weights
(the layers Winograd computes; conv_out excepted, so the video is not pushed into the clamp) multiplied by a scale.
PSNR: 10 log10(peak-to-peak^2 / MSE), peak-to-peak 2 for the [-1, 1] video, the reference's range for a layer.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # `python bench/winograd_error.py`: make the repository's package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import cpu_name  # noqa: E402
from fastvideo_pan2_ext import reference  # noqa: E402
from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.definitions.allowance import (  # noqa: E402
    ALLOWANCE, VIDEO_PEAK_TO_PEAK, compare_to_reference, psnr_db)
from fastvideo_pan2_ext.vae_kernel.definitions.architecture import WAN22_CONFIG, expected_shapes  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.portable.ops import TORCH_OPS  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.compiled.selfcheck import random_weights, reference_conv3d  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.portable.winograd import TILES, conv3d_winograd, winograd_ops, winograd_weights  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "bench" / "results" / "winograd-error-2026-11-30.json"


def error_figures(candidate: torch.Tensor, ref: torch.Tensor, baseline: torch.Tensor, peak_to_peak: float | None,
                  unit_range: bool = False) -> dict:
    """max|d|, RMS(d), PSNR of candidate - ref, and the allowance verdict against `baseline`."""
    report = compare_to_reference("", candidate, ref, baseline, unit_range=unit_range)
    if peak_to_peak is None:
        peak_to_peak = float(ref.max() - ref.min())
    return {"max_d": report.max_err, "rms_d": report.rms_err, "psnr_db": psnr_db(report.rms_err, peak_to_peak),
            "max_ratio": report.max_err / report.baseline_max_err,
            "rms_ratio": report.rms_err / report.baseline_rms_err, "ok": report.ok}


# ---------------------------------------------------------------------------------------------------- per layer


def conv_layers(config) -> dict[tuple[int, int, int], list[str]]:
    """(Co, Ci, kt) -> the names of the decoder's (kt, 3, 3) convs of that shape, in execution order."""
    layers: dict[tuple[int, int, int], list[str]] = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith(".weight") and len(shape) == 5 and shape[3:] == (3, 3):
            layers.setdefault((shape[0], shape[1], shape[2]), []).append(name[:-len(".weight")])
    return layers


def activations(shape: tuple[int, ...], kind: str, normed: bool, generator: torch.Generator) -> torch.Tensor:
    """bf16 [N, T, H, W, C] inputs like the decoder's: `normed` ones as silu(rms_norm(noise) * gamma) (every conv
    but conv_in), else unit-variance noise (conv_in's latents); `kind` "white" or "smooth" (noise drawn at a quarter
    of the resolution and upsampled bilinearly)."""
    n, t, h, w, c = shape
    if kind == "white":
        noise = torch.randn(shape, generator=generator)
    else:
        coarse = torch.randn(n * t, c, math.ceil(h / 4) + 1, math.ceil(w / 4) + 1, generator=generator)
        fine = F.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=True)
        noise = fine.view(n, t, c, h, w).permute(0, 1, 3, 4, 2)
        noise = noise / noise.pow(2).mean().sqrt()
    if normed:
        gamma = 1 + 0.1 * torch.randn(c, generator=generator)
        noise = F.silu(F.normalize(noise, dim=-1) * c ** 0.5 * gamma)
    return noise.to(torch.bfloat16).contiguous()


def layer_study(seeds, frames: int, rows: int, width: int, kinds) -> list[dict]:
    rows_out = []
    for (co, ci, kt), names in conv_layers(WAN22_CONFIG).items():
        for kind in kinds:
            per_seed = []
            for seed in seeds:
                g = torch.Generator().manual_seed(seed)
                x = activations((1, frames + kt - 1, rows + 2, width, ci), kind, names[0] != "decoder.conv_in", g)
                w32 = torch.randn(co, kt, 3, 3, ci, generator=g) / math.sqrt(ci * kt * 9)
                b = 0.1 * torch.randn(co, generator=g)
                w = w32.to(torch.bfloat16)
                outputs = {"direct bf16": torch.empty(1, frames, rows, width, co, dtype=torch.bfloat16)}
                TORCH_OPS.conv3d(x, w, b, outputs["direct bf16"])
                for tile in TILES:
                    outputs[f"F({tile}x{tile})"] = out = torch.empty_like(outputs["direct bf16"])
                    conv3d_winograd(x, winograd_weights(w, tile), b, out, tile=tile)
                refs = {"bf16 operands": reference_conv3d(x.float(), w.float(), b),
                        "fp32 weights": reference_conv3d(x.float(), w32, b)}
                per_seed.append({ref_name: {line: error_figures(out, ref, outputs["direct bf16"], None)
                                            for line, out in outputs.items()}
                                 for ref_name, ref in refs.items()})
            rows_out.append({"layer": {"co": co, "ci": ci, "kt": kt}, "names": names, "input": kind,
                             "x_shape": [1, frames + kt - 1, rows + 2, width, ci], "seeds": list(seeds),
                             "per_seed": per_seed, "summary": summarize(per_seed)})
            print(f"layer {ci}->{co} {kind}: " + "; ".join(
                f"{line} max x{s['max_ratio']:.2f} rms x{s['rms_ratio']:.2f}"
                for line, s in rows_out[-1]["summary"]["bf16 operands"].items()), flush=True)
    return rows_out


def summarize(per_seed: list[dict]) -> dict:
    """Over seeds: the worst max|d|, the RMS of the RMS(d)s, the worst ratios, and ok only if every seed is."""
    summary = {}
    for ref_name in per_seed[0]:
        summary[ref_name] = {}
        for line in per_seed[0][ref_name]:
            figs = [s[ref_name][line] for s in per_seed]
            summary[ref_name][line] = {
                "max_d": max(f["max_d"] for f in figs),
                "rms_d": math.sqrt(sum(f["rms_d"] ** 2 for f in figs) / len(figs)),
                "psnr_db": min(f["psnr_db"] for f in figs),
                "max_ratio": max(f["max_ratio"] for f in figs),
                "rms_ratio": max(f["rms_ratio"] for f in figs),
                "ok": all(f["ok"] for f in figs),
            }
    return summary


# ---------------------------------------------------------------------------------------------------- whole decode


def scaled(state_dict: dict, scale: float) -> dict:
    """The (kt, 3, 3) convs' weights times `scale`, conv_out's excepted; every other tensor shared."""
    if scale == 1:
        return state_dict
    return {name: t * scale if (t.dim() == 5 and t.shape[3:] == (3, 3) and not name.startswith("decoder.conv_out"))
            else t for name, t in state_dict.items()}


def decode_study(label: str, config, latent_shapes, seeds, scales) -> list[dict]:
    results = []
    for seed in seeds:
        base = random_weights(config, seed)
        for scale in scales:
            sd = scaled(base, scale)
            cases = []
            for shape in latent_shapes:
                z = torch.randn((1, config.z_dim, *shape), generator=torch.Generator().manual_seed(1000 + seed))
                cases.append({"z": z, "ref": reference.decode(z, sd, torch.float32),
                              "release": reference.decode(z, sd, torch.bfloat16), "videos": {}})
            decoder = WanVAEDecoder(sd, device="cpu", local=True, backend="torch")
            for case in cases:
                case["videos"]["direct (ours)"] = decoder.decode(case["z"])
            for tile in TILES:
                decoder.ops = winograd_ops(TORCH_OPS, tile)  # one table per weights: its transforms are cached
                for case in cases:
                    case["videos"][f"F({tile}x{tile})"] = decoder.decode(case["z"])
            del decoder
            for shape, case in zip(latent_shapes, cases):
                lines = {"release bf16": case["release"], **case["videos"]}
                figures = {line: error_figures(video, case["ref"], case["release"], VIDEO_PEAK_TO_PEAK,
                                                 unit_range=True)
                           for line, video in lines.items()}
                results.append({"config": label, "seed": seed, "conv_scale": scale, "latent_thw": list(shape),
                                "video_shape": list(case["ref"].shape),
                                "saturated_fraction": float((case["ref"].abs() >= 1).float().mean()),
                                "figures": figures})
                print(f"decode {label} seed {seed} x{scale} {list(shape)}: " + "; ".join(
                    f"{line} max {f['max_d']:.4f} rms {f['rms_d']:.5f}" + ("" if f["ok"] else " FAIL")
                    for line, f in figures.items()), flush=True)
    return results


# ---------------------------------------------------------------------------------------------------- report


def markdown(result: dict) -> str:
    out = [f"# Winograd error study ({result['date']})", "", f"`{result['command']}`", "",
           f"{result['machine']}, torch {result['torch']}, {result['threads']} threads. Allowance: max|d| and RMS(d) "
           f"<= {ALLOWANCE} x the baseline's (layers: direct bf16 conv; decodes: release bf16 decode).", ""]
    for ref_name in ("bf16 operands", "fp32 weights") if result["layers"] else ():
        out += [f"## Per layer, reference: fp32 conv of the {ref_name} (worst of {len(result['layer_seeds'])} "
                "seeds; ratio = candidate / direct bf16)", "",
                "| layer (Ci->Co) | input | direct bf16 max / RMS / PSNR | F(2x2) max / RMS / PSNR (ratios) | "
                "F(4x4) max / RMS / PSNR (ratios) |", "|---|---|---|---|---|"]
        for row in result["layers"]:
            s = row["summary"][ref_name]
            cells = [f"{row['layer']['ci']}->{row['layer']['co']}", row["input"], _cell(s["direct bf16"], False)]
            cells += [_cell(s[f"F({t}x{t})"], True) for t in TILES]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    out += ["## Whole decode (reference: fp32 `reference.decode`; baseline: release bf16 decode)", "",
            "| config | seed | conv x | latent T,h,w | sat. | release bf16 | direct (ours) | F(2x2) | F(4x4) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for row in result["decodes"]:
        f = row["figures"]
        cells = [row["config"], str(row["seed"]), str(row["conv_scale"]), "x".join(map(str, row["latent_thw"])),
                 f"{row['saturated_fraction']:.0%}", _cell(f["release bf16"], False)]
        cells += [_cell(f[line], True) for line in ("direct (ours)", "F(2x2)", "F(4x4)")]
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "Cells: max|d| / RMS(d) / PSNR dB; for candidates (max ratio, RMS ratio to the baseline) and the "
            "verdict.", ""]
    return "\n".join(out)


def _cell(f: dict, judged: bool) -> str:
    text = f"{f['max_d']:.3g} / {f['rms_d']:.3g} / {f['psnr_db']:.1f}"
    if judged:
        text += f" (x{f['max_ratio']:.2f}, x{f['rms_ratio']:.2f}) {'ok' if f['ok'] else '**FAIL**'}"
    return text


def keep_direct(layers: list[dict], tile: int) -> list[list[int]]:
    """The layer shapes (Co, Ci, kt) where F(tile) fails the allowance for some input (strict reference)."""
    failing = {(r["layer"]["co"], r["layer"]["ci"], r["layer"]["kt"]) for r in layers
               if not r["summary"]["bf16 operands"][f"F({tile}x{tile})"]["ok"]}
    return [list(s) for s in sorted(failing)]


def latent_thw(text: str) -> tuple[int, int, int]:
    """"2x12x20" -> (2, 12, 20): latent frames, rows, columns."""
    t, h, w = (int(v) for v in text.split("x"))
    return t, h, w



def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="torch threads (fixed for reproducibility)")
    parser.add_argument("--layer-seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--layer-size", type=int, nargs=3, default=[2, 10, 14], metavar=("FRAMES", "ROWS", "WIDTH"),
                        help="output frames, rows and width of each per-layer problem")
    parser.add_argument("--decode-seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--real-latents", type=latent_thw, nargs="*", default=[(2, 2, 3), (3, 2, 3)],
                        help="latents T x h x w decoded at real widths")
    parser.add_argument("--real-scales", type=float, nargs="+", default=[1],
                        help="(kt,3,3) conv weight scales at real widths")
    parser.add_argument("--narrow-dims", type=int, nargs="*", default=[16, 32], help="decoder_base_dim of narrow runs")
    parser.add_argument("--narrow-latents", type=latent_thw, nargs="*", default=[(2, 2, 3), (2, 12, 20), (3, 12, 20)],
                        help="latents T x h x w decoded at narrow widths")
    parser.add_argument("--narrow-scales", type=float, nargs="+", default=[1, 2, 4])
    parser.add_argument("--skip-layers", action="store_true")
    parser.add_argument("--skip-decodes", action="store_true")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    result = {
        "date": datetime.date.today().isoformat(),
        "command": "python -m bench.winograd_error " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores, {platform.platform()}",
        "torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
        "allowance": f"max|d| and RMS(d) <= {ALLOWANCE} x the baseline's, against the fp32 reference",
        "rounding_points": ["U = G g G^T in fp32 from the bf16 weights, rounded to bf16 once",
                            "V = B^T d B in fp32 from the bf16 inputs, rounded to bf16 once",
                            "M = sum over time taps of V_t U_t: fp32 products and accumulation",
                            "Y = A^T M A in fp32 + bias (fp32) + residual (bf16 as fp32), rounded to bf16 once"],
        "layer_seeds": args.layer_seeds,
        "layers": [], "decodes": [],
    }
    if not args.skip_layers:
        frames, rows, width = args.layer_size
        result["layers"] = layer_study(args.layer_seeds, frames, rows, width, ("white", "smooth"))
        result["keep_direct"] = {f"F({t}x{t})": keep_direct(result["layers"], t) for t in TILES}
    if not args.skip_decodes:
        if args.real_latents:
            result["decodes"] += decode_study("wan22 (real widths)", WAN22_CONFIG, args.real_latents,
                                              args.decode_seeds, args.real_scales)
        for dim in args.narrow_dims if args.narrow_latents else ():
            config = dataclasses.replace(WAN22_CONFIG, decoder_base_dim=dim)
            result["decodes"] += decode_study(f"base {dim}", config, args.narrow_latents,
                                              args.decode_seeds, args.narrow_scales)
    result["wall_s"] = time.perf_counter() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    args.out.with_suffix(".md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
