"""A user's interrupted or failed run, with real signals against the real CLI (`fastvideo generate --pipeline pan2`):
it ends promptly with one line and 128 + the signal, leaves no video (not even a partial one) and no process behind,
and prints no traceback and no leaked-semaphore warning. And mistakes the CLI can see are refused before any model
loads, in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _pan2_helpers import OFFLINE

pytestmark = pytest.mark.slow

SAMPLE = Path(__file__).resolve().parents[2] / "fastvideo_pan2_ext" / "assets" / "sample_exif_rotated.jpg"
FASTVIDEO = Path(sys.executable).parent / "fastvideo"


def _command(tiny_ckpt, out: Path, frames: int = 161) -> list[str]:
    return [str(FASTVIDEO), "generate", "--pipeline", "pan2", "--generator.model_path", str(tiny_ckpt),
            "--request.prompt", "a cat", "--request.inputs.image_path", str(SAMPLE),
            "--request.sampling.height", "256", "--request.sampling.width", "384",
            "--request.sampling.num_frames", str(frames), "--request.sampling.num_inference_steps", "1",
            "--request.output.output_path", str(out / "v.mp4"),
            "--generator.pipeline.experimental.vae_decode_kernel", "true"]


def _session_processes(sid: int) -> list[str]:
    """The live (not zombie) processes of a session."""
    ps = subprocess.run(["ps", "-o", "stat=,cmd=", "--sid", str(sid)], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if line.strip() and not line.strip().startswith("Z")]


def _interrupted_run(tiny_ckpt, out: Path, send) -> tuple[int, str, float]:
    """Start the CLI in a session of its own, call `send(process)` two seconds into the decode (the mp4 is being
    written), wait. -> (exit code, output, seconds from the signal to the exit)."""
    env = {**os.environ, **OFFLINE, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(_command(tiny_ckpt, out), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    lines, sent = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            if sent is None and "fast VAE decoder:" in line:
                time.sleep(2)
                send(proc)
                sent = time.monotonic()
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert sent is not None, "the run never reached the decode:\n" + "".join(lines[-30:])
    elapsed = time.monotonic() - sent
    deadline = time.monotonic() + 10  # an orphaned child (the resource tracker) may take a moment to go
    while _session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _session_processes(proc.pid), _session_processes(proc.pid)
    return code, "".join(lines), elapsed


def _worker_of(proc) -> int:
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    return next(int(pid) for pid in children if "resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_text())


@pytest.mark.parametrize("how, send, code, line", [
    ("Ctrl-C to the parent", lambda p: os.kill(p.pid, signal.SIGINT), 130, "interrupted; no video written"),
    ("Ctrl-C to the process group", lambda p: os.killpg(p.pid, signal.SIGINT), 130, "interrupted; no video written"),
    ("SIGTERM to the parent", lambda p: os.kill(p.pid, signal.SIGTERM), 143, "terminated; no video written"),
    ("a worker killed", lambda p: os.kill(_worker_of(p), signal.SIGKILL), 1, "a worker process died; no video written"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_an_interrupted_run_leaves_nothing_and_says_one_line(tiny_ckpt, tmp_path, how, send, code, line):
    out = tmp_path / "out"
    exit_code, output, elapsed = _interrupted_run(tiny_ckpt, out, send)
    assert exit_code == code, output[-3000:]
    assert output.count("no video written") == 1 and f"fastvideo generate: {line}" in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    if how != "a worker killed":  # a SIGKILLed worker cannot release what it held
        assert "leaked semaphore" not in output, output[-3000:]
    assert list(out.iterdir()) == [], list(out.iterdir())  # no video, no partial file
    assert elapsed < 15, f"took {elapsed:.1f} s to stop"


def test_a_pipeline_whose_plugin_is_filtered_out_is_one_error_line(tmp_path):
    start = time.monotonic()
    proc = subprocess.run([str(FASTVIDEO), "generate", "--pipeline", "pan2", "--generator.model_path", str(tmp_path)],
                          capture_output=True, text=True, env={**os.environ, "FASTVIDEO_PLUGINS": ""}, timeout=300)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert errors == ["fastvideo generate: error: --pipeline pan2: the 'pan2' plugin is installed but "
                      "FASTVIDEO_PLUGINS='' leaves it out (unset FASTVIDEO_PLUGINS or list pan2 in it)"], proc.stderr
    assert "Traceback" not in proc.stderr
    print(f"\nrefused in {time.monotonic() - start:.1f} s")


def test_a_bad_request_is_refused_before_any_model_loads(tiny_ckpt, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    start = time.monotonic()
    proc = subprocess.run([*_command(tiny_ckpt, a_file / "out")], capture_output=True, text=True,
                          env={**os.environ, **OFFLINE}, timeout=300)
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fastvideo generate: error:")]
    assert len(errors) == 1 and "cannot write the video to" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Loading" not in proc.stdout + proc.stderr
    print(f"\nrefused in {elapsed:.1f} s")
