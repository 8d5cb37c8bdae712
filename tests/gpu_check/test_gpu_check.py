"""gpu_check/gpu_check.sh rehearsed the way the GPU machine runs it, on CPU (docs/gpu-check.md): both parts.

The GPU machine gets a bare copy of the tree (what git tracks or would track; this package not installed), the bundle
of `gpu_check/make_gpu_bundle.sh`, a Python with its own packages only, and runs the script from the tree's root. Here:
the same copy; a Python 3.12 venv whose only packages are those of this venv that the GPU machine's image also holds
(linked into one folder that a `.pth` line adds: none of this venv's start-up hooks, this package's editable finder
included, ever runs); cwd = the tree's root; `--dry-run`, where the build really compiles sm_90a and the compiled
decoder is the emulated extension, loaded and self-checked in a child process exactly as a built one is. Part 2
installs the bundle's wheels (FastVideo among them) and the tree into its throwaway environment, as on the GPU.

The sm_90a build shares its cache with tests/vae_kernel/compiled/test_compile.py (one compile per session when both run).
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _source_tree import REPO, copy_source_tree

from fastvideo_pan2_ext.vae_kernel.compiled import build

pytestmark = [
    pytest.mark.skipif(build.cuda_home() is None, reason="no CUDA toolkit (nvcc) on this machine"),
    pytest.mark.timeout(2700),
    pytest.mark.slow,
]

# The Python packages of the GPU machine's image (device tool, KINDS.md, as read on 2026-11-17).
GPU_MACHINE_PACKAGES = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp
""".split())
def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _gpu_machine_python(root: Path) -> Path:
    """A venv with only the GPU machine's packages (this venv's copies, linked); returns its python."""
    site = root / "site"
    site.mkdir()
    for dist in importlib.metadata.distributions():
        if _normalized(dist.metadata["Name"]) not in GPU_MACHINE_PACKAGES:
            continue
        for top in {f.parts[0] for f in dist.files or () if f.parts and f.parts[0] not in ("..", "__pycache__")}:
            if top.endswith(".pth") or (site / top).exists():
                continue
            target = Path(dist.locate_file(top))
            if target.exists():
                (site / top).symlink_to(target)
    venv = root / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    [site_packages] = venv.glob("lib/python3*/site-packages")
    (site_packages / "gpu_machine.pth").write_text(f"{site}\n")
    return venv / "bin" / "python"


@pytest.fixture(scope="module")
def machine(tmp_path_factory):
    """(tree, python, environment) as the GPU machine would have them, the bundle made here and carried."""
    root = tmp_path_factory.mktemp("gpu-machine")
    tree = copy_source_tree(root / "tree")
    subprocess.run(["bash", "gpu_check/make_gpu_bundle.sh"], cwd=tree, check=True, timeout=600,
                   env=dict(os.environ, PYTHON=sys.executable))
    python = _gpu_machine_python(root)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PYTHON=str(python), MAX_JOBS=os.environ.get("MAX_JOBS", "1"))
    probe = subprocess.run([str(python), "-c", "import fastvideo_pan2_ext"], cwd=root, env=env, capture_output=True)
    assert probe.returncode != 0, "the rehearsal Python must not have this package installed"
    return tree, env



def _dry_run(machine, out: Path, part: int, *extra: str) -> tuple[subprocess.CompletedProcess, dict, float]:
    tree, env = machine
    start = time.monotonic()
    command = ["bash", "gpu_check/gpu_check.sh", "--part", str(part), "--dry-run", "--out", str(out), *extra]
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=2250)
    wall = time.monotonic() - start
    report = json.loads((out / f"gpu_check_dry_run_part{part}.json").read_text())
    print(f"\ndry-run rehearsal of part {part}: {wall:.0f} s wall, {report.get('total_seconds')} s in the check")
    return done, report, wall


def _timed(report: dict, step: str, name: str) -> dict:
    """One decoder's timing entry: one run after the warm-up, its time inside its step's wall time."""
    entry = report[step][name]
    assert len(entry["runs"]) == 1 and entry["median_s"] == entry["runs"][0]["seconds"]
    assert 0 < entry["median_s"] < report[step]["step_seconds"], (step, name, entry)
    return entry


def _no_fallbacks_anywhere(report: dict) -> None:
    summary = report["summary"]
    assert summary["fallbacks"] == {} and summary["fallbacks_not_recorded"] == [] and summary["failed_steps"] == []


PART1 = {}


def test_part_1_builds_self_checks_and_times_t_max_inside_its_deadline(machine, tmp_path, compile_cache):
    cache = compile_cache  # shared with test_compile.py
    done, report, wall = _dry_run(machine, tmp_path, 1, "--build-root", str(cache), "--deadline", "1800")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert report["skipped"] == [] and wall < 1800 + 60 and report["total_seconds"] < 1800
    failed = {k: v for k, v in report.items() if isinstance(v, dict) and "error" in v}
    assert not failed, failed
    big = max(report["sizes"]["timing_t"])
    assert [k for k in report if k.endswith(f"T={big}")] == [f"oracle:T={big}", f"compiled_timing:T={big}",
                                                              f"compiled_winograd_timing:T={big}", f"timing:T={big}"]

    b = report["build"]
    assert b["arch"] == "sm_90a" and 0 < b["warm_seconds"] < b["step_seconds"]
    assert Path(b["file"]).is_relative_to(cache)
    conv = [k for k in b["ptxas"] if "ConvUniversal" in k["kernel"]]
    assert conv and conv[0]["registers"] >= 32 and conv[0]["spill_stores"] == 0, b["ptxas"]

    for step in ("compiled_self_check", "compiled_winograd_self_check"):
        check = report[step]
        assert check["ok"] and all(case["ok"] and case["fallbacks"] == {} for case in check["cases"])
        names = [case["text"] for case in check["cases"]]
        assert len(names) == 76 and names[-2].startswith("decode") and names[-1].startswith("encode"), names
        for shape in ("conv3d 48 -> 1024 k3x3x3", "conv3d 256 -> 12 k3x3x3", "conv3d 1024 -> 2048 k3x1x1",
                      "upsample2x_conv3x3 1024 -> 1024", "rms_norm_silu 1024 -> 1024"):
            assert any(name.startswith(shape) for name in names), (shape, names)

    oracle = report[f"oracle:T={big}"]
    assert oracle["latent_frames"] == report["sizes"]["oracle_frames"] < big  # a prefix, not the whole decode
    assert oracle["video_frames"] == 4 * oracle["latent_frames"] - 3
    direct = _timed(report, f"compiled_timing:T={big}", "compiled")
    winograd = _timed(report, f"compiled_winograd_timing:T={big}", "compiled_winograd")
    portable = _timed(report, f"timing:T={big}", "portable")
    for entry, algorithm in ((direct, "direct"), (winograd, "winograd"), (portable, "direct")):
        assert entry["allowance"]["ok"] and set(entry["conv_algorithms"].values()) == {algorithm}
        assert entry["plan"]["frames_per_pass"] in (1, 2, 4)  # the product's default, "auto", and what it chose
    assert direct["fallbacks"] == {} and winograd["fallbacks"] == {} and "fallbacks" not in portable
    steps = [k for k, v in report.items() if isinstance(v, dict) and "step_seconds" in v]
    assert steps[steps.index(f"compiled_timing:T={big}") + 1] == "pan2_block"  # right after the first compiled timing
    _check_pan2_block(report["pan2_block"], report["summary"])
    _no_fallbacks_anywhere(report)
    summary = report["summary"]
    assert summary["compiled_ok"] is True and summary["audited"] == 2
    assert summary[f"T={big} winograd speedup vs direct"] == round(direct["median_s"]
                                                                    / winograd["median_s"], 2)
    PART1["report"] = report


def _check_pan2_block(result: dict, summary: dict) -> None:
    """The PAN2 block at the dry run's size: the tiny checkpoint's config at 9 frames of 64x96 (grid 3 x 2 x 3) and 8
    text tokens, `model.cost`'s count for one block; torch's SDPA and its flash kernel timed and projected to a step
    (44 blocks on a GPU, here the tiny config's 2; two forwards), the kernels this CPU or this machine lacks named."""
    from fastvideo_pan2_ext.demo.tiny_checkpoints import tiny_pan2_transformer_config
    from fastvideo_pan2_ext.model.cost import joint_block_flops

    config = tiny_pan2_transformer_config()
    assert result["config"] == "tiny" and result["grid"] == [3, 2, 3] and result["text_tokens"] == 8
    assert (result["hidden"], result["heads"], result["blocks"]) == (32, 2, config.num_layers)
    flops = joint_block_flops(config, 18, 8)
    assert result["flops"] == {"linear": flops.linear, "attention": flops.attention}
    kernels = result["kernels"]
    assert set(kernels) == {"sdpa", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "fa2", "fa3", "fa4"}
    for name in ("sdpa", "sdpa_flash"):
        entry = kernels[name]
        assert len(entry["runs_ms"]) == 3 and entry["ms"] == sorted(entry["runs_ms"])[1] > 0
        assert entry["tflops"] == pytest.approx(flops.total / entry["ms"] / 1e9, rel=2e-3)  # 4 figures each
        assert entry["projected_step_s"] == pytest.approx(entry["ms"] / 1e3 * 2 * config.num_layers, rel=2e-3)
        assert entry["projected_50_steps_s"] == pytest.approx(50 * entry["projected_step_s"], rel=2e-3)
        assert entry["finite"] and entry["max_diff_vs_sdpa"] < 1e-2
        assert summary[f"pan2 block {name} ms"] == entry["ms"]
    assert "No viable backend" in kernels["sdpa_cudnn"]["error"]  # a CUDA kernel: recorded, the others still timed
    assert all(kernels[k]["absent"].startswith("not importable") for k in ("fa2", "fa3", "fa4"))
    assert result["fastest"] in ("sdpa", "sdpa_flash") and result["founding_b300_s"] == {"fa4": 288, "sdpa": 670}


def test_every_step_s_cap_is_seconds_and_the_pan2_block_follows_the_first_compiled_timing():
    """On a GPU a step's limit is min(cap, time left): a cap that is not a number would stop the whole part there
    (the dry run never reads caps)."""
    from gpu_check import gpu_check

    for part in (1, 2):
        for sizes in (gpu_check.FULL, gpu_check.DRY):
            steps = gpu_check.part_steps(part, sizes, with_diffusers=True)
            assert all(isinstance(step.cap, (int, float)) and step.cap > 0 for step in steps), part
    names = [step.name for step in gpu_check.part_steps(1, gpu_check.FULL, with_diffusers=False)]
    assert names[names.index("compiled_timing:T=49") + 1] == "pan2_block"
    assert gpu_check.FULL["pan2_block"] == (241, 704, 1248, 1544)


def test_part_2_measures_the_rest_covers_the_gaps_and_runs_the_pipeline_last(machine, tmp_path, compile_cache):
    cache = compile_cache  # shared with test_compile.py
    done, report, wall = _dry_run(machine, tmp_path, 2, "--build-root", str(cache), "--deadline", "2100")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert report["skipped"] == [] and wall < 2100 + 120 and report["total_seconds"] < 2100
    failed = {k: v for k, v in report.items() if isinstance(v, dict) and "error" in v}
    assert not failed, failed
    assert list(report)[-2:] == ["pipeline", "total_seconds"] or list(report)[-3:-1] == ["pipeline", "total_seconds"]
    assert report["environment"]["diffusers"][0].isdigit(), "the bundle's diffusers wheels were not used"
    sizes = report["sizes"]
    for t in sizes["correctness_t"]:
        assert report[f"oracle:T={t}"]["latent_frames"] == t  # the whole decode
        entry = report["compiled_correctness"][str(t)]["compiled"]
        assert entry["ok"] and entry["fallbacks"] == {}
        assert all(report["correctness"][str(t)][name]["ok"] for name in ("release_bf16", "portable"))
    big, *rest = sizes["timing_t"]
    for name in ("release_bf16", "diffusers_bf16"):
        _timed(report, f"timing:T={big}", name)
    for t in rest:
        assert _timed(report, f"compiled_timing:T={t}", "compiled")["fallbacks"] == {}
        assert set(report[f"timing:T={t}"]) - {"step_seconds"} == {"portable", "release_bf16", "diffusers_bf16"}
    assert set(report["compiled_memory"]) - {"step_seconds"} == {str(f) for f in sizes["memory_fpp"]}
    assert all(report["compiled_memory"][str(f)]["compiled"]["fallbacks"] == {} for f in sizes["memory_fpp"])
    assert report["compiled_memory"]["auto"]["compiled"]["plan"]["frames_per_pass"] in (1, 2, 4)  # T = 5
    assert len(report["compiled_profile"]["compiled"]["top20"]) > 5
    assert report["compiled_profile"]["compiled"]["fallbacks"] == {}
    assert {row["op"] for row in report["conv_bench"]["layers"]} == {"conv3d", "upsample2x_conv3x3"}
    _check_winograd_bench(report)
    _check_coverage(report["coverage"])
    _check_wan21_steps(report)
    _check_encode(report["encode"], sizes["encode"])
    _check_encode_bands(report["encode_bands"], sizes["encode"])
    _check_pan2_options(report["pan2_options"], sizes["pan2_options"])
    _check_pipeline(report["pipeline"], sizes["pipeline"])
    _no_fallbacks_anywhere(report)
    assert report["summary"]["compiled_ok"] is True and report["summary"]["pipeline_ok"] is True
    assert report["summary"]["pan2_options_ok"] is True
    assert list(report).index("pan2_options") < list(report).index("pipeline")


def _check_winograd_bench(report: dict) -> None:
    bench = report["winograd_conv_bench"]
    assert "winograd" in bench["winograd_table"] and "winograd" not in bench["direct_table"]
    assert bench["layers"] and all(row["kernel"] == [3, 3, 3] for row in bench["layers"]) and bench["fallbacks"] == {}
    for row in bench["layers"]:
        assert row["allowance"]["ok"] and row["faster"] in ("direct", "winograd")
        assert row["winograd_effective_tflops"] == pytest.approx(2.25 * row["winograd_actual_tflops"], rel=2e-3)
        assert row["winograd_wins"] == (row["faster"] == "winograd")
    [(gpu, layers)] = bench["suggested_measured_winograd_layers"].items()
    assert gpu == "emulated (dry run)" and gpu in bench["suggested_entry"]
    won = {tuple(row["layer"]) for row in bench["layers"] if row["winograd_wins"]}
    assert sorted(map(tuple, layers)) == sorted(won)


def _check_coverage(coverage: dict) -> None:
    """The gaps of the user's self-check, at the dry run's sizes: several bands, a big sub-pixel op, two models."""
    assert coverage["ok"] is True
    large = coverage["winograd_many_tiles_and_bands"]
    assert large["ok"] and large["bands"] >= 2 and large["allowance"]["ok"] and large["fallbacks"] == {}
    big = coverage["subpixel_over_2e31"]
    assert big["ok"] and big["over_2e31"] is False and big["out_elements"] == math.prod(big["out"])  # tiny here
    two = coverage["two_weight_sets"]
    assert list(two["videos"]) == ["first", "second", "first again"] and two["fallbacks"] == {}
    assert all(video["ok"] for video in two["videos"].values())


def _check_wan21_steps(report: dict) -> None:
    """The Wan2.1 VAE at each size: the release bf16 decode and the compiled one, each one run after a warm-up."""
    for h, w in report["sizes"]["wan21_hw"]:
        _timed(report, f"wan21_timing:{h}x{w}", "release_bf16")
        compiled = _timed(report, f"compiled_wan21_timing:{h}x{w}", "compiled")
        assert set(compiled["conv_algorithms"].values()) == {"direct"} and compiled["fallbacks"] == {}


def _check_encode(result: dict, size: list) -> None:
    """The fast encoder against diffusers' encodes: every method timed, each fast one within the allowance (mean and
    logvar), the steady reuse bit-identical to no reuse; the compiled table's bf16 encode handed to the portable ops
    only what the kernels never take (Wan2.1's 3-channel conv_in, the stride-2 convs, the copy into conv_in's
    window: `kernels.BY_DESIGN`)."""
    frames, height, width, _ = size
    fast = ("fast_auto", "fast_auto_no_reuse", "fast_bf16", "fast_bf16_compiled")
    assert result["video"] == [1, 3, frames, height, width]
    for name in ("diffusers_fp32", "diffusers_bf16", *fast):
        assert result[name]["seconds"] > 0
    for name in fast:
        assert result[name]["ok"] and set(result[name]["allowance"]) == {"mean", "logvar"}
    assert set(result["fast_bf16_compiled"]["fallbacks"]) == {"conv3d: 3 input channels, portable by design",
                                                             "conv3d_strided: portable by design",
                                                             "patchify_into: portable by design"}
    assert result["reuse_bit_identical"] is True and result["ok"] is True


def _check_encode_bands(result: dict, size: list) -> None:
    """Two gloo ranks' bands on the encode step's input: on a CPU at one thread, one rank's moments bit for bit on
    every rank, with one rank's reuse record, in both precisions."""
    frames, height, width, _ = size
    assert result["ranks"] == 2 and result["video"] == [1, 3, frames, height, width]
    for precision in ("auto", "bf16"):
        entry = result[precision]
        assert entry["bit_identical"] and entry["ranks_agree"] and entry["reuse_as_one_rank"], entry
        assert entry["max_abs_diff"] == 0 and all(s > 0 for s in entry["rank_seconds"]) and entry["ok"]
    assert result["ok"] is True


def _check_pan2_options(result: dict, size: list) -> None:
    """FastVideo's VideoGenerator (from the bundle's wheels) on the tiny checkpoint, image-to-video with guidance, one
    process per run, in turn: each run's final latents and frames held to its reference run's. On this CPU the
    compat package turns the three offloads off (recorded so: asked for, off in the worker, the plain run's numbers bit for
    bit); FSDP runs over one gloo rank (every DiT parameter a DTensor, bf16) and gives the plain bf16 run's latents;
    FSDP's bf16 gather against the fp32 run is a few percent (docs/design/pan2.md, "The transformer")."""
    height, width, frames, steps = size
    assert result["ok"] is True, result
    assert "site-packages" in result["fastvideo"] and result["together"] == 1 and result["rounding"] == 1e-5
    assert result["request"] == {"prompt": "a fox", "negative_prompt": "blurry", "guidance_scale": 3.0, "seed": 5,
                                 "height": height, "width": width, "num_frames": frames,
                                 "num_inference_steps": steps, "image": "demo.pan2.SAMPLE_IMAGE"}
    options = result["options"]
    offloads = ("dit_layerwise_offload", "text_encoder_cpu_offload", "vae_cpu_offload")
    assert list(options) == ["plain", *offloads, "plain_bf16", "use_fsdp_inference"]
    flags = ("dit_cpu_offload", *offloads, "use_fsdp_inference")
    for name, entry in options.items():
        assert entry["ok"] is True, (name, entry)
        assert entry["latents_shape"] == [1, 48, (frames - 1) // 4 + 1, height // 16, width // 16]
        assert entry["seconds"] > entry["load_s"] + entry["generate_s"] and entry["generate_s"] > 0
        worker = entry["worker"]
        assert worker["device"] == "cpu" and worker["args"]["pin_cpu_memory"] is False
        assert {flag: worker["args"][flag] for flag in flags} == {flag: flag == name == "use_fsdp_inference"
                                                                  for flag in flags}, name
        dit = worker["transformer"]
        assert dit["module_lists"] == {"transformer_blocks": {"blocks": 2, "offload_hooked": 0, "device_bytes": 0},
                                       "context_refiner": {"blocks": 1, "offload_hooked": 0, "device_bytes": 0}}
        assert dit["dtypes"] == ["bfloat16" if entry["dit_precision"] == "bf16" else "float32"]
        assert worker["text_encoder"]["dtypes"] == worker["vae"]["dtypes"] == ["float32"]
    for name in ("plain", "plain_bf16"):
        entry = options[name]
        assert entry["reference"] is None and entry["in_effect"] is True and "max_abs_diff" not in entry
        assert entry["evidence"] == "options on: none"
    for name in offloads:
        entry = options[name]
        assert entry["reference"] == "plain" and entry["in_effect"] is False and entry["off_without_gpu"] is True
        assert entry["evidence"].startswith(f"the worker's FastVideoArgs have {name}=False (`compat.cpu_gaps` turns")
        assert entry["bit_identical"] and entry["max_abs_diff"] == entry["max_rel_diff"] == 0
        assert entry["frames_max_diff"] == 0 and entry["reference_max_abs"] > 0.5
    fsdp = options["use_fsdp_inference"]
    assert fsdp["reference"] == "plain_bf16" and fsdp["in_effect"] is True and "off_without_gpu" not in fsdp
    dit = fsdp["worker"]["transformer"]
    assert dit["dtensor_parameters"] == dit["parameters"] > 0 and dit["fsdp_meshes"] == [[1, 1]]
    assert fsdp["evidence"] == f"{dit['parameters']} of {dit['parameters']} DiT parameters FSDP DTensors on meshes " \
                               "[[1, 1]]"
    assert fsdp["max_rel_diff"] <= 1e-5 and fsdp["frames_max_diff"] <= 1
    assert 1e-3 < fsdp["max_rel_diff_vs_plain_fp32"] < 0.1  # bf16's numbers, not fp32's


def _check_pipeline(result: dict, size: list) -> None:
    """FastVideo ran the PAN2 pipeline from the bundle's wheels: the plugin registered, the fast decoder on (on CPU:
    the portable backend), the mp4 written while decoding, of the size asked for."""
    height, width, frames, _ = size
    assert result["ok"] is True, result
    assert result["exit_code"] == 0 and result["video_frames"] == frames and result["video_hw"] == [height, width]
    assert result["backend"] == "torch" and result["streamed"] is True
    assert "site-packages" in result["fastvideo"]


def test_a_crashing_compiled_decoder_fails_its_self_check_and_the_steps_needing_it_are_skipped(machine, tmp_path):
    done, report, _ = _dry_run(machine, tmp_path, 1, "--stand-in", "emulated-abort", "--skip", "build",
                               "--deadline", "900")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "exited with -6" in report["compiled_self_check"]["error"]  # SIGABRT: the child died, the run went on
    assert "exited with -6" in report["compiled_winograd_self_check"]["error"]
    big = max(report["sizes"]["timing_t"])
    for step in (f"compiled_timing:T={big}", f"compiled_winograd_timing:T={big}"):
        assert report[step]["skipped"].startswith("compiled_self_check failed: child exited with -6"), report[step]
        assert any(s.startswith(f"{step}: compiled_self_check failed") for s in report["skipped"])
    assert "fallbacks" not in report[f"timing:T={big}"]["portable"]
    assert _timed(report, f"timing:T={big}", "portable")["allowance"]["ok"]
    summary = report["summary"]
    assert summary["compiled_ok"] is False and summary["self_check_ok"] is False
    assert set(summary["failed_steps"]) == {"compiled_self_check", "compiled_winograd_self_check"}


def test_a_deadline_too_short_for_everything_still_times_t_max_and_lists_what_it_skipped(machine, tmp_path):
    """The deadline: what part 1 took up to its compiled T = max timing (measured above; this file's tests share a
    worker under pytest-xdist's --dist loadfile), and 15 s less than the Winograd self-check expects to need: t_max is
    timed with room for the machine to be slower than when part 1 ran, and the Winograd self-check no longer fits;
    nothing runs past the deadline."""
    full = PART1.get("report")
    big = 4
    if full is None:
        deadline = 240.0
    else:
        big = max(full["sizes"]["timing_t"])
        steps = ("compiled_self_check", f"oracle:T={big}", f"compiled_timing:T={big}")
        from gpu_check import gpu_check

        [winograd] = [s for s in gpu_check.part_steps(1, gpu_check.DRY, with_diffusers=False)
                      if s.name == "compiled_winograd_self_check"]
        deadline = sum(full[s]["step_seconds"] for s in steps) + winograd.needs[True] - 15
    done, report, wall = _dry_run(machine, tmp_path, 1, "--skip", "build", "--deadline", f"{deadline:.0f}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert report["total_seconds"] <= deadline + 5 and wall < deadline + 60
    timed = _timed(report, f"compiled_timing:T={big}", "compiled")
    assert timed["allowance"]["ok"] and timed["fallbacks"] == {}
    assert report["skipped"][0] == "build: --skip" and len(report["skipped"]) >= 2, report["skipped"]
    later = ("compiled_winograd_self_check", f"compiled_winograd_timing:T={big}", f"timing:T={big}")
    for name in later:  # each ran, or is listed as skipped
        assert "step_seconds" in report[name] or any(s.startswith(f"{name}:") for s in report["skipped"]), name
    assert any(s.startswith(later) for s in report["skipped"][1:]), report["skipped"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_and_without_dry_run_it_says_so(tmp_path):
    for part in ("1", "2"):
        script = REPO / "gpu_check" / "gpu_check.sh"
        done = subprocess.run(["bash", str(script), "--part", part, "--out", str(tmp_path)],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 2
        assert "no CUDA GPU" in done.stderr
