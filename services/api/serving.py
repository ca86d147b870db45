"""How uvicorn serves the API: one configuration for `memories api` and for the in-process servers of tests and
benchmarks, and how long a stopping API may take."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import uvicorn

from services.api.limits import BoundedHeadHttpTools
from shared import bus, bus_connection
from shared.servers import LOOPBACK, free_port
from shared.settings import Settings

if TYPE_CHECKING:
    from fastapi import FastAPI


def requests_grace_s(settings: Settings) -> int:
    """How long uvicorn lets the requests in hand finish once told to stop: a write may take up to
    `bus.PUBLISH_TIMEOUT_S` to publish, then waits up to the write timeout for its decision."""
    return int(settings.memories_write_timeout_s + bus.PUBLISH_TIMEOUT_S)


def stop_grace_s(settings: Settings) -> float:
    """The longest a stopping API takes: its requests in hand, then the lifespan's shutdown (the change events on
    their way, then the bus drained)."""
    return (
        requests_grace_s(settings) + bus.PUBLISH_TIMEOUT_S + bus_connection.DRAIN_TIMEOUT_S + bus_connection.DRAIN_FLUSH_S
    )


def server_config(app: FastAPI, settings: Settings, *, host: str, port: int, **options: Any) -> uvicorn.Config:
    """The API's uvicorn configuration; `options` add to it or replace its parts (tests vary the protocol)."""
    configured: dict[str, Any] = {
        "http": BoundedHeadHttpTools,
        "access_log": False,
        "log_config": None,  # uvicorn's lines go through our handlers (JSON outside a terminal)
        "timeout_graceful_shutdown": requests_grace_s(settings),
        "timeout_keep_alive": settings.memories_keep_alive_s,
    }
    return uvicorn.Config(app, host=host, port=port, **{**configured, **options})


@contextmanager
def serve_in_thread(settings: Settings, *, timeout: float = 60) -> Iterator[str]:
    """The API on a thread of its own (its own event loop), next to other work in the same process. Yields the base
    URL (`http://127.0.0.1:<port>`) once the API accepts requests; stops it after."""
    from services.api.main import create_app  # `memories up` reads the graces above without loading the API

    port = free_port()
    server = uvicorn.Server(server_config(create_app(settings), settings, host=LOOPBACK, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="memories-api", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the API did not start")
        time.sleep(0.05)
    try:
        yield f"http://{LOOPBACK}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
