"""bench/bench.py's versus-fp32 workloads (cpu-real-width): ours and diffusers' fp32 decode interleaved, medians,
the audit against diffusers' fp32 output, the op profiles and the per-shape conv layout table; here on a tiny
decoder of the same layout (the real widths take minutes)."""

from __future__ import annotations

import dataclasses
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import bench  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.portable import ops  # noqa: E402


def test_versus_fp32_workload_times_both_decodes_interleaved_and_audits_ours():
    assert bench.WORKLOADS["cpu-real-width"].versus_fp32
    assert bench.WORKLOADS["cpu-real-width"].config.decoder_base_dim == 256
    tiny = dataclasses.replace(bench.WORKLOADS["cpu-tiny"], name="tiny-versus-fp32", frames=(2,), versus_fp32=True)
    args = bench.parse_args(["--repeats", "2", "--profile", "--conv-layouts", "--threads", "1"])
    report = bench.bench_versus_fp32(tiny, args, bench.torch.device("cpu"), log=lambda message: None)
    assert report["interleaved"] and report["baseline"] == "diffusers AutoencoderKLWan fp32"
    ours, theirs = report["results"]
    assert ours["line"] == "WanVAEDecoder torch" and theirs["line"] == "diffusers AutoencoderKLWan fp32"
    for row in (ours, theirs):
        assert len(row["times_s"]) == 2 and row["median_s"] == statistics.median(row["times_s"]) > 0
        assert row["video_frames"] == 5
    assert ours["speedup_vs_diffusers_fp32"] == theirs["median_s"] / ours["median_s"]
    assert ours["audit"]["ok"] and ours["audit"]["rms_err"] > 0
    profiles = report["profiles"]["T=2"]
    assert set(profiles) == {ours["line"], theirs["line"]}
    for rows in profiles.values():  # the top ops by self CPU time (which ops lead depends on the machine)
        times = [r["self_cpu_s"] for r in rows]
        assert 0 < len(rows) <= 15 and times == sorted(times, reverse=True) and all(r["calls"] >= 1 for r in rows)
        assert all(isinstance(r["op"], str) and r["op"] for r in rows)
    layouts = report["conv_layouts"]
    assert {(r["co"], r["ci"], tuple(r["kernel"])) for r in layouts} >= {(8, 8, (3, 3, 3)), (12, 8, (3, 3, 3))}
    variants = {"fp32_channels_last", "fp32_channels_first", "bf16_channels_last"}
    for r in layouts:
        assert all(r[f"{v}_s"] > 0 for v in variants) and r["faster"] in variants and r["diffusers_fp32_s"] > 0
        assert r["chosen_vs_diffusers"] == r["diffusers_fp32_s"] / r[f"{r['chosen']}_s"]
        # narrow convs stay channels last (weights.CPU_CHANNELS_FIRST_MIN), in the dtype this CPU computes in
        assert r["chosen"] == f"{'bf16' if ops.cpu_has_amx_bf16() else 'fp32'}_channels_last"
