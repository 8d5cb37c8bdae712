"""Several PAN2 servers behind one HTTP entry point, on Ray Serve (docs/design/serving.md, "Scale-out"; README,
"Serving").

``fastvideo serve --config serve_pan2.yaml --server.replicas N`` runs N replicas of the PAN2 server as one Ray Serve
application behind Ray Serve's HTTP proxy at ``server.host:server.port``. Each replica is one process with the whole
server (`serving.served_app`: FastVideo's REST app with PAN2's rules, its model, its workers). Ray Serve routes;
nothing here balances load.

- A job lives in the replica that took its POST (its status, its video), so its follow-ups must reach that replica:
  Ray Serve's consistent-hash request router sends every request with the same session header (``x-session-id``) to
  the same replica, with no fallback to another. A client sends one session id with a job's POST and the same with
  the job's GETs (a fresh id per job spreads the jobs over the replicas). An API request without the header is
  refused here (400): it would land on any replica.
- Every response names its replica (``x-serve-replica``).
- A replica whose worker process is gone fails Ray Serve's health check and is replaced (its jobs are lost).
- Each replica reserves ``generator.engine.num_gpus`` GPUs where the cluster has GPUs, so Ray places the replicas
  on machines with free GPUs and gives each its own.
- ``server.ray_address`` None: a Ray instance of this command's own on this machine; else the running cluster at
  that address (``ray start`` on each machine): the replicas spread over its machines, and a proxy on every machine
  is an entry point.
- SIGINT or SIGTERM deletes the application (each replica's FastVideo shutdown and PAN2's cleanup run) and stops a Ray
  instance started here: no process is left; the signal then ends the command, as it ends a single server.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.experimental.consistent_hash_router import ConsistentHashRouter

from fastvideo_pan2_ext.vae_kernel.errors import first_line

APP_NAME = "pan2"
DEPLOYMENT = "PAN2Server"
# The header Ray Serve's proxy reads a request's session from (Ray's own variable, default x-session-id; Ray treats
# '-' and '_' alike and ignores case).
SESSION_HEADER = os.environ.get("RAY_SERVE_SESSION_ID_HEADER_KEY", "x-session-id").lower().replace("_", "-")
REPLICA_HEADER = "x-serve-replica"
STICKY_PREFIX = "/v1/"  # the API: its jobs live in one replica
MAX_ONGOING_REQUESTS = 64  # per replica: every request is short (a job runs after its POST has returned)
MISSING_SESSION = (f"this server runs several replicas and a job lives in one: send the header {SESSION_HEADER} "
                   "(any id; a new one per job spreads the jobs) with a job's POST, and the same with its GETs")


class StartFailed(RuntimeError):
    """The replicas did not start (the reason is one line; the replicas' errors are in the log above it)."""


class _Sessions:
    """ASGI middleware of a replica: an API request without the session header is refused (400, one line), and every
    response names the replica."""

    def __init__(self, app, replica: str) -> None:
        self.app = app
        self.name = (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # the lifespan (the model loads there) passes through
            return await self.app(scope, receive, send)

        async def named(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.name]}
            await send(message)

        if scope["path"].startswith(STICKY_PREFIX) and not _session(scope["headers"]):
            from fastapi.responses import JSONResponse

            return await JSONResponse({"detail": MISSING_SESSION}, status_code=400)(scope, receive, named)
        await self.app(scope, receive, named)


def _session(headers) -> bytes:
    wanted = SESSION_HEADER.encode()
    return next((value for name, value in headers if name.lower().replace(b"_", b"-") == wanted), b"")


@serve.ingress()
class Replica:
    """One replica: `make_app()` (run in the replica's process) gives the server's ASGI app and its `unhealthy()`
    check (a reason, or None)."""

    def __init__(self, make_app: Callable[[], tuple]) -> None:
        self._app, self._unhealthy = make_app()

    def __serve_build_asgi_app__(self):
        self._app.add_middleware(_Sessions, replica=serve.get_replica_context().replica_tag)
        return self._app

    async def check_health(self) -> None:
        reason = self._unhealthy()
        if reason:
            raise RuntimeError(reason)


class _Stopped(BaseException):
    """SIGINT or SIGTERM arrived (a BaseException, so no `except Exception` on the way swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop(signum, frame):
    raise _Stopped(signum)


def run(make_app: Callable[[], tuple], *, replicas: int, gpus_per_replica: int, host: str, port: int,
        ray_address: str | None) -> None:
    """Serve `replicas` replicas of `make_app` behind http://host:port until SIGINT or SIGTERM, then stop everything
    (module docstring) and end by that signal. StartFailed when the application does not start."""
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, _stop) for s in signals}  # from the start: a signal during it stops it too
    received = None
    try:
        ray.init(address=ray_address, namespace=APP_NAME, include_dashboard=False)
        for s in signals:  # Ray's core installs a SIGTERM handler that ends the process 3 s later: ours again
            signal.signal(s, _stop)
        gpus = gpus_per_replica if ray.cluster_resources().get("GPU", 0) else 0
        serve.start(http_options={"host": host, "port": port})
        deployment = serve.deployment(
            Replica, name=DEPLOYMENT, num_replicas=replicas, max_ongoing_requests=MAX_ONGOING_REQUESTS,
            ray_actor_options={"num_cpus": 0, "num_gpus": gpus},  # its workers compute, outside Ray's accounts
            request_router_config=RequestRouterConfig(request_router_class=ConsistentHashRouter,
                                                      request_router_kwargs={"num_fallback_replicas": 0}))
        try:
            serve.run(deployment.bind(make_app), name=APP_NAME, route_prefix="/")
        except RuntimeError as exc:  # DEPLOY_FAILED: a replica kept failing to start
            raise StartFailed(f"the replicas did not start ({first_line(exc)}); their errors are above") \
                from None
        print(f"PAN2: {replicas} replicas ready behind http://{host}:{port} (Ray Serve; {gpus} GPU(s) each); a job's "
              f"requests carry one {SESSION_HEADER} header", flush=True)
        threading.Event().wait()
    except _Stopped as stopped:
        received = stopped.signum
    finally:
        for s in signals:  # a second signal must not cut the cleanup short
            signal.signal(s, signal.SIG_IGN)
        try:
            if ray.is_initialized() and ray_address is None:
                serve.shutdown()
            elif ray.is_initialized():  # a cluster's Serve instance may run other applications
                serve.delete(APP_NAME)
        finally:
            ray.shutdown()
            for s, handler in previous.items():
                signal.signal(s, handler)
    if received is not None:  # end by the signal, as uvicorn ends a single server
        sys.stdout.flush()
        signal.signal(received, signal.SIG_DFL)
        os.kill(os.getpid(), received)
