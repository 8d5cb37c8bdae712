"""FastVideo's HTTP server (fastvideo.entrypoints.openai, its optional web stack: fastapi, uvicorn, aiofiles): the
parts a PAN2 server replaces, and what it reads of the running server. What PAN2's server does instead is its own
(`fastvideo_integration.serving`, `uploads`, `http_limits`); this module only puts it in FastVideo's place.

Its seams are checked when a PAN2 server starts (`compat.check_serving`), so a FastVideo without the web stack still
runs PAN2 everywhere else."""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Callable

from .seams import Seam, replace_once

logger = logging.getLogger(__name__)

SEAMS = (
    Seam("fastvideo.entrypoints.openai.api_server", "run_server", "a PAN2 server runs what run_server runs (its "
         "default_request check, create_app, uvicorn), with PAN2's HTTP limits as uvicorn's options (FastVideo's: "
         "httptools, no header bound, a 300 s keep-alive)", mentions="uvicorn.run("),
    Seam("fastvideo.entrypoints.openai.video_api", "download_video_content", "GET /v1/videos/{id}/content serves "
         "whatever is at the job's file_path, links followed: PAN2's route, matched before it, serves only the file "
         "the job wrote", replaced=True, mentions="FileResponse("),
    Seam("fastvideo.entrypoints.openai.utils", "_save_upload_to_path", "reads an upload whole into memory: PAN2 "
         "copies it in chunks", replaced=True, mentions="await upload.read()"),
    Seam("fastvideo.entrypoints.openai.api_server", "_validate_default_request_against_preset", "a scaled-out PAN2 "
         "server checks its default_request as run_server does, before any replica starts"),
    Seam("fastvideo.entrypoints.openai.api_server", "create_app", "PAN2's /health replaces FastVideo's (always "
         "'ok', even with its workers dead), and its /v1/images routes are not served (they run the generator "
         "outside PAN2's checks and its one-job-at-a-time queue)", replaced=True),
    Seam("fastvideo.entrypoints.openai.image_api", "router", "... the image routes, as create_app mounts them"),
    Seam("fastvideo.entrypoints.openai.video_api", "save_image_to_path", "FastVideo stores an upload as "
         "uploads/<request id>_<the client's file name>, a name that can hold a path ('../x'): PAN2 keeps it in "
         "uploads/", replaced=True),
    Seam("fastvideo.entrypoints.openai.video_api", "_build_generation_kwargs", "PAN2 checks every request here, "
         "before a job exists: FastVideo's create_video calls it, then queues the job; it makes the video's folder "
         "(following links), so PAN2 hands it one that exists and makes the request's own once it passed",
         replaced=True, mentions="os.makedirs(output_dir"),
    Seam("fastvideo.api.compat", "explicit_request_updates", "the default_request fields the operator wrote, which "
         "_build_generation_kwargs applies: its output_path is checked at start and used as FastVideo uses it"),
    Seam("fastvideo.api.schema", "OutputConfig.output_path", "... set to the folder it names, resolved at start"),
    Seam("fastvideo.entrypoints.openai.video_api", "_run_generation", "FastVideo runs jobs concurrently in the "
         "default thread pool over one unlocked worker pipe (clients get each other's videos): PAN2 runs one at a "
         "time", replaced=True),
    Seam("fastvideo.entrypoints.openai.video_api", "create_video", "calls the two above by their module names",
         mentions="_run_generation(request_id"),
    Seam("fastvideo.entrypoints.openai.video_api", "create_video", "... and stores an upload through "
         "save_image_to_path by its module name", mentions="await save_image_to_path(image, input_path)"),
    Seam("fastvideo.entrypoints.openai.video_api", "VideoGenerationsRequest", "a field its model refuses is a one-line "
         "400 (FastVideo: an unhandled error for a multipart request, pydantic's many lines for a JSON one)",
         replaced=True),
    Seam("fastvideo.entrypoints.openai.video_api", "create_video", "... which create_video makes by its module name",
         mentions="req = VideoGenerationsRequest("),
    Seam("fastvideo.entrypoints.openai.stores", "VIDEO_STORE.pop", "a DELETE removes the job's video and keeps a "
         "waiting job from running (FastVideo only forgets the job)", replaced=True),
    Seam("fastvideo.entrypoints.openai.video_api", "delete_video", "... DELETE /v1/videos/{id} pops the job store",
         mentions="VIDEO_STORE.pop(video_id)"),
    Seam("fastvideo.entrypoints.openai.stores", "AsyncDictStore.update_fields", "a job's update says whether the "
         "store still holds it", mentions="return None"),
    Seam("fastvideo.entrypoints.openai.state", "get_generator", "the server's VideoGenerator"),
    Seam("fastvideo.entrypoints.openai.state", "get_output_dir", "the server's output folder"),
    Seam("fastvideo.entrypoints.openai.stores", "VIDEO_STORE", "job status updates"),
)


def run_video_server(config, *, uvicorn_options: dict, **parts) -> None:
    """FastVideo's REST server for `config` (a ServeConfig), run as its run_server runs it (the default_request
    check, create_app, uvicorn) with `parts` in place of its own (`replace_server_parts`) and uvicorn run with
    `uvicorn_options` (FastVideo's own: httptools, no header bound, a 300 s keep-alive). Returns when the server
    stops."""
    import uvicorn
    from fastvideo.api.compat import generator_config_to_fastvideo_args
    from fastvideo.entrypoints.openai import api_server

    replace_server_parts(**parts)
    server = config.server
    check_default_request(config)
    app = api_server.create_app(generator_config_to_fastvideo_args(config.generator), output_dir=server.output_dir,
                                default_request=config.default_request)
    logger.info("Starting FastVideo server (PAN2) on %s:%d; model %s", server.host, server.port,
                config.generator.model_path)
    uvicorn.run(app, host=server.host, port=server.port, log_level="info", **uvicorn_options)


def video_server_app(config, **parts):
    """The ASGI app `run_video_server` serves (the same replacements), for an engine that runs apps itself (a Ray
    Serve replica): the model loads in its lifespan's startup, `stopped()` runs after its shutdown. Check
    `config.default_request` first (`check_default_request`), as FastVideo's run_server does."""
    from fastvideo.api.compat import generator_config_to_fastvideo_args
    from fastvideo.entrypoints.openai import api_server

    replace_server_parts(**parts)
    return api_server.create_app(generator_config_to_fastvideo_args(config.generator),
                                 output_dir=config.server.output_dir, default_request=config.default_request)


def default_output_path(default_request) -> str | None:
    """The folder a serve config's `default_request` sends videos to when the operator set one (FastVideo's
    `_build_generation_kwargs` applies only the fields written), else None."""
    from fastvideo.api.compat import explicit_request_updates

    return None if default_request is None else explicit_request_updates(default_request).get("output_path")


def set_default_output_path(config, folder: str) -> None:
    config.default_request.output.output_path = folder


def check_default_request(config) -> None:
    """FastVideo's start-up check of a serve config's `default_request` against the model's preset."""
    from fastvideo.entrypoints.openai import api_server

    if config.default_request is not None:
        api_server._validate_default_request_against_preset(config.default_request, config.generator.model_path)


def replace_server_parts(*, check_request: Callable, run_job: Callable, health: Callable, stopped: Callable,
                         deleted: Callable, content: Callable, save_image: Callable, make_request: Callable,
                         middleware=()) -> None:
    """In this process's FastVideo server modules: `check_request(request_id, req, build, default_folder)` in place of
    its request-to-kwargs step (`build(folder)`: FastVideo's kwargs for the request with its video in `folder`, which
    FastVideo makes, following links; `default_folder`: `default_output_path` of the default_request; returns the
    kwargs, or raises fastapi's HTTPException), `run_job(request_id, kwargs)` (a
    coroutine) in place of its job runner, `health()` (a coroutine returning a response) as /health,
    `content(video_id)` as GET /v1/videos/{video_id}/content, `deleted(job)` called with each job a DELETE removed
    from the job store, `stopped()` called after FastVideo's shutdown (uvicorn re-raises a SIGTERM after it: nothing
    runs later), `save_image(image, target_path, fastvideo_save)` (a coroutine) in place of its save of a request's
    image (`fastvideo_save(image, path)`: FastVideo's own), `make_request(request_class, **fields)` in place of its
    request model's constructor, and each `(middleware class, its options)` around the app (the first outermost)."""
    from fastvideo.entrypoints.openai import api_server, video_api
    from fastvideo.entrypoints.openai.stores import VIDEO_STORE

    build = video_api._build_generation_kwargs
    video_api._build_generation_kwargs = lambda request_id, req, default_request=None: check_request(
        request_id, req, lambda folder: build(request_id, req.model_copy(update={"output_path": str(folder)}),
                                              default_request=default_request), default_output_path(default_request))
    video_api._run_generation = run_job

    def make_save(save):
        async def save_image_to_path(image, target_path: str) -> str:
            return await save_image(image, target_path, save)

        return save_image_to_path

    replace_once(video_api, "save_image_to_path", make_save)
    replace_once(video_api, "VideoGenerationsRequest", lambda original: functools.partial(make_request, original))

    def make_pop(pop):  # the job store's pop serves DELETE /v1/videos/{id} only
        async def pop_job(key: str):
            job = await pop(key)
            if job is not None:
                deleted(job)
            return job

        return pop_job

    replace_once(VIDEO_STORE, "pop", make_pop)

    def make(original):
        def create_app(*args, **kwargs):
            app = original(*args, **kwargs)
            app.router.routes[:] = [r for r in app.router.routes if not _unserved(r)]
            app.add_api_route("/health", health, methods=["GET"])
            # Before FastVideo's video routes (FastAPI keeps its router whole): matched first.
            app.add_api_route("/v1/videos/{video_id}/content", content, methods=["GET"])
            app.router.routes.insert(0, app.router.routes.pop())
            for cls, options in reversed(middleware):  # Starlette's last added is the outermost
                app.add_middleware(cls, **options)
            fastvideo_lifespan = app.router.lifespan_context

            @contextlib.asynccontextmanager
            async def lifespan(app_):
                try:
                    async with fastvideo_lifespan(app_):
                        yield
                finally:
                    stopped()

            app.router.lifespan_context = lifespan
            return app

        return create_app

    replace_once(api_server, "create_app", make)


def _unserved(route) -> bool:
    """FastVideo's routes a PAN2 server drops: its /health (PAN2's replaces it) and its image routes (FastAPI keeps an
    included router whole, as `original_router`; older releases copy its routes, each with its path)."""
    from fastvideo.entrypoints.openai import image_api

    path = getattr(route, "path", None) or ""
    return path == "/health" or path.startswith("/v1/images") or \
        getattr(route, "original_router", None) is image_api.router


async def served_job(request_id: str) -> dict | None:
    """The server's job `request_id` (what GET /v1/videos/{id} answers), or None."""
    from fastvideo.entrypoints.openai.stores import VIDEO_STORE

    return await VIDEO_STORE.get(request_id)


def served_generator():
    """The running server's VideoGenerator."""
    from fastvideo.entrypoints.openai.state import get_generator

    return get_generator()


def served_output_dir() -> str:
    from fastvideo.entrypoints.openai.state import get_output_dir

    return get_output_dir()


async def update_job(request_id: str, fields: dict) -> bool:
    """Update a job's fields in the server's job store (what GET /v1/videos/{id} answers); False when the store no
    longer holds the job (a DELETE removed it)."""
    from fastvideo.entrypoints.openai.stores import VIDEO_STORE

    return await VIDEO_STORE.update_fields(request_id, fields) is not None
