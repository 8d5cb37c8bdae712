"""bench/bench.py end to end on tiny CPU workloads (both VAE layouts): JSON with timings, memory and a passing audit,
direct vs Winograd decodes and layers, and a PNG plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import bench  # noqa: E402


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
    assert fast["audit"]["ok"] and fast["audit"]["psnr_db"] > 30
    assert fast["speedup_vs_release"] == pytest.approx(lines["release bf16 (baseline)"]["median_s"] / fast["median_s"])
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_without_diffusers_uses_the_bit_identical_reference_baseline(tmp_path):
    out = tmp_path / "nodiff.json"
    bench.main(["--workload", "cpu-tiny", "--frames", "1", "--repeats", "1", "--no-diffusers", "--out", str(out)])
    (workload,) = json.loads(out.read_text())["workloads"]
    assert workload["baseline"].startswith("reference.decode bf16 (bit-identical to diffusers")


def test_bench_wan21_times_direct_and_winograd_decodes_and_layers(tmp_path):
    out = tmp_path / "wan21.json"
    bench.main(["--workload", "cpu-wan21-tiny", "--frames", "2", "--repeats", "1", "--conv-algorithms", "direct",
                "winograd", "--conv-layers", "--conv-layer-size", "1", "4", "6", "--out", str(out)])
    (workload,) = json.loads(out.read_text())["workloads"]
    assert workload["baseline"] == "diffusers AutoencoderKLWan bf16"
    assert workload["config"]["residual"] is False and workload["video_hw"] == [48, 64]
    lines = {r["line"]: r for r in workload["results"]}
    assert set(lines) == {"release bf16 (baseline)", "reference fp32", "WanVAEDecoder torch",
                          "WanVAEDecoder torch+winograd-f2x2"}
    for line, algorithm in (("WanVAEDecoder torch", "direct"), ("WanVAEDecoder torch+winograd-f2x2", "winograd")):
        assert lines[line]["conv_algorithm"] == algorithm and lines[line]["audit"]["ok"]
        assert lines[line]["video_frames"] == 5 and lines[line]["speedup_vs_release"] > 0
    layers = workload["conv_layers"]
    assert {tuple(r["layer"]) for r in layers} == set(bench.conv_layers(bench.WORKLOADS["cpu-wan21-tiny"].config))
    for r in layers:
        assert (r["direct_table"], r["winograd_table"]) == ("torch", "torch+winograd-f2x2")
        assert (r["frames"], r["rows"], r["cols"]) == (1, 4, 6) and r["faster"] in ("direct", "winograd")
        assert r["direct_tflops"] > 0 and r["winograd_speedup"] > 0
        # even rows and cols: the Winograd GEMMs do 16 products where the direct conv does 36
        assert r["winograd_effective_tflops"] == pytest.approx(2.25 * r["winograd_actual_tflops"], rel=2e-3)
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", ["cpu-tiny", "cpu-wan21-tiny"])
def test_bench_weights_drive_diffusers_and_the_reference_identically(name):
    workload = bench.WORKLOADS[name]
    sd = bench.random_weights(workload.config)
    vae = bench.diffusers_vae(workload, sd).to(torch.bfloat16)
    z = bench.seeded_latents(workload, 2)
    with torch.no_grad():
        release = vae.decode(z.to(torch.bfloat16)).sample
    assert torch.equal(release, bench.reference.decode(z, sd, torch.bfloat16))


@pytest.mark.parametrize("argv, message", [
    (["--frames", "0"], "--frames values must be >= 1"),
    (["--frames-per-pass", "0"], "frames_per_pass must be 'auto' or an int >= 1"),
    (["--workload", "nope"], "invalid choice"),
    (["--conv-algorithms", "fft"], "invalid choice"),
    (["--conv-layer-size", "1", "0", "4"], "--conv-layer-size values must be >= 1"),
])
def test_bench_refuses_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_bench_runs_as_a_script_and_as_a_module():
    for cmd in ([sys.executable, "bench/bench.py", "--help"], [sys.executable, "-m", "bench.bench", "--help"]):
        result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0 and "--workload" in result.stdout, result.stderr
