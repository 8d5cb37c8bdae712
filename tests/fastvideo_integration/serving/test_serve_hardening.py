"""PAN2's server against what one careless or hostile client can do (docs/design/serving.md, "Serving"; issue 38), on
one real server on loopback started from a plain FastVideo serve config: no `pipeline: pan2`, only the tiny PAN2
checkpoint as its `model_path` (its `server:` sets a few of PAN2's limits shorter, which only a PAN2 server accepts).

- PAN2's rules apply however the config names the pipeline: two clients at once each get their own video.
- Every limit refuses at submission with one line and a 4xx: an absurd size, step count or frame count (400), a
  200 MB upload (413; the server's memory does not grow by it: measured), 50 MB of headers (431), a slow client
  (408), a full queue (429); a good request right after still gets its video.
- DELETE of a running job stops it at its next denoising step: the worker serves the next job.
- Links planted at a job's names (its final name, its old partial name, its folder) touch no file outside the
  output; a finished video replaced by a link is not served.

Every loop is bounded in count and time; only 127.0.0.1 is reached."""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import socket
import threading
import time
from pathlib import Path

import pytest
import yaml
from _pan2_helpers import free_port
from _serve_helpers import FRAMES, SIZE, Server

from bench import serve_load

LIMITS = {"header_timeout_s": 2, "body_timeout_s": 3, "max_queued_jobs": 3}  # the rest: the defaults
# 100 steps of 5,040 tokens: a minute or more of denoising even on a fast idle CPU (each such job is deleted)
LONG_JOB = {"size": "640x384", "num_frames": 81, "num_inference_steps": 100}
MiB = 2**20


class Victim:
    """A file outside the output that a planted link points at: it must stay exactly as it was."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.write_text("root secret 42")
        os.utime(path, (1_000_000_000, 1_000_000_000))
        self.before = (path.read_bytes(), path.stat().st_mtime_ns)

    def untouched(self) -> bool:
        return (self.path.read_bytes(), self.path.stat().st_mtime_ns) == self.before


# --------------------------------------------------------------------------------------- which servers get the rules


@pytest.mark.parametrize("checkpoint, pan2", [("tiny_ckpt", True), ("wan22_stock", False)])
def test_a_plain_serve_config_on_a_pan2_checkpoint_gets_pan2s_rules(request, tmp_path, checkpoint, pan2):
    """What `fastvideo serve --config` decides before any model loads: a config that names no pipeline gets PAN2's
    serving rules when its checkpoint is PAN2's (its manifest), and is FastVideo's own otherwise."""
    from fastvideo_pan2_ext.fastvideo_integration import serving

    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"generator": {"model_path": str(request.getfixturevalue(checkpoint))},
                                      "server": {"output_dir": str(tmp_path / "out")}}))
    args = argparse.Namespace(config=str(config), pipeline=None, _unknown=None)
    fastvideos = []
    serving._validate(args, fastvideos.append)
    assert (getattr(args, "_pan2_serving", None) is not None) == pan2 and bool(fastvideos) == (not pan2)
    assert serving.serves_pan2("IFM/PAN2") and not serving.serves_pan2("Wan-AI/Wan2.2-TI2V-5B-Diffusers")


def test_an_operators_default_output_path_outside_output_dir_is_refused_at_start_in_one_line(tiny_ckpt, tmp_path,
                                                                                             monkeypatch, capsys):
    """FastVideo writes every request without an output_path to it; below output_dir it is taken as FastVideo takes it
    (a relative one from the working folder) and resolved once; elsewhere every job used to fail at its save."""
    from fastvideo_pan2_ext.fastvideo_integration import compat, serving

    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "link-out").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "out" / "link-in").symlink_to(tmp_path / "out" / "videos", target_is_directory=True)

    def validated(output_path):
        config = tmp_path / "serve.yaml"
        config.write_text(yaml.safe_dump({"generator": {"model_path": str(tiny_ckpt)}, "server": {"output_dir": "out"},
                                          "default_request": {"output": {"output_path": output_path}}}))
        args = argparse.Namespace(config=str(config), pipeline=None, _unknown=None)
        serving._validate(args, None)
        return compat.http_server.default_output_path(compat.cli.validated_serve_config_of(args).default_request)

    assert validated("out/kept/../defaults") == str(tmp_path / "out" / "defaults")
    assert validated("out/link-in") == str(tmp_path / "out" / "videos")
    for outside in ("elsewhere", str(tmp_path / "elsewhere"), "out/../elsewhere", "out/link-out", "/"):
        capsys.readouterr()
        with pytest.raises(SystemExit) as stop:
            validated(outside)
        assert stop.value.code == 2
        assert capsys.readouterr().err.splitlines() == [
            f"fastvideo serve: error: default_request.output.output_path must be a folder under server.output_dir "
            f"({tmp_path / 'out'}); got {outside!r}"]


def _cancel_on_rank(rank: int, world: int, tmp: str) -> list:
    """Rank 0 sees its job's flag set before step 2, rank 1 (a moment behind) not yet: both must stop at step 2."""
    import types

    import torch.distributed as dist

    from fastvideo_pan2_ext.fastvideo_integration import cancel, compat

    compat.executor.request_group = lambda: dist.group.WORLD  # the request's ranks, as FastVideo's world group has them
    compat.executor.local_torch_device = lambda: "cpu"
    flag = cancel.CancelFlag(f"{tmp}/flag-{rank}")
    batch = types.SimpleNamespace(extra={cancel.KEY: flag})
    stopped = []
    for step in range(4):
        if step == 2 and rank == 0:
            flag.set()
        try:
            cancel.check(batch, step, 4)
        except cancel.JobCancelled as exc:
            stopped.append((step, str(exc)))
            break
    return stopped


@pytest.mark.slow  # two processes that import FastVideo
def test_a_cancelled_job_stops_every_rank_at_the_same_step(tmp_path):
    from _ranks import run_ranks

    stopped = run_ranks(_cancel_on_rank, 2, tmp_path)
    assert stopped == [[(2, "deleted while it ran: stopped before denoising step 3 of 4")]] * 2


# --------------------------------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hardening")


@pytest.fixture(scope="module")
def image(folder) -> Path:
    return serve_load.first_frame(folder / "first_frame.jpg")


@pytest.fixture(scope="module")
def server(folder, tiny_ckpt):
    config = folder / "serve.yaml"
    config.write_text(yaml.safe_dump({
        "generator": {"model_path": str(tiny_ckpt), "engine": {"num_gpus": 1}},
        "server": {"host": "127.0.0.1", "port": free_port(), "output_dir": str(folder / "out"), **LIMITS},
        "default_request": {"sampling": {"num_inference_steps": serve_load.STEPS, "guidance_scale": 1.0}}}))
    srv = Server(config)
    yield srv
    srv.kill()


def _one_line(response, status: int, words: str) -> None:
    assert response.status_code == status, (words, response.status_code, response.text)
    detail = response.json()["detail"]
    assert words in detail and "\n" not in detail, (words, detail)


def _uploads(server) -> list[Path]:
    uploads = server.output_dir / "uploads"
    return sorted(uploads.iterdir()) if uploads.exists() else []


def _good_request_gets_its_video(server, image, seed: int = 7) -> None:
    job = server.wait(serve_load.submit(server, image, seed).json()["id"])
    assert job["status"] == "completed", job
    assert server.client.get(f"/v1/videos/{job['id']}/content").content[4:8] == b"ftyp"


@pytest.mark.slow
def test_two_clients_at_once_each_get_their_own_video(server, image):
    assert "pipeline" not in server.config
    assert "is a PAN2 checkpoint: served with PAN2's rules" in server.output()
    sequential = {}
    for seed in (11, 22):
        job = server.wait(serve_load.submit(server, image, seed).json()["id"])
        assert job["status"] == "completed", job
        sequential[seed] = server.content_sha256(job["id"])
    assert len(set(sequential.values())) == 2  # the seeds make different videos: the check can fail
    together = serve_load.load(server, image, sequential, concurrency=2, timeout_s=300)
    assert together["sha256_by_seed"] == sequential, "a client got another request's video"


@pytest.mark.slow
def test_a_request_over_a_limit_is_refused_at_submission_in_one_line(server, image):
    jobs_before = len(server.client.get("/v1/videos").json()["data"])
    cases = {  # FastVideo: the first killed the worker for memory; the steps held it for hours
        "size 1099511627776x32": ({"size": "1099511627776x32"}, "(35184372088832 pixels) is over this server's limit "
                                  "of 878592 (server.max_pixels)"),
        "just over the area": ({"size": "1280x704"}, "size 1280x704 (901120 pixels) is over"),
        "485 frames": ({"num_frames": 485}, "num_frames 485 is over this server's limit of 481 (server.max_frames)"),
        "24000001 frames": ({"num_frames": 24000001}, "num_frames 24000001 is over"),
        "a million steps": ({"num_inference_steps": 1000000}, "num_inference_steps 1000000 is over this server's "
                            "limit of 100 (server.max_steps)"),
        "no step": ({"num_inference_steps": 0}, "num_inference_steps must be a whole number >= 1; got 0"),
    }
    for fields, words in cases.values():
        request = {"prompt": "x", "size": SIZE, "num_frames": FRAMES, **fields}
        _one_line(server.submit(image, **request), 400, words)
    big_json = server.client.post("/v1/videos", json={"prompt": "x" * (9 * MiB)})
    _one_line(big_json, 413, "over this server's limit of 8388608 (server.max_body_bytes)")
    assert len(server.client.get("/v1/videos").json()["data"]) == jobs_before  # no job was made
    assert _uploads(server) == []
    _good_request_gets_its_video(server, image)


# Raw HTTP on a socket: what a client library will not send (a 200 MB body it stops sending once answered, endless
# headers, a byte at a time).

def _answered(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def _answer(sock: socket.socket, timeout_s: float = 20) -> tuple[int, str]:
    """(status, the one line of its JSON `detail`) of the response on `sock`."""
    data, deadline = b"", time.monotonic() + timeout_s
    while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + _length(data):
        if time.monotonic() > deadline:
            raise AssertionError(f"no whole answer in {timeout_s} s: {data[:300]!r}")
        sock.settimeout(max(deadline - time.monotonic(), 0.1))
        try:
            more = sock.recv(65536)
        except ConnectionResetError:
            more = b""
        if not more:
            break
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    return status, json.loads(body)["detail"]


def _length(data: bytes) -> int:
    found = re.search(rb"(?i)content-length: *(\d+)", data.partition(b"\r\n\r\n")[0])
    return int(found.group(1)) if found else 0


def _send(server, head: bytes, pieces, pause_s: float = 0.0) -> tuple[int, str, float, int]:
    """Send `head`, then each piece until the server answers (or stops reading); -> (status, detail, seconds from
    the first byte to the answer, bytes sent)."""
    sock = socket.create_connection(("127.0.0.1", server.config["server"]["port"]), timeout=20)
    start, sent = time.monotonic(), 0
    try:
        sock.sendall(head)
        sent += len(head)
        for piece in pieces:
            if _answered(sock):
                break
            try:
                sock.sendall(piece)
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                break
            sent += len(piece)
            time.sleep(pause_s)
        status, detail = _answer(sock)
        return status, detail, time.monotonic() - start, sent
    finally:
        sock.close()


class _PeakRSS(threading.Thread):
    """The largest resident memory of process `pid` while running (sampled every 20 ms)."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.done = pid, self.of(pid), threading.Event()

    @staticmethod
    def of(pid: int) -> int:
        status = Path(f"/proc/{pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024

    def run(self) -> None:
        while not self.done.wait(0.02):
            self.peak = max(self.peak, self.of(self.pid))
        self.peak = max(self.peak, self.of(self.pid))


UPLOAD_HEAD = (b'--pan2\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nx\r\n--pan2\r\nContent-Disposition: '
               b'form-data; name="input_reference"; filename="big.jpg"\r\nContent-Type: image/jpeg\r\n\r\n')
UPLOAD_TAIL = b"\r\n--pan2--\r\n"


@pytest.mark.slow
@pytest.mark.parametrize("framing", ["content-length", "chunked", "under the limit"])
def test_a_200_mb_upload_is_a_413_and_never_in_the_servers_memory(server, image, framing):
    """FastVideo: +614 MiB of server memory for a 200 MB upload (it reads the upload whole). Declared: refused before
    a byte of it is read; chunked (no length said): refused once 50 MB have come, its parts on disk meanwhile; 40 MB,
    under the limit: copied to its file in chunks (then refused: not an image)."""
    block = os.urandom(MiB)
    size = 40 * MiB if framing == "under the limit" else 200 * MiB
    if framing != "chunked":
        head = (b"POST /v1/videos HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=pan2\r\n"
                b"Content-Length: %d\r\n\r\n" % (len(UPLOAD_HEAD) + size + len(UPLOAD_TAIL)) + UPLOAD_HEAD)
        pieces = [*(block for _ in range(size // MiB)), UPLOAD_TAIL]
    else:
        head = (b"POST /v1/videos HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=pan2\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n" % (len(UPLOAD_HEAD), UPLOAD_HEAD))
        pieces = (b"%x\r\n%s\r\n" % (len(block), block) for _ in range(size // MiB))
    before = _PeakRSS.of(server.proc.pid)
    sampler = _PeakRSS(server.proc.pid)
    sampler.start()
    try:
        status, detail, seconds, sent = _send(server, head, pieces)
    finally:
        sampler.done.set()
        sampler.join()
    if framing == "under the limit":
        assert status == 400 and "cannot read image" in detail and "\n" not in detail, (status, detail)
    else:
        assert status == 413 and "over this server's limit of 50000000" in detail and "server.max_upload_bytes" in \
            detail and "\n" not in detail, (status, detail)
    grown = sampler.peak - before
    print(f"\n{framing}: {sent / MiB:.1f} MiB sent of {size // MiB} MiB in {seconds:.2f} s, then {status}; the "
          f"server's memory grew by {grown / MiB:.1f} MiB")
    if framing == "chunked":  # counted as it came: refused once past the limit
        assert 50_000_000 < sent < 60 * MiB
    assert grown < 32 * MiB, f"the server's memory grew by {grown / MiB:.0f} MiB during the upload"
    assert _uploads(server) == []
    assert server.client.get("/health").json() == {"status": "ok"}


@pytest.mark.slow
def test_50_mb_of_headers_and_slow_clients_each_get_one_line(server, image):
    port_head = b"GET /health HTTP/1.1\r\nHost: x\r\n"
    status, detail, _, _ = _send(server, port_head + b"X-Big: ", (b"a" * 65536 for _ in range(800)))  # 52 MB at most
    assert (status, detail) == (431, "the request headers are over this server's limit of 65536 bytes "
                                     "(server.max_header_bytes)")

    # Slowloris: 20 connections sending their headers a byte each 0.5 s (FastVideo: 300 held for 45 s and more).
    socks = [socket.create_connection(("127.0.0.1", server.config["server"]["port"]), timeout=20) for _ in range(20)]
    start = time.monotonic()
    try:
        for sock in socks:
            sock.sendall(port_head + b"X-Slow: ")
        while time.monotonic() - start < 8 and not all(_answered(sock) for sock in socks):
            for sock in socks:
                if not _answered(sock):
                    try:
                        sock.sendall(b"a")
                    except OSError:
                        pass
            time.sleep(0.5)
        answers = [_answer(sock) for sock in socks]
        elapsed = time.monotonic() - start
    finally:
        for sock in socks:
            sock.close()
    assert set(answers) == {(408, "the request headers did not all arrive within 2 s (server.header_timeout_s)")}
    assert elapsed < LIMITS["header_timeout_s"] + 3

    # A slow upload: its headers whole, then a trickle of its body (FastVideo: still accepting it after 35 s).
    head = (b"POST /v1/videos HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=pan2\r\n"
            b"Content-Length: 100000\r\n\r\n" + UPLOAD_HEAD)
    status, detail, elapsed, _ = _send(server, head, (b"a" for _ in range(40)), pause_s=0.5)
    assert (status, detail) == (408, "the request body did not all arrive within 3 s (server.body_timeout_s)")
    assert elapsed < LIMITS["body_timeout_s"] + 3
    assert _uploads(server) == []
    _good_request_gets_its_video(server, image)


def _stopped_at_step(log: str, job_id: str) -> int:
    found = re.search(rf"Video {job_id} deleted while it runs.*?stopped before denoising step (\d+) of", log, re.S)
    assert found, log[-3000:]
    return int(found.group(1))


@pytest.mark.slow
def test_a_full_queue_is_a_429_and_delete_stops_a_running_job_at_its_next_step(server, image):
    worker = server.worker_pid()
    running = server.submit(None, prompt="a long one", **LONG_JOB).json()["id"]
    server.wait(running, until=("in_progress",), timeout_s=120)
    started = time.monotonic()
    waiting = [serve_load.submit(server, image, seed).json()["id"] for seed in (1, 2, 3)]
    _one_line(serve_load.submit(server, image, 4), 429, "3 jobs are waiting, this server's limit "
              "(server.max_queued_jobs): submit again later")
    assert len(_uploads(server)) == 3  # the refused one's went at once
    for job_id in waiting:
        assert server.client.delete(f"/v1/videos/{job_id}").status_code == 200
    time.sleep(3)  # some steps of the long job
    deleted = time.monotonic()
    assert server.client.delete(f"/v1/videos/{running}").status_code == 200
    after = serve_load.submit(server, image, 5).json()["id"]
    freed = None
    while freed is None and time.monotonic() - deleted < 120:
        if server.job(after)["status"] != "queued":
            freed = time.monotonic()
        time.sleep(0.05)
    assert freed is not None, "the worker was not freed"
    step = _stopped_at_step(server.output(), running)
    per_step = (deleted - started) / max(step - 1, 1)  # at most: the prompt's encoding is in it too
    print(f"\nstopped before step {step} of 100; {per_step:.2f} s a step at most; the next job ran "
          f"{freed - deleted:.2f} s after the DELETE")
    assert step < 100 and freed - deleted < per_step + 3.0
    job = server.wait(after)
    assert job["status"] == "completed", job
    assert server.worker_pid() == worker and server.client.get("/health").json() == {"status": "ok"}
    assert not (server.output_dir / "videos" / f"{running}.mp4").exists()
    assert f"Video {running} was deleted while it ran: stopped" in server.output()


@pytest.mark.slow
def test_links_planted_at_a_jobs_names_touch_nothing_outside(server, image, tmp_path):
    """A member of the output folder's group, in their own folder under output_dir (the review's S80), while the jobs
    wait: a link at a job's final name (dangling: FastVideo takes the name; to a file: FastVideo takes `name_1`, and
    the job's video, not the link's target, is served), links at the names the product used to write, and a job's
    folder swapped for a link."""
    outside = tmp_path / "outside"
    outside.mkdir()
    victims = [Victim(outside / f"victim-{n}") for n in range(3)]
    out = server.output_dir
    blocker = server.submit(None, prompt="a long one", **LONG_JOB).json()["id"]
    server.wait(blocker, until=("in_progress",), timeout_s=120)
    for name in ("att-a", "att-c"):
        (out / name).mkdir()
    a, b, c = (server.submit_json(prompt=name, size=SIZE, num_frames=FRAMES, output_path=f"att-{name}").json()["id"]
               for name in "abc")  # JSON: FastVideo's multipart form has no output_path
    (out / "att-a" / f"{a}.mp4").symlink_to(outside / "new-file")  # the final name, a link to make a file with
    (out / "att-c" / f"{c}.mp4").symlink_to(victims[0].path)  # the final name, a link to a file to overwrite
    for job, folder in ((a, "att-a"), (c, "att-c")):  # the names the product used to write
        (out / folder / f".{job}.mp4.partial.mp4").symlink_to(victims[1].path)
        (out / folder / f".{job}.mp4.probe-{server.proc.pid}").symlink_to(victims[2].path)
    (out / "att-b").rmdir()
    (out / "att-b").symlink_to(outside, target_is_directory=True)  # the job's folder, now a link out
    assert server.client.delete(f"/v1/videos/{blocker}").status_code == 200

    failed_a, failed_b, done_c = (server.wait(job) for job in (a, b, c))
    assert failed_a["status"] == "failed" and failed_a["error"]["message"] == (
        f"OSError: cannot write the video to {out / 'att-a' / f'{a}.mp4'}: it is a symbolic link: a video is never "
        f"written through one (remove it, or name the file itself)"), failed_a
    assert failed_b["status"] == "failed" and f"{out / 'att-b'} is a symbolic link (below {out} only real " \
        f"folders are used)" in failed_b["error"]["message"], failed_b
    assert done_c["status"] == "completed", done_c
    video = out / "att-c" / f"{c}_1.mp4"  # FastVideo's name beside the taken one
    assert Path(done_c["file_path"]) == video and video.is_file() and not video.is_symlink()
    assert server.client.get(f"/v1/videos/{c}/content").content == video.read_bytes()  # FastVideo: the victim
    assert all(v.untouched() for v in victims)
    assert sorted(outside.iterdir()) == [v.path for v in victims]  # nothing made, nothing written into the folder


@pytest.mark.slow
def test_a_finished_video_replaced_by_a_link_is_not_served(server, image, tmp_path):
    victim = Victim(tmp_path / "victim")
    job = server.wait(serve_load.submit(server, image, 9).json()["id"])
    assert job["status"] == "completed", job
    video = Path(job["file_path"])
    made = server.client.get(f"/v1/videos/{job['id']}/content")
    assert made.status_code == 200 and made.content == video.read_bytes()
    video.unlink()
    video.symlink_to(victim.path)  # FastVideo answered 200 with the link's target
    _one_line(server.client.get(f"/v1/videos/{job['id']}/content"), 404, "is no longer the file this server wrote")
    video.unlink()
    video.write_bytes(made.content)  # the same bytes, another file
    _one_line(server.client.get(f"/v1/videos/{job['id']}/content"), 404, "is no longer the file this server wrote")
    assert server.client.delete(f"/v1/videos/{job['id']}").status_code == 200
    assert video.exists() and victim.untouched()  # not the file it wrote: left alone
