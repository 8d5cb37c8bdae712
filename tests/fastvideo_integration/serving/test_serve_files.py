"""What a PAN2 server leaves on disk and holds open (docs/design/serving.md, "Serving"; issue 38's review), on one real
server on loopback: the shipped example config on the tiny checkpoint, keeping its 2 newest videos
(`server.max_kept_videos`), with a `default_request.output.output_path` of the operator's (relative: from the
server's working folder, as FastVideo takes it).

- A refused request makes no folder: neither the one it names nor the operator's default.
- Past `max_kept_videos` the oldest job's video is removed and no longer held open; its content is a 410 with one line.
- A server stopped while a job has written its video but not yet ended removes the file that job wrote (FastVideo
  named it `<id>_1.mp4` beside a file in the way), and nothing else.

Every loop is bounded in count and time; only 127.0.0.1 is reached."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import yaml
from _serve_helpers import FRAMES, PAUSE_PROMPT, PAUSED, SIZE, Server, serve_config

pytestmark = pytest.mark.slow

KEPT = 2
DEFAULT_FOLDER = "by-default"  # under output_dir: the operator's default_request output_path
LONG_JOB = {"size": "640x384", "num_frames": 81, "num_inference_steps": 100}  # minutes of denoising: deleted


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_ckpt):
    folder = tmp_path_factory.mktemp("serve-files")
    path = serve_config(folder, tiny_ckpt, max_kept_videos=KEPT)
    config = yaml.safe_load(path.read_text())
    config["default_request"]["output"] = {"output_path": f"out/{DEFAULT_FOLDER}"}  # out: the config's output_dir
    path.write_text(yaml.safe_dump(config))
    srv = Server(path)
    yield srv
    srv.kill()


def _tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _one_line(response, status: int, words: str) -> None:
    assert response.status_code == status, (words, response.status_code, response.text)
    detail = response.json()["detail"]
    assert words in detail and "\n" not in detail, (words, detail)


def _video(server, seed: int, **fields) -> dict:
    job = server.wait(server.submit_json(prompt=f"a cat, take {seed}", size=SIZE, num_frames=FRAMES, seed=seed,
                                         **fields).json()["id"])
    assert job["status"] == "completed", job
    return job


def _videos_held_open(server) -> list[str]:
    fds = Path(f"/proc/{server.proc.pid}/fd")
    return sorted(target for fd in fds.iterdir() if (target := os.readlink(fd)).endswith(".mp4"))


def test_a_refused_request_makes_no_folder(server):
    """FastVideo makes a request's folder (`_build_generation_kwargs`) before PAN2's checks could refuse it."""
    out = server.output_dir
    before = _tree(out)
    assert DEFAULT_FOLDER not in before
    cases = [({"size": "1099511627776x32"}, "(server.max_pixels)"),  # to the operator's default folder
             ({"size": "1099511627776x32", "output_path": "asked/for"}, "(server.max_pixels)"),
             ({"num_inference_steps": 1000000, "output_path": str(out / "absolute")}, "(server.max_steps)"),
             ({"num_frames": 10, "output_path": "asked"}, "4k + 1"),
             ({"input_reference": "/etc/hostname", "output_path": "asked"}, "this server reads no path on its disk")]
    for fields, words in cases:
        _one_line(server.submit_json(prompt="x", **{"size": SIZE, "num_frames": FRAMES, **fields}), 400, words)
    assert _tree(out) == before
    job = _video(server, 1)  # no output_path: the operator's default folder, made now
    assert Path(job["file_path"]) == out / DEFAULT_FOLDER / f"{job['id']}.mp4"


def test_past_max_kept_videos_the_oldest_video_goes_and_its_content_is_a_410(server):
    jobs = [_video(server, seed, output_path="kept") for seed in (2, 3, 4)]
    files = [Path(job["file_path"]) for job in jobs]
    _one_line(server.client.get(f"/v1/videos/{jobs[0]['id']}/content"), 410,
              f"the video of {jobs[0]['id']} was removed: this server keeps its {KEPT} newest videos "
              f"(server.max_kept_videos)")
    released = server.job(jobs[0]["id"])
    assert released["status"] == "completed" and released["file_path"] is None, released
    assert not files[0].exists()
    for job, file in zip(jobs[1:], files[1:]):
        assert server.client.get(f"/v1/videos/{job['id']}/content").content == file.read_bytes()
    # One descriptor per kept job (before: one per job, for good). The content responses above close their own
    # descriptors just after their last byte is sent, so the count may take a moment to settle.
    kept = sorted(str(file) for file in files[1:])
    deadline = time.monotonic() + 10
    while _videos_held_open(server) != kept and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _videos_held_open(server) == kept
    assert f"Video {jobs[0]['id']} removed: this server keeps its {KEPT} newest videos" in server.output()


def test_stopping_the_server_removes_the_video_a_job_wrote_and_nothing_else(server):
    """Stopped after the job's video is in place and before the job ended (a pause injected there): the server used
    to remove `<id>.mp4` by name, here someone else's file, and leave the job's `<id>_1.mp4`."""
    blocker = server.submit_json(prompt="a long one", **LONG_JOB).json()["id"]
    server.wait(blocker, until=("in_progress",), timeout_s=120)
    job = server.submit_json(prompt=f"a cat {PAUSE_PROMPT}", size=SIZE, num_frames=FRAMES,
                             output_path="stopped").json()["id"]
    in_the_way = server.output_dir / "stopped" / f"{job}.mp4"
    in_the_way.write_bytes(b"someone else's file")  # FastVideo names the job's video beside it
    video = in_the_way.with_name(f"{job}_1.mp4")
    assert server.client.delete(f"/v1/videos/{blocker}").status_code == 200
    deadline = time.monotonic() + 240
    while f"{PAUSED} {video}" not in server.output():
        assert time.monotonic() < deadline, server.output()[-3000:]
        time.sleep(0.2)
    assert video.is_file() and server.job(job)["status"] == "in_progress"
    server.client.close()
    server.stopped_by(signal.SIGTERM, group=False, timeout_s=90)
    assert server.session_processes() == []
    assert not video.exists() and in_the_way.read_bytes() == b"someone else's file"
