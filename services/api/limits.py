"""Refuse oversized requests before they are read into memory: bodies (an ASGI middleware) and heads (the HTTP
protocol, where the headers are parsed); and requests that take too long to arrive."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from services.api.errors import envelope
from services.api.observed import UNMATCHED
from shared import metrics

UNPARSED = "unparsed"
"""The method label of a request refused before its head was read whole."""


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await envelope(413, self._message)(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            # A body without Content-Length (chunked) is counted as it arrives; the route's error map
            # turns this HTTPException into the 413 envelope.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, self._message)
            return message

        await self.app(scope, limited_receive, send)

    @property
    def _message(self) -> str:
        return f"request body exceeds {self.max_bytes} bytes"


MAX_HEAD_BYTES = 64 * 1024
"""A request's line and headers together, not counting the network read in which they begin (at most 256 KiB
with uvloop). The HTTP parser buffers a header until it ends, whatever its size."""


HEAD_TIMEOUT_S = 15.0
"""From a connection's opening, or a request's first byte, to the end of its head. uvicorn closes a kept-alive
connection idle between requests, but would wait for ever for a head that never comes or trickles in."""


BODY_TIMEOUT_S = 30.0
"""From the end of a request's head to the end of its body: at most 256 KiB (`services.api.main.MAX_BODY_BYTES`),
so ~9 KB/s at the least."""


class BoundedHeadHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol, refusing a request whose head (request line and headers) outgrows
    MAX_HEAD_BYTES with a 431, before the parser has buffered more than that and two network reads: with no
    limit, one unauthenticated request could hold any amount of memory in a header. A head not complete within
    `head_timeout_s`, or a body not complete within `body_timeout_s` of its head, is answered 408 and the
    connection closed: uvicorn would wait for either for ever, a connection held by a few bytes."""

    head_timeout_s = HEAD_TIMEOUT_S
    body_timeout_s = BODY_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes: int | None = 0  # None once the head of the current request is complete
        self._head_began_in_this_read = False
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._expect(self.head_timeout_s, self._head_too_slow)

    def connection_lost(self, exc: Exception | None) -> None:
        self._arrived()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0
        self._head_began_in_this_read = True
        self._expect(self.head_timeout_s, self._head_too_slow)

    def on_headers_complete(self) -> None:
        self._head_bytes = None
        self._expect(self.body_timeout_s, self._body_too_slow)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._arrived()
        super().on_message_complete()

    def _expect(self, within_s: float, too_slow: Callable[[], None]) -> None:
        self._arrived()
        self._deadline = self.loop.call_later(within_s, too_slow)

    def _arrived(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _head_too_slow(self) -> None:
        # `cycle` is the request before (or None): a 408 is written only after its answer, not into it.
        self._too_slow(_HEAD_TOO_SLOW, answerable=self.cycle is None or self.cycle.response_complete)

    def _body_too_slow(self) -> None:
        if self.flow.read_paused:
            # The server stopped reading, not the client sending: a pipelined request waits for the one before it,
            # or the app has not yet read what is buffered. The client's time starts again when reading does.
            self._expect(self.body_timeout_s, self._body_too_slow)
            return
        # `cycle` is this request; its app, waiting for the body, reads a disconnect once the connection closes.
        # An answer it began, or one to a request before it (pipelined), is not to be cut into.
        self._too_slow(_BODY_TOO_SLOW, answerable=not self.pipeline and not self.cycle.response_started)

    def _too_slow(self, message: str, *, answerable: bool) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if answerable:
            self._refuse(408, b"Request Timeout", "REQUEST_TIMEOUT", message)
        else:
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        # uvicorn's answer to bytes its parser cannot read is plain text; every answer of this API is the envelope.
        self._refuse(400, b"Bad Request", "VALIDATION_FAILED", _NOT_HTTP)

    def _refuse(self, status: int, reason: bytes, code: str, message: str) -> None:
        """An answer in the error envelope written by the protocol itself (no request reached the app, nor the
        response counter, so it is counted here); the connection is closed after it."""
        metrics.observe_http_response(UNPARSED, UNMATCHED, status)
        body = json.dumps({"error": {"code": code, "message": message}}).encode()
        head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n"
        self.transport.write(head % (status, reason, len(body)) + body)
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        self._head_began_in_this_read = False
        super().data_received(data)
        # The read in which a head begins may also hold the end of the request before it (pipelining): it is not
        # counted, so the bound is MAX_HEAD_BYTES plus one read.
        if self._head_bytes is None or self._head_began_in_this_read or self.transport.is_closing():
            return
        self._head_bytes += len(data)
        if self._head_bytes > MAX_HEAD_BYTES:
            self._refuse(431, b"Request Header Fields Too Large", "PAYLOAD_TOO_LARGE", _HEAD_TOO_LARGE)


_HEAD_TOO_LARGE = f"the request line and headers may take at most {MAX_HEAD_BYTES // 1024} KiB"
_HEAD_TOO_SLOW = f"the request line and headers must arrive within {HEAD_TIMEOUT_S:g} s"
_NOT_HTTP = "the request is not HTTP/1.1 this server can read (a malformed request line, header or length)"
_BODY_TOO_SLOW = f"the request body must arrive within {BODY_TIMEOUT_S:g} s of the headers"
