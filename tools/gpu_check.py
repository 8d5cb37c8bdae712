"""One GPU check of the compiled decoder (run through tools/gpu_check.sh): build cold then warm, correctness against
the fp32 reference at 704x1248 for T = 2 and 8, timing of the release bf16 decode vs the portable vs the compiled
decoder for T = 31 and 49, peak memory, and one JSON file with the GPU, the versions and the date.

Needs only torch (plus a C++ compiler, nvcc, ninja and CUTLASS headers for the build). The release bf16 decode is
`reference.decode(z, weights, torch.bfloat16)`, proven bit-identical to diffusers' `AutoencoderKLWan.decode` in bf16,
so no diffusers is needed on the GPU machine. Weights are seeded random in the real Wan2.2 layout.

`--dry-run` runs every step on CPU at tiny sizes, with the portable backend standing in for the compiled one and the
build done compile-only for sm_90a: it proves the script before a GPU is spent on it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from fastvideo_pan2_ext import reference
from fastvideo_pan2_ext.vae_kernel import build, compiled
from fastvideo_pan2_ext.vae_kernel.decoder import WanVAEDecoder

REAL = dict(z_dim=48, decoder_base_dim=256, dim_mult=(1, 2, 4, 4), num_res_blocks=2,
            temperal_upsample=(True, True, False), out_channels=12, patch_size=2)
TINY = dict(REAL, z_dim=8, decoder_base_dim=8)

FULL = dict(latent_hw=(44, 78), correctness_t=(2, 8), timing_t=(31, 49))
DRY = dict(latent_hw=(3, 4), correctness_t=(2, 3), timing_t=(3, 4))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def measured(device: torch.device, record: dict):
    """Wall time (synchronized) and peak allocated memory of the block, into `record`."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    sync(device)
    start = time.perf_counter()
    yield
    sync(device)
    record["seconds"] = round(time.perf_counter() - start, 4)
    if device.type == "cuda":
        record["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
        record["peak_above_start_gib"] = round((torch.cuda.max_memory_allocated(device) - base) / 2**30, 3)


def build_step(arch: str, root: Path) -> dict:
    """Cold build then warm load, each in a fresh process (as a user's first and second run)."""
    script = ("import json, sys, time; t = time.monotonic(); "
              "from fastvideo_pan2_ext.vae_kernel import compiled; "
              "ext = compiled.build_extension(sys.argv[1], root=sys.argv[2]); "
              "print(json.dumps({'seconds': time.monotonic() - t, 'file': ext.__file__, 'arch': ext.arch()}))")
    result = {"arch": arch, "root": str(root)}
    result["cached_before_cold"] = (build.published_entry(compiled.extension_spec(arch), root) /
                                    build.MANIFEST).exists()
    for phase in ("cold", "warm"):
        done = subprocess.run([sys.executable, "-c", script, arch, str(root)], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{phase} build failed:\n{done.stderr[-4000:]}")
        info = json.loads(done.stdout.strip().splitlines()[-1])
        result[f"{phase}_seconds"] = round(info["seconds"], 2)
        result["file"] = info["file"]
    return result


def correctness_step(weights, config_hw, ts, device, compiled_backend: str | None, seed: int = 1) -> list[dict]:
    results = []
    h, w = config_hw
    z_dim = reference.infer_config(weights).z_dim
    decoders = {name: WanVAEDecoder(weights, device=device, local=True, backend=backend)
                for name, backend in (("portable", "torch"), ("compiled", compiled_backend)) if backend}
    for t in ts:
        z = torch.randn(1, z_dim, t, h, w, generator=torch.Generator().manual_seed(seed + t)).to(device)
        ref32 = reference.decode(z, weights, torch.float32)
        release = reference.decode(z, weights, torch.bfloat16)
        entry = {"T": t, "frames": 4 * t - 3, "latent_hw": [h, w]}
        for name, decoder in decoders.items():
            video = decoder.decode(z)
            report = compiled.compare_to_reference(name, video, ref32, release, unit_range=True)
            entry[name] = {"max_err": report.max_err, "rms_err": report.rms_err, "ok": report.ok,
                           "backend": decoder.backend}
            del video
        base = compiled.compare_to_reference("release", release, ref32, release)
        entry["release_bf16"] = {"max_err": base.max_err, "rms_err": base.rms_err}
        results.append(entry)
        del ref32, release
    return results


def timing_step(weights, config_hw, ts, device, compiled_backend: str | None, frames_per_pass: int, seed: int = 2):
    results = []
    h, w = config_hw
    z_dim = reference.infer_config(weights).z_dim
    runners = {
        "release_bf16": lambda z: reference.decode(z, weights, torch.bfloat16),
        "portable": WanVAEDecoder(weights, device=device, local=True, backend="torch",
                                  frames_per_pass=frames_per_pass).decode,
    }
    if compiled_backend:
        runners["compiled"] = WanVAEDecoder(weights, device=device, local=True, backend=compiled_backend,
                                            frames_per_pass=frames_per_pass).decode
    warm = torch.randn(1, z_dim, 2, h, w).to(device)
    for run in runners.values():  # first-call costs (cuDNN autotune, kernel loading) stay out of the timings
        run(warm)
    for t in ts:
        z = torch.randn(1, z_dim, t, h, w, generator=torch.Generator().manual_seed(seed + t)).to(device)
        entry = {"T": t, "frames": 4 * t - 3, "latent_hw": [h, w], "frames_per_pass": frames_per_pass}
        for name, run in runners.items():
            record = {}
            with measured(device, record):
                video = run(z)
            del video
            entry[name] = record
        for name in ("portable", "compiled"):
            if name in entry:
                speedup = entry["release_bf16"]["seconds"] / entry[name]["seconds"]
                entry[f"speedup_{name}_vs_release"] = round(speedup, 2)
        results.append(entry)
    return results


def environment(device: torch.device) -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["capability"] = list(torch.cuda.get_device_capability(device))
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    home = build.cuda_home()
    info["nvcc"] = build._tool_version([os.path.join(home, "bin", "nvcc"), "--version"]).splitlines()[-1] \
        if home else None
    try:
        info["cutlass"] = compiled.cutlass_version(compiled.cutlass_source_dir())
    except compiled.CompiledUnavailable as exc:
        info["cutlass"] = f"unavailable: {exc}"
    return info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, portable backend as 'compiled'")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")), help="where the JSON goes")
    parser.add_argument("--build-root", type=Path, default=None,
                        help="build cache for the cold/warm build (default: a fresh temporary one, so cold is cold)")
    parser.add_argument("--frames-per-pass", type=int, default=4)
    parser.add_argument("--skip", default="", help="comma-separated steps to skip: build,correctness,timing")
    args = parser.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}

    if args.dry_run:
        device, sizes, config, compiled_backend = torch.device("cpu"), DRY, TINY, "torch"
        arch = "sm_90a"
    else:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA GPU (use --dry-run on CPU)", file=sys.stderr)
            return 2
        device, sizes, config, compiled_backend = torch.device("cuda", 0), FULL, REAL, "cuda"
        arch = compiled.arch_for_device(device)

    args.out.mkdir(parents=True, exist_ok=True)
    report = {"mode": "dry-run" if args.dry_run else "gpu", "environment": environment(device),
              "config": {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()},
              "sizes": {k: list(v) for k, v in sizes.items()}}
    out_file = args.out / f"gpu_check{'_dry_run' if args.dry_run else ''}.json"

    def save():
        out_file.write_text(json.dumps(report, indent=1))

    started = time.monotonic()
    if "build" not in skip:
        root = args.build_root or Path(tempfile.mkdtemp(prefix="wan22-build-"))
        os.environ[build.BUILD_DIR_ENV] = str(root)  # the decoders below load this build
        try:
            report["build"] = build_step(arch, root)
        except Exception as exc:  # e.g. no nvcc on the GPU machine: still measure the portable decoder
            report["build"] = {"arch": arch, "error": f"{type(exc).__name__}: {exc}"[-4000:]}
            compiled_backend = None if compiled_backend == "cuda" else compiled_backend
        print(f"build: {report['build']}", flush=True)
        save()

    weights = compiled.random_weights(reference.WanVAEConfig(**config))
    if device.type == "cuda" and compiled_backend == "cuda":
        try:  # the self-check (in a child process); outside the allowance -> no compiled timings, said in the JSON
            table = compiled.load_ops(device)
            report["self_check"] = [str(r) for r in compiled.self_check(table, device)]
        except compiled.CompiledUnavailable as exc:
            report["self_check"] = f"failed: {exc}"
            compiled_backend = None
        save()
    report["compiled_measured"] = compiled_backend is not None
    if "correctness" not in skip:
        report["correctness"] = correctness_step(weights, sizes["latent_hw"], sizes["correctness_t"], device,
                                                 compiled_backend)
        print(f"correctness: {json.dumps(report['correctness'])}", flush=True)
        save()
    if "timing" not in skip:
        report["timing"] = timing_step(weights, sizes["latent_hw"], sizes["timing_t"], device, compiled_backend,
                                       args.frames_per_pass)
        print(f"timing: {json.dumps(report['timing'])}", flush=True)
    report["total_seconds"] = round(time.monotonic() - started, 1)
    report["all_correct"] = compiled_backend is not None and all(
        e[k]["ok"] for e in report.get("correctness", []) for k in ("portable", "compiled"))
    save()
    print(f"gpu_check: wrote {out_file} ({report['total_seconds']} s); all correct: {report['all_correct']}")
    return 0 if report["all_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
