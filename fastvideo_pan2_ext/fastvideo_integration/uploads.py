"""Uploads in a PAN2 server: what FastVideo's server does with a request's image, replaced (through
`compat.http_server.replace_server_parts`; the serving table of docs/fastvideo.md lists each replacement).

- No reference_url fetched over http(s): the client sends the image itself.
- An upload is stored as FastVideo names it, uploads/<request id>_<the client's file name>, with that name made one
  safe file name in uploads/ (`in_uploads`), copied in chunks into a file created exclusively, never through a link
  (`save_upload`; FastVideo reads it whole into memory).
- What a request saved goes when the request is not accepted (`UploadGuard`), and a field FastVideo's request model
  refuses is a one-line 400 (`request_or_400`).
"""

from __future__ import annotations

import contextvars
import glob
import os
import re
from pathlib import Path

from fastvideo_pan2_ext.vae_kernel.errors import first_line

from .compat import http_server


async def save_image(image, target_path: str, fastvideo_save) -> str:
    """FastVideo's save of a request's image (`fastvideo_save(image, path)` for a data: URL or a path), as a PAN2
    server does it: no http(s) URL, kept in uploads/, an uploaded file copied in chunks, nothing left of a failed save,
    and recorded for `UploadGuard`."""
    if isinstance(image, str) and image.lower().startswith(("http://", "https://")):
        raise ValueError("this server fetches no reference_url over http(s) (a client could make it read any "
                         "host, any size, into memory): send the image itself (multipart input_reference, "
                         "or a data: URL)")
    path = in_uploads(target_path)
    try:
        saved = await (fastvideo_save(image, path) if isinstance(image, str) else save_upload(image, path))
    except BaseException:
        for written in glob.glob(glob.escape(path) + "*"):  # what a failed save wrote (it may add a suffix)
            Path(written).unlink(missing_ok=True)
        raise
    holder = _SAVED_UPLOADS.get()
    if holder is not None:
        holder.append(saved)
    return saved


# The uploads the POST being handled saved (a list per request, set by `UploadGuard` around it).
_SAVED_UPLOADS: contextvars.ContextVar[list | None] = contextvars.ContextVar("pan2_saved_uploads", default=None)


class UploadGuard:
    """ASGI middleware around POST /v1/videos: the uploads the request saved go when it is not accepted (any answer but
    200: PAN2's refusals, FastVideo's own 400s), and an error FastVideo's handler lets escape after saving one (a
    multipart `extra_body` that is JSON but not an object, say: a dropped connection) is a one-line 400."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"].rstrip("/") != "/v1/videos":
            await self.app(scope, receive, send)
            return
        from fastapi.responses import JSONResponse

        saved: list[str] = []
        statuses: list[int] = []

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])
            await send(message)

        token = _SAVED_UPLOADS.set(saved)
        try:
            await self.app(scope, receive, sending)
        except Exception as exc:  # noqa: BLE001 - not an interrupt: this request is refused, the server goes on
            for upload in saved:
                Path(upload).unlink(missing_ok=True)
            if statuses:  # the answer had started: nothing more can be said
                raise
            await JSONResponse({"detail": f"invalid request: {first_line(exc, with_type=True)}"}, status_code=400)(
                scope, receive, send)
            return
        finally:
            _SAVED_UPLOADS.reset(token)
        if statuses[:1] != [200]:
            for upload in saved:
                Path(upload).unlink(missing_ok=True)


def one_line_400(detail: str):
    """fastapi's HTTPException 400 whose str is its detail alone (FastVideo's JSON branch quotes str(exception))."""
    from fastapi import HTTPException

    class OneLine(HTTPException):
        def __str__(self) -> str:
            return self.detail

    return OneLine(status_code=400, detail=detail)


def request_or_400(request_class, /, **fields):
    """FastVideo's request object from a submission's fields; fields it refuses are a one-line 400 (FastVideo answers
    a multipart one with an unhandled error and a JSON one with pydantic's many lines)."""
    import pydantic

    try:
        return request_class(**fields)
    except pydantic.ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'request'}: {e['msg']}" for e in exc.errors())
        raise one_line_400(f"invalid request: {problems}") from None


def in_uploads(target_path: str) -> str:
    """FastVideo's path for an upload, uploads/<request id>_<the client's file name>, with that name made one safe
    file name in uploads/ (a separator or any other character but letters, digits, '.', '-' and '_' becomes '_')."""
    uploads = os.path.join(http_server.served_output_dir(), "uploads")
    if not target_path.startswith(uploads + os.sep):
        raise ValueError(f"an upload must be stored in {uploads}")
    return os.path.join(uploads, re.sub(r"[^\w.-]", "_", target_path[len(uploads) + 1:]))


async def save_upload(upload, path: str) -> str:
    """FastVideo's save of an uploaded file, but copied in chunks (FastVideo reads it whole into memory) into a file
    created exclusively, never through a link, in a folder below output_dir reached without one."""
    from fastvideo_pan2_ext.media.video_io import open_folder

    folder = open_folder(os.path.dirname(path), http_server.served_output_dir())
    try:
        fd = os.open(os.path.basename(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=folder)
    finally:
        os.close(folder)
    with os.fdopen(fd, "wb") as out:
        await upload.seek(0)
        while chunk := await upload.read(1 << 20):  # Starlette spooled it to disk past 1 MiB
            out.write(chunk)
    return path
