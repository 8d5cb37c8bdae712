"""The GPU check of the compiled decoder, in two commands (run it through gpu_check/gpu_check.sh; docs/gpu-check.md says
how, docs/design/gpu-check-rules.md, "The GPU check", why).

Part 1 (`--part 1`, about 280 s on an H200): what decides the design, first.
- build: cold then warm, each in a fresh process; the kernels' registers, spills and shared memory (ptxas -v);
- the compiled op table's self-check at every production op shape, then the Winograd table's (every case reported;
  run as the loader runs it, so a pass is remembered and no later step checks the table again);
- the whole decode at T = 49 (704x1248) by the compiled direct kernels, the compiled Winograd kernels and the portable
  decoder: one timed repeat after a warm-up, peak memory, which algorithm ran each (kt, 3, 3) conv, the calls that
  fell back to the portable op, and the allowance against an fp32 oracle of the first few latent frames (the decoder
  is causal in time: those frames of a T = 49 decode are the whole decode of its first latent frames);
- after the compiled direct timing, `pan2_block`: one joint block of PAN2's real transformer (random bf16 weights) at
  the 241-frame 704x1248 token count, timed with each attention kernel the machine has (torch's SDPA, its flash,
  memory-efficient and cuDNN kernels; FlashAttention 2, 3 and 4 where importable): ms per block, TFLOP/s against
  `model.cost`'s count, the sampler step it projects to.
Part 2 (`--part 2`): the rest.
- the same build and self-checks (remembered from part 1 on the same machine; done again on a fresh one);
- correctness at T = 2 and 8 against the whole fp32 reference: the release bf16, portable and compiled decodes;
- what the self-check never exercises (`coverage`): a Winograd GEMM with more tiles than the GPU has SMs, a conv in
  several Winograd bands, the sub-pixel conv writing more than 2^31 elements, two weight sets in one process;
- baselines at T = 49, one repeat each after a warm-up: the release decode (bf16 weights resident), diffusers' own
  `AutoencoderKLWan.decode` in bf16 under autocast (the bundle brings diffusers);
- peak memory at frames_per_pass 1, 2, 4 and auto, beside the planner's replay estimate;
- a torch.profiler kernel table (top 20) of one 4-frame pass; our conv against cuDNN's on the dominant layer shapes;
  each dominant (kt, 3, 3) layer by the direct and the Winograd kernels (the suggested
  `backends.MEASURED_WINOGRAD_LAYERS` entry);
- the fast encoder on image-to-video's input (the Wan2.1 VAE, 81 frames at 480x832) against diffusers' fp32 (TF32)
  and bf16 encodes: time, peak memory, the allowance of mean and logvar, the steady reuse on and off, bf16 on the
  portable and the compiled table; its row bands on two gloo ranks sharing the GPU against one rank;
- T = 31; the Wan2.1 VAE at 480x832 and 720x1280, 81 frames;
- `pan2_options`, what only a GPU runs of PAN2 in FastVideo: the tiny checkpoint through `VideoGenerator` (image to
  video, guidance 3.0, 2 steps, `return_trajectory_latents`) once plain and once with each of `dit_layerwise_offload`,
  `text_encoder_cpu_offload`, `vae_cpu_offload` (the DiT in fp32) and `use_fsdp_inference` on one GPU over NCCL (held
  to a plain bf16 run: FastVideo 0.2.1 gathers an FSDP DiT in bf16), each run a process of its own (the six start
  together on a GPU, in turn in a dry run): per run the final latents' max |d| from its reference run (absolute and
  relative to the reference's largest value), the frames', whether the option was in effect in FastVideo's worker
  (its own FastVideoArgs after the device policy; the DiT's blocks hooked by the layer-wise offload and emptied, the
  text encoder and VAE back on the CPU, the DiT's FSDP DTensors), seconds, `ok` (in effect, latents equal to fp32
  rounding); in a dry run the offloads are off (`compat.cpu_gaps` turns them off without a GPU) and recorded so;
- last, with its time reserved from the start: the PAN2 pipeline end to end in FastVideo on the tiny checkpoint, the
  fast decoder on, the mp4 streamed while decoding (`python -m fastvideo_pan2_ext.demo`).
The two FastVideo steps are skipped, with the reason, where FastVideo does not import.

Every step runs in a child process of its own (a new process group) under a hard time limit: the smaller of its own
cap and what is left of `--deadline`; at the limit the group is killed and the step recorded as timed out, so the run
cannot pass its deadline. A step whose expected time no longer fits is skipped and named in `skipped`; once a
self-check fails, the steps that need its table are skipped with that reason (no child checks it again). The JSON is
replaced atomically after every step. Each compiled decode records the calls its table handed to the portable op
(`fallbacks`); `compiled_ok` is false if any timed or audited compiled decode fell back. Exit code 0 only if every
compiled step that ran passed.

`--dry-run` runs all of it on CPU at tiny sizes: the build really compiles (sm_90a, compile-only), and the compiled
decoder is the emulated extension (`gpu_check/emulated_extension.py`, the Winograd kernels' API too) loaded through
the same loader and child-process self-check as a built one; `--stand-in emulated-abort` makes every compiled child
die, to prove the isolation. The dry run is single-threaded (`single_threaded_cpu`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import copy
import dataclasses
import datetime
import gc
import importlib
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's package, installed or not

from fastvideo_pan2_ext import reference  # noqa: E402
from fastvideo_pan2_ext.demo.tiny_checkpoints import tiny_pan2_transformer_config  # noqa: E402
from fastvideo_pan2_ext.model.architecture import PAN2TransformerConfig, latent_grid, weight_shapes  # noqa: E402
from fastvideo_pan2_ext.model.cost import joint_block_flops  # noqa: E402
from fastvideo_pan2_ext.model.memory import VAE_SPATIAL, Request  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.compiled import build, extension, loader, selfcheck, verification  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.definitions.allowance import compare_to_reference  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.definitions.architecture import (  # noqa: E402
    WAN21_CONFIG, WAN21_ENCODER_CONFIG, WAN22_CONFIG, WanVAEConfig, diffusers_arguments, diffusers_encoder_arguments,
    latent_frames, narrow, narrow_encoder)
from fastvideo_pan2_ext.vae_kernel.decoder import WanVAEDecoder  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.encoder import WanVAEEncoder  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.options import argparse_type  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.compiled.kernels import BY_DESIGN, CompiledKernels, make_ops  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.portable.ops import TORCH_OPS, Ops  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.definitions.precision import exact_fp32  # noqa: E402
from bench.bench import conv_layer_inputs, conv_speeds, measure  # noqa: E402
from bench.winograd_error import conv_layers  # noqa: E402
from gpu_check.emulated_extension import VARIANTS as STAND_INS, stand_in as stand_in_source  # noqa: E402

# layout -> (the real decoder, the dry run's narrow one)
CONFIGS = {"wan22": (WAN22_CONFIG, narrow(WAN22_CONFIG, 8, z_dim=8)), "wan21": (WAN21_CONFIG, narrow(WAN21_CONFIG, 8))}
# (latent rows, cols); correctness T (whole fp32 oracle); timing T (the largest is part 1's, audited on its first
# `oracle_frames` latent frames); memory T and frames_per_pass; the Wan2.1 VAE's video sizes and T (21: 81 frames);
# the coverage step's sub-pixel conv (channels, frames, rows, cols of its input: 20 frames of the 512-channel one at
# 704x1248 write 2.25e9 > 2^31 elements), the pipeline's video (height, width, frames, steps), the PAN2 block's
# request (frames, height, width, text tokens: PAN2's default video, the most text it conditions on; the dry run's
# block is the tiny checkpoint's) and the PAN2 options' request (height, width, frames, steps; the tiny checkpoint).
FULL = dict(latent_hw=(44, 78), correctness_t=(2, 8), timing_t=(49, 31), oracle_frames=3, memory_t=9,
            memory_fpp=(1, 2, 4, "auto"), wan21_hw=((480, 832), (720, 1280)), wan21_t=21,
            big_subpixel=(512, 20, 176, 312), pipeline=(256, 384, 17, 2), encode=(81, 480, 832, 96),
            pan2_block=(241, 704, 1248, Request(704, 1248, 241).text_tokens), pan2_options=(256, 384, 17, 2))
DRY = dict(latent_hw=(3, 4), correctness_t=(2, 3), timing_t=(4, 3), oracle_frames=2, memory_t=5,
           memory_fpp=(1, 2, 4, "auto"), wan21_hw=((16, 24), (24, 32)), wan21_t=3,
           big_subpixel=(8, 3, 12, 16), pipeline=(64, 96, 9, 1), encode=(13, 16, 24, 8), pan2_block=(9, 64, 96, 8),
           pan2_options=(64, 96, 9, 2))
# Dominant conv shapes of the real decoder at 704x1248 (Ci, Co, kernel, latent-relative scale) and the sub-pixel convs.
BENCH_CONVS = [(1024, 1024, (3, 3, 3), 2), (1024, 512, (3, 3, 3), 4), (512, 512, (3, 3, 3), 4),
               (512, 256, (3, 3, 3), 8), (256, 256, (3, 3, 3), 8)]
BENCH_UPSAMPLES = [(1024, 1), (1024, 2), (512, 4)]  # (channels, scale of the low-resolution input)
WARMUP_T = 9  # the warm-up decode: the first frame, then two 4-frame passes
REPEATS = 1  # timed decodes after the warm-up (the lease buys numbers, not error bars)
WINOGRAD_TILE = (128, 256)  # csrc/winograd.cu's TileShape (M, N) of one persistent CTA's GEMM tile
TAG = "GPU_CHECK_CHILD "
DEFAULT_DEADLINES = {1: 340.0, 2: 420.0}  # seconds; each inside one 600 s device command with room to spare
PIPELINE = "pipeline"
PAN2_BLOCK = "pan2_block"
PAN2_OPTIONS = "pan2_options"
PAN2_STEPS = 50  # PAN2's default sampler steps (configs.pan2), each two forwards (guidance)
# The founding figure: PAN2 on one B300, 241 frames at 704x1248, 50 steps, the whole run (text, denoise, decode).
FOUNDING_B300_S = {"fa4": 288, "sdpa": 670}


# --------------------------------------------------------------------------------------------------- bookkeeping


class Report:
    """The JSON result, replaced atomically (temp file + rename) after every step."""

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
    """The run's deadline."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


class Context:
    """What every step needs: where it runs, the model (the Wan2.2 VAE; `layout="wan21"`: the Wan2.1 VAE decoding
    video of `video_hw`), the sizes, the scratch folder the children read."""

    def __init__(self, dry_run: bool, stand_in: str, scratch: Path, frames_per_pass: int | str,
                 layout: str = "wan22", video_hw: tuple[int, int] | None = None) -> None:
        self.dry_run, self.stand_in = dry_run, stand_in
        self.device = torch.device("cpu") if dry_run else torch.device("cuda", 0)
        self.layout = layout
        self.config = CONFIGS[layout][dry_run]
        self.sizes = DRY if dry_run else FULL
        self.latent_hw = (tuple(s // self.config.spatial_scale for s in video_hw) if video_hw
                          else tuple(self.sizes["latent_hw"]))
        self.arch = stand_in if dry_run else extension.arch_for_device(self.device)
        self.source = stand_in_source(stand_in) if dry_run else extension.built(self.arch)
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
    """The allowance figures of `video` against the oracle; an oracle of fewer latent frames judges the frames it
    covers (the decoder is causal in time)."""
    frames = ref32.shape[2]
    return compare_to_reference(name, video[:, :, :frames], ref32, release, unit_range=True).figures()


@contextlib.contextmanager
def counting_fallbacks(ctx: Context, name: str, entry: dict):
    """Into entry["fallbacks"]: the calls the compiled table of decoder `name` handed to the portable op during the
    block (op: reason -> count; empty: every call ran on the kernels). Nothing for the other decoders."""
    table = op_table(ctx, name) if name.startswith("compiled") else None
    before = dict(table.fallbacks) if table is not None else {}
    yield
    if table is not None:
        entry["fallbacks"] = fallback_delta(table, before)


def fallback_delta(table: Ops, before: dict) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in table.fallbacks.items() if v != before.get(k, 0)}


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
        return loader.load_ops(ctx.device, source=ctx.source)
    if name == "compiled_winograd":
        return loader.load_ops(ctx.device, source=ctx.source, winograd=True)
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
    vae = AutoencoderKLWan(**diffusers_arguments(c))  # the encoder never runs here
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
        out[t] = {}
        for name, run in runners.items():
            entry = {}
            with counting_fallbacks(ctx, name, entry):
                video = run(ctx.latents(t))
            out[t][name] = audit(name, video, ref32, release) | entry
    return out


def timing(ctx: Context, names, t: int) -> dict:
    """decoder -> median of REPEATS after a warm-up, peak memory, the calls that fell back (compiled tables); where
    an oracle of this T was made, the allowance figures too."""
    out = {}
    for name, run in decoders(ctx, names).items():
        entry: dict = {}
        with counting_fallbacks(ctx, name, entry):
            run(ctx.latents(WARMUP_T, seed=99))  # first-call costs (cuDNN autotune, kernel loading) stay out
            runs, video, plan = [], None, plan_of(run, (1, ctx.config.z_dim, t, *ctx.latent_hw))
            for _ in range(REPEATS):
                del video
                record = {}
                with measured(ctx, record):
                    video = run(ctx.latents(t))
                runs.append(record)
        entry |= {"median_s": statistics.median(r["seconds"] for r in runs), "runs": runs, "plan": plan}
        if (table := op_table(ctx, name)) is not None:
            entry["conv_algorithms"] = layer_algorithms(table, ctx.config)
        if oracle_path(ctx, t).exists():
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
            with counting_fallbacks(ctx, name, record), measured(ctx, record):
                run(ctx.latents(t))
            replay = WanVAEDecoder(ctx.weights(), ctx.device, local=True, backend="torch", frames_per_pass=fpp)
            record["replay_peak_gib"] = round(replay.peak_bytes(ctx.latents(t).shape) / 2**30, 3)
            out[fpp][name] = record
    return out


def encode_inputs(device: torch.device, size) -> tuple:
    """The encode steps' seeded diffusers Wan2.1 VAE (encoder base width size[3]) on `device`, and image-to-video's
    input: an image, then zero frames ([1, 3, size[0], size[1], size[2]]). The same in every process of the run."""
    from diffusers import AutoencoderKLWan  # noqa: PLC0415 - carried to the GPU machine in the bundle

    frames, height, width, base = size
    vae = AutoencoderKLWan(**diffusers_encoder_arguments(narrow_encoder(WAN21_ENCODER_CONFIG, base)))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in vae.named_parameters():
            param.copy_(selfcheck.seeded_parameter(name, param.shape, generator))
    video = torch.zeros((1, 3, frames, height, width), device=device)
    video[:, :, :1] = torch.rand((1, 3, 1, height, width), generator=generator).to(device) * 2 - 1
    return vae.to(device).eval(), video


BAND_RANKS = 2
BAND_PRECISIONS = ("auto", "bf16")


def _encode_band_rank(rank: int, scratch: str, device: str, size: list) -> None:
    """One rank of `encode_bands` (spawned): its band of the encode steps' input, saved for the parent."""
    import torch.distributed as dist  # noqa: PLC0415

    torch.set_num_threads(1)  # the ranks share this machine; the parent encodes at one thread too
    dist.init_process_group("gloo", init_method=f"file://{scratch}/bands-rendezvous", rank=rank,
                            world_size=BAND_RANKS, timeout=datetime.timedelta(seconds=300))
    try:
        vae, video = encode_inputs(torch.device(device), size)
        saved = {}
        for precision in BAND_PRECISIONS:
            # the default group: the two ranks' bands; the portable table in every process, on a GPU as in the dry
            # run (each process would otherwise self-check the compiled one on its own)
            encoder = WanVAEEncoder(vae, precision=precision, backend="torch")
            start = time.perf_counter()
            saved[precision] = encoder.encode(video).cpu()
            saved[f"{precision}_seconds"] = round(time.perf_counter() - start, 4)
            saved[f"{precision}_reused"] = {k: list(v) for k, v in encoder.last_reuse.items()}
        torch.save(saved, f"{scratch}/band{rank}.pt")
    finally:
        dist.destroy_process_group()


def encode_bands(ctx: Context) -> dict:
    """The fast encoder's row bands over two gloo ranks sharing this device (two processes: a check of the bands'
    result, not of their speed; the portable table) on the encode step's input, precision "auto" and "bf16", against
    the same encode on one rank: bit-identical where each conv sums in the same order whatever the rows of its call
    (the dry run, at one thread); else within the allowance of one rank's exact fp32 encode (baseline: one rank's
    bf16 encode)."""
    import torch.multiprocessing as mp  # noqa: PLC0415

    scratch = ctx.scratch / "encode_bands"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    size = list(ctx.sizes["encode"])
    mp.start_processes(_encode_band_rank, args=(str(scratch), str(ctx.device), size), nprocs=BAND_RANKS,
                       start_method="spawn")
    bands = [torch.load(scratch / f"band{rank}.pt") for rank in range(BAND_RANKS)]
    torch.set_num_threads(1)  # as the ranks (this step's own process)
    vae, video = encode_inputs(ctx.device, size)
    with exact_fp32():
        ref32 = WanVAEEncoder(vae, precision="fp32").encode(video).cpu()
    alone_bf16 = WanVAEEncoder(vae, precision="bf16", backend="torch").encode(video).cpu()
    out: dict = {"ranks": BAND_RANKS, "video": list(video.shape), "backend": "torch"}
    for precision in BAND_PRECISIONS:
        encoder = WanVAEEncoder(vae, precision=precision, backend="torch")
        alone = encoder.encode(video).cpu()
        got = [band[precision] for band in bands]
        entry = {"bit_identical": all(torch.equal(g, alone) for g in got),
                 "ranks_agree": all(torch.equal(g, got[0]) for g in got),
                 "max_abs_diff": max(float((g.float() - alone.float()).abs().max()) for g in got),
                 "reuse_as_one_rank": all(band[f"{precision}_reused"] == {k: list(v) for k, v in
                                                                          encoder.last_reuse.items()}
                                          for band in bands),
                 "rank_seconds": [band[f"{precision}_seconds"] for band in bands],
                 "allowance": {half: compare_to_reference(f"bands {precision} {half}", got[0].chunk(2, 1)[i],
                                                          ref32.chunk(2, 1)[i], alone_bf16.chunk(2, 1)[i]).figures()
                               for i, half in enumerate(("mean", "logvar"))}}
        within = all(a["ok"] for a in entry["allowance"].values())
        entry["ok"] = entry["ranks_agree"] and entry["reuse_as_one_rank"] and (
            entry["bit_identical"] if ctx.dry_run else entry["bit_identical"] or within)
        out[precision] = entry
    out["ok"] = all(out[p]["ok"] for p in BAND_PRECISIONS)
    return out


def encode(ctx: Context) -> dict:
    """The fast encoder (one rank) on image-to-video's input (an image, then zero frames: `sizes["encode"]` frames,
    height, width and the Wan2.1 encoder's base width) against diffusers' own encode of the same weights: diffusers
    in fp32 as torch's defaults run it (TF32 convs on a GPU) and in bf16; the fast encoder at precision "auto" with
    the steady reuse on and off, and "bf16" on the portable table and on the compiled one (its calls that ran
    portable counted: conv_in, the stride-2 convs and patchify by design). Each timed once after a warm-up; the
    moments judged by the allowance against diffusers' fp32 encode with TF32 off (mean and logvar apart; baselines:
    diffusers' TF32 and bf16 encodes)."""
    vae, video = encode_inputs(ctx.device, ctx.sizes["encode"])
    vae_bf16 = copy.deepcopy(vae).to(torch.bfloat16)
    warm = video[:, :, :5]

    def diffusers_encode(x, dtype=torch.float32):
        with torch.no_grad():
            return (vae if dtype == torch.float32 else vae_bf16).encode(x.to(dtype)).latent_dist.parameters.float()

    with exact_fp32():
        ref32 = diffusers_encode(video)
    out: dict = {"video": list(video.shape), "encoder_base_dim": ctx.sizes["encode"][3]}
    results = {}
    encoders = [("diffusers_fp32", diffusers_encode),
                ("diffusers_bf16", lambda x: diffusers_encode(x, torch.bfloat16)),
                ("fast_auto", WanVAEEncoder(vae).encode),
                ("fast_auto_no_reuse", WanVAEEncoder(vae, reuse_steady=False).encode),
                ("fast_bf16", WanVAEEncoder(vae, precision="bf16", backend="torch").encode)]
    judged = [("fast_auto", "diffusers_fp32"), ("fast_auto_no_reuse", "diffusers_fp32"),
              ("fast_bf16", "diffusers_bf16")]
    try:
        compiled = op_table(ctx, "compiled")
        encoders.append(("fast_bf16_compiled", WanVAEEncoder(vae, precision="bf16", backend=compiled).encode))
        judged.append(("fast_bf16_compiled", "diffusers_bf16"))
    except extension.CompiledUnavailable as exc:  # recorded; the other encodes still run
        compiled, out["fast_bf16_compiled"] = None, {"error": str(exc)}
    for name, run in encoders:
        run(warm)
        record: dict = {}
        before = dict(compiled.fallbacks) if compiled is not None else {}
        with measured(ctx, record):
            results[name] = run(video)
        if name == "fast_bf16_compiled":
            record["fallbacks"] = fallback_delta(compiled, before)
        out[name] = record
    for name, baseline in judged:
        out[name]["allowance"] = {
            half: compare_to_reference(f"{name} {half}", results[name].chunk(2, 1)[i], ref32.chunk(2, 1)[i],
                                       results[baseline].chunk(2, 1)[i]).figures()
            for i, half in enumerate(("mean", "logvar"))}
        # Where diffusers' fp32 encode is exact fp32 (no TF32: a CPU), the baseline error is 0 and fp32 rounding judges.
        rounding = 2e-5 * max(1.0, float(ref32.abs().max()))
        out[name]["ok"] = all(a["ok"] or (a["baseline_max_err"] == 0 and a["max_err"] <= rounding)
                              for a in out[name]["allowance"].values())
    out["reuse_bit_identical"] = bool(torch.equal(results["fast_auto"], results["fast_auto_no_reuse"]))
    if compiled is not None:  # the compiled encode hands the portable ops only what its kernels never take
        out["fast_bf16_compiled"]["ok"] &= all(BY_DESIGN in k for k in out["fast_bf16_compiled"]["fallbacks"])
    out["ok"] = out["reuse_bit_identical"] and all(out[n]["ok"] for n, _ in judged)
    return out


def profile(ctx: Context, names) -> dict:
    """decoder -> top-20 kernel table of a T = 5 decode (the first frame, then one 4-frame pass), and its host
    (issuing) time against its device (kernel) time."""
    from torch.profiler import ProfilerActivity, profile as torch_profile  # noqa: PLC0415

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
    out = {}
    for name, run in decoders(ctx, names, frames_per_pass=4).items():
        counted: dict = {}
        with counting_fallbacks(ctx, name, counted):
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
        } | counted
    return out


def dominant_convs(ctx: Context) -> list[tuple[str, int, int, tuple[int, int, int], int]]:
    """(op, Ci, Co, kernel, latent-relative scale) of BENCH_CONVS and BENCH_UPSAMPLES; the dry run's at tiny widths."""
    cases = [("conv3d", ci, co, k, s) for ci, co, k, s in BENCH_CONVS]
    cases += [("upsample2x_conv3x3", c, c, (1, 3, 3), s) for c, s in BENCH_UPSAMPLES]
    if ctx.dry_run:  # the same code at tiny widths
        cases = [(op, max(8, ci // 64), max(8, co // 64), k, s) for op, ci, co, k, s in cases]
    return cases


def conv_bench(ctx: Context) -> dict:
    """TFLOP/s of the compiled conv vs torch's (cuDNN) channels-last conv3d on the dominant layer shapes; the calls
    that fell back."""
    table = loader.load_ops(ctx.device, source=ctx.source)
    before = dict(table.fallbacks)
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
    return {"layers": rows, "fallbacks": fallback_delta(table, before)}


def winograd_conv_bench(ctx: Context) -> dict:
    """Direct vs Winograd F(2x2, 3x3) compiled convs at the dominant (kt, 3, 3) layer shapes (4 frames at their real
    size): time, TFLOP/s effective and actual (`bench.conv_speeds`), and the Winograd output's allowance against the
    fp32 conv. The layers where Winograd is faster and within the allowance are this GPU's suggested
    `backends.MEASURED_WINOGRAD_LAYERS` entry (what conv_algorithm "auto" then runs by Winograd)."""
    direct = loader.load_ops(ctx.device, source=ctx.source)
    winograd = loader.load_ops(ctx.device, source=ctx.source, winograd=True)
    before = {"direct": dict(direct.fallbacks), "winograd": dict(winograd.fallbacks)}
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
            "suggested_entry": f"{gpu!r}: frozenset({won!r}),",
            "fallbacks": fallback_delta(direct, before["direct"]) | fallback_delta(winograd, before["winograd"])}


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
    """Median seconds of `fn` after a warm-up (`bench.measure`: CUDA events on a GPU)."""
    return measure(fn, ctx.device, repeats, warmup=1)[1]["median_s"]


# --------------------------------------------------------------------------------------------------- the oracle


def oracle_path(ctx: Context, t: int) -> Path:
    h, w = ctx.latent_hw
    return ctx.scratch / f"oracle_{ctx.layout}_{h}x{w}_T{t}.pt"


def make_oracle(ctx: Context, t: int, frames: int | None = None) -> dict:
    """The fp32 reference and the release bf16 decode of the first `frames` (default: all) of the T latent frames
    the decoders decode, saved in the scratch folder for the steps after this one."""
    z = ctx.latents(t)[:, :, :frames or t]
    with exact_fp32():
        ref32 = reference.decode(z, ctx.weights(), torch.float32).cpu()
    torch.save({"ref32": ref32, "release": reference.decode(z, ctx.weights(torch.bfloat16), torch.bfloat16).cpu()},
               oracle_path(ctx, t))
    return {"t": t, "latent_frames": z.shape[2], "video_frames": ref32.shape[2]}


def load_oracle(ctx: Context, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    saved = torch.load(oracle_path(ctx, t))
    return saved["ref32"].to(ctx.device), saved["release"].to(ctx.device)


def compiled_self_check(ctx: Context, winograd: bool = False) -> dict:
    """The compiled op table's self-check (its (kt, 3, 3) convs by the Winograd kernels if `winograd`), run as the
    loader runs it (`verification.verify_build_isolated`: in a process of its own, a pass remembered in the build
    cache, so the steps after this one load the table without checking it again); after a failure, every case
    again, past the first failing one, for the whole diagnosis. A case that fell back to the portable op failed."""
    ext = ctx.source.open()
    try:
        results = verification.verify_build_isolated(ctx.source, ctx.device, winograd=winograd)  # returns only a pass
        verdict = {"ok": all(r.ok for r in results)}
    except extension.CompiledUnavailable as exc:
        results = selfcheck.self_check(make_ops(ext, winograd_convs=winograd), ctx.device, keep_going=True)
        verdict = {"ok": False, "verification": str(exc)[-4000:]}
    return verdict | {"cases": [r.to_json() | {"text": str(r), "ok": r.ok} for r in results]}


# --------------------------------------------------------------------------------------------------- coverage


def coverage(ctx: Context) -> dict:
    """What the user's self-check never exercises (its cases are small), each judged by the allowance and recorded on
    its own: a Winograd GEMM with more tiles than SMs, a conv in several Winograd bands, the sub-pixel conv writing
    more than 2^31 elements, two weight sets decoded by one compiled table in one process."""
    out = {}
    for name, check in (("winograd_many_tiles_and_bands", winograd_large), ("subpixel_over_2e31", subpixel_large),
                        ("two_weight_sets", two_weight_sets)):
        try:
            out[name] = check(ctx)
        except Exception as exc:  # recorded; the other checks still run
            out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[-3000:]}
        gc.collect()
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    out["ok"] = all(v.get("ok") is True for v in out.values())
    return out


def winograd_large(ctx: Context) -> dict:
    """The 1024-channel (3, 3, 3) conv at its real size (4 frames, latent x 2) by the compiled Winograd kernels: its
    GEMMs have more 128x256 tiles than the GPU has SMs (each persistent CTA takes several) and the conv runs in several
    bands of tile rows; the output against the fp32 conv."""
    table = loader.load_ops(ctx.device, source=ctx.source, winograd=True)
    before = dict(table.fallbacks)
    h, w = ctx.latent_hw
    c = 1024 if not ctx.dry_run else 16
    x, weight, b = conv_layer_inputs((c, c, 3), 4, 2 * h, 2 * w, ctx.device)
    _, ti, hi, cols, ci = x.shape
    frames, rows = ti - 2, hi - 2
    tiles_h, tiles_w = math.ceil(rows / 2), math.ceil(cols / 2)
    band_bytes = CompiledKernels.winograd_band_bytes if not ctx.dry_run else 16 * tiles_w * (ti * ci * 2 + frames * c
                                                                                               * 4) * 2
    row_bytes = 16 * tiles_w * (ti * ci * 2 + frames * c * 4)  # CompiledKernels._winograd_bands' rule
    bands = math.ceil(tiles_h / max(1, band_bytes // row_bytes))
    band_tiles = math.ceil(tiles_h / bands) * tiles_w
    gemm_tiles = 16 * math.ceil(frames * band_tiles / WINOGRAD_TILE[0]) * math.ceil(c / WINOGRAD_TILE[1])
    sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count if ctx.device.type == "cuda" else None
    with patched_band_bytes(band_bytes):
        figures = winograd_conv_allowance(table, x, weight, b)
    fell = fallback_delta(table, before)
    many_tiles = sms is None or gemm_tiles > sms
    return {"layer": [c, c, 3], "input": list(x.shape), "bands": bands, "gemm_tiles_per_band": gemm_tiles,
            "sms": sms, "allowance": figures, "fallbacks": fell,
            "ok": figures["ok"] and not fell and bands > 1 and many_tiles}


@contextlib.contextmanager
def patched_band_bytes(band_bytes: int):
    """The dry run's tiny conv in several bands: its band budget set to two tile rows (the real size needs none)."""
    saved = CompiledKernels.winograd_band_bytes
    CompiledKernels.winograd_band_bytes = band_bytes
    try:
        yield
    finally:
        CompiledKernels.winograd_band_bytes = saved


def subpixel_large(ctx: Context) -> dict:
    """The 512-channel sub-pixel conv (nearest 2x upsample + 3x3) on 20 frames at its real size: its 4-phase
    intermediate and its output have more than 2^31 elements (int64 indexing). Judged on the first and the last two
    frames (each frame is independent) against the fp32 definition."""
    table = loader.load_ops(ctx.device, source=ctx.source)
    before = dict(table.fallbacks)
    c, frames, rows, cols = ctx.sizes["big_subpixel"]
    g = torch.Generator(ctx.device).manual_seed(5)
    x = torch.randn(frames, rows + 2, cols, c, generator=g, device=ctx.device).to(torch.bfloat16)
    w3 = (torch.randn(c, c, 3, 3, generator=g, device=ctx.device) / (9 * c) ** 0.5).to(torch.bfloat16)
    b = (0.1 * torch.randn(c, generator=g, device=ctx.device)).to(torch.bfloat16).float()
    from fastvideo_pan2_ext.vae_kernel.portable import weights as weights_mod  # noqa: PLC0415

    w_sub = weights_mod.subpixel_weights(w3.float()).to(torch.bfloat16)
    out = torch.empty(frames, 2 * rows, 2 * cols, c, device=ctx.device, dtype=torch.bfloat16)
    table.upsample2x_conv3x3(x, w_sub, b, out)
    ctx.sync()
    picked = [0, frames - 2, frames - 1]
    with exact_fp32():
        ref = selfcheck.reference_upsample2x_conv3x3(x[picked].float(), w3.float(), b)
    figures = compare_to_reference("upsample2x_conv3x3 > 2^31", out[picked], ref, ref.to(torch.bfloat16)).figures()
    fell = fallback_delta(table, before)
    big = out.numel() > 2**31 or ctx.dry_run
    return {"channels": c, "frames": frames, "out": list(out.shape), "out_elements": out.numel(),
            "over_2e31": out.numel() > 2**31, "allowance": figures, "fallbacks": fell,
            "ok": figures["ok"] and not fell and big}


def two_weight_sets(ctx: Context) -> dict:
    """Two models (different seeded weights) decoded one after the other by the process's one compiled table, the
    first model's weights freed before the second's are made (the allocator then reuses their addresses, where a
    cache keyed by address would hand the second model the first one's tensors), then the first again: each video
    against its own release bf16 decode, at T = 2."""
    table = loader.load_ops(ctx.device, source=ctx.source)
    before = dict(table.fallbacks)
    t = 2
    z = ctx.latents(t)
    out = {}
    for label, seed in (("first", 0), ("second", 1), ("first again", 0)):
        state = selfcheck.random_weights(ctx.config, seed=seed, device=ctx.device)
        decoder = WanVAEDecoder(state, ctx.device, local=True, backend=table, frames_per_pass=2)
        video = decoder.decode(z)
        with exact_fp32():
            ref32 = reference.decode(z, state, torch.float32)
        release = reference.decode(z, {k: v.to(torch.bfloat16) for k, v in state.items()}, torch.bfloat16)
        out[label] = audit(f"{label} weight set (seed {seed})", video, ref32, release)
        del state, decoder, video, ref32, release
        gc.collect()
    fell = fallback_delta(table, before)
    return {"t": t, "videos": out, "fallbacks": fell, "ok": all(v["ok"] for v in out.values()) and not fell}


# --------------------------------------------------------------------------------------------------- PAN2's block


def attention_kernels() -> dict:
    """name -> an attention with `reference._pan2_sdpa`'s contract ([B, S, H, hd] q, k, v -> [B, S, H hd]), or the
    reason it is absent. Called directly, not through FastVideo's backends: part 1 carries no FastVideo (and FastVideo's
    flash backends need these same packages). torch's math kernel is left out: it materialises the scores (175 GB per
    block at 241 frames)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

    def only(backend):
        def attention(q, k, v):
            with sdpa_kernel([backend]):
                return reference._pan2_sdpa(q, k, v)
        return attention

    def flash(module: str):
        def attention(q, k, v):
            out = fn(q, k, v, softmax_scale=q.shape[-1] ** -0.5, causal=False)
            return (out[0] if isinstance(out, tuple) else out).flatten(2, 3)  # FA3/FA4 may return (out, lse)
        try:
            fn = importlib.import_module(module).flash_attn_func
        except Exception as exc:  # noqa: BLE001 - absent, or present and broken: either way not timed
            return f"not importable: {type(exc).__name__}: {exc}"[:300]
        return attention

    return {"sdpa": reference._pan2_sdpa,  # torch's own choice: the founding figure's "SDPA"
            "sdpa_flash": only(SDPBackend.FLASH_ATTENTION), "sdpa_efficient": only(SDPBackend.EFFICIENT_ATTENTION),
            "sdpa_cudnn": only(SDPBackend.CUDNN_ATTENTION),
            "fa2": flash("flash_attn"), "fa3": flash("flash_attn_interface"), "fa4": flash("flash_attn.cute")}


def pan2_block(ctx: Context, repeats: int = 3) -> dict:
    """One joint block of PAN2's transformer (`reference._pan2_joint_block`, the math tests/model/test_pan2_dit.py holds the
    DiT to) with random bf16 weights on the device, over the tokens of `sizes["pan2_block"]` (the real config and
    241 frames at 704x1248 on a GPU; the tiny checkpoint's config and a tiny video in a dry run), timed (median of
    `repeats` after a warm-up) with each attention kernel of `attention_kernels`. Per kernel: ms per block, TFLOP/s
    against `model.cost`'s count for one block, the step it projects to (every joint block, two forwards: the refiner
    and embeddings are under 0.2% of a step's FLOPs) and `PAN2_STEPS` of them, and its output's largest difference
    from torch's SDPA's (relative to the output's largest value)."""
    config = tiny_pan2_transformer_config() if ctx.dry_run else PAN2TransformerConfig()
    frames, height, width, text = ctx.sizes["pan2_block"]
    grid = latent_grid(config, latent_frames(frames), height // VAE_SPATIAL, width // VAE_SPATIAL)
    video, d, name = math.prod(grid), config.inner_dim, "transformer_blocks.0"
    g = torch.Generator(ctx.device).manual_seed(11)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=ctx.device, dtype=torch.bfloat16)

    # Matrices N(0, 1/fan_in) and gains near 1 keep the activations O(1) (no inf/NaN to time), as the checkpoint's.
    weights = {k: rand(*shape) * shape[-1] ** -0.5 if len(shape) > 1 else 1 + 0.1 * rand(*shape)
               for k, shape in weight_shapes(config).items() if k.startswith(f"{name}.")}
    x, c, temb = rand(1, video, d), rand(1, text, d), rand(1, d)
    rope = reference.pan2_rope(config, grid, ctx.device)
    flops = joint_block_flops(config, video, text)
    out: dict = {"config": "real" if not ctx.dry_run else "tiny", "hidden": d, "heads": config.num_attention_heads,
                 "head_dim": config.attention_head_dim, "blocks": config.num_layers, "grid": list(grid),
                 "video_tokens": video, "text_tokens": text,
                 "flops": {"linear": flops.linear, "attention": flops.attention},
                 "founding_b300_s": FOUNDING_B300_S, "kernels": {}}
    sdpa_out = None
    for kernel, attention in attention_kernels().items():
        if isinstance(attention, str):
            out["kernels"][kernel] = {"absent": attention}
            continue
        try:
            with torch.no_grad():
                (video_out, _), timed = measure(lambda: reference._pan2_joint_block(
                    weights, name, x, c, temb, rope, config.num_attention_heads, attention),  # noqa: B023 - run here
                    ctx.device, repeats, 1)
        except Exception as exc:  # noqa: BLE001 - a kernel this GPU or these shapes do not take: recorded, next one
            out["kernels"][kernel] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            continue
        finally:
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
        seconds = timed["median_s"]
        step = seconds * config.num_layers * 2
        entry = {"ms": round(seconds * 1e3, 3), "runs_ms": [round(t * 1e3, 3) for t in timed["times_s"]],
                 "tflops": float(f"{flops.total / seconds / 1e12:.4g}"), "projected_step_s": float(f"{step:.4g}"),
                 f"projected_{PAN2_STEPS}_steps_s": float(f"{step * PAN2_STEPS:.4g}"),
                 "finite": bool(torch.isfinite(video_out).all())}
        entry |= {k: round(v, 3) for k, v in timed.items() if k.endswith("_gib")}  # peak memory of the last run
        if sdpa_out is None:
            sdpa_out = video_out
        entry["max_diff_vs_sdpa"] = round(float((video_out.float() - sdpa_out.float()).abs().max()
                                                / sdpa_out.float().abs().max()), 5)
        out["kernels"][kernel] = entry
        del video_out
    timed_kernels = {k: v["ms"] for k, v in out["kernels"].items() if "ms" in v}
    out["fastest"] = min(timed_kernels, key=timed_kernels.get) if timed_kernels else None
    return out


# --------------------------------------------------------------------------------------------------- FastVideo


def fastvideo_here(ctx: Context, timeout: float) -> tuple[str | None, dict | None]:
    """(where FastVideo is, None), or (None, the step's skip record) where FastVideo or the PAN2 plugin does not
    import (a process of its own: importing FastVideo here would change this one)."""
    probe = subprocess.run([sys.executable, "-c", "import fastvideo, fastvideo_pan2_ext; print(fastvideo.__file__)"],
                           capture_output=True, text=True, timeout=min(timeout, 300), cwd=ctx.scratch)
    if probe.returncode != 0:
        return None, {"skipped": "FastVideo or the PAN2 plugin does not import here (part 2 installs the bundle's "
                                 f"wheels; see docs/gpu-check.md): {probe.stderr.strip().splitlines()[-1:]}"}
    return probe.stdout.strip().splitlines()[-1], None


def tiny_checkpoint(ctx: Context) -> Path:
    """The demo's tiny public-layout PAN2 checkpoint, made once per run in the scratch folder (the `pipeline` step's
    demo finds it there too)."""
    from fastvideo_pan2_ext.demo.pan2 import ensure_tiny_checkpoint  # noqa: PLC0415

    return ensure_tiny_checkpoint(ctx.scratch / "tiny-checkpoint")[0]


# --------------------------------------------------------------------------------------------------- PAN2's options

# The runs of `pan2_options`, each FastVideo's VideoGenerator in a process of its own: (name, dit_precision, the run
# its final latents are held to). Every run sets all four of FastVideo's options the plan decides (FastVideo 0.2.1's
# defaults turn every offload on) and FSDP's: off but its own. FastVideo 0.2.1's FSDP inference all-gathers the
# DiT's weights in bf16 whatever dit_precision says (`TransformerLoader`: `param_dtype=torch.bfloat16`), so FSDP is
# held to a plain bf16 run; the rest compute in fp32 and are held to the plain fp32 run.
OPTION_RUNS = (("plain", "fp32", None), ("dit_layerwise_offload", "fp32", "plain"),
               ("text_encoder_cpu_offload", "fp32", "plain"), ("vae_cpu_offload", "fp32", "plain"),
               ("plain_bf16", "bf16", None), ("use_fsdp_inference", "bf16", "plain_bf16"))
OPTION_FLAGS = ("dit_cpu_offload", "dit_layerwise_offload", "text_encoder_cpu_offload", "vae_cpu_offload",
                "use_fsdp_inference")
# What FastVideo's compat package turns off on a GPU-less machine (`fastvideo_integration.compat.cpu_gaps`'s
# CPU_OFFLOAD_FLAGS: FastVideo's offloads need CUDA), so a dry run records them off; FSDP2 runs there over gloo.
OFF_WITHOUT_GPU = ("dit_layerwise_offload", "text_encoder_cpu_offload", "vae_cpu_offload")
# The request (tests/model/test_pan2_parallel.py's): image-to-video, so the VAE's encode of the first frame is in the
# latents (vae_cpu_offload moves the VAE for it), with a negative prompt at guidance 3.0 (two forwards a step).
OPTION_REQUEST = {"prompt": "a fox", "negative_prompt": "blurry", "guidance_scale": 3.0, "seed": 5}
# The latents are fp32 through the sampler: equal "to fp32 rounding" is max|d| <= this x max|reference|, as
# tests/model/test_pan2_parallel.py holds several ranks to one.
OPTION_ROUNDING = 1e-5


def option_engine(name: str) -> dict:
    """FastVideo's `engine` section of run `name`: one GPU, every offload off but the one named, FSDP likewise."""
    return {"num_gpus": 1, "use_fsdp_inference": name == "use_fsdp_inference",
            "offload": {"dit": False, "dit_layerwise": name == "dit_layerwise_offload",
                        "text_encoder": name == "text_encoder_cpu_offload", "vae": name == "vae_cpu_offload"}}


def _worker_state(wrapper) -> dict:
    """Run in FastVideo's worker after the request (sent there by value through `collective_rpc`): the options as the
    worker's own FastVideoArgs have them after its device policy (FastVideo's conflicts and unified memory, our
    CPU settings of `compat.cpu_gaps`), and where each component's weights are: devices, bytes on an accelerator, the DiT's
    blocks hooked by FastVideo's layer-wise offload, its parameters that are FSDP's DTensors."""
    import torch  # noqa: PLC0415
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    worker = wrapper.worker
    args, pipeline = worker.fastvideo_args, worker.pipeline

    def where(params) -> dict:
        local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
        return {"devices": sorted({str(t.device) for t in local}),
                "device_bytes": sum(t.numel() * t.element_size() for t in local if t.device.type != "cpu"),
                "dtypes": sorted({str(t.dtype).replace("torch.", "") for t in local})}

    def hooked(block) -> bool:
        return "LayerwiseOffloadHook" in getattr(getattr(block, "_hook_manager", None), "forward_hooks", {})

    dit = pipeline.get_module("transformer")
    params = list(dit.parameters())
    lists = {name: child for name, child in dit.named_children() if isinstance(child, torch.nn.ModuleList)}
    meshes = {tuple(p.device_mesh.mesh.shape) for p in params if isinstance(p, DTensor)}
    return {"args": {flag: bool(getattr(args, flag, False)) for flag in
                     ("dit_cpu_offload", "dit_layerwise_offload", "text_encoder_cpu_offload", "vae_cpu_offload",
                      "use_fsdp_inference", "pin_cpu_memory")},
            "device": str(worker.device),
            "transformer": where(params) | {
                "parameters": len(params), "dtensor_parameters": sum(isinstance(p, DTensor) for p in params),
                "fsdp_meshes": [list(m) for m in sorted(meshes)],
                "module_lists": {name: {"blocks": len(blocks), "offload_hooked": sum(map(hooked, blocks)),
                                        "device_bytes": where(blocks.parameters())["device_bytes"]}
                                 for name, blocks in lists.items()}},
            "text_encoder": where(pipeline.get_module("text_encoder").parameters()),
            "vae": where(pipeline.get_module("vae").parameters())}


def pan2_option_run(ctx: Context, name: str, precision: str, checkpoint: str, out: str) -> dict:
    """One run of `pan2_options` (its own process): the tiny checkpoint through FastVideo's `VideoGenerator` as a
    user makes one (`from_config`, the demo's way), run `name`'s options, the DiT in `precision`; the final latents
    (`return_trajectory_latents`) and the frames saved to `out`; the worker's state after the request."""
    import cloudpickle  # noqa: PLC0415 - FastVideo's own dependency (its RPC sends functions so)
    import numpy as np  # noqa: PLC0415

    from fastvideo_pan2_ext.configs import PAN2PipelineConfig  # noqa: PLC0415
    from fastvideo_pan2_ext.demo.pan2 import SAMPLE_IMAGE  # noqa: PLC0415
    from fastvideo_pan2_ext.fastvideo_integration import compat  # noqa: PLC0415

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the checkpoint is local; the GPU machine has no network
    height, width, frames, steps = ctx.sizes[PAN2_OPTIONS]
    # The DiT in `precision`, the text encoder and both VAE passes in fp32.
    config = PAN2PipelineConfig(dit_precision=precision, text_encoder_precisions=("fp32",), vae_decode_precision="fp32")
    start = time.perf_counter()
    generator = compat.symbol("VideoGenerator").from_config({
        "model_path": checkpoint, "engine": option_engine(name),
        "pipeline": {"experimental": {"pipeline_config": config}}})
    loaded = time.perf_counter()
    try:
        result = generator.generate({
            "prompt": OPTION_REQUEST["prompt"], "negative_prompt": OPTION_REQUEST["negative_prompt"],
            "inputs": {"image_path": str(SAMPLE_IMAGE)},
            "sampling": {"height": height, "width": width, "num_frames": frames, "num_inference_steps": steps,
                         "guidance_scale": OPTION_REQUEST["guidance_scale"], "seed": OPTION_REQUEST["seed"]},
            "runtime": {"return_trajectory_latents": True},
            "output": {"output_path": str(Path(out).parent), "save_video": False, "return_frames": True}})
        generated = time.perf_counter()
        [state] = generator.executor.collective_rpc(cloudpickle.dumps(_worker_state))
    finally:
        generator.shutdown()
    latents = result.trajectory[:, -1].float().cpu()  # [batch, steps, C, T', h, w]: after the last step
    torch.save({"latents": latents, "frames": torch.from_numpy(np.stack(result.frames))}, out)
    return {"dit_precision": precision, "load_s": round(loaded - start, 2), "generate_s": round(generated - loaded, 2),
            "peak_memory_mb": result.peak_memory_mb, "latents_shape": list(latents.shape), "file": out,
            "worker": state}


def option_in_effect(name: str, worker: dict, dry_run: bool) -> tuple[bool, str]:
    """Whether run `name`'s option was in effect in FastVideo's worker (a plain run: that none was, and on a GPU
    every component's weights on it), and the evidence in words."""
    args, dit = worker["args"], worker["transformer"]
    if name.startswith("plain"):
        on = [flag for flag in OPTION_FLAGS if args.get(flag)]
        parked = [] if dry_run else [part for part in ("transformer", "text_encoder", "vae")
                                     if worker[part]["device_bytes"] == 0]
        where = "" if dry_run else f"; components with no weights on {worker['device']}: {parked or 'none'}"
        return not on and not parked, f"options on: {on or 'none'}{where}"
    if not args.get(name):
        cpu = dry_run and name in OFF_WITHOUT_GPU
        why = (" (`compat.cpu_gaps` turns FastVideo's offloads off on a GPU-less machine: "
               "fastvideo_pan2_ext.fastvideo_integration.compat.cpu_gaps.CPU_OFFLOAD_FLAGS)") if cpu else ""
        return False, f"the worker's FastVideoArgs have {name}=False{why}"
    if name == "dit_layerwise_offload":
        [(first, joint), *rest] = dit["module_lists"].items()  # FastVideo hooks the first ModuleList only
        others = sum(blocks["offload_hooked"] for _, blocks in rest)
        words = (f"{joint['offload_hooked']} of {joint['blocks']} {first} hooked by FastVideo's "
                 f"LayerwiseOffloadHook, {others} of the other blocks; {joint['device_bytes']} bytes of {first} "
                 "on the device after the run")
        return joint["offload_hooked"] == joint["blocks"] > 0 and others == 0 and joint["device_bytes"] == 0, words
    if name in ("text_encoder_cpu_offload", "vae_cpu_offload"):
        part = worker[name.split("_cpu_")[0]]
        return part["devices"] == ["cpu"], f"its weights after the run on {part['devices']}"
    words = (f"{dit['dtensor_parameters']} of {dit['parameters']} DiT parameters FSDP DTensors on meshes "
             f"{dit['fsdp_meshes']}")
    return dit["dtensor_parameters"] > 0, words  # use_fsdp_inference


def pan2_options(ctx: Context, timeout: float) -> dict:
    """What only a GPU runs of PAN2 in FastVideo: the tiny checkpoint through `VideoGenerator` once plain and once
    with each of `dit_layerwise_offload`, `text_encoder_cpu_offload`, `vae_cpu_offload` (the DiT in fp32) and
    `use_fsdp_inference` on one GPU over NCCL (held to a plain bf16 run: see `OPTION_RUNS`), each in a process of its
    own (FastVideo keeps global state; `run_child`), the same request and seed. Per run: the largest difference of
    its final latents from its reference run's (absolute, relative to the reference's largest value), the frames'
    (8-bit levels), whether the option was in effect in FastVideo's worker (`option_in_effect`), seconds; `ok`: in
    effect and the latents equal to fp32 rounding. On a GPU the runs start together (16 cores: their time is
    FastVideo's start), in a dry run one after another; there the offloads are off (FastVideo's offloads need CUDA)
    and recorded so, FSDP runs over gloo. Skipped, with the reason, where FastVideo does not import."""
    end = time.monotonic() + timeout - 10  # what is left for the runs: their results reach the report
    where, skipped = fastvideo_here(ctx, timeout)
    if skipped:
        return skipped
    checkpoint = str(tiny_checkpoint(ctx))
    folder = ctx.scratch / PAN2_OPTIONS
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    child = argparse.Namespace(scratch=ctx.scratch, frames_per_pass=ctx.frames_per_pass, dry_run=ctx.dry_run,
                               stand_in=ctx.stand_in)

    def launch(run) -> dict:
        name, precision, _ = run
        start = time.monotonic()
        result = run_child(child, "pan2_option", max(end - time.monotonic(), 1.0),
                           {"name": name, "precision": precision, "checkpoint": checkpoint,
                            "out": str(folder / f"{name}.pt")})
        return result | {"seconds": round(time.monotonic() - start, 1)}

    together = 1 if ctx.dry_run else len(OPTION_RUNS)
    with concurrent.futures.ThreadPoolExecutor(together) as pool:
        runs = dict(zip((run[0] for run in OPTION_RUNS), pool.map(launch, OPTION_RUNS)))
    height, width, frames, steps = ctx.sizes[PAN2_OPTIONS]
    out: dict = {"fastvideo": where, "checkpoint": checkpoint, "together": together, "rounding": OPTION_ROUNDING,
                 "request": OPTION_REQUEST | {"height": height, "width": width, "num_frames": frames,
                                              "num_inference_steps": steps, "image": "demo.pan2.SAMPLE_IMAGE"},
                 "options": {}}
    saved = {name: torch.load(run["file"]) for name, run in runs.items() if "file" in run}
    for name, _, held_to in OPTION_RUNS:
        entry = runs[name] | {"reference": held_to}
        if "file" not in entry:  # its error, or timed out: not ok
            out["options"][name] = entry | {"ok": False}
            continue
        entry["in_effect"], entry["evidence"] = option_in_effect(name, entry["worker"], ctx.dry_run)
        if held_to is None:
            entry["ok"] = entry["in_effect"]
        elif held_to not in saved:
            entry["ok"] = False
        else:
            got, ref = saved[name], saved[held_to]
            scale = float(ref["latents"].abs().max())
            diff = float((got["latents"] - ref["latents"]).abs().max())
            entry |= {"max_abs_diff": diff, "max_rel_diff": diff / scale, "reference_max_abs": scale,
                      "bit_identical": bool(torch.equal(got["latents"], ref["latents"])),
                      "frames_max_diff": int((got["frames"].int() - ref["frames"].int()).abs().max())}
            # Off on a CPU (`compat.cpu_gaps` turns FastVideo's offloads off there): the dry run rehearses the code path.
            if ctx.dry_run and name in OFF_WITHOUT_GPU and not entry["worker"]["args"][name]:
                entry["off_without_gpu"] = True
            effect = entry["in_effect"] or entry.get("off_without_gpu", False)
            entry["ok"] = effect and diff <= OPTION_ROUNDING * scale
        out["options"][name] = entry
    if {"plain", "use_fsdp_inference"} <= saved.keys():  # what FSDP's bf16 gather costs against fp32 (no verdict)
        fp32, fsdp = saved["plain"]["latents"], saved["use_fsdp_inference"]["latents"]
        out["options"]["use_fsdp_inference"]["max_rel_diff_vs_plain_fp32"] = float(
            (fsdp - fp32).abs().max() / fp32.abs().max())
    out["ok"] = all(entry["ok"] for entry in out["options"].values())
    return out


# --------------------------------------------------------------------------------------------------- the pipeline


def pipeline(ctx: Context, timeout: float) -> dict:
    """The PAN2 pipeline in FastVideo, end to end on the tiny checkpoint, the fast decoder on (backend "auto": the
    compiled kernels on a GPU) and the mp4 written while decoding: `python -m fastvideo_pan2_ext.demo`, in a process
    of its own (FastVideo starts its worker from there). Skipped, with the reason, where FastVideo does not import."""
    where, skipped = fastvideo_here(ctx, timeout)
    if skipped:
        return skipped
    height, width, frames, steps = ctx.sizes["pipeline"]
    out = ctx.scratch / "pipeline"
    argv = [sys.executable, "-m", "fastvideo_pan2_ext.demo", "--out", str(out), "--height", str(height), "--width",
            str(width), "--frames", str(frames), "--steps", str(steps), "--decoder", "kernel",
            "--cache-dir", str(ctx.scratch / "tiny-checkpoint")]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the installed package, as a user has it
    start = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=max(1.0, timeout - (time.monotonic() - start)),
                          cwd=ctx.scratch, env=env)
    log = done.stdout + done.stderr
    result = {"argv": argv[1:], "seconds": round(time.monotonic() - start, 1), "exit_code": done.returncode,
              "fastvideo": where,
              "decoder_lines": [line.strip()[-300:] for line in log.splitlines()
                                if "fast VAE decoder" in line or "PAN2 decode" in line or "decoder:" in line][:8]}
    video = out / "pan2_demo.mp4"
    if done.returncode != 0 or not video.is_file():
        return result | {"ok": False, "log_tail": log[-4000:]}
    from fastvideo_pan2_ext.media.video_io import mp4_size  # noqa: PLC0415

    stored_h, stored_w, stored_frames = mp4_size(video)
    backend = re.search(r"fast VAE decoder: backend (\w+)", log)
    result.update(video_frames=stored_frames, video_hw=[stored_h, stored_w],
                  backend=backend.group(1) if backend else None,
                  streamed="while decoding" in log)
    want_backend = "torch" if ctx.dry_run else "compiled"
    result["ok"] = (result["video_frames"] == frames and result["video_hw"] == [height, width]
                    and result["streamed"] and result["backend"] == want_backend)
    return result


# --------------------------------------------------------------------------------------------------- children


CHILD_STEPS = {
    "build": lambda ctx, a: build_step(ctx, Path(a["root"]), a["timeout"]),
    "self_check": lambda ctx, _: compiled_self_check(ctx),
    "winograd_self_check": lambda ctx, _: compiled_self_check(ctx, winograd=True),
    "oracle": lambda ctx, a: make_oracle(ctx, a["t"], a.get("frames")),
    "correctness": lambda ctx, a: correctness(ctx, a["names"]),
    "timing": lambda ctx, a: timing(ctx, a["names"], a["t"]),
    "coverage": lambda ctx, _: coverage(ctx),
    "memory": lambda ctx, a: memory(ctx, a["names"]),
    "profile": lambda ctx, a: profile(ctx, a["names"]),
    "encode": lambda ctx, _: encode(ctx),
    "encode_bands": lambda ctx, _: encode_bands(ctx),
    "conv_bench": lambda ctx, _: conv_bench(ctx),
    "winograd_conv_bench": lambda ctx, _: winograd_conv_bench(ctx),
    PIPELINE: lambda ctx, a: pipeline(ctx, a["timeout"]),
    PAN2_BLOCK: lambda ctx, _: pan2_block(ctx),
    PAN2_OPTIONS: lambda ctx, a: pan2_options(ctx, a["timeout"]),
    "pan2_option": lambda ctx, a: pan2_option_run(ctx, a["name"], a["precision"], a["checkpoint"], a["out"]),
}


def run_child(args, kind: str, limit: float, payload: dict) -> dict:
    """One step in a fresh process of its own group (a fault there cannot touch this one), killed with everything it
    started at `limit` seconds; its result, or its error."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--child-args",
            json.dumps(payload | {"timeout": limit}), "--scratch", str(args.scratch),
            "--frames-per-pass", str(args.frames_per_pass)]
    argv += ["--dry-run", "--stand-in", args.stand_in] if args.dry_run else []
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return {"error": f"timed out: killed at its hard limit of {limit:.0f} s", "timed_out": True,
                "stderr": stderr[-3000:]}
    answer = verification.last_tagged(TAG, stdout)
    if proc.returncode != 0 or answer is None:
        return {"error": f"child exited with {proc.returncode}", "stderr": stderr[-4000:]}
    return answer


def child_main(args) -> int:
    payload = json.loads(args.child_args)  # layout / video_hw: the Wan2.1 steps' model and size
    ctx = Context(args.dry_run, args.stand_in, args.scratch, args.frames_per_pass, payload.get("layout", "wan22"),
                  payload.get("video_hw"))
    try:
        result = CHILD_STEPS[args.child](ctx, payload)
    except Exception as exc:  # the step's error, with its message, in the report
        result = {"error": f"{type(exc).__name__}: {exc}"[-4000:]}
    print(verification.tagged_line(TAG, result), flush=True)
    return 0


# --------------------------------------------------------------------------------------------------- build


def build_step(ctx: Context, root: Path, timeout: float) -> dict:
    """Cold build (or the cached one: part 2 on the machine that ran part 1) then warm load, each in a fresh process
    (as a user's first and second run), within `timeout` together."""
    end = time.monotonic() + timeout - 5
    script = ("import sys, time; t = time.monotonic(); "
              f"sys.path.insert(0, {str(REPO)!r}); "
              "from fastvideo_pan2_ext.vae_kernel.compiled import extension, verification; "
              "ext = extension.build_extension(sys.argv[1], root=sys.argv[2]); "
              f"print(verification.tagged_line({TAG!r}, "
              "{'seconds': time.monotonic() - t, 'file': ext.__file__, 'arch': ext.arch()}))")
    arch = "sm_90a" if ctx.dry_run else ctx.arch
    spec = extension.extension_spec(arch)
    result = {"arch": arch, "root": str(root), "key": build.extension_key(spec)}
    entry = build.published_entry(spec, root)
    result["cached_before_cold"] = (entry / build.MANIFEST).exists()
    for phase in ("cold", "warm"):
        done = subprocess.run([sys.executable, "-c", script, arch, str(root)], capture_output=True, text=True,
                              timeout=max(end - time.monotonic(), 1))
        if done.returncode != 0:
            return result | {"error": f"{phase} build failed:\n{done.stderr[-4000:]}"}
        info = verification.last_tagged(TAG, done.stdout)
        if info is None:
            return result | {"error": f"{phase} build printed no result:\n{done.stderr[-4000:]}"}
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


# --------------------------------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of a part: the child that runs it and its payload; `needs`: the seconds it is expected to take
    (GPU, dry run), skipped when less is left; `cap`: its own hard limit on a GPU (a dry run's steps are bounded by
    the deadline alone: a shared CPU's speed varies too much for caps); `tables`: the self-checks whose op tables it
    decodes with (skipped once one of them failed)."""

    name: str
    kind: str
    payload: dict
    needs: tuple[float, float]
    cap: float
    tables: tuple[str, ...] = ()


DIRECT, WINOGRAD = ("compiled_self_check",), ("compiled_self_check", "compiled_winograd_self_check")


def part_steps(part: int, sizes: dict, with_diffusers: bool) -> list[Step]:
    """The steps of `part`, most valuable first."""
    big, *rest = sizes["timing_t"]
    steps = [Step("build", "build", {}, (60, 20), 240),
             Step("compiled_self_check", "self_check", {}, (40, 20), 200, ("build",)),
             Step("compiled_winograd_self_check", "winograd_self_check", {}, (40, 60), 200, ("build",))]
    if part == 1:
        return steps[:2] + [
            Step(f"oracle:T={big}", "oracle", {"t": big, "frames": sizes["oracle_frames"]}, (10, 5), 90),
            Step(f"compiled_timing:T={big}", "timing", {"t": big, "names": ["compiled"]}, (20, 10), 120,
                 DIRECT),
            Step(PAN2_BLOCK, PAN2_BLOCK, {}, (40, 10), 150),  # no table: plain torch and the attention kernels
            steps[2],
            Step(f"compiled_winograd_timing:T={big}", "timing", {"t": big, "names": ["compiled_winograd"]}, (20, 10),
                 120, WINOGRAD),
            Step(f"timing:T={big}", "timing", {"t": big, "names": ["portable"]}, (30, 10), 150)]
    baselines = ["release_bf16"] + ["diffusers_bf16"] * with_diffusers
    out = steps + [Step(f"oracle:T={t}", "oracle", {"t": t}, (10, 5), 120) for t in sizes["correctness_t"]]
    out += [Step("correctness", "correctness", {"names": ["release_bf16", "portable"]}, (10, 10), 120),
            Step("compiled_correctness", "correctness", {"names": ["compiled"]}, (10, 10), 120, DIRECT),
            Step("coverage", "coverage", {}, (30, 15), 150, WINOGRAD),
            Step(f"timing:T={big}", "timing", {"t": big, "names": baselines}, (60, 15), 200),
            Step("compiled_memory", "memory", {"names": ["compiled"]}, (20, 10), 120, DIRECT),
            Step("memory", "memory", {"names": ["portable"]}, (20, 10), 120)]
    out += [Step("encode", "encode", {}, (40, 20), 150), Step("encode_bands", "encode_bands", {}, (40, 30), 150)] * \
        with_diffusers
    out += [
            Step("compiled_profile", "profile", {"names": ["compiled"]}, (10, 10), 90, DIRECT),
            Step("profile", "profile", {"names": ["portable"]}, (10, 10), 90),
            Step("conv_bench", "conv_bench", {}, (10, 10), 90, DIRECT),
            Step("winograd_conv_bench", "winograd_conv_bench", {}, (15, 10), 90, WINOGRAD)]
    for t in rest:
        out += [Step(f"compiled_timing:T={t}", "timing", {"t": t, "names": ["compiled"]}, (15, 10), 90,
                     DIRECT),
                Step(f"timing:T={t}", "timing", {"t": t, "names": ["portable", *baselines]}, (60, 15), 150)]
    for h, w in sizes["wan21_hw"]:
        wan21 = {"t": sizes["wan21_t"], "layout": "wan21", "video_hw": [h, w]}
        out += [Step(f"compiled_wan21_timing:{h}x{w}", "timing", wan21 | {"names": ["compiled"]}, (15, 10),
                     90, DIRECT),
                Step(f"wan21_timing:{h}x{w}", "timing", wan21 | {"names": ["release_bf16"]}, (40, 15), 120)]
    # FastVideo's offloads and FSDP on NCCL (six FastVideo processes; together on a GPU, in turn in a dry run)
    out += [Step(PAN2_OPTIONS, PAN2_OPTIONS, {}, (60, 420), 120)]
    return out + [Step(PIPELINE, PIPELINE, {}, (60, 60), 150)]


def blocked_by(step: Step, data: dict) -> str | None:
    """Why `step` cannot run: a step whose table it needs failed (or was skipped)."""
    for name in step.tables:
        result = data.get(name)
        if result is None or "skipped" in result:
            return f"needs {name}, which did not run"
        if "error" in result or result.get("ok") is False:
            return f"{name} failed: {str(result.get('error') or result.get('verification') or 'see its cases')[:300]}"
    return None


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
    deadline = args.deadline or DEFAULT_DEADLINES[args.part] * (3 if args.dry_run else 1)
    clock = Clock(deadline)
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    with_diffusers = diffusers_available()
    report = Report(args.out / f"gpu_check{'_dry_run' if args.dry_run else ''}_part{args.part}.json", {
        "mode": "dry-run" if args.dry_run else "gpu", "part": args.part, "deadline_seconds": deadline,
        "environment": environment(ctx), "config": ctx.config.__dict__, "sizes": ctx.sizes, "skipped": []})
    if not with_diffusers and args.part == 2:
        report.data["skipped"].append("diffusers_bf16: diffusers is not importable (carry the bundle's wheels)")
    skip = {s for s in args.skip.split(",") if s}
    root = args.build_root or REPO / "build" / "gpu_check_cache"
    if args.build_root is None and args.part == 1:
        shutil.rmtree(root, ignore_errors=True)  # part 1's build is cold; part 2 reuses it on the same machine
    os.environ[build.BUILD_DIR_ENV] = str(root)  # every child loads this build and its remembered verdicts
    steps = part_steps(args.part, ctx.sizes, with_diffusers)
    # The pipeline runs last but its time is kept for it from the start: no step before it may eat into it.
    last = steps[-1] if steps[-1].kind == PIPELINE and PIPELINE not in skip else None
    kept = last.needs[args.dry_run] if last else 0.0

    def skipped(step: Step, why: str) -> None:
        report.data["skipped"].append(f"{step.name}: {why}")
        report.put(step.name, {"skipped": why})

    for step in steps:
        if step.name.split(":")[0] in skip or step.kind in skip:
            skipped(step, "--skip")
            continue
        if step.name != "build" and "build" in step.tables and "build" in skip:
            step = dataclasses.replace(step, tables=())  # --skip build: the cache given is the build
        reserve = 0.0 if step is last else kept
        if (why := blocked_by(step, report.data)) is not None:
            skipped(step, why)
            continue
        left = clock.left() - reserve
        needs = step.needs[args.dry_run]
        if left < needs:
            skipped(step, f"deadline ({clock.left():.0f} s left, needs ~{needs:.0f}"
                          f"{f' + {reserve:.0f} kept for the pipeline' if reserve else ''})")
            continue
        limit = left if args.dry_run else min(step.cap, left)
        print(f"gpu_check: {step.name} ({clock.left():.0f} s left, limit {limit:.0f} s)", flush=True)
        t0 = time.monotonic()
        value = run_child(args, step.kind, limit, step.payload | ({"root": str(root)} if step.kind == "build" else {}))
        value["step_seconds"] = round(time.monotonic() - t0, 1)
        if value.get("timed_out") and (args.dry_run or limit < step.cap):  # the deadline, not its cap, stopped it
            report.data["skipped"].append(f"{step.name}: killed at the deadline after {limit:.0f} s")
        report.put(step.name, value)

    report.data["total_seconds"] = round(time.monotonic() - started, 1)
    report.data["summary"] = summary(report.data, ctx)
    report.save()
    ok = report.data["summary"]["compiled_ok"]
    print(f"gpu_check: wrote {report.path} ({report.data['total_seconds']} s); compiled decoder correct everywhere "
          f"it ran, no fallbacks: {ok}; skipped: {report.data['skipped'] or 'nothing'}", flush=True)
    return 0 if ok else 1


def compiled_results(data: dict):
    """(step name, decoder or part, entry) of every compiled decode the report holds: the timed, audited, measured
    and profiled ones, the benches and the coverage checks."""
    for step, value in data.items():
        if not isinstance(value, dict) or "error" in value or "skipped" in value:
            continue
        if step in ("conv_bench", "winograd_conv_bench"):
            yield step, step, value
        elif step == "coverage":
            yield from ((step, k, v) for k, v in value.items() if isinstance(v, dict))
        elif step.startswith("compiled_") and not step.endswith("self_check"):
            for key, entry in value.items():
                if isinstance(entry, dict) and "compiled" in entry:  # correctness / memory: T or fpp -> decoder
                    yield from ((step, f"{key} {k}", v) for k, v in entry.items() if k.startswith("compiled"))
                elif key.startswith("compiled") and isinstance(entry, dict):
                    yield step, key, entry


def summary(data: dict, ctx: Context) -> dict:
    """The headline: did every compiled step that ran pass (built, self-checked, within the allowance where audited,
    not one call fallen back); the steps that failed; speeds (`timing_summary`), Winograd's (`winograd_summary`)."""
    ran = [k for k, v in data.items() if isinstance(v, dict) and "step_seconds" in v]
    failed = [k for k in ran if "error" in data[k] or data[k].get("ok") is False]
    fallbacks = {f"{step} {name}": entry["fallbacks"] for step, name, entry in compiled_results(data)
                 if entry.get("fallbacks")}
    missing = [step for step, name, entry in compiled_results(data) if "fallbacks" not in entry]
    audits = [(f"{step} {name}", entry.get("allowance", entry).get("ok"))
              for step, name, entry in compiled_results(data)
              if "allowance" in entry or step in ("compiled_correctness",)]
    given = data.get("build") == {"skipped": "--skip"}  # --skip build: the --build-root given is the build
    out = {"build_ok": given or ("build" in data and "error" not in data["build"] and "skipped" not in data["build"]),
           "self_check_ok": data.get("compiled_self_check", {}).get("ok", False),
           "winograd_self_check_ok": data.get("compiled_winograd_self_check", {}).get("ok", False),
           "audits_ok": all(ok for _, ok in audits), "audited": len(audits),
           "fallbacks": fallbacks, "fallbacks_not_recorded": missing, "failed_steps": failed}
    out["compiled_ok"] = (out["build_ok"] and out["self_check_ok"] and out["audits_ok"] and not fallbacks
                          and not missing and not failed)
    for t in ctx.sizes["timing_t"]:
        out.update(timing_summary(data.get(f"timing:T={t}", {}), data.get(f"compiled_timing:T={t}", {}), f"T={t}"))
    out.update(winograd_summary(data, max(ctx.sizes["timing_t"])))
    for h, w in ctx.sizes["wan21_hw"]:
        out.update(timing_summary(data.get(f"wan21_timing:{h}x{w}", {}),
                                  data.get(f"compiled_wan21_timing:{h}x{w}", {}), f"wan21 {h}x{w}"))
    if PIPELINE in data:
        out["pipeline_ok"] = data[PIPELINE].get("ok", False)
    if PAN2_OPTIONS in data:
        options = data[PAN2_OPTIONS]
        out["pan2_options_ok"] = options.get("ok", False)
        for name, entry in options.get("options", {}).items():
            if "max_rel_diff" in entry:
                out[f"pan2 {name} in effect, max rel diff"] = [entry["in_effect"],
                                                               float(f"{entry['max_rel_diff']:.3g}")]
    for kernel, entry in data.get(PAN2_BLOCK, {}).get("kernels", {}).items():
        if "ms" in entry:
            out[f"pan2 block {kernel} ms"] = entry["ms"]
            out[f"pan2 {kernel} projected {PAN2_STEPS} steps s"] = entry[f"projected_{PAN2_STEPS}_steps_s"]
    return out


def timing_summary(base: dict, compiled_step: dict, label: str) -> dict:
    """The median seconds of one size's decoders, and the compiled decoder's speedup over diffusers' decode (or the
    release decode where diffusers did not run)."""
    out = {}
    compiled = compiled_step.get("compiled", {})
    for name in ("release_bf16", "diffusers_bf16", "portable"):
        if "median_s" in base.get(name, {}):
            out[f"{label} {name} s"] = base[name]["median_s"]
    if "median_s" in compiled:
        out[f"{label} compiled s"] = compiled["median_s"]
        anchor = base.get("diffusers_bf16", base.get("release_bf16", {})).get("median_s")
        if anchor:
            out[f"{label} compiled speedup vs {'diffusers' if 'diffusers_bf16' in base else 'release'}"] = \
                round(anchor / compiled["median_s"], 2)
    return out


def winograd_summary(data: dict, big: int) -> dict:
    """Winograd's self-check, its whole decode at T = `big` (time, allowance, speedup over the direct kernels) and
    the suggested `MEASURED_WINOGRAD_LAYERS` entry."""
    out = {"winograd_self_check_ok": data.get("compiled_winograd_self_check", {}).get("ok", False)}
    winograd = data.get(f"compiled_winograd_timing:T={big}", {}).get("compiled_winograd", {})
    direct = data.get(f"compiled_timing:T={big}", {}).get("compiled", {})
    if "median_s" in winograd:
        out[f"T={big} compiled_winograd s"] = winograd["median_s"]
        out[f"T={big} winograd within the allowance"] = winograd.get("allowance", {}).get("ok", False)
        if "median_s" in direct:
            out[f"T={big} winograd speedup vs direct"] = round(direct["median_s"] / winograd["median_s"],
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
    parser.add_argument("--part", type=int, choices=(1, 2), default=1,
                        help="1: build, self-checks and the T = 49 timings (first); 2: everything else")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, the emulated extension as compiled")
    parser.add_argument("--stand-in", default="emulated", choices=sorted(STAND_INS),
                        help="dry run: which emulated extension stands in for the compiled one")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")), help="where the JSON goes")
    parser.add_argument("--build-root", type=Path, default=None,
                        help="build cache (default: build/gpu_check_cache in this tree, emptied by part 1 so that "
                             "its build is cold, reused by part 2)")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds for the whole part; no step runs past it (default: part 1 340, part 2 420; "
                             "three times that in a dry run)")
    parser.add_argument("--frames-per-pass", type=argparse_type("frames_per_pass"), default="auto",
                        help="the timed decodes' setting (default: auto, the product's default)")
    parser.add_argument("--skip", default="", help="comma-separated steps to skip (timing, memory, pipeline, ...)")
    parser.add_argument("--scratch", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=sorted(CHILD_STEPS), help=argparse.SUPPRESS)
    parser.add_argument("--child-args", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.deadline is not None and args.deadline <= 0:
        parser.error(f"--deadline must be positive; got {args.deadline}")
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
