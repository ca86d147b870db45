"""Every API response counted by route template and status (`memories_http_responses_total`); HEAD answered as GET."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared import metrics

UNMATCHED = "unmatched"
"""The route label of a path no route matches (a 404 or 405 of the router): one series, whatever the path."""
UNCOUNTED = frozenset({"/healthz", "/readyz", "/metrics"})
"""The probes' and the scrape's: a steady trickle that is no client's, which diluted the API's error rate (a 5xx
alert on a quiet hour stayed silent) and counted a readiness 503 as a failed request."""


class ResponseCounter:
    """Pure ASGI, outside the routes: it sees the status that leaves, the error map's included; an exception
    that escapes every handler leaves as a 500.

    It also drops, quietly, what is sent to a client that has hung up: uvloop refuses to write on the closed
    connection (a RuntimeError), which the answers to requests a client pipelined and then left met. Raised, each
    was logged twice at ERROR with its traceback: anyone could fill the logs and wake whoever watches them."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status, client_gone = 500, False

        async def observed_send(message: Message) -> None:
            nonlocal status, client_gone
            if message["type"] == "http.response.start":
                status = message["status"]
            if client_gone:
                return
            try:
                await send(message)
            except RuntimeError as exc:
                if not _connection_closed(exc):
                    raise
                client_gone = True

        try:
            await self.app(scope, receive, observed_send)
        finally:
            # The router wrote the matched route into this same scope on the way in.
            route = getattr(scope.get("route"), "path", UNMATCHED)
            if route not in UNCOUNTED:
                metrics.observe_http_response(scope["method"], route, status)


def _connection_closed(error: RuntimeError) -> bool:
    # uvloop's words: "unable to perform operation on <TCPTransport closed=True …>; the handler is closed".
    return "closed" in str(error)


class HeadAsGet:
    """HEAD on any path that takes GET, as HTTP requires of every server (RFC 9110, 9.1): the request is routed as
    a GET in a scope of its own, and the server, which still sees the HEAD in its own scope, sends the GET's status
    and headers without its body. FastAPI's routes take only the methods they name, so HEAD was a 405 (health
    checkers and link checkers send it)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return
        as_get = {**scope, "method": "GET"}
        try:
            await self.app(as_get, receive, send)
        finally:
            if "route" in as_get:  # for ResponseCounter outside: the route the router matched, in the HEAD's scope
                scope["route"] = as_get["route"]
