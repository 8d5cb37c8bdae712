"""A bounded load run against a PAN2 server started as a user starts one (`fastvideo serve --config`, the shipped
example config pointed at a checkpoint, loopback only): requests per minute at concurrency 1 and 4 (and more), with
the ratio to serial, every video checked against its serial run by content. Every loop is bounded in count and time;
the server's whole session is stopped at the end, whatever happened.

    .venv/bin/python bench/serve_load.py CHECKPOINT [--requests 8] [--concurrency 1 4] [--replicas N]
                                         [--out bench/results/X.json]

`--replicas N`: the same server scaled out (`server.replicas: N`, Ray Serve); each request's job gets its own session
header, the sessions chosen so that the requests are dealt to the replicas in turn (Ray spreads real sessions by
their hash, less evenly), and every job's requests are checked to have reached one replica.

Stands in for `fastvideo bench`, which looks the model id up on the hub and polls a wedged job forever.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import copy
import datetime
import hashlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
FASTVIDEO = Path(sys.executable).parent / "fastvideo"
EXAMPLE_CONFIG = REPO / "configs" / "serve_pan2.yaml"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
SIZE, FRAMES, STEPS = "96x64", 9, 2  # the tiny request: 3 latent frames, one 64x96 first frame
# A scaled-out server (fastvideo_pan2_ext.fastvideo_integration.scale_out, which a client does not import): the header that
# routes a job's requests to its replica, the header that names the replica, the line that says all are ready.
SESSION_HEADER, REPLICA_HEADER, REPLICAS_READY = "x-session-id", "x-serve-replica", "replicas ready behind"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_config(folder: Path, checkpoint: Path, **server) -> Path:
    """The shipped example config, pointed at `checkpoint` and a free loopback port, STEPS steps per video."""
    config = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    config["generator"]["model_path"] = str(checkpoint)
    config["server"].update(port=free_port(), output_dir=str(folder / "out"), **server)
    config["default_request"] = {"sampling": {"num_inference_steps": STEPS, "guidance_scale": 1.0}}
    path = folder / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class Server:
    """`fastvideo serve --config CONFIG` in a session of its own, its output in `log`; scaled out when the config says
    `server.replicas` (then ready once every replica is)."""

    def __init__(self, config: Path, startup_s: float = 300, env: dict | None = None) -> None:
        self.config = yaml.safe_load(config.read_text())
        self.url = f"http://127.0.0.1:{self.config['server']['port']}"
        self.output_dir = Path(self.config["server"]["output_dir"])
        self.replicas = self.config["server"].get("replicas")
        self.replicas_seen: list[str | None] = []  # a session's: the replica of each response
        self.log = config.parent / "server.log"
        env = {**os.environ, **OFFLINE, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([str(FASTVIDEO), "serve", "--config", str(config)], stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=config.parent)
        self.client = httpx.Client(base_url=self.url, timeout=30)
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the server exited ({self.proc.returncode}):\n{self.output()[-4000:]}"
            try:
                if self.client.get("/health").status_code == 200 and (not self.replicas or
                                                                     REPLICAS_READY in self.output()):
                    return
            except httpx.TransportError:
                pass
            time.sleep(1)
        self.kill()
        raise AssertionError(f"the server did not start in {startup_s} s:\n{self.output()[-4000:]}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def session(self, key: str) -> Server:
        """This server as one client sees it that sends `key` as its session header with every request (close it
        with `.client.close()`); `replicas_seen` collects the replica each response names."""
        view = copy.copy(self)
        view.replicas_seen = []
        view.client = httpx.Client(base_url=self.url, timeout=30, headers={SESSION_HEADER: key}, event_hooks={
            "response": [lambda response: view.replicas_seen.append(response.headers.get(REPLICA_HEADER))]})
        return view

    def submit(self, image: Path | None = None, **fields) -> httpx.Response:
        """POST /v1/videos as multipart (the image as input_reference, if any)."""
        files = {"input_reference": (image.name, image.read_bytes(), "image/jpeg")} if image else {}
        data = {k: (None, str(v)) for k, v in fields.items()}  # multipart even without a file
        return self.client.post("/v1/videos", files={**data, **files})

    def submit_json(self, **body) -> httpx.Response:
        return self.client.post("/v1/videos", json=body)

    def job(self, job_id: str) -> dict:
        response = self.client.get(f"/v1/videos/{job_id}")
        assert response.status_code == 200, f"GET /v1/videos/{job_id}: {response.status_code} {response.text}"
        return response.json()

    def wait(self, job_id: str, until=("completed", "failed"), timeout_s: float = 240) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job["status"] in until:
                return job
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} not {until} in {timeout_s} s: {self.job(job_id)}")

    def content_sha256(self, job_id: str) -> str:
        response = self.client.get(f"/v1/videos/{job_id}/content")
        assert response.status_code == 200, response.text
        return hashlib.sha256(response.content).hexdigest()

    def session_processes(self) -> list[str]:
        """The live (not zombie) processes of the server's session."""
        ps = subprocess.run(["ps", "-o", "stat=,pid=,cmd=", "--sid", str(self.proc.pid)], capture_output=True,
                            text=True).stdout
        return [line for line in ps.splitlines() if line.strip() and not line.strip().startswith("Z")]

    def worker_pid(self) -> int:
        children = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        return next(int(pid) for pid in children
                    if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"))

    def stopped_by(self, signum: int, group: bool, timeout_s: float = 60) -> int:
        """Send `signum` (to the whole session's group, as Ctrl-C in a terminal does, or to the server alone), wait
        for the server and its children to end. -> its exit code."""
        (os.killpg if group else os.kill)(self.proc.pid, signum)
        code = self.proc.wait(timeout=timeout_s)
        deadline = time.monotonic() + 15  # an orphaned child (the resource tracker) may take a moment to go
        while self.session_processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        return code

    def kill(self) -> None:
        self.client.close()
        if self.proc.poll() is None or self.session_processes():
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)


def submit(server: Server, image: Path, seed: int):
    """One tiny request; its prompt and seed say which video it is."""
    return server.submit(image, prompt=f"a cat, take {seed}", size=SIZE, num_frames=FRAMES, seed=seed)


def sessions_by_replica(server: Server, wanted: int) -> dict[str, list[str]]:
    """Session ids that a scaled-out `server` routes to each of its replicas, `wanted` for each (found by asking, a
    bounded number of times: the ring is Ray's)."""
    found: dict[str, list[str]] = {}
    for n in range(max(64, 8 * wanted * server.replicas)):
        client = server.session(f"client-{n}")
        try:
            response = client.client.get("/v1/videos")
        finally:
            client.client.close()
        if response.status_code != 200:
            raise RuntimeError(f"GET /v1/videos: {response.status_code} {response.text}")
        found.setdefault(client.replicas_seen[0], []).append(f"client-{n}")
        if len(found) == server.replicas and all(len(keys) >= wanted for keys in found.values()):
            return found
    raise RuntimeError(f"no {wanted} sessions for each of {server.replicas} replicas: {found}")


def dealt_sessions(server: Server, seeds) -> dict:
    """A session for each seed, the seeds dealt to the replicas in turn."""
    seeds = list(seeds)
    per_replica = -(-len(seeds) // server.replicas)
    groups = [keys[:per_replica] for keys in sessions_by_replica(server, per_replica).values()]
    return dict(zip(seeds, [key for turn in zip(*groups) for key in turn]))


def load(server: Server, image: Path, seeds, concurrency: int, timeout_s: float = 1800,
         sessions: dict | None = None) -> dict:
    """One video per seed, submitted by `concurrency` clients, each waiting for its video. -> wall time, requests per
    minute, the median latency, and each video's sha256 by seed. A scaled-out server: each seed's requests carry its
    session (`sessions[seed]`, else "seed-<seed>"), must all reach one replica, and `replica_by_seed` says which."""
    seeds = list(seeds)

    def one(seed: int):
        client = server.session((sessions or {}).get(seed, f"seed-{seed}")) if server.replicas else server
        try:
            start = time.monotonic()
            job_id = submit(client, image, seed).json()["id"]
            job = client.wait(job_id, timeout_s=timeout_s)
            if job["status"] != "completed":
                raise RuntimeError(f"job {job_id} (seed {seed}) {job['status']}: {job.get('error')}")
            sha = client.content_sha256(job_id)
            if len(set(client.replicas_seen)) > 1:
                raise RuntimeError(f"job {job_id} (seed {seed}): its requests reached replicas {client.replicas_seen}")
            return seed, time.monotonic() - start, sha, (client.replicas_seen or [None])[0]
        finally:
            if client is not server:
                client.client.close()

    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(one, seeds))
    wall = time.monotonic() - start
    result = {"requests": len(seeds), "concurrency": concurrency, "wall_s": round(wall, 2),
              "requests_per_min": round(60 * len(seeds) / wall, 2),
              "latency_s_median": round(statistics.median(d[1] for d in done), 2),
              "sha256_by_seed": {seed: sha for seed, _, sha, _ in done}}
    if server.replicas:
        result["replica_by_seed"] = {seed: replica for seed, _, _, replica in done}
        result["requests_by_replica"] = dict(collections.Counter(result["replica_by_seed"].values()))
    return result


def first_frame(path: Path, width: int = 192, height: int = 128) -> Path:
    """A 3:2 gradient JPEG (the tiny request's first frame)."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // (width - 1), y * 255 // (height - 1), (x * 7 + y * 3) % 256], -1)
    Image.fromarray(pixels.astype(np.uint8)).save(path, quality=95)
    return path


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--replicas", type=int, default=None, help="scale the server out (server.replicas)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        image = first_frame(tmp / "first_frame.jpg")
        server = Server(serve_config(tmp, args.checkpoint.resolve(), **({"replicas": args.replicas} if args.replicas
                                                                        else {})), startup_s=600)
        try:
            sessions = dealt_sessions(server, range(args.requests)) if args.replicas else None
            runs = [load(server, image, range(args.requests), c, sessions=sessions) for c in args.concurrency]
        finally:
            server.kill()
    serial = next((r for r in runs if r["concurrency"] == 1), runs[0])
    for run in runs:
        run["ratio_to_serial"] = round(run["requests_per_min"] / serial["requests_per_min"], 3)
        run["same_videos_as_serial"] = run["sha256_by_seed"] == serial["sha256_by_seed"]
    argv = [a if a != sys.argv[1] else f"<checkpoint {args.checkpoint.name}>" for a in sys.argv[1:]]
    result = {"command": "bench/serve_load.py " + " ".join(argv), "date": datetime.date.today().isoformat(),
              "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(),
                          "load_average_1_5_15_min_at_end": [round(x, 2) for x in os.getloadavg()]},
              "request": {"size": SIZE, "num_frames": FRAMES, "num_inference_steps": STEPS},
              "replicas": args.replicas, "runs": runs}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
