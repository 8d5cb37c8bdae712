"""What an out-of-memory retry costs (docs/design/worker.md, "Out-of-memory retries"), on CPU.

    python bench/retry_cost.py [--frames 5] [--height 4] [--width 6] [--repeats 3]

Times, in one run, median of `--repeats` (single-threaded, so that the two shared cores do not skew the ratio):
- `direct`: a decode planned at 2 latent frames per pass from the start;
- `early`: a decode at 4 frames per pass whose first 4-frame pass runs out of memory (the op table raises
  torch.OutOfMemoryError for a conv output of more than 8 video frames), retried at 2;
- `late`: the same decode whose last conv of the first attempt runs out of memory (a one-time shortage), retried at 2:
  the worst case, a whole attempt lost;
- `replan`: of that, choosing the smaller plan (the planner's meta-device replays of the failed and the smaller plan,
  none cached: with frames_per_pass="auto" the plan's own replays are cached already).
Each retried video is checked bit-identical to `direct`. Also lists the plans a retry walks through for a
193-frame video (T = 49, 704x1248, the planner's replay on the meta device, bf16 as on a GPU) and how long choosing all
of them takes on this CPU. Writes
bench/results/retry-cost-<date>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, installed or not

from bench.machine import cpu_name  # noqa: E402
from fastvideo_pan2_ext.vae_kernel import TORCH_OPS, WanVAEDecoder  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.definitions.architecture import WAN22_CONFIG, WanVAEConfig, expected_shapes  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.planning.memory import MemoryPlanner, Plan  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.compiled.selfcheck import random_weights  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.portable.weights import prepare  # noqa: E402

NARROW = WanVAEConfig(8, 8, (1, 2, 4, 4), 2, (True, True, False), 12, 2)  # bench.py's cpu-tiny widths


def faulty(frames: int | None = None, at_call: int | None = None):
    """The portable table whose conv3d runs out of memory for outputs of more than `frames` frames, or once, at its
    `at_call`-th call."""
    calls = [0]

    def conv3d(x, w, b, out, residual=None):
        calls[0] += 1
        if (frames is not None and out.shape[1] > frames) or calls[0] == at_call:
            raise torch.OutOfMemoryError("injected")
        TORCH_OPS.conv3d(x, w, b, out, residual)

    return dataclasses.replace(TORCH_OPS, name="faulty", conv3d=conv3d), calls


def timed(make, z, repeats: int):
    times, video, decoder = [], None, None
    for _ in range(repeats):
        decoder = make()
        start = time.perf_counter()
        video = decoder.decode(z)
        times.append(time.perf_counter() - start)
    return statistics.median(times), video, decoder


def ladder(start: Plan, stream: bool) -> list[str]:
    """The plans a decode of a 193-frame video (T = 49, 704x1248) tries, from `start`, when every plan runs out of
    memory."""
    meta = torch.device("meta")
    weights = {name: prepare(name, torch.empty(shape, device=meta)) for name, shape in
               expected_shapes(WAN22_CONFIG).items()}
    planner = MemoryPlanner(weights, WAN22_CONFIG, torch.device("cuda"))  # bf16 scratch, as on a GPU
    shape = (1, WAN22_CONFIG.z_dim, 49, 44, 78)
    plans, plan = [], start
    while plan is not None:
        peak = planner.peak_bytes(shape, plan.frames_per_pass, plan.tile_rows, stream)
        plans.append(f"{plan}: {peak / 2**30:.2f} GiB")
        plan = planner.retry_plan(shape, plan.frames_per_pass, plan.tile_rows, stream, may_tile=True)
    return plans


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=5, help="latent frames T (video: 4T - 3)")
    parser.add_argument("--height", type=int, default=4, help="latent rows")
    parser.add_argument("--width", type=int, default=6, help="latent columns")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "bench" / "results")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("fastvideo_pan2_ext.vae_kernel.decoder").setLevel(logging.ERROR)  # the retry warnings
    sd = random_weights(NARROW, seed=0)
    z = torch.randn((1, NARROW.z_dim, args.frames, args.height, args.width), generator=torch.Generator().manual_seed(1))

    direct, expected, _ = timed(lambda: WanVAEDecoder(sd, device="cpu", frames_per_pass=2, backend="torch"), z,
                                args.repeats)
    counter = faulty()  # count the convs of an undisturbed decode at 4 frames per pass
    WanVAEDecoder(sd, device="cpu", frames_per_pass=4, backend=counter[0]).decode(z)
    convs_at_4 = counter[1][0]
    rows = {"direct_2_frames_per_pass_s": round(direct, 3)}
    for name, make in (("early", lambda: faulty(frames=8)[0]), ("late", lambda: faulty(at_call=convs_at_4)[0])):
        seconds, video, decoder = timed(lambda: WanVAEDecoder(sd, device="cpu", frames_per_pass=4, backend=make()),
                                        z, args.repeats)
        assert decoder.last_retries == ((4, None),) and decoder.last_plan == (2, None), decoder.last_retries
        assert torch.equal(video, expected), f"{name}: the retried video differs"
        rows[f"{name}_fault_retried_s"] = round(seconds, 3)
        rows[f"{name}_fault_ratio"] = round(seconds / direct, 3)
        print(f"{name} fault at 4 frames per pass, retried at 2: {seconds:.3f} s vs {direct:.3f} s planned at 2 "
              f"directly ({seconds / direct:.2f}x)")
    planner = MemoryPlanner(WanVAEDecoder(sd, device="cpu", backend="torch").weights, NARROW, torch.device("cpu"))
    start = time.perf_counter()
    planner.retry_plan(tuple(z.shape), 4, None, False, may_tile=True)  # fresh: nothing replayed yet
    rows["replan_s"] = round(time.perf_counter() - start, 3)
    print(f"of which choosing the smaller plan (the planner's replays, none cached): {rows['replan_s']:.3f} s")
    start = time.perf_counter()
    pan2 = {"decode": ladder(Plan(8, None), False)}
    rows["pan2_decode_ladder_planning_s"] = round(time.perf_counter() - start, 1)  # every retry's plan, on this CPU
    pan2["decode_iter"] = ladder(Plan(8, None), True)
    for kind, plans in pan2.items():
        print(f"PAN2's video, {kind}, every plan failing: " + " -> ".join(plans))
    result = {
        "command": "python bench/retry_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, {cpu_name()}, 1 thread",
        "model": "narrow Wan2.2 layout (bench.py's cpu-tiny widths), seeded random weights",
        "latents": list(z.shape), "video_frames": 4 * args.frames - 3, "repeats": args.repeats,
        "convs_per_attempt_at_4_frames_per_pass": convs_at_4,
        **rows,
        "pan2_default_video_retry_plans": pan2,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"retry-cost-{result['date']}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return 0



if __name__ == "__main__":
    sys.exit(main())
