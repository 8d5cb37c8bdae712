"""PAN2 served by two replicas behind one entry point (`server.replicas: 2`: Ray Serve), started as a user starts it
(`fastvideo serve --config`, the shipped example config on the tiny checkpoint, loopback only), driven by a real HTTP
client: concurrent clients each get their own video (checked by content against sequential runs on a single
server), both replicas serve, a job's requests all reach its replica (and only there is the job known), a request
without a session is refused in one line, and SIGTERM with a job in flight leaves no process and no file."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import psutil
import pytest
from _pan2_helpers import exif_rotated_jpeg
from _serve_helpers import FRAMES, SIZE, serve_config

from fastvideo_pan2_ext.fastvideo_integration import scale_out
from bench import serve_load

pytestmark = pytest.mark.slow

SEEDS = (11, 22, 33, 44)
LONG_JOB = {"size": "384x256", "num_frames": 161, "num_inference_steps": 1}  # seconds of decode on 2 cores


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    return exif_rotated_jpeg(tmp_path_factory.mktemp("scale-out-image") / "first_frame.jpg", 192, 128)


@pytest.fixture(scope="module")
def sequential(tmp_path_factory, tiny_ckpt, image) -> dict:
    """sha256 of each seed's video, made one at a time by a single server."""
    server = serve_load.Server(serve_config(tmp_path_factory.mktemp("single"), tiny_ckpt))
    try:
        return serve_load.load(server, image, SEEDS, 1, 300)["sha256_by_seed"]
    finally:
        server.kill()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, tiny_ckpt, sequential):
    server = serve_load.Server(serve_config(tmp_path_factory.mktemp("replicas"), tiny_ckpt, replicas=2))
    yield server
    server.kill()


def test_the_client_constants_are_the_servers():
    assert (serve_load.SESSION_HEADER, serve_load.REPLICA_HEADER) == (scale_out.SESSION_HEADER,
                                                                      scale_out.REPLICA_HEADER)


def test_concurrent_clients_each_get_their_own_video_from_both_replicas(replicas, image, sequential):
    assert replicas.config["server"]["host"] == "127.0.0.1" and replicas.config["server"]["replicas"] == 2
    assert len(set(sequential.values())) == len(SEEDS)  # the seeds make different videos: the check can fail
    by_seed = serve_load.dealt_sessions(replicas, SEEDS)  # two for each replica, as Ray's ring routes them
    result = serve_load.load(replicas, image, SEEDS, len(SEEDS), 300, sessions=by_seed)  # all sent together
    assert result["sha256_by_seed"] == sequential, "a client got another request's video"
    # Both replicas served, two jobs each (each job's requests all reached one replica: `load` checks it).
    assert sorted(result["requests_by_replica"].values()) == [2, 2], result


def test_a_job_is_known_only_to_its_replica_and_a_request_needs_a_session(replicas, image):
    sessions = serve_load.sessions_by_replica(replicas, 1)
    (here, there) = (replicas.session(keys[0]) for keys in sessions.values())
    try:
        job = here.wait(serve_load.submit(here, image, 5).json()["id"])
        assert job["status"] == "completed", job
        assert there.client.get(f"/v1/videos/{job['id']}").status_code == 404  # the other replica has no such job
        assert there.client.get(f"/v1/videos/{job['id']}/content").status_code == 404
        assert here.client.get(f"/v1/videos/{job['id']}/content").status_code == 200
        assert len(set(here.replicas_seen)) == 1 and set(here.replicas_seen) != set(there.replicas_seen)
    finally:
        here.client.close()
        there.client.close()
    for response in (replicas.submit(image, prompt="x", size=SIZE, num_frames=FRAMES),
                     replicas.client.get(f"/v1/videos/{job['id']}")):
        assert response.status_code == 400, response.text
        detail = response.json()["detail"]
        assert f"send the header {scale_out.SESSION_HEADER}" in detail and "\n" not in detail, detail
    assert replicas.client.get("/health").json() == {"status": "ok"}  # not an API request: no session needed


def test_sigterm_with_a_job_in_flight_leaves_no_process_and_no_file(replicas, image):
    client = replicas.session("the-long-one")
    try:
        job_id = client.submit(image, prompt="a long one", **LONG_JOB).json()["id"]
        client.wait(job_id, until=("in_progress",), timeout_s=120)
        videos = replicas.output_dir / "videos"
        deadline = time.monotonic() + 120  # the decoding stage writes the mp4 while it decodes: signal then
        while not list(videos.glob(".*.partial.mp4")) and time.monotonic() < deadline:
            assert client.job(job_id)["status"] == "in_progress", client.job(job_id)
            time.sleep(0.2)
        assert list(videos.glob(".*.partial.mp4")), "the job was not writing its video"
    finally:
        client.client.close()
    everything = psutil.Process(replicas.proc.pid).children(recursive=True)  # Ray's processes, the replicas, workers
    assert len(everything) > 6, [p.name() for p in everything]
    replicas.client.close()
    code = replicas.stopped_by(signal.SIGTERM, group=False)
    assert code == -signal.SIGTERM, (code, replicas.output()[-3000:])  # ended by the signal, as a single server is
    assert replicas.session_processes() == []
    alive = [p for p in everything if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert alive == [], alive
    left = sorted(p.relative_to(replicas.output_dir) for p in replicas.output_dir.rglob("*") if p.is_file())
    assert [p for p in left if p.name.startswith(".") or p.parts[0] == "uploads"] == [], left  # no partial, upload
