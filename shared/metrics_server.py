"""/metrics, /healthz and /readyz for the processes without an HTTP server (writer, extractor): a tiny
server on the event loop, so a probe never waits on the work of a handler."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable

from shared.metrics import CONTENT_TYPE, render
from shared.settings import Settings

log = logging.getLogger("memories.metrics")

ReadyCheck = Callable[[], bool | Awaitable[bool]]

_REQUEST_TIMEOUT_S = 5.0
_MAX_HEADER_LINES = 100


class MetricsServer:
    """A minimal HTTP/1.0 server on the process's event loop: `/metrics`, `/healthz`, `/readyz`.

    It runs on the same loop as the consumers on purpose: a blocked loop stops answering `/healthz`, which
    is exactly when a liveness probe should restart the process. `ready` is called for each `/readyz`; an
    exception from it counts as not ready.
    """

    def __init__(self, port: int, ready: ReadyCheck | None = None, host: str = "127.0.0.1") -> None:
        self._host, self._port = host, port
        self._ready = ready
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        """The bound port (the chosen one when constructed with 0)."""
        if self._server is None or not self._server.sockets:
            return self._port
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def addresses(self) -> list[str]:
        """The addresses it listens on, once started."""
        return [str(sock.getsockname()[0]) for sock in self._server.sockets] if self._server else []

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, self._host, self._port)
        log.info("metrics and probes on http://%s:%d/metrics", self._host, self.port)
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            method, path = await asyncio.wait_for(self._read_request(reader), _REQUEST_TIMEOUT_S)
            status, content_type, body = await self._route(method, path)
            head = (
                f"HTTP/1.0 {status}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode() + (b"" if method == "HEAD" else body))
            await writer.drain()
        except (TimeoutError, ConnectionError, ValueError):
            pass  # a probe that hung up or spoke garbage gets nothing
        finally:
            writer.close()

    @staticmethod
    async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str]:
        request_line = (await reader.readline()).decode("latin-1").split()
        if len(request_line) < 2:
            raise ValueError("no request line")
        for _ in range(_MAX_HEADER_LINES):  # headers are read and ignored
            if (await reader.readline()).strip() == b"":
                break
        return request_line[0].upper(), request_line[1].split("?", 1)[0]

    async def _route(self, method: str, path: str) -> tuple[str, str, bytes]:
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "text/plain", b"GET only\n"
        if path == "/metrics":
            return "200 OK", CONTENT_TYPE, render()
        if path == "/healthz":
            return "200 OK", "application/json", b'{"status":"ok"}'
        if path == "/readyz":
            ready = await self._is_ready()
            body = b'{"status":"ready"}' if ready else b'{"status":"unavailable"}'
            return ("200 OK" if ready else "503 Service Unavailable"), "application/json", body
        return "404 Not Found", "text/plain", b"not found\n"

    async def _is_ready(self) -> bool:
        if self._ready is None:
            return True
        try:
            answer = self._ready()
            return bool(await answer) if inspect.isawaitable(answer) else bool(answer)
        except Exception:
            log.exception("readiness check failed")
            return False


async def serve_metrics(settings: Settings, ready: ReadyCheck | None = None) -> MetricsServer | None:
    """Start the server on MEMORIES_METRICS_PORT; None when that is 0 (off)."""
    if not settings.memories_metrics_port:
        return None
    server = MetricsServer(settings.memories_metrics_port, ready, host=settings.memories_metrics_host)
    await server.start()
    return server
