"""FastVideo's parent and its workers (fastvideo.entrypoints.video_generator, fastvideo.worker, the world group):
what the parent hands a worker's batch, what it checks in what the workers return, the ranks of a request and the
device of this one."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Callable

from .seams import Seam, replace_once

SEAMS = (
    Seam("fastvideo.entrypoints.video_generator", "VideoGenerator", "the demo generates as a user does",
         name="VideoGenerator"),
    Seam("fastvideo.worker.multiproc_executor", "MultiprocExecutor._init_executor", "/health asks its worker "
         "processes (`self.workers`, each with its `proc`)", mentions="self.workers ="),
    Seam("fastvideo.entrypoints.video_generator", "VideoGenerator._generate_single_video", "FastVideo saves in the "
         "parent after the worker returns the whole video; a streamed save is requested from here, through its "
         "`_extra_overrides` keyword (copied into the worker's batch.extra)", replaced=True),
    Seam("fastvideo.worker.multiproc_executor", "MultiprocExecutor.execute_forward", "a decode that failed in the "
         "worker (its latents kept) comes back as a marker in the output batch's extra: the parent raises there, "
         "before FastVideo post-processes the placeholder output", replaced=True),
    Seam("fastvideo.worker.gpu_worker", "Worker.execute_forward", "every worker runs the request the parent handed "
         "them all: inside it, and only there, the ranks hold the same latents and first frame", replaced=True),
    Seam("fastvideo.distributed.parallel_state", "get_world_group", "the ranks of a request decode one video "
         "together over FastVideo's world group"),
)


def worker_processes(generator) -> list:
    """The worker processes of a VideoGenerator's `mp` executor (empty for another executor)."""
    return [worker.proc for worker in getattr(generator.executor, "workers", None) or []]


def wrap_generate_single_video(wrapper: Callable) -> None:
    """`VideoGenerator._generate_single_video` becomes `wrapper(original, generator, prompt, sampling_param,
    fastvideo_args, **kwargs)`. Idempotent."""
    from fastvideo.entrypoints.video_generator import VideoGenerator

    def make(original):
        @functools.wraps(original)
        def generate_single_video(self, prompt, sampling_param=None, fastvideo_args=None, **kwargs):
            return wrapper(original, self, prompt, sampling_param, fastvideo_args, **kwargs)

        return generate_single_video

    replace_once(VideoGenerator, "_generate_single_video", make)


def with_batch_extra(kwargs: dict, key: str, value) -> dict:
    """`_generate_single_video` keyword arguments that put `value` into the worker's `batch.extra[key]`."""
    return {**kwargs, "_extra_overrides": {**kwargs.get("_extra_overrides", {}), key: value}}


def batch_extra(batch, key: str, cls: type):
    """The `cls` the parent put into this batch's `batch.extra[key]` (`with_batch_extra`), or None where it put none
    (TypeError for anything else)."""
    value = (batch.extra or {}).get(key)
    if value is not None and not isinstance(value, cls):
        raise TypeError(f"batch.extra[{key!r}] must be a {cls.__name__}; got {type(value).__name__}")
    return value


def local_torch_device():
    """This rank's device, as FastVideo's stages place tensors (FastVideo's, or its CPU-only replacement)."""
    from fastvideo.distributed import parallel_state

    return parallel_state.get_local_torch_device()


_forward_checks: list[Callable] = []


def on_execute_forward(check: Callable) -> None:
    """`MultiprocExecutor.execute_forward` (the parent's call into the workers) calls `check(output_batch)` on what the
    workers return, before FastVideo reads it (`check` may raise); each check once, in registration order."""
    from fastvideo.worker.multiproc_executor import MultiprocExecutor

    if check not in _forward_checks:
        _forward_checks.append(check)

    def make(original):
        @functools.wraps(original)
        def execute_forward(self, forward_batch, fastvideo_args):
            output_batch = original(self, forward_batch, fastvideo_args)
            for each in _forward_checks:
                each(output_batch)
            return output_batch

        return execute_forward

    replace_once(MultiprocExecutor, "execute_forward", make)


_in_request = contextvars.ContextVar("fastvideo_pan2_ext_in_request", default=False)


@contextlib.contextmanager
def request_scope():
    """Marks a request that every rank runs with the same inputs (what `request_group` reads)."""
    token = _in_request.set(True)
    try:
        yield
    finally:
        _in_request.reset(token)


def run_requests_in_scope() -> None:
    """A worker's `Worker.execute_forward` (the request the parent handed every worker, `collective_rpc`) runs in
    `request_scope`. Idempotent."""
    from fastvideo.worker.gpu_worker import Worker

    def make(original):
        @functools.wraps(original)
        def execute_forward(self, forward_batch, fastvideo_args):
            with request_scope():
                return original(self, forward_batch, fastvideo_args)

        return execute_forward

    replace_once(Worker, "execute_forward", make)


def request_group():
    """The process group of the ranks that run this request together (FastVideo's world group), or None: on one
    rank, and outside a request the executor handed every worker (`request_scope`), where each rank calls
    with its own data (FastVideo's preprocessing shards the dataset by rank, its training gives each rank a batch),
    not in step."""
    if not _in_request.get():
        return None
    from fastvideo.distributed import parallel_state

    try:
        world = parallel_state.get_world_group()
    except AssertionError:  # FastVideo's distributed environment is not initialized: one process
        return None
    return world.device_group if world.world_size > 1 else None
