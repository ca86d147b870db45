"""Refuse oversized request bodies before they are read into memory."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.api.errors import envelope


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
