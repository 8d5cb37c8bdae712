"""PAN2 served with `fastvideo serve`, as a user runs it: the shipped example config on the tiny checkpoint, loopback
only, driven by a real HTTP client. Concurrent clients each get their own video (checked by content against
sequential runs), bad requests are refused at submission and never reach a worker, a failure in the worker fails
that job only, the server touches no file outside its folders, and SIGINT / SIGTERM with a job in flight leave no
process and no partial file. One server serves the module's tests in order; the signal tests start their own."""

from __future__ import annotations

import concurrent.futures
import os
import select
import signal
import socket
import time
from pathlib import Path

import pytest
from _pan2_helpers import exif_rotated_jpeg, video_frames_and_size
from _serve_helpers import FAULT_PROMPT, FRAMES, SIZE, Server, serve_config

from bench import serve_load

pytestmark = pytest.mark.slow

SEEDS = (11, 22, 33)
LONG_JOB = {"size": "384x256", "num_frames": 161, "num_inference_steps": 1}  # seconds of decode on 2 cores


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("serve")


@pytest.fixture(scope="module")
def image(folder) -> Path:
    return exif_rotated_jpeg(folder / "first_frame.jpg", 192, 128)


@pytest.fixture(scope="module")
def operator_images(folder, image) -> Path:
    images = folder / "operator-images"
    images.mkdir()
    (images / "frame.jpg").write_bytes(image.read_bytes())
    return images


@pytest.fixture(scope="module")
def server(folder, tiny_ckpt, operator_images):
    srv = Server(serve_config(folder, tiny_ckpt, input_dir=str(operator_images)))
    yield srv
    srv.kill()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def test_the_example_config_serves_pan2_on_loopback_only(server):
    assert server.config["pipeline"] == "pan2" and server.config["server"]["host"] == "127.0.0.1"
    assert f"Uvicorn running on {server.url} " in server.output()
    assert "PAN2 attention policy" in server.output()  # the worker built PAN2's pipeline


def test_concurrent_clients_each_get_the_video_of_their_own_request(server, image):
    sequential = {}
    for seed in SEEDS:
        job = server.wait(serve_load.submit(server, image, seed).json()["id"])
        assert job["status"] == "completed", job
        sequential[seed] = server.content_sha256(job["id"])
    assert len(set(sequential.values())) == len(SEEDS)  # the seeds make different videos: the check can fail

    with concurrent.futures.ThreadPoolExecutor(1) as background:  # the tool's load run: all sent together
        run = background.submit(serve_load.load, server, image, SEEDS, len(SEEDS), 300)
        seen_running, most_running = 0, 0
        deadline = time.monotonic() + 300
        while not run.done() and time.monotonic() < deadline:
            jobs = server.client.get("/v1/videos").json()["data"]
            running = sum(job["status"] == "in_progress" for job in jobs)
            seen_running, most_running = seen_running + running, max(most_running, running)
            time.sleep(0.2)
        result = run.result(timeout=5)
    assert seen_running and most_running == 1, "jobs must report in_progress, one at a time"
    assert result["sha256_by_seed"] == sequential, "a client got another request's video"


def _truncated_jpeg(path: Path, image: Path) -> Path:
    data = image.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def test_bad_requests_are_refused_at_submission_in_one_line(server, image, folder, tmp_path):
    jobs_before = len(server.client.get("/v1/videos").json()["data"])
    outside = tmp_path / "outside"
    other_host = socket.create_server(("127.0.0.1", 0))  # FastVideo would fetch from it, whatever it sends
    refused = {
        "a reference_url over http": (
            server.submit_json(prompt="x", reference_url=f"http://127.0.0.1:{other_host.getsockname()[1]}/big.jpg",
                               size=SIZE, num_frames=FRAMES), "this server fetches no reference_url over http(s)"),
        "size 300x200": (server.submit(image, prompt="x", size="300x200", num_frames=FRAMES),
                         "height must be a positive multiple of 32; got 200"),
        "truncated JPEG": (server.submit(_truncated_jpeg(tmp_path / "cut.jpg", image), prompt="x", size=SIZE,
                                         num_frames=FRAMES), "cut.jpg"),
        "10 frames": (server.submit(image, prompt="x", size=SIZE, num_frames=10), "got 10: ask for 9 or 13"),
        "seconds halfway": (server.submit(image, prompt="x", size=SIZE, seconds=1, fps=7),
                            "seconds=1 at fps=7 is 7 frames, halfway between 5 and 9"),
        "a server path": (server.submit_json(prompt="x", input_reference="/etc/hostname", size=SIZE,
                                             num_frames=FRAMES), "this server reads no path on its disk outside"),
        "an output folder outside": (server.submit_json(prompt="x", reference_url=_data_url(image), size=SIZE,
                                                        num_frames=FRAMES, output_path=str(outside)),
                                     "output_path must be a folder under the server's output_dir"),
        "an output folder above": (server.submit_json(prompt="x", reference_url=_data_url(image), size=SIZE,
                                                      num_frames=FRAMES, output_path="../escape"),
                                   "output_path must be a folder under the server's output_dir"),
        "a field FastVideo's request refuses (multipart)": (  # FastVideo: a 500, and the upload stayed
            server.submit(image, prompt="x", size=SIZE, num_frames=FRAMES, extra_body='{"fps": "many"}'),
            "invalid request: fps: Input should be a valid integer"),
        "a field FastVideo's request refuses (JSON)": (  # FastVideo: pydantic's lines, and the upload stayed
            server.submit_json(prompt="x", reference_url=_data_url(image), size=SIZE, num_frames=FRAMES,
                               fps="many"), "Invalid request body: invalid request: fps: Input should be a valid"),
        "a JSON key named as our function's parameter": (
            server.submit_json(prompt="x", reference_url=_data_url(image), size=SIZE, num_frames=FRAMES,
                               fps="many", request_class=1), "Invalid request body: invalid request: fps:"),
        "an extra_body that is not an object (multipart)": (  # FastVideo: an unhandled error, and the upload stayed
            server.submit(image, prompt="x", size=SIZE, extra_body="[]"),
            "invalid request: AttributeError: 'list' object has no attribute 'get'"),
        "a file name with a path": (  # FastVideo stores it as uploads/<id>_<name>: three folders up, were it kept
            server.client.post("/v1/videos", files={
                "input_reference": ("a/../../../planted.jpg", image.read_bytes(), "image/jpeg"),
                **{k: (None, v) for k, v in {"prompt": "x", "size": "300x200", "num_frames": str(FRAMES)}.items()}}),
            "height must be a positive multiple of 32; got 200"),
    }
    for case, (response, words) in refused.items():
        assert response.status_code == 400, (case, response.text)
        detail = response.json()["detail"]
        assert words in detail and "\n" not in detail, (case, detail)
    assert len(server.client.get("/v1/videos").json()["data"]) == jobs_before  # no job was made
    assert not select.select([other_host], [], [], 0)[0], "the server connected to the reference_url's host"
    other_host.close()
    assert not outside.exists() and not (folder / "escape").exists()
    assert not (server.output_dir.parent / "planted.jpg").exists()
    uploads = server.output_dir / "uploads"
    assert _files(uploads) == [] and not any(uploads.iterdir())  # the refused requests' uploads are gone
    assert server.client.post("/v1/images", json={"prompt": "x"}).status_code == 404  # PAN2 serves videos only
    assert server.client.get("/health").json() == {"status": "ok"}


def _data_url(image: Path) -> str:
    import base64

    return "data:image/jpeg;base64," + base64.b64encode(image.read_bytes()).decode()


def test_seconds_become_4k_plus_1_frames_and_the_operators_folder_is_readable(server, operator_images):
    response = server.submit_json(prompt="a dog", input_reference=str(operator_images / "frame.jpg"), size=SIZE,
                                  seconds=1, fps=8, seed=5, output_path="by-client")
    assert response.status_code == 200, response.text
    job = server.wait(response.json()["id"])
    assert job["status"] == "completed", job
    video = Path(job["file_path"])
    assert video.parent == (server.output_dir / "by-client").resolve()
    assert video_frames_and_size(video) == (9, (96, 64))  # 1 s x 8 fps = 8 frames -> the nearest 4k + 1


def test_a_failure_in_the_worker_fails_that_job_only(server, image):
    worker = server.worker_pid()
    failed = server.wait(server.submit(image, prompt=f"a cat {FAULT_PROMPT}", size=SIZE,
                                       num_frames=FRAMES).json()["id"])
    assert failed["status"] == "failed", failed
    message = failed["error"]["message"]
    assert message.startswith("OutOfMemoryError: CUDA out of memory (injected") and "\n" not in message, message
    assert server.client.get(f"/v1/videos/{failed['id']}/content").status_code == 500
    good = server.wait(server.submit(image, prompt="a cat", size=SIZE, num_frames=FRAMES).json()["id"])
    assert good["status"] == "completed", good
    assert server.worker_pid() == worker and server.client.get("/health").json() == {"status": "ok"}
    assert _files(server.output_dir / "uploads") == []  # every job's upload went with it
    videos = _files(server.output_dir / "videos")
    assert videos and all(not p.name.startswith(".") for p in videos)  # no partial file


def test_a_request_without_an_image_is_text_to_video(server, image):
    t2v = server.wait(server.submit(None, prompt="a lighthouse in a storm", size=SIZE, num_frames=FRAMES,
                                    seed=11).json()["id"])
    i2v = server.wait(server.submit(image, prompt="a lighthouse in a storm", size=SIZE, num_frames=FRAMES,
                                    seed=11).json()["id"])
    assert t2v["status"] == i2v["status"] == "completed", (t2v, i2v)
    assert server.content_sha256(t2v["id"]) != server.content_sha256(i2v["id"])  # the first frame conditions


def test_delete_skips_a_waiting_job_and_removes_a_video_made_or_being_made(server, image):
    """DELETE /v1/videos/{id}: a job waiting for its turn is never generated, a running one stops at its next
    denoising step (a video it finished first is removed), a completed one's video goes at once (FastVideo only
    forgets the job: the waiting one ran, the running one ran on, and every video stayed)."""
    videos = server.output_dir / "videos"
    running = server.submit(image, prompt="a long one", **LONG_JOB).json()["id"]
    server.wait(running, until=("in_progress",), timeout_s=120)
    waiting = server.submit(image, prompt="a cat", size=SIZE, num_frames=FRAMES, seed=5).json()["id"]
    assert server.client.delete(f"/v1/videos/{waiting}").status_code == 200
    assert server.client.delete(f"/v1/videos/{running}").status_code == 200
    later = server.wait(server.submit(image, prompt="a cat", size=SIZE, num_frames=FRAMES, seed=6).json()["id"])
    assert later["status"] == "completed", later  # served after the running job ended, the deleted one skipped
    log = server.log.read_text(errors="replace")
    assert f"Video {waiting} was deleted before its turn: not generated" in log
    assert f"Video {running} was deleted while it ran" in log  # stopped (test_serve_hardening: at its next step)
    assert not (videos / f"{waiting}.mp4").exists() and not (videos / f"{running}.mp4").exists()
    made = Path(later["file_path"])
    assert made.exists() and server.client.delete(f"/v1/videos/{later['id']}").status_code == 200
    assert not made.exists() and server.client.get(f"/v1/videos/{later['id']}").status_code == 404
    assert _files(server.output_dir / "uploads") == []


def test_the_servers_log_is_plain_text(server):
    """The server's output goes to a file: the worker's prefix without colour codes, and no decoder bar (the test
    servers run with TQDM_DELAY=0, which would draw it at once)."""
    log = server.log.read_bytes()
    assert b"(Worker pid=" in log and b"PAN2 decode: wrote" in log
    assert b"\x1b" not in log and b"VAE decode:" not in log, log[-3000:]


def test_a_dead_worker_is_reported_and_ctrl_c_leaves_nothing(server, image):
    job_id = server.submit(image, prompt="a long one", **LONG_JOB).json()["id"]
    server.wait(job_id, until=("in_progress",), timeout_s=120)
    os.kill(server.worker_pid(), signal.SIGKILL)
    failed = server.wait(job_id)
    assert failed["status"] == "failed" and "a worker process stopped" in failed["error"]["message"], failed
    health = server.client.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "unhealthy", health.text
    server.client.close()
    server.stopped_by(signal.SIGINT, group=True)
    assert server.session_processes() == []
    assert [p for p in _files(server.output_dir) if p.name.startswith(".")] == []  # no partial file


@pytest.mark.parametrize("signum, group", [(signal.SIGINT, True), (signal.SIGTERM, False)],
                         ids=["ctrl-c-to-the-group", "sigterm-to-the-server"])
def test_a_signal_with_a_job_in_flight_leaves_no_process_and_no_file(tiny_ckpt, tmp_path, image, signum, group):
    srv = Server(serve_config(tmp_path, tiny_ckpt))
    try:
        job_id = srv.submit(image, prompt="a long one", **LONG_JOB).json()["id"]
        srv.wait(job_id, until=("in_progress",), timeout_s=120)
        deadline = time.monotonic() + 120  # the decoding stage writes the mp4 while it decodes: signal then
        while not list((srv.output_dir / "videos").glob(".*.partial.mp4")) and time.monotonic() < deadline:
            assert srv.job(job_id)["status"] == "in_progress", srv.job(job_id)
            time.sleep(0.2)
        assert list((srv.output_dir / "videos").glob(".*.partial.mp4")), "the job was not writing its video"
        srv.client.close()
        srv.stopped_by(signum, group)
        assert srv.session_processes() == []
        assert _files(srv.output_dir) == [], _files(srv.output_dir)  # no video, no partial file, no upload
    finally:
        srv.kill()
