"""Benchmark and audit of the fast Wan VAE decoder (Wan2.2 and Wan2.1 layouts) against the release bf16 decode.

    python -m bench.bench --workload cpu-narrow --threads 1            # CPU: narrow widths, small frames
    python -m bench.bench --workload cpu-wan21-narrow --threads 1      # CPU: the Wan2.1 layout, narrow widths
    python bench/bench.py --workload gpu-real --frames 2 31 49 121     # GPU: the real decoder at 704x1248
    python -m bench.bench --conv-algorithms direct winograd --conv-layers   # direct vs Winograd F(2x2, 3x3)
    python -m bench.bench --workload cpu-real-width --threads 2 --profile   # CPU: the real widths vs diffusers fp32

For each workload and latent frame count T it decodes the same seeded latents with
- the fast decoder (`WanVAEDecoder`, each requested backend, conv algorithm and rank count),
- the release baseline: diffusers' `AutoencoderKLWan.to(bf16).decode(z.bf16())`, or, where diffusers is not installed
  (the GPU machine has only torch), `reference.decode(z, sd, torch.bfloat16)`, which is bit-identical to it,
- the fp32 reference (`reference.decode`), the oracle of the audit,
and records the median time of N runs after a warm-up (CUDA events on GPU), peak memory (allocated and reserved on
GPU; RSS on CPU, sampled during the decode), and the allowance (docs/design.md, "Definitions"): d = video - fp32
reference, all finite and in [-1, 1], max|d| and RMS(d) within 3x the release decode's, and PSNR. Weights are seeded random weights of the
workload's architecture (time and memory do not depend on their values). Writes JSON and a PNG plot.

`cpu-real-width` is the real Wan2.2 decoder (widths 1024/512/256) on a small frame, and its yardstick is diffusers'
fp32 decode (what a CPU user runs), not the bf16 one: the two decodes run interleaved (one warm-up each, then ours,
diffusers', ours, ...), medians of `--repeats`; diffusers' fp32 output is the audit's reference (it is bit-exact with
`reference.decode` fp32) and `reference.decode` bf16 its yardstick. `--profile` adds one torch.profiler run of each
decode (the top ops by self CPU time). Needs diffusers.

`--conv-layers` also times each distinct (kt, 3, 3) conv of the workload's decoder on a small input, by the backend's
direct conv3d and by its Winograd table's (`backends.select_ops(backend, device, "direct" | "winograd")`): TFLOP/s
effective (the direct conv's FLOPs / time) and actual (the Winograd GEMMs' FLOPs / time), and which is faster
(JSON: the workload's "conv_layers"). `conv_layer_inputs` and `conv_speeds` are shared with gpu_check/gpu_check.py.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # `python bench/bench.py`: make the repository's package importable as in `-m` use
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import cpu_name  # noqa: E402
from fastvideo_pan2_ext import reference  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.definitions.allowance import ALLOWANCE, compare_to_reference  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.definitions.architecture import (WAN21_CONFIG, WAN22_CONFIG,  # noqa: E402
                                                                    WanVAEConfig, diffusers_arguments, narrow)
from fastvideo_pan2_ext.vae_kernel.options import argparse_type  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.compiled.selfcheck import random_weights  # noqa: E402
from bench.winograd_error import conv_layers  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent.parent / "bench" / "results"


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    config: WanVAEConfig
    latent_hw: tuple[int, int]
    frames: tuple[int, ...]  # latent frame counts T
    encoder_base_dim: int  # only for building diffusers' module (its encoder is never run)
    versus_fp32: bool = False  # timed against diffusers' fp32 decode, interleaved (`bench_versus_fp32`)


WORKLOADS = {
    w.name: w
    for w in [
        Workload("cpu-narrow",
                 narrow(WAN22_CONFIG, 16, z_dim=16), (6, 10), (2, 3, 5), 16),
        Workload("cpu-tiny",
                 narrow(WAN22_CONFIG, 8, z_dim=8), (3, 4), (1, 2, 5), 8),
        Workload("cpu-tiles",  # a taller frame, for the tiled decode's memory-versus-tile table
                 narrow(WAN22_CONFIG, 32, z_dim=16), (32, 48), (2,), 32),
        Workload("cpu-stream",  # a long clip of real-size frames, narrow widths: decode versus decode_iter memory
                 narrow(WAN22_CONFIG, 8, z_dim=8), (44, 78), (5, 9), 8),
        Workload("cpu-wan21-narrow",  # the Wan2.1 layout at cpu-narrow's widths and video size (8x: twice the latents)
                 narrow(WAN21_CONFIG, 16), (12, 20), (2, 3, 5),
                 16),
        Workload("cpu-wan21-tiny",
                 narrow(WAN21_CONFIG, 8, z_dim=8), (6, 8), (1, 2, 5), 8),
        Workload("cpu-real-width",  # the real decoder's widths on a small frame: 3 latent frames -> 9 frames of 64x96
                 WAN22_CONFIG, (4, 6), (3,), 160,
                 versus_fp32=True),
        Workload("gpu-real",
                 WAN22_CONFIG, (44, 78), (2, 31, 49, 121), 160),
    ]
}


# --------------------------------------------------------------------------------------------------------------------
# Weights, latents and the baseline module
# --------------------------------------------------------------------------------------------------------------------


def diffusers_vae(workload: Workload, sd: dict[str, torch.Tensor]):
    """diffusers' AutoencoderKLWan with these decoder weights, or None where diffusers is not installed."""
    try:
        from diffusers import AutoencoderKLWan  # noqa: PLC0415
    except Exception:  # noqa: BLE001 - absent or broken: the reference decode is the bit-identical stand-in
        return None
    c = workload.config
    vae = AutoencoderKLWan(**diffusers_arguments(c, workload.encoder_base_dim), latents_mean=[0.0] * c.z_dim,
                           latents_std=[1.0] * c.z_dim)
    missing, unexpected = vae.load_state_dict(sd, strict=False)
    if unexpected or any(k.startswith(("decoder.", "post_quant_conv.")) for k in missing):
        raise RuntimeError(f"diffusers module does not match the workload: missing {missing}, unexpected {unexpected}")
    return vae.eval()


def seeded_latents(workload: Workload, t: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + t)
    return torch.randn((1, workload.config.z_dim, t, *workload.latent_hw), generator=generator)


# --------------------------------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------------------------------


class _RssPeak:
    """Peak resident memory of this process while the block runs (sampled every 2 ms from /proc)."""

    def __enter__(self):
        _release_free_heap()
        self.peak = self.start = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._rss())

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _release_free_heap() -> None:
    """Hand freed heap pages back to the OS (glibc), so an RSS increase measures this decode, not an earlier one."""
    try:
        import ctypes  # noqa: PLC0415

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _time_and_memory(stats: dict) -> str:
    return f"{stats['median_s']:.3f} s, memory {({k: round(v, 4) for k, v in stats.items() if 'gib' in k})}"


def measure(fn, device: torch.device, repeats: int, warmup: int) -> tuple[torch.Tensor, dict]:
    """Run fn() warmup + repeats times; returns the last output and {times_s, median_s, memory}."""
    out = None
    for _ in range(warmup):
        out = fn()
        del out
    times, memory = [], {}
    for _ in range(repeats):
        out = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            stop.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(stop) / 1e3)
            memory = {"peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                      "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}
        else:
            with _RssPeak() as rss:
                t0 = time.perf_counter()
                out = fn()
                times.append(time.perf_counter() - t0)
            memory = {"peak_rss_gib": rss.peak / 2**30, "rss_increase_gib": (rss.peak - rss.start) / 2**30}
    return out, {"times_s": times, "median_s": statistics.median(times), **memory}


def audit(video: torch.Tensor, ref32: torch.Tensor, release: torch.Tensor) -> dict:
    """The allowance (`definitions.allowance`) against the fp32 reference, the release decode's error the
    yardstick: `AllowanceReport.figures()`, as every result file's audit."""
    return compare_to_reference("video", video.cpu(), ref32.cpu(), release.cpu(), unit_range=True).figures()


# --------------------------------------------------------------------------------------------------------------------
# Multi-rank runs (real processes; gloo on CPU, NCCL on GPU)
# --------------------------------------------------------------------------------------------------------------------


def _rank_worker(rank: int, world: int, tmp: str, spec: dict) -> None:
    import torch.distributed as dist  # noqa: PLC0415

    from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder  # noqa: PLC0415

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{tmp}/rendezvous",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    try:
        sd, z = torch.load(f"{tmp}/inputs.pt")
        decoder = WanVAEDecoder(sd, device=device, frames_per_pass=spec["frames_per_pass"], backend=spec["backend"],
                                conv_algorithm=spec["conv_algorithm"])
        z = z.to(device)

        def run():
            dist.barrier()
            return decoder.decode(z)

        video, stats = measure(run, device, spec["repeats"], spec["warmup"])
        if rank == 0:
            torch.save((video.cpu(), stats), f"{tmp}/result.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, sd, z, spec: dict) -> tuple[torch.Tensor, dict]:
    import torch.multiprocessing as mp  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        torch.save((sd, z.cpu()), f"{tmp}/inputs.pt")
        mp.spawn(_rank_worker, args=(world, tmp, spec), nprocs=world, join=True)
        return torch.load(f"{tmp}/result.pt")


# --------------------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------------------


def bench_workload(workload: Workload, args, device: torch.device, log) -> dict:
    frames = tuple(sorted(args.frames)) if args.frames else workload.frames
    sd = random_weights(workload.config, seed=0)
    sd_on_device = {k: v.to(device) for k, v in sd.items()}
    vae = None if args.no_diffusers or args.skip_baselines else diffusers_vae(workload, sd)
    if vae is not None:
        vae = vae.to(device=device, dtype=torch.bfloat16)
        baseline_name = "diffusers AutoencoderKLWan bf16"

        def baseline(z):
            with torch.no_grad():
                return vae.decode(z.to(torch.bfloat16)).sample
    else:
        baseline_name = "reference.decode bf16 (bit-identical to diffusers AutoencoderKLWan bf16; diffusers absent)"

        def baseline(z):
            return reference.decode(z.to(torch.bfloat16), sd_on_device, torch.bfloat16)

    decoders = fast_decoders(sd_on_device, args, device)
    rows = []
    for i, t in enumerate(frames):
        # Warm-up runs (oneDNN / cuDNN set-up, allocator) only before the first, smallest frame count.
        warmup, baseline_warmup = (args.warmup, args.baseline_warmup) if i == 0 else (0, 0)
        z = seeded_latents(workload, t).to(device)
        video_frames = 4 * t - 3
        release = ref32 = None
        if not args.skip_baselines:
            log(f"[{workload.name}] T={t} ({video_frames} frames): baseline ...")
            release, stats = measure(lambda: baseline(z), device, args.baseline_repeats, baseline_warmup)
            rows.append({"line": "release bf16 (baseline)", "backend": baseline_name, "ranks": 1,
                         "latent_frames": t, "video_frames": video_frames, **stats})
        if not args.skip_baselines and t in (args.audit_frames or frames):
            log(f"[{workload.name}] T={t}: fp32 reference ...")
            ref32, stats = measure(lambda: reference.decode(z, sd_on_device, torch.float32), device, 1, 0)
            rows.append({"line": "reference fp32", "backend": "reference.decode fp32", "ranks": 1,
                         "latent_frames": t, "video_frames": video_frames, **stats})
        for (backend, algorithm), decoder in decoders.items():
            for world in [*args.ranks, *(-n for n in args.tile_rows or [])]:  # negative: tiles of -world rows
                tiles = -world if world < 0 else None
                what = f"tile_rows={tiles}" if tiles else f"ranks={world}"
                log(f"[{workload.name}] T={t}: WanVAEDecoder backend={decoder.backend} {what} ...")
                if tiles:
                    decoder.enable_tiling(tiles)
                    video, stats = measure(lambda: decoder.decode(z), device, args.repeats, warmup)
                    decoder.disable_tiling()
                elif world == 1:
                    video, stats = measure(lambda: decoder.decode(z), device, args.repeats, warmup)
                else:
                    spec = {"threads": torch.get_num_threads(), "device": str(device), "backend": backend,
                            "conv_algorithm": algorithm, "frames_per_pass": args.frames_per_pass,
                            "repeats": args.repeats, "warmup": max(warmup, 1)}
                    video, stats = run_ranks(world, sd, z, spec)
                suffix = f", tiles of {tiles} rows" if tiles else (f" x{world} ranks" if world > 1 else "")
                row = {"line": f"WanVAEDecoder {decoder.backend}{suffix}", "backend": decoder.backend,
                       "conv_algorithm": algorithm, "ranks": 1 if tiles else world, "tile_rows": tiles,
                       "frames_per_pass": args.frames_per_pass,
                       "latent_frames": t, "video_frames": video_frames, **stats}
                if release is not None:
                    row["speedup_vs_release"] = rows[_index(rows, t)]["median_s"] / stats["median_s"]
                log(f"    {_time_and_memory(stats)}")
                if ref32 is not None:
                    row["audit"] = audit(video, ref32, release)
                    log(f"    {row['speedup_vs_release']:.2f}x release; audit {row['audit']}")
                rows.append(row)
                del video
            if args.stream:
                log(f"[{workload.name}] T={t}: WanVAEDecoder backend={decoder.backend} decode_iter ...")

                def stream():
                    for _ in decoder.decode_iter(z):  # what a writer that saves chunk by chunk holds: one chunk
                        pass

                _, stats = measure(stream, device, args.repeats, warmup)
                rows.append({"line": f"WanVAEDecoder {decoder.backend}, decode_iter (chunks not kept)",
                             "backend": decoder.backend, "conv_algorithm": algorithm, "ranks": 1,
                             "frames_per_pass": args.frames_per_pass,
                             "latent_frames": t, "video_frames": video_frames, **stats})
                log(f"    {_time_and_memory(stats)}")
        del release, ref32
    report = {"workload": workload.name, "config": dataclasses.asdict(workload.config),
              "latent_hw": list(workload.latent_hw),
              "video_hw": [workload.config.spatial_scale * s for s in workload.latent_hw],
              "baseline": baseline_name, "results": rows}
    if args.conv_layers:
        report["conv_layers"] = conv_layer_rows(workload, args, device, log)
    return report


def bench_versus_fp32(workload: Workload, args, device: torch.device, log) -> dict:
    """WanVAEDecoder (the first of --backends) against diffusers' fp32 decode of the same latents, interleaved."""
    from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder  # noqa: PLC0415

    sd = random_weights(workload.config, seed=0)
    vae = diffusers_vae(workload, sd)
    if vae is None:
        raise SystemExit(f"{workload.name} times diffusers' fp32 decode: install diffusers")
    vae = vae.to(device)
    decoder = WanVAEDecoder({k: v.to(device) for k, v in sd.items()}, device=device,
                            frames_per_pass=args.frames_per_pass, local=True, backend=args.backends[0])
    ours_line, theirs_line = f"WanVAEDecoder {decoder.backend}", "diffusers AutoencoderKLWan fp32"
    rows, profiles = [], {}
    for t in tuple(sorted(args.frames)) if args.frames else workload.frames:
        z = seeded_latents(workload, t).to(device)

        def theirs():
            with torch.no_grad():
                return vae.decode(z).sample

        decodes = {ours_line: lambda: decoder.decode(z), theirs_line: theirs}
        log(f"[{workload.name}] T={t}: a warm-up, then {args.repeats} interleaved runs of each ...")
        outputs = {line: fn() for line, fn in decodes.items()}  # the warm-up (its outputs are the audit's)
        stats = {line: [] for line in decodes}
        for _ in range(args.repeats):
            for line, fn in decodes.items():
                _, s = measure(fn, device, 1, 0)
                stats[line].append(s)
        release = reference.decode(z.to(torch.bfloat16), sd, torch.bfloat16)
        video_frames = 4 * t - 3
        for line in decodes:
            times = [s["times_s"][0] for s in stats[line]]
            rows.append({"line": line, "backend": decoder.backend if line == ours_line else "diffusers fp32",
                         "frames_per_pass": args.frames_per_pass if line == ours_line else None, "ranks": 1,
                         "latent_frames": t, "video_frames": video_frames, "times_s": times,
                         "median_s": statistics.median(times),
                         "peak_rss_gib": max(s["peak_rss_gib"] for s in stats[line])})
            log(f"    {line}: {_time_and_memory(rows[-1])}")
        rows[-2]["speedup_vs_diffusers_fp32"] = rows[-1]["median_s"] / rows[-2]["median_s"]
        rows[-2]["audit"] = audit(outputs[ours_line], outputs[theirs_line], release)
        log(f"    {rows[-2]['speedup_vs_diffusers_fp32']:.2f}x diffusers fp32; audit {rows[-2]['audit']}")
        if args.profile:
            profiles[f"T={t}"] = {line: profile_ops(fn) for line, fn in decodes.items()}
    report = {"workload": workload.name, "config": dataclasses.asdict(workload.config),
              "latent_hw": list(workload.latent_hw),
              "video_hw": [workload.config.spatial_scale * s for s in workload.latent_hw],
              "baseline": theirs_line, "interleaved": True, "results": rows}
    if profiles:
        report["profiles"] = profiles
    if args.conv_layouts:
        log(f"[{workload.name}] conv layouts, per shape (1 thread, thread CPU time):")
        report["conv_layouts"] = conv_layout_rows(workload, log)
    return report


@contextlib.contextmanager
def cpu_computing_in(dtype: torch.dtype):
    """The portable ops as they run on a CPU that computes in `dtype` (`ops.compute_dtype`: bf16 where the CPU has
    AMX-BF16, else fp32), whichever kind this CPU is: the probe answers for that kind."""
    from fastvideo_pan2_ext.vae_kernel.portable import ops  # noqa: PLC0415

    saved = ops.cpu_has_amx_bf16
    ops.cpu_has_amx_bf16 = lambda: dtype == torch.bfloat16
    try:
        yield
    finally:
        ops.cpu_has_amx_bf16 = saved


def conv_layout_rows(workload: Workload, log, frames: int = 2, repeats: int = 3) -> list[dict]:
    """Each distinct conv3d of the workload's decoder (Co, Ci, kernel, at its level's size for `frames` output
    frames), by the portable op as each kind of CPU runs it: in fp32 with the weights channels last and channels first
    (what `weights.to_compute_layout` chooses between on a CPU without AMX-BF16), and in bf16 with the weights as
    prepared, channels last and prepacked (a CPU with AMX-BF16); and diffusers' own call for the same output
    (`WanCausalConv3d`: fp32 channels first, the width padded by `F.pad`, then `F.conv3d`). The thread CPU time on one
    thread (its own work, whatever else the machine runs), median of `repeats` after a warm-up, conversions of the
    bf16 activations included; `chosen` is what this CPU runs."""
    from fastvideo_pan2_ext.vae_kernel.portable import ops  # noqa: PLC0415
    from fastvideo_pan2_ext.vae_kernel.definitions.architecture import expected_shapes  # noqa: PLC0415
    from fastvideo_pan2_ext.vae_kernel.portable.weights import to_compute_layout  # noqa: PLC0415

    c = workload.config
    layers = {}
    for name, shape in expected_shapes(c).items():
        if len(shape) != 5 or not name.startswith("decoder."):
            continue
        level = len(c.dim_mult) - 1 if name.startswith("decoder.conv_out") else (
            int(name.split(".")[2]) if name.startswith("decoder.up_blocks.") else 0)
        co, ci, kt, kh, kw = shape
        layers.setdefault((co, ci, kt, kh, kw, level), name)
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        for (co, ci, kt, kh, kw, level), name in layers.items():
            h, w = (s * 2 ** level for s in workload.latent_hw)
            g = torch.Generator().manual_seed(co + ci + kt)
            x = torch.randn((1, frames + kt - 1, h + kh - 1, w, ci), generator=g).to(torch.bfloat16)
            wt = (torch.randn((co, kt, kh, kw, ci), generator=g) / (ci * kt * kh * kw) ** 0.5).to(torch.bfloat16)
            b, out = torch.zeros(co), torch.empty((1, frames, h, w, co), dtype=torch.bfloat16)
            variants = {
                "fp32_channels_last": (torch.float32, wt.float()),
                "fp32_channels_first": (torch.float32,
                                        wt.permute(0, 4, 1, 2, 3).float().contiguous().permute(0, 2, 3, 4, 1)),
                "bf16_channels_last": (torch.bfloat16, wt),
            }
            times = {}
            x32, w32 = x.permute(0, 4, 1, 2, 3).float().contiguous(), wt.permute(0, 4, 1, 2, 3).float().contiguous()

            def diffusers_conv():
                torch.nn.functional.conv3d(torch.nn.functional.pad(x32, (kw // 2, kw // 2)), w32, b)

            with torch.no_grad():
                diffusers_conv()
                runs = []
                for _ in range(repeats):
                    t0 = time.thread_time()
                    diffusers_conv()
                    runs.append(time.thread_time() - t0)
            times["diffusers_fp32"] = statistics.median(runs)
            for variant, (dtype, weight) in variants.items():
                with cpu_computing_in(dtype):
                    ops.prepack(weight)  # as `weights.load` does (bf16 only: `ops.prepack`)
                    ops.conv3d(x, weight, b, out)
                    runs = []
                    for _ in range(repeats):
                        t0 = time.thread_time()
                        ops.conv3d(x, weight, b, out)
                        runs.append(time.thread_time() - t0)
                times[variant] = statistics.median(runs)
            mine = to_compute_layout(wt)
            chosen = (f"{'bf16' if mine.dtype == torch.bfloat16 else 'fp32'}_channels_"
                      f"{'first' if ops.computes_channels_first(mine) else 'last'}")
            ours = {k: v for k, v in times.items() if k != "diffusers_fp32"}
            rows.append({"layer": name, "co": co, "ci": ci, "kernel": [kt, kh, kw], "frames": frames, "rows": h,
                         "cols": w, **{f"{k}_s": v for k, v in times.items()},
                         "faster": min(ours, key=ours.get), "chosen": chosen,
                         "chosen_vs_diffusers": times["diffusers_fp32"] / times[chosen]})
            log(f"    conv {ci} -> {co} k{kt}x{kh}x{kw} at {frames}x{h}x{w}: "
                + ", ".join(f"{k.replace('_', ' ')} {v * 1e3:.1f} ms" for k, v in times.items())
                + f" (this CPU: {chosen.replace('_', ' ')})")
    finally:
        torch.set_num_threads(saved)
    return rows


def profile_ops(fn, top: int = 15) -> list[dict]:
    """One torch.profiler run of fn(): the `top` ops by self CPU time (seconds, calls)."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return [{"op": e.key, "self_cpu_s": e.self_cpu_time_total / 1e6, "calls": e.count} for e in events[:top]]


def fast_decoders(sd_on_device: dict, args, device: torch.device) -> dict:
    """(backend, conv_algorithm) -> a single-rank WanVAEDecoder, one per distinct op table (on CPU "auto" is "direct",
    so asking for both times it once)."""
    from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder  # noqa: PLC0415

    decoders, tables = {}, set()
    for backend in args.backends:
        for algorithm in args.conv_algorithms:
            decoder = WanVAEDecoder(sd_on_device, device=device, frames_per_pass=args.frames_per_pass, local=True,
                                    backend=backend, conv_algorithm=algorithm)
            if decoder.backend not in tables:
                tables.add(decoder.backend)
                decoders[backend, algorithm] = decoder
    return decoders


# --------------------------------------------------------------------------------------------------------------------
# Direct vs Winograd, layer by layer (shared with gpu_check/gpu_check.py)
# --------------------------------------------------------------------------------------------------------------------


def conv_layer_inputs(layer: tuple[int, int, int], frames: int, rows: int, cols: int, device: torch.device,
                      seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Operands of one (kt, 3, 3) conv (Co, Ci, kt) with `frames` x `rows` x `cols` outputs, as the decoder passes
    them: x bf16 [1, frames + kt - 1, rows + 2, cols, Ci] (history frames and halo rows in front), w bf16
    [Co, kt, 3, 3, Ci] (randn / sqrt(fan-in)), b fp32 [Co]."""
    co, ci, kt = layer
    g = torch.Generator(device).manual_seed(seed)  # drawn on the device: a GPU's real-size inputs in milliseconds
    x = torch.randn(1, frames + kt - 1, rows + 2, cols, ci, generator=g, device=device).to(torch.bfloat16)
    w = (torch.randn(co, kt, 3, 3, ci, generator=g, device=device) / math.sqrt(9 * kt * ci)).to(torch.bfloat16)
    b = 0.1 * torch.randn(co, generator=g, device=device)
    return x, w, b


def conv_speeds(direct, winograd, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, timer) -> dict:
    """One (kt, 3, 3) conv by `direct` and by `winograd` (both `ops.conv3d`-shaped), timed by `timer(fn) -> seconds`
    (which warms up first: the Winograd table transforms and caches the weights on its first call). Effective
    TFLOP/s count the direct conv's FLOPs, actual ones the Winograd GEMMs' (16 products per 2x2 output tile, the
    transforms not counted): effective / actual = 2.25 where rows and cols are even."""
    co, kt, _, _, ci = w.shape
    _, ti, hi, cols, _ = x.shape
    frames, rows = ti - kt + 1, hi - 2
    out = torch.empty(1, frames, rows, cols, co, device=x.device, dtype=torch.bfloat16)
    direct_flops = 2 * frames * rows * cols * co * ci * kt * 9
    winograd_flops = 2 * frames * math.ceil(rows / 2) * math.ceil(cols / 2) * 16 * co * ci * kt
    direct_s = timer(lambda: direct(x, w, b, out))
    winograd_s = timer(lambda: winograd(x, w, b, out))
    figures = {"direct_gflop": direct_flops / 1e9, "winograd_gflop": winograd_flops / 1e9,
               "direct_ms": direct_s * 1e3, "winograd_ms": winograd_s * 1e3,
               "direct_tflops": direct_flops / direct_s / 1e12,
               "winograd_effective_tflops": direct_flops / winograd_s / 1e12,
               "winograd_actual_tflops": winograd_flops / winograd_s / 1e12, "winograd_speedup": direct_s / winograd_s}
    return {"layer": [co, ci, kt], "kernel": [kt, 3, 3], "frames": frames, "rows": rows, "cols": cols,
            **{k: float(f"{v:.4g}") for k, v in figures.items()},  # 4 significant digits: tiny CPU layers too
            "faster": "winograd" if winograd_s < direct_s else "direct"}


def conv_layer_rows(workload: Workload, args, device: torch.device, log) -> list[dict]:
    """Each distinct (kt, 3, 3) conv of the workload's decoder, by each backend's direct and Winograd conv3d."""
    from fastvideo_pan2_ext.vae_kernel.backends import select_ops  # noqa: PLC0415

    frames, rows, cols = args.conv_layer_size

    def timer(fn):
        return measure(fn, device, args.repeats, 1)[1]["median_s"]

    out = []
    for backend in args.backends:
        direct, winograd = select_ops(backend, device, "direct"), select_ops(backend, device, "winograd")
        for layer, names in conv_layers(workload.config).items():
            x, w, b = conv_layer_inputs(layer, frames, rows, cols, device)
            row = {"direct_table": direct.name, "winograd_table": winograd.name, "names": names,
                   **conv_speeds(direct.conv3d, winograd.conv3d, x, w, b, timer)}
            log(f"[{workload.name}] conv {layer[1]} -> {layer[0]} k{layer[2]}x3x3 ({direct.name}): direct "
                f"{row['direct_ms']:.3f} ms, Winograd {row['winograd_ms']:.3f} ms ({row['winograd_speedup']:.2f}x)")
            out.append(row)
    return out


def _index(rows: list[dict], t: int) -> int:
    """Where this T's baseline row is."""
    return next(i for i, r in enumerate(rows) if r["latent_frames"] == t and r["line"].startswith("release"))


def plot(report: dict, path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    workloads = report["workloads"]
    fig, axes = plt.subplots(len(workloads), 2, figsize=(12, 4.2 * len(workloads)), squeeze=False)
    for (ax_t, ax_m), w in zip(axes, workloads):
        lines: dict[str, list[dict]] = {}
        for r in w["results"]:
            lines.setdefault(r["line"], []).append(r)
        # On CPU the process's own footprint (torch, diffusers) dwarfs a small decode: plot what the decode adds.
        mem_key = "peak_allocated_gib" if report["device"].startswith("cuda") else "rss_increase_gib"
        video = "x".join(map(str, w["video_hw"]))
        single_length = len({r["video_frames"] for r in w["results"]}) == 1
        if single_length:  # one clip length (e.g. the tile table): one bar per line, labelled with its value
            names = list(lines)
            for ax, key in ((ax_t, "median_s"), (ax_m, mem_key)):
                values = [lines[n][0].get(key, float("nan")) for n in names]
                bars = ax.barh(names, values, color=[f"C{i}" for i in range(len(names))])
                ax.bar_label(bars, fmt="%.3g", fontsize=8)
                ax.invert_yaxis()
                ax.tick_params(axis="y", labelsize=8)
            frames = w["results"][0]["video_frames"]
            ax_t.set(title=f"{w['workload']} ({video}, {frames} frames): decode time", xlabel="seconds (median)")
            ax_m.set(title=f"{w['workload']}: peak memory",
                     xlabel="GiB " + ("peak allocated" if mem_key.startswith("peak_alloc") else "RSS increase"))
        else:
            for line, rs in lines.items():
                xs = [r["video_frames"] for r in rs]
                ax_t.plot(xs, [r["median_s"] for r in rs], marker="o", label=line)
                ax_m.plot(xs, [r.get(mem_key, float("nan")) for r in rs], marker="o", label=line)
            ax_t.set(title=f"{w['workload']} ({video}): decode time", xlabel="video frames",
                     ylabel="seconds (median)")
            ax_m.set(title=f"{w['workload']}: peak memory", xlabel="video frames",
                     ylabel="GiB " + ("peak allocated" if mem_key.startswith("peak_alloc") else "RSS increase (rank 0)"))
            for ax in (ax_t, ax_m):
                ax.legend(fontsize=8)
            ax_t.set_yscale("log")
        for ax in (ax_t, ax_m):
            ax.grid(alpha=0.3)
    fig.suptitle(f"Wan VAE decode on {report['device_name']} ({report['date']}, {report['threads']} threads)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)




def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", nargs="+", default=None, choices=sorted(WORKLOADS),
                   help="default: cpu-narrow on CPU, gpu-real on GPU")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--frames", type=int, nargs="+", help="latent frame counts T (default: the workload's)")
    p.add_argument("--audit-frames", type=int, nargs="+", help="T values to audit against fp32 (default: all)")
    p.add_argument("--backends", nargs="+", default=["auto"], choices=["auto", "cuda", "torch"])
    p.add_argument("--conv-algorithms", nargs="+", default=["auto"], choices=["auto", "direct", "winograd"],
                   help="the fast decoder's 3x3 convs: each listed algorithm is a decode of its own (audited too)")
    p.add_argument("--conv-layers", action="store_true",
                   help="also time each distinct (kt, 3, 3) conv of the decoder, direct vs Winograd")
    p.add_argument("--conv-layer-size", type=int, nargs=3, default=[2, 16, 24], metavar=("FRAMES", "ROWS", "COLS"),
                   help="the output size of each --conv-layers conv (default 2 16 24)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1], help="rank counts for the fast decoder")
    p.add_argument("--tile-rows", type=int, nargs="+", help="also time tiled decodes with these latent rows per tile")
    p.add_argument("--stream", action="store_true", help="also measure decode_iter with chunks dropped as they come")
    p.add_argument("--skip-baselines", action="store_true",
                   help="time only the fast decoder (no release baseline, no fp32 reference, no audit)")
    p.add_argument("--frames-per-pass", type=argparse_type("frames_per_pass"), default=4, help="an int, or auto (default 4)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--baseline-repeats", type=int, default=1)
    p.add_argument("--baseline-warmup", type=int, default=0, help="(warm-ups run before the first T only)")
    p.add_argument("--profile", action="store_true",
                   help="versus-fp32 workloads (cpu-real-width): also profile one decode of each, per op")
    p.add_argument("--conv-layouts", action="store_true",
                   help="versus-fp32 workloads: also time each conv shape's op channels last vs channels first")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (recorded in the JSON)")
    p.add_argument("--no-diffusers", action="store_true", help="use reference.decode bf16 as the baseline")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/<device>-<date>.json)")
    args = p.parse_args(argv)
    for name in ("frames", "audit_frames", "ranks", "tile_rows", "conv_layer_size"):
        if any(v < 1 for v in getattr(args, name) or []):
            p.error(f"--{name.replace('_', '-')} values must be >= 1; got {getattr(args, name)}")
    if args.repeats < 1 or args.baseline_repeats < 1:
        p.error("--repeats and --baseline-repeats must be >= 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    names = args.workload or (["gpu-real"] if device.type == "cuda" else ["cpu-narrow"])
    date = datetime.date.today().isoformat()
    out = args.out or RESULTS_DIR / f"{device.type}-{date}.json"

    def log(message):
        print(message, flush=True)

    report = {
        "date": date, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
        "command": " ".join(["python -m bench.bench", *(argv if argv is not None else sys.argv[1:])]),
        "allowance": f"max|d| and RMS(d) <= {ALLOWANCE} x the release bf16 decode's, against the fp32 reference",
        "workloads": [],
    }
    for name in names:
        bench = bench_versus_fp32 if WORKLOADS[name].versus_fp32 else bench_workload
        report["workloads"].append(bench(WORKLOADS[name], args, device, log))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))  # after each workload, so a long run keeps what it measured
    plot(report, out.with_suffix(".png"))
    log(f"wrote {out} and {out.with_suffix('.png')}")
    return report


if __name__ == "__main__":
    main()
