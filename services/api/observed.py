"""Every API response counted by route template and status (`memories_http_responses_total`)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared import metrics

UNMATCHED = "unmatched"
"""The route label of a path no route matches (a 404 or 405 of the router): one series, whatever the path."""


class ResponseCounter:
    """Pure ASGI, outside the routes: it sees the status that leaves, the error map's included; an exception
    that escapes every handler leaves as a 500."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def observed_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, observed_send)
        finally:
            # The router wrote the matched route into this same scope on the way in.
            route = getattr(scope.get("route"), "path", UNMATCHED)
            metrics.observe_http_response(scope["method"], route, status)
