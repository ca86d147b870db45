"""The API served by uvicorn on a thread of its own (its own event loop): for benchmarks and tests that
need a real HTTP server next to other work in the same process."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from services.api.main import create_app
from shared.servers import LOOPBACK, free_port
from shared.settings import Settings


@contextmanager
def serve_in_thread(settings: Settings, *, timeout: float = 60) -> Iterator[str]:
    """Yields the base URL (`http://127.0.0.1:<port>`) once the API accepts requests; stops it after."""
    port = free_port()
    config = uvicorn.Config(
        create_app(settings), host=LOOPBACK, port=port, log_config=None, log_level="warning", access_log=False
    )
    server = uvicorn.Server(config)
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
