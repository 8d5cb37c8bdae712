"""The PAN2 server's rules that need no model: `seconds` to frames, the serving and scale-out options, and a bad serve
config refused in one line before any model loads (the real `fastvideo serve` command)."""

from __future__ import annotations

import resource

import pytest
import yaml
from _pan2_helpers import OFFLINE, run, run_python
from _serve_helpers import EXAMPLE_CONFIG, FASTVIDEO

from fastvideo_pan2_ext.fastvideo_integration.serving import Replicas, ServingRules, frames_for_seconds


@pytest.mark.parametrize("seconds, fps, frames", [(4, 24, 97), (1, 8, 9), (5, 24, 121), (1, 1, 1), (2, 3, 5)])
def test_seconds_become_the_nearest_4k_plus_1_frames(seconds, fps, frames):
    assert frames_for_seconds(seconds, fps) == frames


@pytest.mark.parametrize("seconds, fps, words", [
    (1, 7, "7 frames, halfway between 5 and 9"), (1, 3, "3 frames, halfway between 1 and 5"),
    (0, 24, "seconds must be a whole number >= 1; got 0"), (1.5, 24, "got 1.5"), (True, 24, "got True")])
def test_seconds_that_cannot_be_mapped_are_refused_with_the_numbers(seconds, fps, words):
    with pytest.raises(ValueError, match=words):
        frames_for_seconds(seconds, fps)


def test_the_serving_options_are_checked(tmp_path):
    rules = ServingRules.from_config(str(tmp_path / "out"), input_dir=str(tmp_path), upload_retention_s=30)
    assert rules == ServingRules(tmp_path / "out", tmp_path, 30.0) and (tmp_path / "out" / "videos").is_dir()
    with pytest.raises(ValueError, match="server.input_dir must be an existing folder; got '/no/such'"):
        ServingRules.from_config(str(tmp_path), input_dir="/no/such")
    for bad in (-1, float("nan"), "10", True):
        with pytest.raises(ValueError, match="server.upload_retention_s must be a number of seconds >= 0"):
            ServingRules.from_config(str(tmp_path), upload_retention_s=bad)


@pytest.mark.skipif(resource.getrlimit(resource.RLIMIT_NOFILE)[1] == resource.RLIM_INFINITY,
                    reason="no hard limit on open files here")
def test_more_kept_videos_than_this_process_may_hold_open_is_refused(tmp_path):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert ServingRules.from_config(str(tmp_path)).max_kept_videos == 1000
    with pytest.raises(ValueError, match=rf"server.max_kept_videos {hard} holds as many files open: with "
                                         rf"server.max_connections 64 and 256 more, {hard + 320}, over this process's "
                                         rf"limit of {hard} open files \(ulimit -Hn\): lower it, or raise the limit"):
        ServingRules.from_config(str(tmp_path), max_kept_videos=hard)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match=f"server.max_kept_videos must be a whole number >= 1; got {bad!r}"):
            ServingRules.from_config(str(tmp_path), max_kept_videos=bad)


def test_the_scale_out_options_are_checked():
    assert Replicas() == Replicas(None, None) and Replicas(2, "auto").replicas == 2
    for bad in (0, -1, "2", 2.0, True):
        with pytest.raises(ValueError, match=f"server.replicas must be a whole number >= 1; got {bad!r}"):
            Replicas(bad)
    with pytest.raises(ValueError, match="server.ray_address must be a Ray address"):
        Replicas(2, "")
    with pytest.raises(ValueError, match="server.ray_address places replicas: set server.replicas too"):
        Replicas(None, "auto")


@pytest.mark.slow
def test_a_cleanup_step_that_fails_leaves_the_others_to_do(tmp_path):
    """A stopping server whose partial-file cleanup fails (a descriptor of it closed behind its back: the fault, made
    here) still removes its jobs' uploads and logs what failed. In a process of its own: stopping stops that
    process's children."""
    code = f"""
import logging, os, sys
from pathlib import Path
from fastvideo_pan2_ext.fastvideo_integration import streamed_save
from fastvideo_pan2_ext.fastvideo_integration.serving import PAN2Server, ServingRules
from fastvideo_pan2_ext.media.video_io import PartialFile
logging.basicConfig(stream=sys.stdout, level=logging.INFO)
server = PAN2Server(ServingRules.from_config({str(tmp_path / "out")!r}))
partial = PartialFile(server.rules.output_dir / "videos" / "job.mp4")
os.close(partial._fd)
streamed_save._in_flight.add(partial)
upload = server.rules.output_dir / "uploads" / "job_first_frame.jpg"
upload.parent.mkdir()
upload.write_bytes(b"jpeg")
server._uploads["job"] = upload
server.stopped()
print("upload left:", upload.exists())
"""
    done = run_python(code, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "upload left: False" in done.stdout, done.stdout[-3000:]
    assert "a step of its cleanup failed; the others go on" in done.stdout + done.stderr
    assert "Bad file descriptor" in done.stdout + done.stderr


def test_a_bad_serve_config_is_one_line_before_any_model_loads(tiny_ckpt, tmp_path):
    config = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    config["generator"]["model_path"] = str(tiny_ckpt)
    config["server"]["output_dir"] = str(tmp_path / "out")
    cases = {"pan3": ("pipeline", "pan3", "unknown pipeline 'pan3'; known pipelines: pan2"),
             "not a checkpoint": ("model_path", str(tmp_path), "not a PAN2 checkpoint"),
             "no replica": ("replicas", 0, "server.replicas must be a whole number >= 1; got 0")}
    for case, (key, value, words) in cases.items():
        bad = yaml.safe_load(yaml.safe_dump(config))
        {"pipeline": bad, "model_path": bad["generator"], "replicas": bad["server"]}[key][key] = value
        path = tmp_path / "serve.yaml"
        path.write_text(yaml.safe_dump(bad))
        proc = run([str(FASTVIDEO), "serve", "--config", str(path)], env_extra=OFFLINE, timeout=300)
        assert proc.returncode == 2, (case, proc.stderr[-3000:])
        errors = [line for line in proc.stderr.splitlines() if line.startswith("fastvideo serve: error: ")]
        assert len(errors) == 1 and words in errors[0], (case, proc.stderr[-3000:])
        assert "Traceback" not in proc.stderr and "Loading model" not in proc.stdout + proc.stderr, case
