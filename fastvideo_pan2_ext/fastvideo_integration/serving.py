"""``fastvideo serve`` for PAN2 (docs/design/serving.md, "Serving"; what is patched and why: docs/fastvideo.md).

A serve config with ``pipeline: pan2`` at its top (or ``fastvideo serve --pipeline pan2 --config ...``), or any
serve config whose ``model_path`` is a PAN2 checkpoint (`serves_pan2`), runs FastVideo 0.2.1's REST server
(``POST /v1/videos``, ``GET /v1/videos/{id}/content``) on PAN2, with these rules:

- One job at a time: FastVideo runs each job's synchronous ``generate_video`` in the default thread pool, and its
  executor sends and receives on one worker pipe without a lock, so concurrent jobs read each other's replies (each
  client gets another's video, or a corrupt one). Here jobs wait in arrival order for one thread (an asyncio lock);
  a job says ``in_progress`` while it runs. Throughput is one video at a time, as the workers compute one anyway.
- Every check PAN2 makes (first frame present and readable, its aspect, size, frame count, fps; ``seconds`` mapped
  to the nearest 4k + 1 frames or refused with the two counts) runs at submission: a bad request is a 400 with one
  line, and never reaches a worker. A request that still fails in the worker fails alone (`request_failure`); the
  worker serves the next one. ``/health`` answers 503 when a worker process is gone.
- What one request may cost (`ServingRules`, `LIMITS`: operator keys under ``server:``): its size, frames and steps
  (400), the jobs waiting (429), and at the HTTP layer (`http_limits`) its body, headers and their times (413, 431,
  408); and how many finished videos the server keeps (``server.max_kept_videos``: past it, the oldest goes, and its
  content is a 410). ``DELETE`` of a running job stops it at its next denoising step (`cancel`).
- Files: a request's ``input_reference`` path is read only when it is the image the client sent (multipart upload,
  ``reference_url``) or, if the operator names one (``server.input_dir``), a file under that folder; a request's
  ``output_path`` must be a folder under ``server.output_dir`` (so must the operator's
  ``default_request.output.output_path``, checked at start), made only once the whole request passed its checks; no
  link below it is followed when a video is written, and a job's content is only the file it wrote (`content`).
  Uploads are removed when their job ends (or ``server.upload_retention_s`` seconds later). The host defaults to
  127.0.0.1.
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
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastvideo_pan2_ext.attention import apply_fa4_policy
from fastvideo_pan2_ext.configs.pan2 import DEFAULT_FPS, DEFAULT_HEIGHT, DEFAULT_NUM_FRAMES, DEFAULT_WIDTH, \
    PAN2PipelineConfig, check_frame_count
from fastvideo_pan2_ext.media.image import check_size, cover_size, load_image
from fastvideo_pan2_ext.media.video_io import check_writable, open_folder, open_written, remove_video
from fastvideo_pan2_ext.vae_kernel.errors import first_line

from . import cancel, cli, compat, decode_failure, http_limits, request_failure, streamed_save, uploads
from .checkpoint import NotPAN2CheckpointError, looks_like_pan2, read_manifest

logger = logging.getLogger(__name__)

PIPELINE_NAME = "pan2"
LOOPBACK = "127.0.0.1"
_SERVING = "_pan2_serving"  # the namespace attribute: the ServingRules of a PAN2 server (cmd reads it)


MAX_FRAMES = 481  # PAN2's trained range: 20 s at 24 fps


@dataclasses.dataclass(frozen=True)
class ServingRules:
    """What a PAN2 server may read and write: `output_dir` (resolved), the operator's `input_dir` (None: only the
    images clients send), and how long an upload outlives its job; and what one request may cost (`LIMITS`: PAN2's
    trained ranges and sizes no single request can exhaust a machine with, by default; an operator may raise them)."""

    output_dir: Path
    input_dir: Path | None = None
    upload_retention_s: float = 0.0
    max_pixels: int = DEFAULT_HEIGHT * DEFAULT_WIDTH  # width x height: 704x1248, PAN2's trained area
    max_frames: int = MAX_FRAMES
    max_steps: int = 100
    max_queued_jobs: int = 16  # waiting for their turn (the running one aside); past it, a 429
    max_upload_bytes: int = 50_000_000  # a multipart body (the image): streamed to disk
    max_body_bytes: int = 8 * 2**20  # any other body (JSON, a data-URL image in it): read whole by FastVideo
    max_header_bytes: int = 64 * 2**10
    header_timeout_s: float = 10.0  # a request's headers all in (slowloris); also an idle connection's keep-alive
    body_timeout_s: float = 120.0  # a request's body all in (a slow upload): 50 MB needs 420 kB/s
    max_connections: int = 64  # uvicorn's limit_concurrency: past it, a 503
    max_kept_videos: int = 1000  # completed jobs' videos kept (each held open: `PAN2Server._written`), the newest

    @classmethod
    def from_config(cls, output_dir: str, input_dir=None, upload_retention_s=0.0, **limits) -> ServingRules:
        if input_dir is not None and not (isinstance(input_dir, str) and Path(input_dir).is_dir()):
            raise ValueError(f"server.input_dir must be an existing folder; got {input_dir!r}")
        _check_number("upload_retention_s", upload_retention_s, zero=True)
        for name, value in limits.items():
            if name not in LIMITS:
                raise ValueError(f"unknown server option {name!r}")
            _check_number(name, value, whole=not name.endswith("_s"))
        out = Path(output_dir).resolve()
        check_writable(out / "videos" / "video.mp4", root=out)
        rules = cls(out, Path(input_dir).resolve() if input_dir else None, float(upload_retention_s),
                    **{name: value if not name.endswith("_s") else float(value) for name, value in limits.items()})
        rules.check_open_files()
        return rules

    def check_open_files(self) -> None:
        """ValueError unless this process may hold the kept videos open, with a descriptor for each connection and
        `OPEN_FILES_BESIDE` more (the soft limit is raised to the hard one: `_allow_open_files`)."""
        import resource

        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        needed = self.max_kept_videos + self.max_connections + OPEN_FILES_BESIDE
        if hard != resource.RLIM_INFINITY and needed > hard:
            raise ValueError(f"server.max_kept_videos {self.max_kept_videos} holds as many files open: with "
                             f"server.max_connections {self.max_connections} and {OPEN_FILES_BESIDE} more, {needed}, "
                             f"over this process's limit of {hard} open files (ulimit -Hn): lower it, or raise the "
                             f"limit")

    def options(self) -> dict:
        """The `server:` keys that make these rules (for `from_config` in another process)."""
        return {**{name: getattr(self, name) for name in OPTIONS}, "input_dir": str(self.input_dir) if
                self.input_dir else None}


def _check_number(name: str, value, whole: bool = False, zero: bool = False) -> None:
    """ValueError naming `server.<name>` unless `value` is a finite number (whole, if `whole`) over 0 (or 0, if
    `zero`)."""
    kinds = (int,) if whole else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) or value < 0 \
            or (value == 0 and not zero):
        what = "a whole number >= 1" if whole else f"a number of seconds {'>= 0' if zero else '> 0'}"
        raise ValueError(f"server.{name} must be {what}; got {value!r}")


OPTIONS = tuple(f.name for f in dataclasses.fields(ServingRules) if f.name != "output_dir")  # keys of `server:`
LIMITS = OPTIONS[OPTIONS.index("max_pixels"):]  # what one request may cost, and what the server keeps
OPEN_FILES_BESIDE = 256  # a server's descriptors beside its connections and kept videos (worker pipes, logs, ...)


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


def _allow_open_files() -> None:
    """The newest `max_kept_videos` completed jobs' videos are held open (`PAN2Server._written`): the soft limit on
    open files is raised to the hard one, as servers that hold many files do (`ServingRules.check_open_files`)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:  # the soft limit stays; a server with very many jobs may run out
            logger.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, first_line(exc))


class PAN2Server:
    """The rules above, for one server process (FastVideo's video API calls `check_request`, `run_job`, `health`)."""

    def __init__(self, rules: ServingRules) -> None:
        self.rules = rules
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pan2-job")
        self._turn: asyncio.Lock | None = None  # made in the server's event loop
        self._uploads: dict[str, Path] = {}  # request id -> the image its client sent
        self._queued: set[str] = set()  # accepted jobs waiting for their turn
        # request id -> what it has moved into place so far (video_io.WrittenFile, `streamed_save.recording`), its
        # stop flag
        self._running: dict[str, tuple[list, cancel.CancelFlag]] = {}
        # request id -> (the video_io.WrittenFile of its completed job, a read descriptor of that file held open: an
        # inode in use is never reused, so (device, inode) names that file alone), oldest first: the newest
        # `max_kept_videos` until their jobs are deleted
        self._written: dict[str, tuple[object, int]] = {}
        _allow_open_files()
        self._flags = Path(tempfile.mkdtemp(prefix="pan2-jobs-"))  # the jobs' stop flags (mode 0700)
        streamed_save.confine_outputs(rules.output_dir)  # no video of this process is written through a link

    # ------------------------------------------------------------------------------------------- submission

    def _upload_of(self, request_id: str, req) -> Path | None:
        """The image the client of `request_id` sent, as FastVideo stored it (uploads/<request id>_<name>)."""
        path = req.input_reference
        if not path:
            return None
        path = Path(path).resolve()
        uploads = Path(compat.http_server.served_output_dir()).resolve() / "uploads"
        return path if path.parent == uploads and path.name.startswith(f"{request_id}_") else None

    def check_request(self, request_id: str, req, build, default_folder: str | None):
        """The job's generate_video kwargs (FastVideo's `build(folder)`, the video in `folder`), or a 400 naming the
        first problem (a 429 when `max_queued_jobs` wait already). `default_folder`: the operator's
        default_request output_path (None: not set). The whole request is checked before its folder is made: a
        refused one leaves none."""
        from fastapi import HTTPException

        upload = self._upload_of(request_id, req)
        if len(self._queued) >= self.rules.max_queued_jobs:
            if upload is not None:
                upload.unlink(missing_ok=True)
            raise HTTPException(status_code=429, detail=f"{len(self._queued)} jobs are waiting, this server's limit "
                                f"(server.max_queued_jobs): submit again later")
        try:
            folder = self._output_folder(req, default_folder)
            kwargs = build(self.rules.output_dir)  # a folder that exists: FastVideo's makedirs makes none
            kwargs["return_frames"] = False  # nothing comes back but the file: the decoding stage writes it
            self._check_inputs(req, kwargs, upload)
            os.close(open_folder(folder, self.rules.output_dir))  # made now, without following a link
            kwargs["output_path"] = str(folder / Path(kwargs["output_path"]).name)  # FastVideo's name for the video
        except (ValueError, OSError) as exc:
            if upload is not None:
                upload.unlink(missing_ok=True)
            raise HTTPException(status_code=400, detail=first_line(exc)) from None
        if upload is not None:
            self._uploads[request_id] = upload
        self._queued.add(request_id)
        return kwargs

    def _output_folder(self, req, default_folder: str | None) -> Path:
        """The folder the request's video goes to (not made here), as FastVideo chooses it: the request's
        output_path, else the operator's default (under output_dir: `check_default_output`), else
        output_dir/videos."""
        if "output_path" not in req.model_fields_set or not req.output_path:
            return Path(default_folder) if default_folder else self.rules.output_dir / "videos"
        # Lexical (an absolute path stays itself): a link below output_dir is refused when it is made, never followed.
        folder = Path(os.path.normpath(self.rules.output_dir / req.output_path))
        if not _within(folder, self.rules.output_dir):
            raise ValueError(f"output_path must be a folder under the server's output_dir ({self.rules.output_dir}); "
                             f"got {req.output_path!r}")
        return folder

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
        self._check_limits(width * height, "max_pixels", f"size {width}x{height} ({width * height} pixels)")
        fps = kwargs.get("fps", DEFAULT_FPS)
        if isinstance(fps, bool) or not isinstance(fps, int) or fps < 1:
            raise ValueError(f"fps must be a whole number >= 1; got {fps!r}")
        if req.num_frames is None and "seconds" in req.model_fields_set:  # multipart always sets seconds (4)
            kwargs["num_frames"] = frames_for_seconds(req.seconds, fps)
        frames = kwargs.get("num_frames", DEFAULT_NUM_FRAMES)
        check_frame_count(frames)
        self._check_limits(frames, "max_frames", f"num_frames {frames}")
        steps = kwargs.get("num_inference_steps")  # None: PAN2's default
        if steps is not None:
            if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
                raise ValueError(f"num_inference_steps must be a whole number >= 1; got {steps!r}")
            self._check_limits(steps, "max_steps", f"num_inference_steps {steps}")
        if image is not None:  # last: the costliest check
            img = load_image(image)  # reads it fully: unreadable, truncated or oversized images fail here
            cover_size(img.width, img.height, height, width)

    def _check_limits(self, value: int, limit: str, what: str) -> None:
        if value > getattr(self.rules, limit):
            raise ValueError(f"{what} is over this server's limit of {getattr(self.rules, limit)} (server.{limit})")

    # ------------------------------------------------------------------------------------------- jobs

    async def run_job(self, request_id: str, kwargs: dict) -> None:
        """Wait for the turn (arrival order), run the job, record how it ended (and the file it wrote), drop its
        upload. A DELETE while it runs sets its flag: it stops at its next denoising step (`cancel`)."""
        if self._turn is None:
            self._turn = asyncio.Lock()
        try:
            async with self._turn:
                self._queued.discard(request_id)
                flag = cancel.CancelFlag(str(self._flags / request_id))
                wrote: list = []  # the file it moves into place (FastVideo may name it `name_1.mp4`)
                self._running[request_id] = (wrote, flag)  # before a DELETE can see it run
                if not await compat.http_server.update_job(request_id, {"status": "in_progress", "progress": 0}):
                    self._running.pop(request_id, None)
                    flag.clear()  # a DELETE meanwhile may have set it
                    logger.info("Video %s was deleted before its turn: not generated", request_id)
                    return
                start = time.perf_counter()
                error = None
                try:
                    await asyncio.get_running_loop().run_in_executor(self._thread, self._generate, kwargs, flag, wrote)
                    update = {"status": "completed", "progress": 100, "completed_at": int(time.time()),
                              "inference_time_s": time.perf_counter() - start}
                except Exception as exc:  # this job failed; the server goes on
                    error = exc
                    update = {"status": "failed", "error": {"message": self._reason(exc)}}
                kept = await compat.http_server.update_job(request_id, update)
                self._running.pop(request_id, None)
                flag.clear()
                written = wrote[0] if wrote else None
                if not kept:  # deleted while it ran: its video goes too
                    logger.info("Video %s was deleted while it ran: %s", request_id, "stopped" if error else
                                "its video removed")
                    if written is not None:
                        remove_video(written.path, self.rules.output_dir, (written.device, written.inode))
                elif error is not None:
                    logger.error("Video %s failed: %s", request_id, update["error"]["message"], exc_info=error)
                else:
                    if written is not None:  # FastVideo's save may have chosen another name (`name_1.mp4`)
                        self._keep(request_id, written)
                        await compat.http_server.update_job(request_id, {"file_path": written.path})
                        await self._release_oldest()
                    logger.info("Video %s completed in %.2fs", request_id, update["inference_time_s"])
        finally:
            self._drop_upload(request_id)

    def _keep(self, request_id: str, written) -> None:
        """Remember the video a completed job wrote, holding it open (see `_written`)."""
        try:
            self._written[request_id] = (written, open_written(written, self.rules.output_dir))
        except OSError as exc:  # replaced or removed already: never served (`content` says so)
            logger.warning("Video %s: its file %s changed before it could be kept: %s", request_id, written.path,
                           first_line(exc))

    async def _release_oldest(self) -> None:
        """Past `max_kept_videos` kept videos, the oldest go (closed and removed); their jobs stay, with no file (their
        content: a 410)."""
        for request_id in list(self._written)[:max(len(self._written) - self.rules.max_kept_videos, 0)]:
            await compat.http_server.update_job(request_id, {"file_path": None})
            if self._forget(request_id, "released"):
                logger.info("Video %s removed: this server keeps its %d newest videos (server.max_kept_videos)",
                            request_id, self.rules.max_kept_videos)

    def _forget(self, request_id: str, why: str) -> bool:
        """Close and remove the video a completed job wrote (the file it wrote, never through a link); -> whether it
        had one kept."""
        written, pin = self._written.pop(request_id, (None, None))
        if written is None:
            return False
        os.close(pin)
        try:
            remove_video(written.path, self.rules.output_dir, (written.device, written.inode))
        except OSError as exc:  # the job goes on without it all the same; the file stays, and the log says so
            logger.warning("Video %s %s, but its file %s could not be removed: %s", request_id, why, written.path, exc)
        return True

    @staticmethod
    def _generate(kwargs: dict, flag: cancel.CancelFlag, wrote: list) -> None:
        with request_failure.failing_alone(), cancel.cancellable(flag), streamed_save.recording(wrote):
            compat.http_server.served_generator().generate_video(**kwargs)

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
        return first_line(chain[-1], with_type=True)

    def _drop_upload(self, request_id: str) -> None:
        upload = self._uploads.pop(request_id, None)
        if upload is None:
            return
        if self.rules.upload_retention_s > 0:
            asyncio.get_running_loop().call_later(self.rules.upload_retention_s, upload.unlink, True)
        else:
            upload.unlink(missing_ok=True)

    def deleted(self, job: dict) -> None:
        """After DELETE /v1/videos/{id} removed `job`: a completed job's video goes (the file it wrote, never through
        a link), a waiting one's upload (the job is not run when its turn comes), a running one stops at its next
        denoising step (its flag set; `run_job` then removes whatever it wrote)."""
        request_id = job.get("id", "")
        if job.get("status") == "queued":
            self._queued.discard(request_id)
            self._drop_upload(request_id)
        if request_id in self._running:
            self._running[request_id][1].set()
            logger.info("Video %s deleted while it runs: it stops at its next denoising step", request_id)
        self._forget(request_id, "deleted")

    async def content(self, video_id: str):
        """GET /v1/videos/{id}/content: the regular file this server wrote for the job, opened without following a
        link and only while it is that very file (FastVideo serves whatever is at the job's path, links followed)."""
        from fastapi import HTTPException
        from fastapi.responses import StreamingResponse

        job = await compat.http_server.served_job(video_id)
        if not job:
            raise HTTPException(status_code=404, detail="Video not found")
        written, _ = self._written.get(video_id, (None, None))
        if written is None and job.get("status") == "completed" and not job.get("file_path"):  # `_release_oldest`
            raise HTTPException(status_code=410, detail=f"the video of {video_id} was removed: this server keeps its "
                                f"{self.rules.max_kept_videos} newest videos (server.max_kept_videos)")
        if written is None and job.get("status") != "completed":
            if job.get("status") == "failed":
                raise HTTPException(status_code=500, detail="Video generation failed")
            raise HTTPException(status_code=404, detail="Video still being generated")
        try:
            if written is None:
                raise OSError("gone before the job completed")
            fd = open_written(written, self.rules.output_dir)
        except OSError:
            raise HTTPException(status_code=404, detail=f"the video of {video_id} is no longer the file this server "
                                "wrote (replaced or removed)") from None
        file = os.fdopen(fd, "rb")  # a file object now: closed when collected even if the download never starts
        size = os.fstat(fd).st_size

        def chunks():
            with file:  # closed however the download ends
                while chunk := file.read(1 << 20):
                    yield chunk

        return StreamingResponse(chunks(), media_type="video/mp4", headers={
            "content-length": str(size), "content-disposition": f'attachment; filename="{Path(written.path).name}"'})

    def parts(self) -> dict:
        """What FastVideo's server gets from this one (`compat.http_server.replace_server_parts`)."""
        r = self.rules
        return dict(check_request=self.check_request, run_job=self.run_job, health=self.health, stopped=self.stopped,
                    deleted=self.deleted, content=self.content, save_image=uploads.save_image,
                    make_request=uploads.request_or_400, middleware=[(http_limits.BodyLimits, dict(
                        max_upload_bytes=r.max_upload_bytes, max_body_bytes=r.max_body_bytes,
                        body_timeout_s=r.body_timeout_s)), (uploads.UploadGuard, {})])

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
        procs = compat.executor.worker_processes(compat.http_server.served_generator())
        dead = [p.pid for p in procs if not p.is_alive()]
        if not procs or dead:
            return f"worker process(es) {dead or 'none'} not running: no request can be served; restart the server"
        return None

    def stopped(self) -> None:
        """After FastVideo's shutdown: no worker, no partial video, no video of a job that did not end, no upload left
        (idempotent)."""
        logger.info("PAN2 server stopping: workers, partial videos and uploads removed")
        for step in (cli.stop_workers, streamed_save.remove_left_partials, self._remove_unfinished_videos,
                     self._remove_uploads, lambda: shutil.rmtree(self._flags, ignore_errors=True),
                     lambda: self._thread.shutdown(wait=False, cancel_futures=True)):
            try:  # one step that fails leaves the others to do
                step()
            except Exception:
                logger.exception("PAN2 server stopping: a step of its cleanup failed; the others go on")

    def _remove_unfinished_videos(self) -> None:
        for request_id in list(self._running):  # its job never ended: a video finished during the shutdown goes too
            for written in self._running.pop(request_id)[0]:  # the file it wrote, whatever FastVideo named it
                remove_video(written.path, self.rules.output_dir, (written.device, written.inode))

    def _remove_uploads(self) -> None:
        for request_id in list(self._uploads):
            self._uploads.pop(request_id).unlink(missing_ok=True)


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
    config = compat.cli.validated_serve_config(raw)
    rules = ServingRules.from_config(config.server.output_dir, **options)
    # Resolved once, here: the jobs' paths are then below it as written (no link is followed below it), and the
    # replicas, which run in Ray's working folder, get this command's.
    config.server.output_dir = str(rules.output_dir)
    check_default_output(config, rules.output_dir)
    if replicas.replicas is not None:
        _scale_out()  # Ray Serve is there
        compat.http_server.check_default_request(config)  # before any replica loads a model
        if os.path.exists(config.generator.model_path):
            config.generator.model_path = os.path.abspath(config.generator.model_path)
    else:
        apply_fa4_policy()  # in the parent, so the workers it spawns inherit the decision
    return config, rules, replicas


def check_default_output(config, output_dir: Path) -> None:
    """The operator's `default_request.output.output_path` (if set) resolved, as FastVideo takes it (a relative one
    from the working folder), and set back; ValueError unless it is a folder under `output_dir` (every job sent
    there would fail when its video is saved)."""
    path = compat.http_server.default_output_path(config.default_request)
    if not path:
        return
    folder = Path(path).resolve()
    if not _within(folder, output_dir):
        raise ValueError(f"default_request.output.output_path must be a folder under server.output_dir ({output_dir}); "
                         f"got {path!r}")
    compat.http_server.set_default_output_path(config, str(folder))


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
    rules = ServingRules.from_config(str(rules.output_dir), **rules.options())
    apply_fa4_policy()  # in the replica, so the workers it spawns inherit the decision
    server = PAN2Server(rules)
    return compat.http_server.video_server_app(config, **server.parts()), server.unhealthy


def serves_pan2(model_path) -> bool:
    """Whether FastVideo runs PAN2 for `model_path`, whatever the serve config names: a folder whose manifest's
    `_class_name` is PAN2's, or a model FastVideo's registry gives `PAN2PipelineConfig` (the hub id)."""
    if not isinstance(model_path, str) or not model_path:
        return False
    if os.path.isdir(model_path):
        try:
            if looks_like_pan2(str(read_manifest(model_path).get("_class_name"))):
                return True
        except NotPAN2CheckpointError:  # no manifest: FastVideo's own error comes
            return False
    config_class = compat.registry.pipeline_config_class(model_path)  # e.g. by the folder's or the hub id's name
    return config_class is not None and issubclass(config_class, PAN2PipelineConfig)


def _validate(args, fastvideo_validate) -> None:
    if not getattr(args, "config", None) or not os.path.exists(args.config):
        return fastvideo_validate(args)  # FastVideo's one line for a missing config
    try:
        raw = compat.cli.raw_serve_config(args.config, getattr(args, "_unknown", None))
        name = raw.pop("pipeline", None) or getattr(args, "pipeline", None)
        if name is None and not serves_pan2(raw.get("generator", {}).get("model_path")):
            return fastvideo_validate(args)
        if name is None:  # a plain config on a PAN2 checkpoint: PAN2's rules all the same
            logger.info("%s is a PAN2 checkpoint: served with PAN2's rules, as with `pipeline: %s`",
                        raw["generator"]["model_path"], PIPELINE_NAME)
            name = PIPELINE_NAME
        if name != PIPELINE_NAME:
            cli.fail("serve", f"unknown pipeline {name!r}; known pipelines: {PIPELINE_NAME}")
        compat.check_serving()
        config, rules, replicas = _pan2_serve_config(raw)
    except (ValueError, OSError, compat.IncompatibleFastVideo) as exc:
        cli.fail("serve", exc)
    compat.cli.hand_serve_config_to_serve(args, config)
    setattr(args, _SERVING, (rules, replicas))


def _run(args, fastvideo_run) -> None:
    rules, replicas = getattr(args, _SERVING, (None, None))
    if rules is None:
        return fastvideo_run(args)
    config = compat.cli.validated_serve_config_of(args)
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
        compat.http_server.run_video_server(config, **server.parts(), uvicorn_options=http_limits.uvicorn_options(
            max_header_bytes=rules.max_header_bytes, header_timeout_s=rules.header_timeout_s,
            max_connections=rules.max_connections))
    finally:  # a second Ctrl-C skips FastVideo's shutdown (uvicorn's forced exit)
        server.stopped()


def install() -> None:
    """Extend FastVideo's `serve` command (idempotent)."""
    compat.cli.extend_serve_cli(_add_arguments, _validate, _run)
