"""``fastvideo serve`` for PAN2 (docs/design.md, "Serving"; what is patched and why: docs/fastvideo.md).

A serve config with ``pipeline: pan2`` at its top (or ``fastvideo serve --pipeline pan2 --config ...``) runs
FastVideo 0.2.1's REST server (``POST /v1/videos``, ``GET /v1/videos/{id}/content``) on PAN2, with these rules:

- One job at a time: FastVideo runs each job's synchronous ``generate_video`` in the default thread pool, and its
  executor sends and receives on one worker pipe without a lock, so concurrent jobs read each other's replies (each
  client gets another's video, or a corrupt one). Here jobs wait in arrival order for one thread (an asyncio lock);
  a job says ``in_progress`` while it runs. Throughput is one video at a time, as the workers compute one anyway.
- Every check PAN2 makes (first frame present and readable, its aspect, size, frame count, fps; ``seconds`` mapped
  to the nearest 4k + 1 frames or refused with the two counts) runs at submission: a bad request is a 400 with one
  line, and never reaches a worker. A request that still fails in the worker fails alone (`request_failure`); the
  worker serves the next one. ``/health`` answers 503 when a worker process is gone.
- Files: a request's ``input_reference`` path is read only when it is the image the client sent (multipart upload,
  ``reference_url``) or, if the operator names one (``server.input_dir``), a file under that folder; a request's
  ``output_path`` must be a folder under ``server.output_dir``. Uploads are removed when their job ends (or
  ``server.upload_retention_s`` seconds later). The host defaults to 127.0.0.1.
- The video is saved while it is decoded (`streamed_save`): the request asks for no frames back.
- Stopping (Ctrl-C, SIGTERM): after FastVideo's shutdown the workers are stopped, partial videos and the jobs'
  uploads removed.
- ``server.replicas: N`` runs N such servers behind one entry point on Ray Serve (`scale_out`): each replica is
  this server's app (`served_app`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastvideo_pan2_ext.attention import apply_fa4_policy
from fastvideo_pan2_ext.configs.pan2 import DEFAULT_FPS, DEFAULT_HEIGHT, DEFAULT_NUM_FRAMES, DEFAULT_WIDTH, \
    check_frame_count
from fastvideo_pan2_ext.image import check_size, cover_size, load_image
from fastvideo_pan2_ext.video_io import check_writable

from . import adapter, cli, decode_failure, request_failure, streamed_save

logger = logging.getLogger(__name__)

PIPELINE_NAME = "pan2"
LOOPBACK = "127.0.0.1"
_SERVING = "_pan2_serving"  # the namespace attribute: the ServingRules of a PAN2 server (cmd reads it)


@dataclasses.dataclass(frozen=True)
class ServingRules:
    """What a PAN2 server may read and write: `output_dir` (resolved), the operator's `input_dir` (None: only the
    images clients send), and how long an upload outlives its job."""

    output_dir: Path
    input_dir: Path | None = None
    upload_retention_s: float = 0.0

    @classmethod
    def from_config(cls, output_dir: str, input_dir=None, upload_retention_s=0.0) -> ServingRules:
        if input_dir is not None and not (isinstance(input_dir, str) and Path(input_dir).is_dir()):
            raise ValueError(f"server.input_dir must be an existing folder; got {input_dir!r}")
        if isinstance(upload_retention_s, bool) or not isinstance(upload_retention_s, (int, float)) \
                or not math.isfinite(upload_retention_s) or upload_retention_s < 0:
            raise ValueError(f"server.upload_retention_s must be a number of seconds >= 0; got {upload_retention_s!r}")
        out = Path(output_dir).resolve()
        check_writable(out / "videos" / "video.mp4")
        return cls(out, Path(input_dir).resolve() if input_dir else None, float(upload_retention_s))


OPTIONS = tuple(f.name for f in dataclasses.fields(ServingRules) if f.name != "output_dir")  # keys of `server:`


@dataclasses.dataclass(frozen=True)
class Replicas:
    """`server.replicas` (None: one server, no Ray) and `server.ray_address` (None: a Ray instance of the command's
    own on this machine; "auto" or HOST:PORT: a running Ray cluster to place the replicas on)."""

    replicas: int | None = None
    ray_address: str | None = None

    def __post_init__(self) -> None:
        if self.replicas is not None and (isinstance(self.replicas, bool) or not isinstance(self.replicas, int)
                                          or self.replicas < 1):
            raise ValueError(f"server.replicas must be a whole number >= 1; got {self.replicas!r}")
        if self.ray_address is not None and not (isinstance(self.ray_address, str) and self.ray_address):
            raise ValueError(f"server.ray_address must be a Ray address (\"auto\", HOST:PORT); got "
                             f"{self.ray_address!r}")
        if self.ray_address is not None and self.replicas is None:
            raise ValueError("server.ray_address places replicas: set server.replicas too")


SCALE_OUT_OPTIONS = tuple(f.name for f in dataclasses.fields(Replicas))  # keys of `server:`


def frames_for_seconds(seconds, fps) -> int:
    """The 4k + 1 frame count nearest to `seconds` x `fps`; ValueError naming both counts when it is halfway."""
    if isinstance(seconds, bool) or not isinstance(seconds, int) or seconds < 1:
        raise ValueError(f"seconds must be a whole number >= 1; got {seconds!r}")
    n = seconds * fps
    lower = (n - 1) // 4 * 4 + 1
    if n - lower == 2:
        raise ValueError(f"seconds={seconds} at fps={fps} is {n} frames, halfway between {lower} and {lower + 4} (PAN2 "
                         f"makes 4k + 1 frames): send num_frames {lower} or {lower + 4}")
    return lower if n - lower < 2 else lower + 4


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


class PAN2Server:
    """The rules above, for one server process (FastVideo's video API calls `check_request`, `run_job`, `health`)."""

    def __init__(self, rules: ServingRules) -> None:
        self.rules = rules
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pan2-job")
        self._turn: asyncio.Lock | None = None  # made in the server's event loop
        self._uploads: dict[str, Path] = {}  # request id -> the image its client sent
        self._running: dict[str, Path] = {}  # request id -> its video, until the job's end is recorded

    # ------------------------------------------------------------------------------------------- submission

    def _upload_of(self, request_id: str, req) -> Path | None:
        """The image the client of `request_id` sent, as FastVideo stored it (uploads/<request id>_<name>)."""
        path = req.input_reference
        if not path:
            return None
        path = Path(path).resolve()
        uploads = Path(adapter.served_output_dir()).resolve() / "uploads"
        return path if path.parent == uploads and path.name.startswith(f"{request_id}_") else None

    def check_request(self, request_id: str, req, build):
        """The job's generate_video kwargs (FastVideo's `build()`), or a 400 naming the first problem."""
        from fastapi import HTTPException

        upload = self._upload_of(request_id, req)
        try:
            self._check_output_path(req)
            kwargs = build()
            kwargs["return_frames"] = False  # nothing comes back but the file: the decoding stage writes it
            self._check_inputs(req, kwargs, upload)
        except (ValueError, OSError) as exc:
            if upload is not None:
                upload.unlink(missing_ok=True)
            raise HTTPException(status_code=400, detail=str(exc).splitlines()[0] if str(exc) else
                                type(exc).__name__) from None
        if upload is not None:
            self._uploads[request_id] = upload
        return kwargs

    def _check_output_path(self, req) -> None:
        if "output_path" not in req.model_fields_set or not req.output_path:
            return
        folder = (self.rules.output_dir / req.output_path).resolve()  # an absolute path stays itself
        if not _within(folder, self.rules.output_dir):
            raise ValueError(f"output_path must be a folder under the server's output_dir ({self.rules.output_dir}); "
                             f"got {req.output_path!r}")
        req.output_path = str(folder)

    def _check_inputs(self, req, kwargs: dict, upload: Path | None) -> None:
        image = kwargs.get("image_path")  # None: text-to-video
        sent_path = image is not None and "input_reference" in req.model_fields_set and upload is None
        if sent_path:
            resolved = Path(image).resolve()
            if not (self.rules.input_dir and _within(resolved, self.rules.input_dir)):
                raise ValueError("input_reference must be an image sent with the request (multipart input_reference, "
                                 "or reference_url); this server reads no path on its disk" +
                                 (f" outside {self.rules.input_dir}" if self.rules.input_dir else ""))
            image = kwargs["image_path"] = str(resolved)  # what was checked is what the worker opens
        height, width = kwargs.get("height", DEFAULT_HEIGHT), kwargs.get("width", DEFAULT_WIDTH)
        check_size(height, width)
        if image is not None:
            img = load_image(image)  # reads it fully: unreadable, truncated or oversized images fail here
            cover_size(img.width, img.height, height, width)
        fps = kwargs.get("fps", DEFAULT_FPS)
        if isinstance(fps, bool) or not isinstance(fps, int) or fps < 1:
            raise ValueError(f"fps must be a whole number >= 1; got {fps!r}")
        if req.num_frames is None and "seconds" in req.model_fields_set:  # multipart always sets seconds (4)
            kwargs["num_frames"] = frames_for_seconds(req.seconds, fps)
        check_frame_count(kwargs.get("num_frames", DEFAULT_NUM_FRAMES))

    # ------------------------------------------------------------------------------------------- jobs

    async def run_job(self, request_id: str, kwargs: dict) -> None:
        """Wait for the turn (arrival order), run the job, record how it ended, drop its upload."""
        if self._turn is None:
            self._turn = asyncio.Lock()
        try:
            async with self._turn:
                if not await adapter.update_job(request_id, {"status": "in_progress", "progress": 0}):
                    logger.info("Video %s was deleted before its turn: not generated", request_id)
                    return
                self._running[request_id] = Path(kwargs["output_path"])
                start = time.perf_counter()
                try:
                    await asyncio.get_running_loop().run_in_executor(self._thread, self._generate, kwargs)
                    update = {"status": "completed", "progress": 100, "completed_at": int(time.time()),
                              "inference_time_s": time.perf_counter() - start}
                    logger.info("Video %s completed in %.2fs", request_id, update["inference_time_s"])
                except Exception as exc:  # this job failed; the server goes on
                    update = {"status": "failed", "error": {"message": self._reason(exc)}}
                    logger.error("Video %s failed: %s", request_id, update["error"]["message"], exc_info=exc)
                kept = await adapter.update_job(request_id, update)
                video = self._running.pop(request_id, None)
                if video is not None and not kept:  # deleted while it ran: its video goes too
                    video.unlink(missing_ok=True)
        finally:
            self._drop_upload(request_id)

    @staticmethod
    def _generate(kwargs: dict):
        with request_failure.failing_alone():
            return adapter.served_generator().generate_video(**kwargs)

    @staticmethod
    def _reason(exc: BaseException) -> str:
        """The one line a client reads for a failed job."""
        chain, seen = [], set()
        while exc is not None and id(exc) not in seen:
            seen.add(id(exc))
            chain.append(exc)
            exc = exc.__cause__ or exc.__context__
        for each in chain:
            if isinstance(each, (request_failure.RequestFailed, decode_failure.DecodeFailed)):
                return str(each)
        if any(isinstance(each, (EOFError, ConnectionError)) for each in chain):
            return "a worker process stopped (its error is in the server log); this server cannot generate until " \
                   "it is restarted"
        return request_failure.one_line(chain[-1])

    def _drop_upload(self, request_id: str) -> None:
        upload = self._uploads.pop(request_id, None)
        if upload is None:
            return
        if self.rules.upload_retention_s > 0:
            asyncio.get_running_loop().call_later(self.rules.upload_retention_s, upload.unlink, True)
        else:
            upload.unlink(missing_ok=True)

    def deleted(self, job: dict) -> None:
        """After DELETE /v1/videos/{id} removed `job`: a completed job's video goes, a waiting one's upload (the job
        is not run when its turn comes, and a running one loses its video when it ends: `run_job`)."""
        if job.get("status") == "queued":
            self._drop_upload(job.get("id", ""))
        video = job.get("file_path")
        if video and job.get("status") == "completed":
            try:
                Path(video).unlink(missing_ok=True)
            except OSError as exc:  # the job is gone all the same; the file stays, and the log says so
                logger.warning("Video %s deleted, but its file %s could not be removed: %s", job.get("id"), video, exc)

    # ------------------------------------------------------------------------------------------- health, stop

    async def health(self):
        from fastapi.responses import JSONResponse

        reason = self.unhealthy()
        if reason:
            return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)
        return {"status": "ok"}

    @staticmethod
    def unhealthy() -> str | None:
        """Why no request can be served (a worker process is gone), or None."""
        procs = adapter.worker_processes(adapter.served_generator())
        dead = [p.pid for p in procs if not p.is_alive()]
        if not procs or dead:
            return f"worker process(es) {dead or 'none'} not running: no request can be served; restart the server"
        return None

    def stopped(self) -> None:
        """After FastVideo's shutdown: no worker, no partial video, no video of a job that did not end, no upload left
        (idempotent)."""
        logger.info("PAN2 server stopping: workers, partial videos and uploads removed")
        cli.stop_workers()
        streamed_save.remove_left_partials()
        for request_id in list(self._running):  # its job never ended: a video finished during the shutdown goes too
            self._running.pop(request_id).unlink(missing_ok=True)
        for request_id in list(self._uploads):
            self._uploads.pop(request_id).unlink(missing_ok=True)
        self._thread.shutdown(wait=False, cancel_futures=True)


# ----------------------------------------------------------------------------------------------- the command


def _add_arguments(parser) -> None:
    parser.add_argument("--pipeline", type=str, default=None, metavar="NAME",
                        help=f"Plugin pipeline to serve ({PIPELINE_NAME}); or `pipeline: {PIPELINE_NAME}` in the "
                        "config.")


def _pan2_serve_config(raw: dict):
    server = raw["server"]
    options = {name: server.pop(name) for name in OPTIONS if name in server}
    replicas = Replicas(**{name: server.pop(name) for name in SCALE_OUT_OPTIONS if name in server})
    server.setdefault("host", LOOPBACK)
    cli.select_pan2(raw["generator"])
    config = adapter.validated_serve_config(raw)
    rules = ServingRules.from_config(config.server.output_dir, **options)
    if replicas.replicas is not None:
        _scale_out()  # Ray Serve is there
        adapter.check_default_request(config)  # before any replica loads a model
        # The replicas run in Ray's working folder: the paths are this command's.
        config.server.output_dir = str(rules.output_dir)
        if os.path.exists(config.generator.model_path):
            config.generator.model_path = os.path.abspath(config.generator.model_path)
    else:
        apply_fa4_policy()  # in the parent, so the workers it spawns inherit the decision
    return config, rules, replicas


def _scale_out():
    """The `scale_out` module, or a ValueError saying how to install what it needs."""
    try:
        from . import scale_out
    except ImportError as exc:
        raise ValueError(f"server.replicas runs the replicas on Ray Serve, which is not installed ({exc}): "
                         "pip install 'fastvideo-pan2-ext[serve]'") from None
    return scale_out


def served_app(config, rules: ServingRules):
    """What each replica of a scaled-out server runs (`scale_out`), in its own process: a PAN2 server's ASGI app for
    `config` (the model loads in its lifespan) and its `unhealthy()` check. The rules are checked again here (this
    replica's machine must have the folders)."""
    rules = ServingRules.from_config(str(rules.output_dir), str(rules.input_dir) if rules.input_dir else None,
                                     rules.upload_retention_s)
    apply_fa4_policy()  # in the replica, so the workers it spawns inherit the decision
    server = PAN2Server(rules)
    app = adapter.video_server_app(config, check_request=server.check_request, run_job=server.run_job,
                                   health=server.health, stopped=server.stopped, deleted=server.deleted)
    return app, server.unhealthy


def _validate(args, fastvideo_validate) -> None:
    if not getattr(args, "config", None) or not os.path.exists(args.config):
        return fastvideo_validate(args)  # FastVideo's one line for a missing config
    try:
        raw = adapter.raw_serve_config(args.config, getattr(args, "_unknown", None))
        name = raw.pop("pipeline", None) or getattr(args, "pipeline", None)
        if name is None:
            return fastvideo_validate(args)
        if name != PIPELINE_NAME:
            cli.fail("serve", f"unknown pipeline {name!r}; known pipelines: {PIPELINE_NAME}")
        adapter.check_serving()
        config, rules, replicas = _pan2_serve_config(raw)
    except (ValueError, OSError, adapter.IncompatibleFastVideo) as exc:
        cli.fail("serve", exc)
    adapter.hand_serve_config_to_serve(args, config)
    setattr(args, _SERVING, (rules, replicas))


def _run(args, fastvideo_run) -> None:
    rules, replicas = getattr(args, _SERVING, (None, None))
    if rules is None:
        return fastvideo_run(args)
    config = adapter.validated_serve_config_of(args)
    if replicas.replicas is not None:
        scale_out = _scale_out()
        try:
            scale_out.run(functools.partial(served_app, config, rules), replicas=replicas.replicas,
                          gpus_per_replica=config.generator.engine.num_gpus, host=config.server.host,
                          port=config.server.port, ray_address=replicas.ray_address)
        except scale_out.StartFailed as exc:
            print(f"fastvideo serve: {exc}", file=sys.stderr)
            raise SystemExit(1) from None
        return
    server = PAN2Server(rules)
    try:
        adapter.run_video_server(config, check_request=server.check_request,
                                 run_job=server.run_job, health=server.health, stopped=server.stopped,
                                 deleted=server.deleted)
    finally:  # a second Ctrl-C skips FastVideo's shutdown (uvicorn's forced exit)
        server.stopped()


def install() -> None:
    """Extend FastVideo's `serve` command (idempotent)."""
    adapter.extend_serve_cli(_add_arguments, _validate, _run)
