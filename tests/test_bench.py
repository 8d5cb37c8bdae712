"""tools/bench.py end to end on a tiny CPU workload: JSON with timings, memory and a passing audit, and a PNG plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tools import bench  # noqa: E402


def test_bench_cpu_run_writes_audited_json_and_plot(tmp_path):
    out = tmp_path / "cpu-test.json"
    bench.main(["--workload", "cpu-tiny", "--frames", "1", "--repeats", "2", "--out", str(out)])
    report = json.loads(out.read_text())
    (workload,) = report["workloads"]
    assert workload["baseline"] == "diffusers AutoencoderKLWan bf16"
    lines = {r["line"]: r for r in workload["results"]}
    assert set(lines) == {"release bf16 (baseline)", "reference fp32", "WanVAEDecoder torch"}
    fast = lines["WanVAEDecoder torch"]
    assert len(fast["times_s"]) == 2 and fast["median_s"] > 0 and fast["rss_increase_gib"] >= 0
    assert fast["audit"]["within_allowance"] and fast["audit"]["psnr_db"] > 30
    assert fast["speedup_vs_release"] == pytest.approx(lines["release bf16 (baseline)"]["median_s"] / fast["median_s"])
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_without_diffusers_uses_the_bit_identical_reference_baseline(tmp_path):
    out = tmp_path / "nodiff.json"
    bench.main(["--workload", "cpu-tiny", "--frames", "1", "--repeats", "1", "--no-diffusers", "--out", str(out)])
    (workload,) = json.loads(out.read_text())["workloads"]
    assert workload["baseline"].startswith("reference.decode bf16 (bit-identical to diffusers")


def test_bench_weights_drive_diffusers_and_the_reference_identically():
    workload = bench.WORKLOADS["cpu-tiny"]
    sd = bench.random_weights(workload.config)
    vae = bench.diffusers_vae(workload, sd).to(torch.bfloat16)
    z = bench.seeded_latents(workload, 2)
    with torch.no_grad():
        release = vae.decode(z.to(torch.bfloat16)).sample
    assert torch.equal(release, bench.reference.decode(z, sd, torch.bfloat16))


@pytest.mark.parametrize("argv, message", [
    (["--frames", "0"], "--frames values must be >= 1"),
    (["--frames-per-pass", "0"], "must be >= 1"),
    (["--workload", "nope"], "invalid choice"),
])
def test_bench_refuses_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


def test_bench_runs_as_a_script_and_as_a_module():
    for cmd in ([sys.executable, "tools/bench.py", "--help"], [sys.executable, "-m", "tools.bench", "--help"]):
        result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0 and "--workload" in result.stdout, result.stderr
