"""What one HTTP request may cost a PAN2 server, at the HTTP layer (docs/design/serving.md, "Serving"): bytes and
seconds.

- `BodyLimits` (ASGI middleware): a request body over its limit is a 413 with one line, at once when its
  Content-Length says so, else as soon as that many bytes have come (a chunked body is counted); a body not all
  there `body_timeout_s` after the request's headers is a 408 with one line. A multipart body (an upload) has its
  own, larger limit: Starlette's parser spools its file parts to disk and the upload is copied to its file in chunks
  (`uploads`), so an upload is never held whole in memory; any other body (JSON) is read whole by FastVideo's
  handler, so its limit is what it may take in memory. Once refused, the app's next read of the request raises,
  whatever the app answers after is dropped, and the connection is closed (the rest of the body is never read).
- `protocol(...)`: uvicorn's h11 protocol, which refuses request headers over `max_header_bytes` (counted as they
  come, before h11 parses them: h11's own bound holds only for headers still incomplete; a 431 with one line) and
  ends a connection whose request headers have not all come `header_timeout_s` after its first byte (or its
  opening) with a 408 and one line (slowloris).
- `uvicorn_options(...)`: those, with the keep-alive of an idle connection and uvicorn's `limit_concurrency` (past
  it, uvicorn answers 503).
"""

from __future__ import annotations

import asyncio
import json
import re

_HEAD_END = re.compile(rb"\n\r?\n")  # the blank line after a request's headers (h11 takes a bare LF too)


def _answer(status: int, line: str) -> tuple[dict, dict]:
    """The two ASGI messages of a one-line JSON answer that closes the connection."""
    body = json.dumps({"detail": line}).encode()
    return ({"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         (b"connection", b"close")]},
            {"type": "http.response.body", "body": body})


class Refused(Exception):
    """This request was refused and answered: what the app reads of it next raises this."""


class BodyLimits:
    """The body limits above, around an ASGI app."""

    def __init__(self, app, *, max_upload_bytes: int, max_body_bytes: int, body_timeout_s: float) -> None:
        self.app = app
        self.max_upload_bytes, self.max_body_bytes, self.body_timeout_s = max_upload_bytes, max_body_bytes, \
            body_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if headers.get(b"content-type", b"").lower().startswith(b"multipart/form-data"):
            limit, key = self.max_upload_bytes, "server.max_upload_bytes"
        else:
            limit, key = self.max_body_bytes, "server.max_body_bytes"
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:  # before a byte of it is read
            for message in _answer(413, f"the request body is {int(declared)} bytes, over this server's limit of "
                                        f"{limit} ({key})"):
                await send(message)
            return

        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        received, body_done, answered, started = 0, False, False, False

        async def refuse(status: int, line: str):
            nonlocal answered
            if not started:  # else the app has answered already: nothing more can be said
                answered = True
                for message in _answer(status, line):
                    await send(message)
            raise Refused(line)

        async def limited_receive():
            nonlocal received, body_done
            if answered:
                raise Refused("refused")
            if body_done:  # a download's wait for the client to go: no limit
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except TimeoutError:
                await refuse(408, f"the request body did not all arrive within {self.body_timeout_s:g} s "
                                  f"(server.body_timeout_s)")
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    await refuse(413, f"the request body is over this server's limit of {limit} bytes ({key})")
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        async def guarded_send(message) -> None:
            nonlocal started
            if answered:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not answered:  # not ours: the app's own error
                raise


def protocol(max_header_bytes: int, header_timeout_s: float) -> type:
    """uvicorn's h11 protocol with the header limits above (uvicorn imported only here: a server that runs)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class LimitedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_timer = None
            self._head_bytes, self._head_tail = 0, b""  # of the request whose headers are coming
            self._seen_cycle = None
            self._time_head()

        def _awaiting_head(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _time_head(self) -> None:
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timed_out)

        def _stop_head(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def data_received(self, data: bytes) -> None:
            if self._awaiting_head():
                if self._head_timer is None:  # the next request on a kept-alive connection begins
                    self._time_head()
                window = self._head_tail + data
                end = _HEAD_END.search(window)
                self._head_bytes += end.end() - len(self._head_tail) if end else len(data)
                if self._head_bytes > max_header_bytes:
                    self._refuse(431, f"the request headers are over this server's limit of {max_header_bytes} "
                                      f"bytes (server.max_header_bytes)")
                    return
                self._head_tail = window[-3:]
            super().data_received(data)
            if self.cycle is not None and self.cycle is not self._seen_cycle:  # its headers are all in
                self._seen_cycle, self._head_bytes, self._head_tail = self.cycle, 0, b""
                self._stop_head()

        def connection_lost(self, exc) -> None:
            self._stop_head()
            super().connection_lost(exc)

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if not self._awaiting_head() or self.transport.is_closing():
                return
            if self._head_bytes == 0:  # nothing sent: closed as an idle keep-alive connection is, without a word
                self.transport.close()
                return
            self._refuse(408, f"the request headers did not all arrive within {header_timeout_s:g} s "
                              f"(server.header_timeout_s)")

        def _refuse(self, status: int, line: str) -> None:
            """Answer one line and close: no request is being served on this connection (no ASGI cycle)."""
            self._stop_head()
            if self.transport.is_closing():
                return
            start, body = _answer(status, line)
            reason = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}[status]
            head = b"".join(name + b": " + value + b"\r\n" for name, value in start["headers"])
            self.transport.write(b"HTTP/1.1 %d %s\r\n%s\r\n%s" % (status, reason, head, body["body"]))
            self.transport.close()

    return LimitedH11Protocol


def uvicorn_options(*, max_header_bytes: int, header_timeout_s: float, max_connections: int) -> dict:
    """uvicorn.run's options for the limits above (FastVideo runs uvicorn with httptools, no header bound, and a
    300 s keep-alive): an idle kept-alive connection is closed after `header_timeout_s` too."""
    return {"http": protocol(max_header_bytes, header_timeout_s),
            "h11_max_incomplete_event_size": max_header_bytes + 4,  # a backstop: `protocol` refuses first
            "timeout_keep_alive": header_timeout_s, "limit_concurrency": max_connections}
