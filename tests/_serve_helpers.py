"""A PAN2 server started as a user starts one (`fastvideo serve --config`, the shipped example config pointed at the
tiny checkpoint, loopback only), and a bounded HTTP client for it. Every wait is bounded in count and time; the
server's whole session is killed when a test ends, whatever happened."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml
from _pan2_helpers import OFFLINE, REPO, free_port

FASTVIDEO = Path(sys.executable).parent / "fastvideo"
EXAMPLE_CONFIG = REPO / "configs" / "serve_pan2.yaml"
SIZE, FRAMES = "96x64", 9  # the tiny request: 3 latent frames, one 64x96 first frame
FAULTS = Path(__file__).resolve().parent / "_serve_faults"  # a sitecustomize that injects worker faults
FAULT_PROMPT = "inject-decode-oom"  # a request whose prompt holds this runs out of memory in the worker's decode


def serve_config(folder: Path, tiny_ckpt: Path, **server) -> Path:
    """The shipped example config, pointed at the tiny checkpoint and a free loopback port, 2 steps per video."""
    config = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    config["generator"]["model_path"] = str(tiny_ckpt)
    config["server"].update(port=free_port(), output_dir=str(folder / "out"), **server)
    config["default_request"] = {"sampling": {"num_inference_steps": 2, "guidance_scale": 1.0}}
    path = folder / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class Server:
    """`fastvideo serve --config CONFIG` in a session of its own, its output in `log`."""

    def __init__(self, config: Path, startup_s: float = 300) -> None:
        self.config = yaml.safe_load(config.read_text())
        self.url = f"http://127.0.0.1:{self.config['server']['port']}"
        self.output_dir = Path(self.config["server"]["output_dir"])
        self.log = config.parent / "server.log"
        env = {**os.environ, **OFFLINE, "PYTHONUNBUFFERED": "1", "PAN2_TEST_FAULT_PROMPT": FAULT_PROMPT,
               "PYTHONPATH": os.pathsep.join([str(FAULTS), str(REPO), os.environ.get("PYTHONPATH", "")])}
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([str(FASTVIDEO), "serve", "--config", str(config)], stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=config.parent)
        self.client = httpx.Client(base_url=self.url, timeout=30)
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the server exited ({self.proc.returncode}):\n{self.output()[-4000:]}"
            try:
                if self.client.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(1)
        self.kill()
        raise AssertionError(f"the server did not start in {startup_s} s:\n{self.output()[-4000:]}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def submit(self, image: Path | None = None, **fields) -> httpx.Response:
        """POST /v1/videos as multipart (the image as input_reference, if any)."""
        files = {"input_reference": (image.name, image.read_bytes(), "image/jpeg")} if image else {}
        data = {k: (None, str(v)) for k, v in fields.items()}  # multipart even without a file
        return self.client.post("/v1/videos", files={**data, **files})

    def submit_json(self, **body) -> httpx.Response:
        return self.client.post("/v1/videos", json=body)

    def job(self, job_id: str) -> dict:
        return self.client.get(f"/v1/videos/{job_id}").json()

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
