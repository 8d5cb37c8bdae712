"""PAN2 at its real size, by arithmetic: the memory plan (`model.memory`) and the compute per step (`model.cost`) for
the GPUs and frame counts docs/benchmarks.md tabulates ("PAN2 at its real size, by arithmetic"), written to a dated
JSON under bench/results/.

    python bench/pan2_plan.py [--out bench/results/pan2-plan-DATE.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastvideo_pan2_ext.model import memory  # noqa: E402
from fastvideo_pan2_ext.model.architecture import PAN2TransformerConfig  # noqa: E402
from fastvideo_pan2_ext.model.cost import step_flops  # noqa: E402

GB = 10 ** 9
# Qwen3.5-9B's text model and the Wan2.2 VAE, counted on the meta device (tests/model/test_pan2_memory.py).
REAL = memory.Sizes(PAN2TransformerConfig(), text_params=7_936_684_544, text_hidden=4096, text_layers=32,
                    vae_params=704_688_668)
GPUS = {"1x H100 80 GB": (80 * GB, 1), "1x H200 141 GB": (141 * GB, 1), "1x B200 180 GB": (180 * GB, 1),
        "8x H100 80 GB": (80 * GB, 8), "8x B200 180 GB": (180 * GB, 8)}
# Peak dense bf16 (NVIDIA's datasheets) and the efficiency assumed for GEMMs and for flash attention.
RATES = {"H200": (989e12, 0.80, 0.60), "B300": (2250e12, 0.70, 0.70)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path,
                        default=Path(f"bench/results/pan2-plan-{datetime.date.today().isoformat()}.json"))
    args = parser.parse_args()
    result = {"what": "PAN2 at its real size by arithmetic (model.memory, model.cost); no GPU ran", "plans": [],
              "cost": []}
    for frames in (241, 481):
        request = memory.Request(704, 1248, frames)
        for gpu, (gpu_bytes, count) in GPUS.items():
            bare = memory.plan(REAL, request, memory.Layout(num_gpus=count, sp_size=count))
            fitting = memory.first_fitting(REAL, request, gpu_bytes, count)
            result["plans"].append({
                "frames": frames, "gpus": gpu, "video_tokens": memory.video_tokens(REAL, request),
                "no_offload_peak_gib": round(bare.peak / memory.GiB, 1),
                "components_gib": {k: round(v / memory.GiB, 2) for k, v in bare.components.items()},
                "fastest_fitting": None if fitting is None else fitting.layout.describe(),
                "fastest_fitting_peak_gib": None if fitting is None else round(fitting.peak / memory.GiB, 1)})
        tokens = memory.video_tokens(REAL, request)
        flops = step_flops(REAL.transformer, tokens, request.text_tokens)
        entry = {"frames": frames, "video_tokens": tokens, "text_tokens": request.text_tokens,
                 "step_pflop": {"linear": flops.linear / 1e15, "attention": flops.attention / 1e15,
                                "total": flops.total / 1e15}}
        for gpu, (peak, gemm, attention) in RATES.items():
            step = flops.linear / (peak * gemm) + flops.attention / (peak * attention)
            entry[f"{gpu}_step_s"] = round(step, 2)
            entry[f"{gpu}_50_steps_s"] = round(50 * step, 1)
        result["cost"].append(entry)
    result["rates"] = {gpu: {"peak_bf16_flops": p, "gemm_efficiency": g, "attention_efficiency": a}
                       for gpu, (p, g, a) in RATES.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
