"""tools/gpu_check.sh --dry-run: every step of the GPU check on CPU (tiny model, portable backend standing in for the
compiled one, the real extension built compile-only for sm_90a, the package used through the script's import shim),
and the JSON it writes.

The build step shares its cache with tests/test_compile.py (one compile per session when both run); alone, it
compiles the extension once (about 4 minutes on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from fastvideo_pan2_ext.vae_kernel import build, compiled

REPO = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.skipif(build.cuda_home() is None, reason="no CUDA toolkit (nvcc) on this machine"),
    pytest.mark.timeout(1800),
]


def test_dry_run_exercises_build_correctness_and_timing_and_writes_the_json(tmp_path, tmp_path_factory):
    root = tmp_path_factory.getbasetemp() / "wan22-compile-cache"
    root.mkdir(exist_ok=True)
    # The same CUTLASS tree as test_compile.py (else the script would pick build/gpu_bundle if present: another key).
    env = dict(os.environ, GPU_CHECK_FORCE_SHIM="1", MAX_JOBS=os.environ.get("MAX_JOBS", "1"),
               WAN22_CUTLASS_DIR=str(compiled.cutlass_source_dir()))
    done = subprocess.run([str(REPO / "tools" / "gpu_check.sh"), "--dry-run", "--out", str(tmp_path),
                           "--build-root", str(root)], capture_output=True, text=True, env=env, timeout=1700)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check_dry_run.json").read_text())

    assert report["mode"] == "dry-run"
    env_info = report["environment"]
    assert env_info["date"] and env_info["torch"] and env_info["cutlass"].count(".") == 2
    b = report["build"]
    assert b["arch"] == "sm_90a" and b["cold_seconds"] > 0 and b["warm_seconds"] > 0
    assert Path(b["file"]).is_file() and Path(b["file"]).is_relative_to(root)

    assert [e["T"] for e in report["correctness"]] == report["sizes"]["correctness_t"]
    for entry in report["correctness"]:
        for name in ("portable", "compiled"):
            assert entry[name]["ok"], entry
            assert entry[name]["max_err"] <= 3 * entry["release_bf16"]["max_err"]
        assert entry["release_bf16"]["rms_err"] > 0  # bf16 really differs from fp32: the rule is not vacuous
    assert [e["T"] for e in report["timing"]] == report["sizes"]["timing_t"]
    for entry in report["timing"]:
        assert all(entry[name]["seconds"] > 0 for name in ("release_bf16", "portable", "compiled"))
    assert report["all_correct"] is True
    assert "gpu_check: wrote" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_and_without_dry_run_it_says_so(tmp_path):
    done = subprocess.run([str(REPO / "tools" / "gpu_check.sh"), "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2
    assert "no CUDA GPU" in done.stderr
