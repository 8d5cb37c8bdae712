"""tools/gpu_check.sh rehearsed the way the GPU machine runs it, on CPU (docs/design.md, "The GPU check").

The GPU machine gets a bare copy of the tree (what git tracks or would track; this package not installed), the bundle
of `tools/make_gpu_bundle.sh`, a Python with its own packages only, and runs the script from the tree's root. Here:
the same copy; a Python 3.12 venv whose only packages are those of this venv that the GPU machine's image also holds
(linked into one folder that a `.pth` line adds: none of this venv's start-up hooks, this package's editable finder
included, ever runs); cwd = the tree's root; `--dry-run`, where the build really compiles sm_90a and the compiled
decoder is the emulated extension, loaded and self-checked in a child process exactly as a built one is.

The sm_90a build shares its cache with tests/test_compile.py (one compile per session when both run).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _source_tree import REPO, copy_source_tree

from fastvideo_pan2_ext.vae_kernel.compiled import build

pytestmark = [
    pytest.mark.skipif(build.cuda_home() is None, reason="no CUDA toolkit (nvcc) on this machine"),
    pytest.mark.timeout(2400),
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
COMPILED_STEPS = ("compiled_self_check", "compiled_correctness", "compiled_memory", "compiled_profile", "conv_bench",
                  "compiled_winograd_self_check", "winograd_conv_bench")


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
    subprocess.run(["bash", "tools/make_gpu_bundle.sh"], cwd=tree, check=True, timeout=600,
                   env=dict(os.environ, PYTHON=sys.executable))
    python = _gpu_machine_python(root)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PYTHON=str(python), MAX_JOBS=os.environ.get("MAX_JOBS", "1"))
    probe = subprocess.run([str(python), "-c", "import fastvideo_pan2_ext"], cwd=root, env=env, capture_output=True)
    assert probe.returncode != 0, "the rehearsal Python must not have this package installed"
    return tree, env


def _dry_run(machine, out: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    tree, env = machine
    done = subprocess.run(["bash", "tools/gpu_check.sh", "--dry-run", "--out", str(out), *extra], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=2300)
    report = json.loads((out / "gpu_check_dry_run.json").read_text())
    return done, report


def test_dry_run_on_a_bare_tree_builds_self_checks_and_measures_everything(machine, tmp_path, tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "wan22-compile-cache"  # shared with test_compile.py
    cache.mkdir(exist_ok=True)
    done, report = _dry_run(machine, tmp_path, "--build-root", str(cache), "--deadline", "2200")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert report["skipped"] == []
    failed = {k: v for k, v in report.items() if isinstance(v, dict) and "error" in v}
    assert not failed, failed

    b = report["build"]
    assert b["arch"] == "sm_90a" and b["cold_seconds"] > 0 and b["warm_seconds"] > 0
    assert Path(b["file"]).is_relative_to(cache)
    conv = [k for k in b["ptxas"] if "ConvUniversal" in k["kernel"]]
    assert conv and conv[0]["registers"] > 0 and conv[0]["spill_stores"] == 0, b["ptxas"]
    assert report["environment"]["diffusers"][0].isdigit(), "the bundle's diffusers wheels were not used"

    check = report["compiled_self_check"]
    names = [case["text"] for case in check["cases"]]
    assert check["ok"] and not any(case["fallbacks"] for case in check["cases"])
    for shape in ("conv3d 48 -> 1024 k3x3x3", "conv3d 256 -> 12 k3x3x3", "conv3d 1024 -> 1024 k3x3x3 + residual",
                  "conv3d 1024 -> 2048 k3x1x1", "upsample2x_conv3x3 1024 -> 1024", "rms_norm_silu 1024 -> 1024"):
        assert any(name.startswith(shape) for name in names), (shape, names)
    assert names[-1].startswith("decode")

    sizes = report["sizes"]
    for t in sizes["correctness_t"]:
        assert report["compiled_correctness"][str(t)]["compiled"]["ok"]
        assert all(report["correctness"][str(t)][name]["ok"] for name in ("release_bf16", "portable"))
    for t in sizes["timing_t"]:
        timed = report[f"timing:T={t}"] | report[f"compiled_timing:T={t}"]
        assert set(timed) == {"release_bf16", "diffusers_bf16", "portable", "compiled"}
        assert all(len(entry["runs"]) == 3 and entry["median_seconds"] > 0 for entry in timed.values())
        # the timed decodes run the product's default, frames_per_pass="auto", and record what it chose
        assert timed["compiled"]["plan"]["frames_per_pass"] in (1, 2, 4, 8) and timed["release_bf16"]["plan"] is None
    big = max(sizes["timing_t"])
    assert report[f"compiled_timing:T={big}"]["compiled"]["allowance"]["ok"]
    assert set(report[f"compiled_timing:T={big}"]["compiled"]["conv_algorithms"].values()) == {"direct"}
    assert set(report[f"timing:T={big}"]["portable"]["conv_algorithms"].values()) == {"direct"}
    assert set(report["compiled_memory"]) == {str(f) for f in sizes["memory_fpp"]}
    assert report["compiled_memory"]["auto"]["compiled"]["plan"]["frames_per_pass"] in (1, 2, 4)  # T = 5: at most 4
    assert len(report["compiled_profile"]["compiled"]["top20"]) > 5
    assert {row["op"] for row in report["conv_bench"]} == {"conv3d", "upsample2x_conv3x3"}
    _check_winograd_steps(report, big)
    _check_wan21_steps(report)
    assert report["summary"]["compiled_ok"] is True and report["summary"]["winograd_self_check_ok"] is True
    print(f"\ndry-run rehearsal: {report['total_seconds']} s")


def _check_winograd_steps(report: dict, big: int) -> None:
    """The Winograd self-check, the per-layer direct vs Winograd table and the whole Winograd decode at T = big."""
    check = report["compiled_winograd_self_check"]
    assert check["ok"] and not any(case["fallbacks"] for case in check["cases"])
    names = [case["text"] for case in check["cases"]]
    assert any(name.startswith("conv3d 1024 -> 1024 k3x3x3") for name in names) and names[-1].startswith("decode")

    bench = report["winograd_conv_bench"]
    assert "winograd" in bench["winograd_table"] and "winograd" not in bench["direct_table"]
    assert bench["layers"] and all(row["kernel"] == [3, 3, 3] for row in bench["layers"])
    for row in bench["layers"]:
        assert row["allowance"]["ok"] and row["direct_tflops"] > 0 and row["faster"] in ("direct", "winograd")
        assert row["winograd_effective_tflops"] == pytest.approx(2.25 * row["winograd_actual_tflops"], rel=2e-3)
        assert row["winograd_wins"] == (row["faster"] == "winograd")
    [(gpu, layers)] = bench["suggested_measured_winograd_layers"].items()
    assert gpu == "emulated (dry run)" and gpu in bench["suggested_entry"]
    won = {tuple(row["layer"]) for row in bench["layers"] if row["winograd_wins"]}
    assert sorted(map(tuple, layers)) == sorted(won)
    assert report["summary"]["suggested_measured_winograd_layers"] == bench["suggested_measured_winograd_layers"]

    (name, entry), = report[f"compiled_winograd_timing:T={big}"].items()
    assert name == "compiled_winograd" and len(entry["runs"]) == 3 and entry["allowance"]["ok"]
    assert set(entry["conv_algorithms"].values()) == {"winograd"}
    assert report["summary"][f"T={big} winograd speedup vs direct"] > 0


def _check_wan21_steps(report: dict) -> None:
    """The Wan2.1 VAE at each size: the release bf16 decode here, the compiled one in a child, median of 3."""
    for h, w in report["sizes"]["wan21_hw"]:
        release = report[f"wan21_timing:{h}x{w}"]["release_bf16"]
        compiled = report[f"compiled_wan21_timing:{h}x{w}"]["compiled"]
        assert len(release["runs"]) == len(compiled["runs"]) == 3 and compiled["median_seconds"] > 0
        assert set(compiled["conv_algorithms"].values()) == {"direct"}
        assert report["summary"][f"wan21 {h}x{w} compiled speedup vs release"] > 0


def test_a_crashing_compiled_decoder_loses_only_its_own_steps(machine, tmp_path):
    done, report = _dry_run(machine, tmp_path, "--stand-in", "emulated-abort", "--skip", "build",
                            "--deadline", "2200")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    for name in COMPILED_STEPS:
        assert "error" in report[name], (name, report[name])
    assert "exited with -6" in report["compiled_self_check"]["error"]  # SIGABRT: the child died, the run went on
    for t in report["sizes"]["correctness_t"]:
        assert report["correctness"][str(t)]["portable"]["ok"]
    for t in report["sizes"]["timing_t"]:
        assert report[f"timing:T={t}"]["portable"]["median_seconds"] > 0
        assert "error" in report[f"compiled_timing:T={t}"]
    assert "error" in report[f"compiled_winograd_timing:T={max(report['sizes']['timing_t'])}"]
    for h, w in report["sizes"]["wan21_hw"]:
        assert report[f"wan21_timing:{h}x{w}"]["release_bf16"]["median_seconds"] > 0
        assert "error" in report[f"compiled_wan21_timing:{h}x{w}"]
    assert report["memory"] and report["profile"] and report["summary"]["compiled_ok"] is False


def test_a_deadline_skips_what_no_longer_fits_and_says_so(machine, tmp_path):
    done, report = _dry_run(machine, tmp_path, "--skip", "build", "--deadline", "1")
    assert done.returncode == 1
    assert any(s.startswith("compiled_self_check: deadline") for s in report["skipped"])
    assert any(s.startswith("timing:T=") for s in report["skipped"]) and "summary" in report


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_and_without_dry_run_it_says_so(tmp_path):
    done = subprocess.run(["bash", str(REPO / "tools" / "gpu_check.sh"), "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2
    assert "no CUDA GPU" in done.stderr
