"""DELETE of a running served job stops it at its next denoising step (docs/design/serving.md, "Serving").

The server's job thread runs each job inside `cancellable(flag)`, `flag` a `CancelFlag`: a file name in a private
folder of the server (the flag is set when the file exists: every process of the machine sees it, with no channel of
its own). `streamed_save` puts the flag into the worker's `batch.extra[KEY]`; `PAN2DenoisingStage` calls `check` before
each step. Once DELETE has set the flag, every rank raises `JobCancelled` at the same step (the ranks agree through
one all-reduce of the flag, so none is left waiting in a collective), and the request fails alone
(`request_failure`): the worker is free for the next job.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os

from . import compat

KEY = "pan2_cancel"  # parent -> worker: the job's CancelFlag


class JobCancelled(RuntimeError):
    """The job was deleted while it ran: stopped between two denoising steps."""


@dataclasses.dataclass(frozen=True)
class CancelFlag:
    """The job is to stop once the file `path` exists (in a folder only the server's user can write)."""

    path: str

    def set(self) -> None:
        os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))

    def is_set(self) -> bool:
        return os.path.lexists(self.path)

    def clear(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


_current: contextvars.ContextVar[CancelFlag | None] = contextvars.ContextVar("pan2_cancel_flag", default=None)


@contextlib.contextmanager
def cancellable(flag: CancelFlag):
    """The requests this thread makes inside the block stop once `flag` is set."""
    token = _current.set(flag)
    try:
        yield
    finally:
        _current.reset(token)


def current() -> CancelFlag | None:
    """The flag of the request being made in this thread (None: it cannot be cancelled)."""
    return _current.get()


def check(batch, step: int, steps: int) -> None:
    """Before denoising step `step` (0-based) of `steps`: JobCancelled on every rank once the job's flag is set."""
    flag = compat.executor.batch_extra(batch, KEY, CancelFlag)
    if flag is None:
        return
    stop = flag.is_set()
    group = compat.executor.request_group()  # the request's ranks (None: one)
    if group is not None:  # ranks may look a moment apart: they stop at the step any of them saw the flag
        import torch
        import torch.distributed as dist

        seen = torch.tensor([int(stop)], device=compat.executor.local_torch_device())
        dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)
        stop = bool(seen.item())
    if stop:
        raise JobCancelled(f"deleted while it ran: stopped before denoising step {step + 1} of {steps}")
