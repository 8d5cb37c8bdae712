"""A served request that fails in the worker fails alone (docs/design/serving.md, "Serving").

FastVideo 0.2.1's worker exits on any exception from a forward pass (and signals its parent), so under `fastvideo
serve` one bad request would end every later one. For a request the parent marks (`FAILS_ALONE_KEY` in the worker's
`batch.extra`, put there while `failing_alone()` is active in the parent's thread), `PAN2Pipeline.forward` catches the
error instead, logs it, and returns the batch with the error's one line (`FAILURE_KEY`); the parent's `check_output`
(run on what the workers return, before FastVideo reads it) raises `RequestFailed` with that line. The worker stays up
for the next request. Unmarked requests (`fastvideo generate`, the Python API) run as FastVideo runs them.
"""

from __future__ import annotations

import contextlib
import contextvars

FAILS_ALONE_KEY = "pan2_fails_alone"  # parent -> worker: an error fails this request only
FAILURE_KEY = "pan2_request_failed"  # worker -> parent: the error's one line

_failing_alone = contextvars.ContextVar("pan2_failing_alone", default=False)


class RequestFailed(RuntimeError):
    """A request failed in the worker, which stays up; the message is the error's one line."""


@contextlib.contextmanager
def failing_alone():
    """The requests this thread makes inside the block fail alone."""
    token = _failing_alone.set(True)
    try:
        yield
    finally:
        _failing_alone.reset(token)


def fails_alone() -> bool:
    """Whether the request being made in this thread fails alone."""
    return _failing_alone.get()


def check_output(output_batch) -> None:
    """In the parent, on what the workers returned: raise RequestFailed for a request that failed alone."""
    line = (getattr(output_batch, "extra", None) or {}).get(FAILURE_KEY)
    if line is not None:
        raise RequestFailed(line)
