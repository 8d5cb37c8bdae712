"""The one-shot GPU check of the compiled decoder (run it through tools/gpu_check.sh; docs/design.md, "The GPU check").

Everything a 15-minute GPU loan must answer, in one run that cannot lose what it measured:
- build: cold then warm, each in a fresh process with a time limit; the kernels' registers, spills and shared memory
  (ptxas -v, from the build log);
- the compiled op table's self-check at every production op shape (child process, every case reported; run as the
  loader runs it, so its pass is remembered and the later steps do not check the table again);
- correctness against the fp32 reference (T = 2, 8, and 49 from the timing runs): the release bf16 decode, the
  portable decoder, the compiled decoder, under the allowance;
- timing at T = 49 and 31 (704x1248): the release decode with bf16 weights resident on the GPU, diffusers' own
  `AutoencoderKLWan.decode` in bf16 under autocast (when the bundle brings diffusers), the portable and the compiled
  decoder; median of 3 after a warm-up of several 4-frame passes; peak memory; for each fast decoder, which
  algorithm ran each (kt, 3, 3) conv ("conv_algorithms");
- Winograd F(2x2, 3x3): the compiled Winograd table's self-check (every case); each dominant layer shape by the
  direct and the Winograd kernels (TFLOP/s effective and actual, the allowance, which is faster, and the suggested
  `backends.MEASURED_WINOGRAD_LAYERS` entry for this GPU); the compiled decoder's whole decode at T = 49 with every
  3x3 conv by Winograd (median of 3, allowance, peak memory), beside the direct one's;
- peak allocated / reserved at frames_per_pass 1, 2, 4 and auto (and the planner's replay estimate beside it);
- a torch.profiler kernel table (top 20) of one 4-frame pass, and host vs GPU time per pass;
- TFLOP/s of our conv against cuDNN's channels-last conv3d on the dominant layer shapes;
- last (the first to go under the deadline): the Wan2.1 VAE at 480x832 and 720x1280, 81 frames (T = 21), the
  release decode (`reference.decode` in bf16, weights resident in bf16) against the compiled decoder, median of 3.

Order: build, self-check, correctness, T = 49 timing, the Winograd steps, memory, profile, conv bench, T = 31,
Wan2.1: the most valuable first.

Failure isolation: the release and portable decodes run here first; every compiled measurement runs in a child
process of its own, so a CUDA fault is that step's error (with the message) and the run goes on. `--deadline`
skips what no longer fits and says so; every subprocess has a time limit; the JSON is replaced atomically after every
measurement. Exit code 0 only if the compiled decoder built, passed the self-check and met the allowance at every size.

`--dry-run` runs all of it on CPU at tiny sizes (the Winograd and Wan2.1 steps included): the build really compiles
(sm_90a, compile-only), and the compiled decoder is the emulated extension (`vae_kernel/compiled/emulated_extension.py`, the
Winograd kernels' API too) loaded through the same loader and child-process self-check as a built one;
`--stand-in emulated-abort` makes every compiled child die, to prove the isolation. The dry run is single-threaded
(`single_threaded_cpu`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, installed or not

from fastvideo_pan2_ext import reference  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.compiled import build, extension, loader, selfcheck, verification  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.definitions.allowance import compare_to_reference  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.definitions.architecture import WAN21_CONFIG, WAN22_CONFIG, WanVAEConfig  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.decoder import WanVAEDecoder  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.options import argparse_type  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.compiled.emulated_extension import VARIANTS as STAND_INS  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.compiled.kernels import make_ops  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.portable.ops import TORCH_OPS, Ops  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.definitions.precision import exact_fp32  # noqa: E402
from tools.bench import conv_layer_inputs, conv_speeds  # noqa: E402
from tools.winograd_error import conv_layers  # noqa: E402

TINY = WanVAEConfig(z_dim=8, decoder_base_dim=8, dim_mult=(1, 2, 4, 4), num_res_blocks=2,
                    temperal_upsample=(True, True, False), out_channels=12, patch_size=2)
TINY_WAN21 = WanVAEConfig(z_dim=16, decoder_base_dim=8, dim_mult=(1, 2, 4, 4), num_res_blocks=2,
                          temperal_upsample=(True, True, False), out_channels=3, patch_size=1, residual=False)
# layout -> (the real decoder, the dry run's narrow one)
CONFIGS = {"wan22": (WAN22_CONFIG, TINY), "wan21": (WAN21_CONFIG, TINY_WAN21)}
# (latent rows, cols), correctness T, timing T (the largest also audited), memory T, frames_per_pass to measure;
# the Wan2.1 VAE's video sizes (rows, cols) and latent frames (T = 21: 81 frames), timed last.
FULL = dict(latent_hw=(44, 78), correctness_t=(2, 8), timing_t=(49, 31), memory_t=9, memory_fpp=(1, 2, 4, "auto"),
            wan21_hw=((480, 832), (720, 1280)), wan21_t=21)
DRY = dict(latent_hw=(3, 4), correctness_t=(2, 3), timing_t=(4, 3), memory_t=5, memory_fpp=(1, 2, 4, "auto"),
           wan21_hw=((16, 24), (24, 32)), wan21_t=3)
# Dominant conv shapes of the real decoder at 704x1248 (Ci, Co, kernel, latent-relative scale) and the sub-pixel convs.
BENCH_CONVS = [(1024, 1024, (3, 3, 3), 2), (1024, 512, (3, 3, 3), 4), (512, 512, (3, 3, 3), 4),
               (512, 256, (3, 3, 3), 8), (256, 256, (3, 3, 3), 8)]
BENCH_UPSAMPLES = [(1024, 1), (1024, 2), (512, 4)]  # (channels, scale of the low-resolution input)
WARMUP_T = 9  # the warm-up decode: the first frame, then two 4-frame passes
REPEATS = 3
TAG = "GPU_CHECK_CHILD "


# --------------------------------------------------------------------------------------------------- bookkeeping


class Report:
    """The JSON result, replaced atomically (temp file + rename) after every measurement."""

    def __init__(self, path: Path, data: dict) -> None:
        self.path, self.data = path, data
        self.save()

    def put(self, key: str, value) -> None:
        self.data[key] = value
        self.save()

    def save(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


class Clock:
    """The run's deadline: steps that no longer fit are skipped and named in the report."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


class Context:
    """What every step needs: where it runs, the model (the Wan2.2 VAE; `layout="wan21"`: the Wan2.1 VAE decoding
    video of `video_hw`), the sizes, the scratch folder the children read."""

    def __init__(self, dry_run: bool, stand_in: str, scratch: Path, frames_per_pass: int | str,
                 layout: str = "wan22", video_hw: tuple[int, int] | None = None) -> None:
        self.dry_run = dry_run
        self.device = torch.device("cpu") if dry_run else torch.device("cuda", 0)
        self.layout = layout
        self.config = CONFIGS[layout][dry_run]
        self.sizes = DRY if dry_run else FULL
        self.latent_hw = (tuple(s // self.config.spatial_scale for s in video_hw) if video_hw
                          else tuple(self.sizes["latent_hw"]))
        self.arch = stand_in if dry_run else extension.arch_for_device(self.device)
        self.scratch = scratch
        self.frames_per_pass = frames_per_pass
        self._weights: dict[torch.dtype, dict] = {}

    def weights(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """The seeded weights, resident on the device (the same numbers in every process of this run)."""
        if dtype not in self._weights:
            fp32 = self._weights.get(torch.float32) or selfcheck.random_weights(self.config, seed=0,
                                                                                device=self.device)
            self._weights[torch.float32] = fp32
            self._weights[dtype] = {k: v.to(dtype) for k, v in fp32.items()}
        return self._weights[dtype]

    def latents(self, t: int, seed: int = 1) -> torch.Tensor:
        h, w = self.latent_hw
        g = torch.Generator().manual_seed(seed + t)
        return torch.randn(1, self.config.z_dim, t, h, w, generator=g).to(self.device)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


@contextlib.contextmanager
def measured(ctx: Context, record: dict):
    """Wall time (synchronized) and peak memory of the block, into `record`."""
    cuda = ctx.device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
        base = torch.cuda.memory_allocated(ctx.device)
    ctx.sync()
    start = time.perf_counter()
    yield
    ctx.sync()
    record["seconds"] = round(time.perf_counter() - start, 4)
    if cuda:
        record["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(ctx.device) / 2**30, 3)
        record["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(ctx.device) / 2**30, 3)
        record["peak_above_start_gib"] = round((torch.cuda.max_memory_allocated(ctx.device) - base) / 2**30, 3)


def audit(name: str, video: torch.Tensor, ref32: torch.Tensor, release: torch.Tensor) -> dict:
    return compare_to_reference(name, video, ref32, release, unit_range=True).figures()


# --------------------------------------------------------------------------------------------------- decoders


def plan_of(run, latents_shape) -> dict | None:
    """What one of our decoders will do for these latents (frames_per_pass, tile_rows), None for the others."""
    decoder = getattr(run, "__self__", None)
    return decoder.plan(latents_shape)._asdict() if isinstance(decoder, WanVAEDecoder) else None


def decoders(ctx: Context, names, frames_per_pass: int | str | None = None) -> dict:
    """name -> a function latents -> video, for the decoders this process runs."""
    fpp = frames_per_pass or ctx.frames_per_pass
    made = {}
    for name in names:
        if name == "release_bf16":  # diffusers' decode, op for op, weights resident in bf16 (reference.decode)
            weights = ctx.weights(torch.bfloat16)
            made[name] = lambda z, w=weights: reference.decode(z, w, torch.bfloat16)
        elif name == "diffusers_bf16":
            made[name] = diffusers_decoder(ctx)
        else:
            made[name] = WanVAEDecoder(ctx.weights(), ctx.device, local=True, backend=op_table(ctx, name),
                                       frames_per_pass=fpp).decode
    return made


def op_table(ctx: Context, name: str) -> Ops | None:
    """The op table of the fast decoder `name` ("portable"; "compiled": built (cached) or emulated, verified in a
    child; "compiled_winograd": the same with its (kt, 3, 3) convs by the Winograd kernels, verified with them);
    None for the release and diffusers decodes. Explicit tables: "auto"'s per-GPU choice never moves a measurement."""
    if name == "portable":
        return TORCH_OPS
    if name == "compiled":
        return loader.load_ops(ctx.device, arch=ctx.arch)
    if name == "compiled_winograd":
        return loader.load_ops(ctx.device, arch=ctx.arch, winograd=True)
    return None


def layer_algorithms(table: Ops, config: WanVAEConfig) -> dict[str, str]:
    """"CoxCixkt" -> "winograd" or "direct": how `table` runs each distinct (kt, 3, 3) conv of `config`'s decoder."""
    uses_winograd = getattr(table.conv3d, "uses_winograd", lambda w: False)  # a winograd.WinogradConv3d has it
    return {f"{co}x{ci}x{kt}": "winograd" if uses_winograd(torch.empty(co, kt, 3, 3, ci, device="meta")) else "direct"
            for co, ci, kt in conv_layers(config)}


def diffusers_decoder(ctx: Context):
    """diffusers' own AutoencoderKLWan (the same weights) decoding in bf16 under autocast, as a user's pipeline does."""
    from diffusers import AutoencoderKLWan  # noqa: PLC0415 - carried to the GPU machine in the bundle

    c = ctx.config
    vae = AutoencoderKLWan(base_dim=c.decoder_base_dim,  # the encoder's width: it never runs here
                           decoder_base_dim=c.decoder_base_dim, z_dim=c.z_dim, dim_mult=list(c.dim_mult),
                           num_res_blocks=c.num_res_blocks, temperal_downsample=[False, True, True],
                           is_residual=True, patch_size=c.patch_size, in_channels=c.out_channels,
                           out_channels=c.out_channels)
    missing = vae.load_state_dict({k: v.cpu() for k, v in ctx.weights().items()}, strict=False).missing_keys
    if any(k.startswith(("decoder.", "post_quant_conv.")) for k in missing):
        raise RuntimeError(f"diffusers' decoder did not take the weights: missing {missing[:3]}")
    vae = vae.to(ctx.device, torch.bfloat16).eval()

    def run(z):
        with torch.no_grad(), torch.autocast(ctx.device.type, dtype=torch.bfloat16):
            return vae.decode(z.to(torch.bfloat16)).sample

    return run


# --------------------------------------------------------------------------------------------------- measurements


def correctness(ctx: Context, names) -> dict:
    """T -> decoder -> allowance figures against the fp32 reference (baseline: the release bf16 decode)."""
    out = {}
    runners = decoders(ctx, names)
    for t in ctx.sizes["correctness_t"]:
        ref32, release = load_oracle(ctx, t)
        out[t] = {name: audit(name, run(ctx.latents(t)), ref32, release) for name, run in runners.items()}
    return out


def timing(ctx: Context, names, t: int) -> dict:
    """decoder -> median of REPEATS after a warm-up, peak memory; at the audited T, the allowance figures too."""
    out = {}
    audited = t == max(ctx.sizes["timing_t"])
    for name, run in decoders(ctx, names).items():
        run(ctx.latents(WARMUP_T, seed=99))  # first-call costs (cuDNN autotune, kernel loading) stay out
        runs, video, plan = [], None, plan_of(run, (1, ctx.config.z_dim, t, *ctx.latent_hw))
        for _ in range(REPEATS):
            del video
            record = {}
            with measured(ctx, record):
                video = run(ctx.latents(t))
            runs.append(record)
        entry = {"median_seconds": statistics.median(r["seconds"] for r in runs), "runs": runs, "plan": plan}
        if (table := op_table(ctx, name)) is not None:
            entry["conv_algorithms"] = layer_algorithms(table, ctx.config)
        if audited and oracle_path(ctx, t).exists():
            ref32, release = load_oracle(ctx, t)
            entry["allowance"] = audit(name, video, ref32, release)
        out[name] = entry
        del video
    return out


def memory(ctx: Context, names) -> dict:
    """frames_per_pass -> decoder -> peak allocated/reserved of a decode, and the planner's replay estimate."""
    out = {}
    t = ctx.sizes["memory_t"]
    for fpp in ctx.sizes["memory_fpp"]:
        out[fpp] = {}
        for name, run in decoders(ctx, names, frames_per_pass=fpp).items():
            record = {"plan": plan_of(run, (1, ctx.config.z_dim, t, *ctx.latent_hw))}
            with measured(ctx, record):
                run(ctx.latents(t))
            replay = WanVAEDecoder(ctx.weights(), ctx.device, local=True, backend="torch", frames_per_pass=fpp)
            record["replay_peak_gib"] = round(replay.peak_bytes(ctx.latents(t).shape) / 2**30, 3)
            out[fpp][name] = record
    return out


def profile(ctx: Context, names) -> dict:
    """decoder -> top-20 kernel table of a T = 5 decode (the first frame, then one 4-frame pass), and its host
    (issuing) time against its device (kernel) time."""
    from torch.profiler import ProfilerActivity, profile as torch_profile  # noqa: PLC0415

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
    out = {}
    for name, run in decoders(ctx, names, frames_per_pass=4).items():
        run(ctx.latents(5, seed=98))
        z = ctx.latents(5)
        with torch_profile(activities=activities) as prof:
            start = time.perf_counter()
            run(z)
            host = time.perf_counter() - start
            ctx.sync()
            wall = time.perf_counter() - start
        events = prof.key_averages()
        rows = sorted(events, key=lambda e: (e.self_device_time_total, e.self_cpu_time_total), reverse=True)[:20]
        device_total = sum(e.self_device_time_total for e in events)
        out[name] = {
            "passes": 2, "host_issue_seconds": round(host, 4), "wall_seconds": round(wall, 4),
            "device_kernel_seconds": round(device_total / 1e6, 4),
            "top20": [{"name": e.key[:120], "calls": e.count, "device_ms": round(e.self_device_time_total / 1e3, 3),
                       "cpu_ms": round(e.self_cpu_time_total / 1e3, 3)} for e in rows],
        }
    return out


def dominant_convs(ctx: Context) -> list[tuple[str, int, int, tuple[int, int, int], int]]:
    """(op, Ci, Co, kernel, latent-relative scale) of BENCH_CONVS and BENCH_UPSAMPLES; the dry run's at tiny widths."""
    cases = [("conv3d", ci, co, k, s) for ci, co, k, s in BENCH_CONVS]
    cases += [("upsample2x_conv3x3", c, c, (1, 3, 3), s) for c, s in BENCH_UPSAMPLES]
    if ctx.dry_run:  # the same code at tiny widths
        cases = [(op, max(8, ci // 64), max(8, co // 64), k, s) for op, ci, co, k, s in cases]
    return cases


def conv_bench(ctx: Context) -> list[dict]:
    """TFLOP/s of the compiled conv vs torch's (cuDNN) channels-last conv3d on the dominant layer shapes."""
    table = loader.load_ops(ctx.device, arch=ctx.arch)
    h, w = ctx.latent_hw
    frames = 4
    g = torch.Generator(ctx.device).manual_seed(3)
    rows = []

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=ctx.device).to(torch.bfloat16)

    for op, ci, co, (kt, kh, kw), s in dominant_convs(ctx):
        rows_, cols = h * s, w * s
        if op == "conv3d":
            x = rand(1, frames + kt - 1, rows_ + kh - 1, cols, ci)
            wt, b = rand(co, kt, kh, kw, ci), torch.zeros(co, device=ctx.device)
            out = torch.empty(1, frames, rows_, cols, co, device=ctx.device, dtype=torch.bfloat16)
            ours = lambda: table.conv3d(x, wt, b, out)  # noqa: E731
            xc = x.permute(0, 4, 1, 2, 3)  # a channels-last view: cuDNN's NDHWC path
            wc = wt.permute(0, 4, 1, 2, 3).contiguous(memory_format=torch.channels_last_3d)
            theirs = lambda: torch.nn.functional.conv3d(xc, wc, b.to(torch.bfloat16),  # noqa: E731
                                                        padding=(0, 0, kw // 2))
            flops = 2 * frames * rows_ * cols * co * ci * kt * kh * kw
        else:
            x = rand(frames, rows_ + 2, cols, ci)
            w_sub, b = rand(2, 2, co, 2, 2, ci), torch.zeros(co, device=ctx.device)
            out = torch.empty(frames, 2 * rows_, 2 * cols, co, device=ctx.device, dtype=torch.bfloat16)
            ours = lambda: table.upsample2x_conv3x3(x, w_sub, b, out)  # noqa: E731
            up = torch.nn.functional.interpolate(x.permute(0, 3, 1, 2), scale_factor=2.0)
            up = up.contiguous(memory_format=torch.channels_last)
            w3 = rand(co, ci, 3, 3).contiguous(memory_format=torch.channels_last)
            theirs = lambda: torch.nn.functional.conv2d(up, w3, padding=(0, 1))  # noqa: E731
            flops = 2 * frames * 4 * rows_ * cols * co * ci * 4  # the sub-pixel form: 4 taps per phase
        row = {"op": op, "ci": ci, "co": co, "kernel": [kt, kh, kw], "rows": rows_, "cols": cols, "frames": frames,
               "gflop": round(flops / 1e9, 3)}
        for label, fn in (("ours", ours), ("torch", theirs)):
            seconds = time_fn(ctx, fn)
            row[f"{label}_ms"] = round(seconds * 1e3, 3)
            row[f"{label}_tflops"] = round(flops / seconds / 1e12, 4)
        rows.append(row)
    return rows


def winograd_conv_bench(ctx: Context) -> dict:
    """Direct vs Winograd F(2x2, 3x3) compiled convs at the dominant (kt, 3, 3) layer shapes (4 frames at their real
    size): time, TFLOP/s effective and actual (`bench.conv_speeds`), and the Winograd output's allowance against the
    fp32 conv. The layers where Winograd is faster and within the allowance are this GPU's suggested
    `backends.MEASURED_WINOGRAD_LAYERS` entry (what conv_algorithm "auto" then runs by Winograd)."""
    direct = loader.load_ops(ctx.device, arch=ctx.arch)
    winograd = loader.load_ops(ctx.device, arch=ctx.arch, winograd=True)
    h, w = ctx.latent_hw
    rows = []
    for op, ci, co, (kt, kh, kw), s in dominant_convs(ctx):
        if op != "conv3d" or (kh, kw) != (3, 3):
            continue
        x, weight, b = conv_layer_inputs((co, ci, kt), 4, h * s, w * s, ctx.device)
        row = conv_speeds(direct.conv3d, winograd.conv3d, x, weight, b, lambda fn: time_fn(ctx, fn))
        row["allowance"] = winograd_conv_allowance(winograd, x, weight, b)
        row["winograd_wins"] = row["faster"] == "winograd" and row["allowance"]["ok"]
        rows.append(row)
    won = sorted({tuple(row["layer"]) for row in rows if row["winograd_wins"]})
    gpu = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else f"{ctx.arch} (dry run)"
    return {"direct_table": direct.name, "winograd_table": winograd.name, "layers": rows,
            "suggested_measured_winograd_layers": {gpu: [list(layer) for layer in won]},
            "suggested_entry": f"{gpu!r}: frozenset({won!r}),"}


def winograd_conv_allowance(table: Ops, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> dict:
    """The allowance of `table`'s conv3d output against the fp32 conv of the same bf16 operands (baseline: that conv
    rounded to bf16 once, the self-check's rule for one op)."""
    n, ti, hi, cols, _ = x.shape
    co, kt = w.shape[:2]
    out = torch.empty(n, ti - kt + 1, hi - 2, cols, co, device=x.device, dtype=torch.bfloat16)
    table.conv3d(x, w, b, out)
    with exact_fp32():
        ref = selfcheck.reference_conv3d(x.float(), w.float(), b)
    return compare_to_reference("winograd conv3d", out, ref, ref.to(torch.bfloat16)).figures()


def time_fn(ctx: Context, fn, repeats: int = 5) -> float:
    """Median seconds of `fn` (CUDA events on a GPU)."""
    fn()
    times = []
    for _ in range(repeats):
        if ctx.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compiled_self_check(ctx: Context, winograd: bool = False) -> dict:
    """The compiled op table's self-check (its (kt, 3, 3) convs by the Winograd kernels if `winograd`), run as the
    loader runs it (`verification.verify_build_isolated`: in a process of its own, a pass remembered in the build
    cache, so the steps after this one load the table without checking it again); after a failure, every case
    again, past the first failing one, for the whole diagnosis."""
    ext = extension.open_extension(ctx.arch)
    try:
        results = verification.verify_build_isolated(ext, ctx.device, winograd=winograd)  # returns only a pass
        verdict = {"ok": True}
    except extension.CompiledUnavailable as exc:
        results = selfcheck.self_check(make_ops(ext, winograd_convs=winograd), ctx.device, keep_going=True)
        verdict = {"ok": False, "verification": str(exc)[-4000:]}
    return verdict | {"cases": [r.to_json() | {"text": str(r)} for r in results]}


# --------------------------------------------------------------------------------------------------- the oracle


def oracle_path(ctx: Context, t: int) -> Path:
    h, w = ctx.latent_hw
    return ctx.scratch / f"oracle_{ctx.layout}_{h}x{w}_T{t}.pt"


def make_oracle(ctx: Context, t: int) -> None:
    """The fp32 reference and the release bf16 decode of T latent frames, saved for this process and the children."""
    z = ctx.latents(t)
    torch.save({"ref32": reference.decode(z, ctx.weights(), torch.float32).cpu(),
                "release": reference.decode(z, ctx.weights(torch.bfloat16), torch.bfloat16).cpu()},
               oracle_path(ctx, t))


def load_oracle(ctx: Context, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    saved = torch.load(oracle_path(ctx, t))
    return saved["ref32"].to(ctx.device), saved["release"].to(ctx.device)


# --------------------------------------------------------------------------------------------------- children


CHILD_STEPS = {
    "self_check": lambda ctx, _: compiled_self_check(ctx),
    "winograd_self_check": lambda ctx, _: compiled_self_check(ctx, winograd=True),
    "correctness": lambda ctx, _: correctness(ctx, ["compiled"]),
    "timing": lambda ctx, a: timing(ctx, a.get("names", ["compiled"]), a["t"]),
    "winograd_conv_bench": lambda ctx, _: winograd_conv_bench(ctx),
    "memory": lambda ctx, _: memory(ctx, ["compiled"]),
    "profile": lambda ctx, _: profile(ctx, ["compiled"]),
    "conv_bench": lambda ctx, _: conv_bench(ctx),
}


def run_child(args, step: str, clock: Clock, **payload) -> dict:
    """One compiled measurement in a fresh process (a fault there cannot touch this one); its result or its error."""
    timeout = clock.left()
    if timeout < 10:
        return {"skipped": "deadline"}
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", step, "--child-args", json.dumps(payload),
            "--scratch", str(args.scratch), "--frames-per-pass", str(args.frames_per_pass)]
    argv += ["--dry-run", "--stand-in", args.stand_in] if args.dry_run else []
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return {"error": f"timed out after {timeout:.0f} s (deadline)", "stderr": (exc.stderr or "")[-3000:]
                if isinstance(exc.stderr, str) else ""}
    lines = [line for line in done.stdout.splitlines() if line.startswith(TAG)]
    if done.returncode != 0 or not lines:
        return {"error": f"child exited with {done.returncode}", "stderr": done.stderr[-4000:]}
    return json.loads(lines[-1][len(TAG):])


def child_main(args) -> int:
    payload = json.loads(args.child_args)  # layout / video_hw: the Wan2.1 steps' model and size
    ctx = Context(args.dry_run, args.stand_in, args.scratch, args.frames_per_pass, payload.get("layout", "wan22"),
                  payload.get("video_hw"))
    result = CHILD_STEPS[args.child](ctx, payload)
    print(TAG + json.dumps(result, default=str), flush=True)
    return 0


# --------------------------------------------------------------------------------------------------- build


def build_step(ctx: Context, root: Path, clock: Clock) -> dict:
    """Cold build then warm load, each in a fresh process (as a user's first and second run), with time limits."""
    script = ("import json, sys, time; t = time.monotonic(); "
              f"sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r}); "
              "from fastvideo_pan2_ext.vae_kernel import extension; "
              "ext = extension.build_extension(sys.argv[1], root=sys.argv[2]); "
              "print(json.dumps({'seconds': time.monotonic() - t, 'file': ext.__file__, 'arch': ext.arch()}))")
    arch = "sm_90a" if ctx.dry_run else ctx.arch
    spec = extension.extension_spec(arch)
    result = {"arch": arch, "root": str(root), "key": build.extension_key(spec)}
    entry = build.published_entry(spec, root)
    result["cached_before_cold"] = (entry / build.MANIFEST).exists()
    for phase in ("cold", "warm"):
        try:
            done = subprocess.run([sys.executable, "-c", script, arch, str(root)], capture_output=True, text=True,
                                  timeout=max(clock.left(), 1))
        except subprocess.TimeoutExpired:
            result["error"] = f"{phase} build did not finish before the deadline"
            return result
        if done.returncode != 0:
            result["error"] = f"{phase} build failed:\n{done.stderr[-4000:]}"
            return result
        info = json.loads(done.stdout.strip().splitlines()[-1])
        result[f"{phase}_seconds"] = round(info["seconds"], 2)
        result["file"] = info["file"]
    result["ptxas"] = ptxas_resources((entry / build.BUILD_LOG).read_text(errors="replace"))
    return result


def ptxas_resources(log: str) -> list[dict]:
    """Registers, spills, stack and shared memory of each kernel, from nvcc's `-Xptxas=-v` lines in a build log."""
    kernels, current = [], None
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '(\S+)' for '(\w+)'", line):
            current = {"kernel": m.group(1)[:160], "arch": m.group(2)}
            kernels.append(current)
        elif current is not None and (m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                                                     r"(\d+) bytes spill loads", line)):
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif current is not None and (m := re.search(r"Used (\d+) registers", line)):
            current["registers"] = int(m.group(1))
            if s := re.search(r"(\d+) bytes smem", line):
                current["smem_bytes"] = int(s.group(1))
    return kernels


# --------------------------------------------------------------------------------------------------- the run


def environment(ctx: Context) -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "device": str(ctx.device), "compiled": ctx.arch,
    }
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        info.update(gpu=props.name, capability=list(torch.cuda.get_device_capability(ctx.device)),
                    sms=props.multi_processor_count, gpu_memory_gib=round(props.total_memory / 2**30, 1))
    info["driver"] = verification.driver_version()
    home = build.cuda_home()
    info["nvcc"] = build.tool_version([os.path.join(home, "bin", "nvcc"), "--version"]).splitlines()[-1] \
        if home else None
    try:
        info["cutlass"] = extension.cutlass_version(extension.cutlass_source_dir())
    except extension.CompiledUnavailable as exc:
        info["cutlass"] = f"unavailable: {exc}"
    try:
        import diffusers  # noqa: PLC0415

        info["diffusers"] = diffusers.__version__
    except ImportError as exc:
        info["diffusers"] = f"unavailable: {exc}"
    return info


def run(args) -> int:
    ctx = Context(args.dry_run, args.stand_in, args.scratch, args.frames_per_pass)
    clock = Clock(args.deadline)
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(args.out / f"gpu_check{'_dry_run' if args.dry_run else ''}.json", {
        "mode": "dry-run" if args.dry_run else "gpu", "deadline_seconds": args.deadline,
        "environment": environment(ctx), "config": ctx.config.__dict__, "sizes": ctx.sizes, "skipped": []})
    skip = {s for s in args.skip.split(",") if s}
    parent_names = ["release_bf16", "portable"] + (["diffusers_bf16"] if diffusers_available() else [])
    if "diffusers_bf16" not in parent_names:
        report.data["skipped"].append("diffusers_bf16: diffusers is not importable (carry the bundle's wheels)")

    def step(name: str, reserve: float, fn, *fn_args, **fn_kwargs):
        """Run one measurement unless skipped or out of time; record its result or its error."""
        if name.split(":")[0] in skip:
            return None
        if clock.left() < reserve:
            report.data["skipped"].append(f"{name}: deadline ({clock.left():.0f} s left, needs ~{reserve:.0f})")
            report.save()
            return None
        print(f"gpu_check: {name} ({clock.left():.0f} s left)", flush=True)
        try:
            value = fn(*fn_args, **fn_kwargs)
        except Exception as exc:  # recorded; the run goes on
            value = {"error": f"{type(exc).__name__}: {exc}"[-4000:]}
        report.put(name, value)
        return value

    if "build" not in skip:
        root = args.build_root or Path(tempfile.mkdtemp(prefix="wan22-build-"))
        os.environ[build.BUILD_DIR_ENV] = str(root)  # the compiled decoders below load this build
        step("build", 30, build_step, ctx, root, clock)
    elif args.build_root:
        os.environ[build.BUILD_DIR_ENV] = str(args.build_root)
    step("compiled_self_check", 20, run_child, args, "self_check", clock)

    # Most valuable first. Each size: the fp32 oracle and the decoders of this process, then the compiled child.
    for t in ctx.sizes["correctness_t"]:
        step(f"oracle:T={t}", 20, make_oracle, ctx, t)
    step("correctness", 20, correctness, ctx, ["release_bf16", "portable"])
    step("compiled_correctness", 20, run_child, args, "correctness", clock)
    big, *rest = ctx.sizes["timing_t"]
    step(f"oracle:T={big}", 60, make_oracle, ctx, big)
    step(f"timing:T={big}", 60, timing, ctx, parent_names, big)
    step(f"compiled_timing:T={big}", 30, run_child, args, "timing", clock, t=big)
    # Winograd F(2x2, 3x3): its self-check, each dominant layer direct vs Winograd, the whole decode at the largest T.
    step("compiled_winograd_self_check", 20, run_child, args, "winograd_self_check", clock)
    step("winograd_conv_bench", 20, run_child, args, "winograd_conv_bench", clock)
    step(f"compiled_winograd_timing:T={big}", 30, run_child, args, "timing", clock, t=big,
         names=["compiled_winograd"])
    step("memory", 20, memory, ctx, ["portable"])
    step("compiled_memory", 20, run_child, args, "memory", clock)
    step("profile", 20, profile, ctx, ["portable"])
    step("compiled_profile", 20, run_child, args, "profile", clock)
    step("conv_bench", 20, run_child, args, "conv_bench", clock)
    for t in rest:
        step(f"timing:T={t}", 40, timing, ctx, parent_names, t)
        step(f"compiled_timing:T={t}", 30, run_child, args, "timing", clock, t=t)
    # Lowest priority: the Wan2.1 VAE, release bf16 here and compiled in a child, per video size.
    for h, w in ctx.sizes["wan21_hw"]:
        wan21 = Context(args.dry_run, args.stand_in, args.scratch, args.frames_per_pass, "wan21", (h, w))
        step(f"wan21_timing:{h}x{w}", 90, timing, wan21, ["release_bf16"], ctx.sizes["wan21_t"])
        step(f"compiled_wan21_timing:{h}x{w}", 30, run_child, args, "timing", clock, t=ctx.sizes["wan21_t"],
             layout="wan21", video_hw=[h, w])

    report.data["total_seconds"] = round(time.monotonic() - started, 1)
    report.data["summary"] = summary(report.data, ctx)
    report.save()
    ok = report.data["summary"]["compiled_ok"]
    print(f"gpu_check: wrote {report.path} ({report.data['total_seconds']} s); compiled decoder correct at every "
          f"size: {ok}; skipped: {report.data['skipped'] or 'nothing'}", flush=True)
    return 0 if ok else 1


def summary(data: dict, ctx: Context) -> dict:
    """The headline: did the compiled decoder build, pass its self-check and the allowance at every size; speeds
    (`timing_summary`), Winograd's verdicts and speed (`winograd_summary`), the Wan2.1 VAE's speeds per size."""
    build_ok = "build" in data and "error" not in data["build"]
    self_check_ok = data.get("compiled_self_check", {}).get("ok", False)
    audits = [v for v in data.get("compiled_correctness", {}).values() if isinstance(v, dict) and "compiled" in v]
    sizes_ok = len(audits) == len(ctx.sizes["correctness_t"]) and all(a["compiled"]["ok"] for a in audits)
    big = f"compiled_timing:T={max(ctx.sizes['timing_t'])}"
    big_ok = data.get(big, {}).get("compiled", {}).get("allowance", {}).get("ok", False)
    out = {"build_ok": build_ok, "self_check_ok": self_check_ok, "correct_at_every_size": sizes_ok and big_ok,
           "compiled_ok": build_ok and self_check_ok and sizes_ok and big_ok}
    for t in ctx.sizes["timing_t"]:
        out.update(timing_summary(data.get(f"timing:T={t}", {}), data.get(f"compiled_timing:T={t}", {}), f"T={t}"))
    out.update(winograd_summary(data, max(ctx.sizes["timing_t"])))
    for h, w in ctx.sizes["wan21_hw"]:
        out.update(timing_summary(data.get(f"wan21_timing:{h}x{w}", {}),
                                  data.get(f"compiled_wan21_timing:{h}x{w}", {}), f"wan21 {h}x{w}"))
    return out


def timing_summary(base: dict, compiled_step: dict, label: str) -> dict:
    """The median seconds of one size's decoders, and the compiled decoder's speedup over diffusers' decode (or the
    release decode where diffusers did not run)."""
    out = {}
    compiled = compiled_step.get("compiled", {})
    for name in ("release_bf16", "diffusers_bf16", "portable"):
        if "median_seconds" in base.get(name, {}):
            out[f"{label} {name} s"] = base[name]["median_seconds"]
    if "median_seconds" in compiled:
        out[f"{label} compiled s"] = compiled["median_seconds"]
        anchor = base.get("diffusers_bf16", base.get("release_bf16", {})).get("median_seconds")
        if anchor:
            out[f"{label} compiled speedup vs {'diffusers' if 'diffusers_bf16' in base else 'release'}"] = \
                round(anchor / compiled["median_seconds"], 2)
    return out


def winograd_summary(data: dict, big: int) -> dict:
    """Winograd's self-check, its whole decode at T = `big` (time, allowance, speedup over the direct kernels) and
    the suggested `MEASURED_WINOGRAD_LAYERS` entry."""
    out = {"winograd_self_check_ok": data.get("compiled_winograd_self_check", {}).get("ok", False)}
    winograd = data.get(f"compiled_winograd_timing:T={big}", {}).get("compiled_winograd", {})
    direct = data.get(f"compiled_timing:T={big}", {}).get("compiled", {})
    if "median_seconds" in winograd:
        out[f"T={big} compiled_winograd s"] = winograd["median_seconds"]
        out[f"T={big} winograd within the allowance"] = winograd.get("allowance", {}).get("ok", False)
        if "median_seconds" in direct:
            out[f"T={big} winograd speedup vs direct"] = round(direct["median_seconds"] / winograd["median_seconds"],
                                                               2)
    if "suggested_measured_winograd_layers" in data.get("winograd_conv_bench", {}):
        out["suggested_measured_winograd_layers"] = data["winograd_conv_bench"]["suggested_measured_winograd_layers"]
    return out


def diffusers_available() -> bool:
    try:
        import diffusers  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def single_threaded_cpu() -> None:
    """The dry run's CPU work in one thread, here and in every process it starts (children, the self-check's
    children): its ops are tiny, and on a shared machine a second thread waiting at every op's barrier made them
    5-100x slower (measured: the emulated self-check 32 s with two threads, 5 s with one)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, the emulated extension as compiled")
    parser.add_argument("--stand-in", default="emulated", choices=sorted(STAND_INS),
                        help="dry run: which emulated extension stands in for the compiled one")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")), help="where the JSON goes")
    parser.add_argument("--build-root", type=Path, default=None,
                        help="build cache for the cold/warm build (default: a fresh temporary one, so cold is cold)")
    parser.add_argument("--deadline", type=float, default=480.0,
                        help="seconds for the whole check; steps that no longer fit are skipped (default 480: one "
                             "600 s device command with 120 s to spare)")
    parser.add_argument("--frames-per-pass", type=argparse_type("frames_per_pass"), default="auto",
                        help="the timed decodes' setting (default: auto, the product's default)")
    parser.add_argument("--skip", default="", help="comma-separated steps to skip (build, timing, memory, ...)")
    parser.add_argument("--scratch", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=sorted(CHILD_STEPS), help=argparse.SUPPRESS)
    parser.add_argument("--child-args", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU (use --dry-run on CPU)", file=sys.stderr)
        return 2
    if args.dry_run:
        single_threaded_cpu()
    if args.child:
        return child_main(args)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        args.scratch = Path(scratch)
        return run(args)


if __name__ == "__main__":
    sys.exit(main())
