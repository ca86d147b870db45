"""How the API spends a request: no dependency in the thread pool, reads without a transaction."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from psycopg.pq import TransactionStatus
from sqlalchemy import text
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from services.api import errors
from services.api.limits import MAX_HEAD_BYTES, UNPARSED, BoundedHeadHttpTools
from services.api.main import create_app
from services.api.observed import UNMATCHED
from services.api.serving import server_config
from shared import metrics
from shared import repository as repo
from shared.servers import LOOPBACK, free_port
from shared.settings import Settings
from tests.conftest import ADMIN_TOKEN, PARTITIONS, open_api, raw_exchange


def _dependencies(dependant: Dependant) -> list[Dependant]:
    found = []
    for child in dependant.dependencies:
        found.append(child)
        found.extend(_dependencies(child))
    return found


def _api_routes(routes: list[Any]) -> list[APIRoute]:
    found = []
    for route in routes:
        if isinstance(route, APIRoute):
            found.append(route)
        elif hasattr(route, "original_router"):  # an included router
            found.extend(_api_routes(route.original_router.routes))
    return found


def test_no_route_dependency_runs_in_the_thread_pool(settings: Settings) -> None:
    """FastAPI runs a plain `def` dependency in its thread pool: a thread hop on every request."""
    app = create_app(settings)
    routes = _api_routes(app.routes)
    assert {"create_entry", "search", "list_memories"} <= {route.endpoint.__name__ for route in routes}
    blocking = {
        f"{route.path}: {dep.call.__name__}"  # type: ignore[union-attr]
        for route in routes
        for dep in _dependencies(route.dependant)
        if dep.call is not None and not inspect.iscoroutinefunction(dep.call) and not inspect.isasyncgenfunction(dep.call)
    }
    assert blocking == set()


async def test_read_sessions_commit_each_statement_and_write_sessions_keep_a_transaction(settings: Settings) -> None:
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        for factory, expected in (
            (app.state.read_sessions, TransactionStatus.IDLE),
            (app.state.sessions, TransactionStatus.INTRANS),
        ):
            async with factory() as session:
                await session.execute(text("SELECT 1"))
                raw = await (await session.connection()).get_raw_connection()
                assert raw.driver_connection.info.transaction_status is expected
        # A read session hands back a connection the next write session uses in a transaction.
        async with app.state.read_sessions() as session:
            await session.execute(text("SELECT 1"))
        async with app.state.sessions() as session:
            await session.execute(text("SELECT 1"))
            raw = await (await session.connection()).get_raw_connection()
            assert raw.driver_connection.info.transaction_status is TransactionStatus.INTRANS


async def test_a_request_waits_for_a_busy_memory_no_longer_than_for_a_write(
    settings: Settings, client: httpx.AsyncClient, memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    entry = (await client.post("/memory-entries", json={"memory_id": memory["id"], "content": "A busy fact"})).json()
    impatient = settings.model_copy(update={"memories_write_timeout_s": 0.5})
    async with open_api(impatient) as (_app, api):
        async with sessions.begin() as session:  # a writer deciding this memory (a slow model, say)
            await repo.lock_memories(session, [memory["id"]])
            edit = await asyncio.wait_for(api.put(f"/memory-entries/{entry['id']}", json={"content": "Edited"}), 10)
        assert edit.status_code == 503 and "busy" in edit.json()["error"]["message"]
        assert (await api.put(f"/memory-entries/{entry['id']}", json={"content": "Edited"})).status_code == 200


async def test_no_free_database_connection_is_a_503() -> None:
    app = FastAPI()
    errors.install(app)

    @app.get("/busy")
    async def busy() -> None:
        raise PoolTimeout("QueuePool limit of size 24 overflow 8 reached")

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as api:
        response = await api.get("/busy")
    assert response.status_code == 503 and response.json()["error"]["code"] == "SERVICE_UNAVAILABLE"


def _responses(**labels: str) -> float:
    return metrics.REGISTRY.get_sample_value("memories_http_responses_total", labels) or 0.0


def refused_by_the_protocol(status: int) -> float:
    """Responses the HTTP protocol wrote itself, which the app's response counter never sees."""
    labels = {"method": UNPARSED, "route": UNMATCHED, "status": str(status)}
    return metrics.REGISTRY.get_sample_value("memories_http_responses_total", labels) or 0.0


async def test_a_request_head_larger_than_the_limit_is_refused_before_it_is_buffered() -> None:
    app = FastAPI()

    @app.post("/size")
    async def size(request: Request) -> dict[str, int]:
        return {"bytes": len(await request.body())}

    async with served(app, BoundedHeadHttpTools) as port:
        # Beyond the limit and the one network read (up to 256 KiB) in which a head begins, which is not counted.
        huge = b"GET /size HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (MAX_HEAD_BYTES * 16) + b"\r\n\r\n"
        counted = refused_by_the_protocol(431)
        refused = await asyncio.to_thread(raw_exchange, port, huge)
        assert refused.startswith(b"HTTP/1.1 431 ") and b'"PAYLOAD_TOO_LARGE"' in refused
        assert refused_by_the_protocol(431) == counted + 1
        # A body is not a head: 200 KiB sent at once, twice on one kept-alive connection, are both read.
        body = b"b" * (200 * 1024)
        post = b"POST /size HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        answered = await asyncio.to_thread(raw_exchange, port, post, post)
        assert answered.count(b"HTTP/1.1 200 OK") == 2 and answered.count(b'{"bytes":204800}') == 2
        # Pipelined: a body and the start of the next request in one read; the body is not the next one's head.
        small = b"POST /size HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n"
        big_body = b"b" * (100 * 1024)
        big_head = b"POST /size HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(big_body)
        answered = await asyncio.to_thread(raw_exchange, port, big_head, big_body + small[:20], small[20:], pause=0.2)
        assert answered.count(b"HTTP/1.1 200 OK") == 2, answered[:300]


async def test_head_is_answered_wherever_get_is_with_its_headers_and_no_body(settings: Settings) -> None:
    # RFC 9110 requires HEAD of every server wherever GET is served; FastAPI's routes answered it 405.
    async with open_api(settings) as (app, client):
        project = (await client.post("/projects", json={"name": "head"})).json()
        async with served(app, BoundedHeadHttpTools, settings) as port:
            def ask(method: str, path: str) -> bytes:
                request = f"{method} {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {ADMIN_TOKEN}\r\n\r\n"
                return raw_exchange(port, request.encode(), quiet_s=0.5)

            heads_counted = _responses(method="HEAD", route="/memories", status="200")
            for path in ("/healthz", f"/api/v1/memories?project_id={project['id']}"):
                got, head = await asyncio.to_thread(ask, "GET", path), await asyncio.to_thread(ask, "HEAD", path)
                got_head, _, body = got.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n"), head  # nothing after
                assert f"content-length: {len(body)}".encode() in head.lower() and body, got_head
            # Counted as what the client sent, under the route it matched (not as a GET, nor as unmatched).
            assert _responses(method="HEAD", route="/memories", status="200") == heads_counted + 1
            # A path that takes no GET takes no HEAD, and says what it takes.
            refused = await asyncio.to_thread(ask, "HEAD", "/api/v1/knowledge/search")
            assert refused.startswith(b"HTTP/1.1 405 ") and b"\r\nallow: POST\r\n" in refused, refused


def test_the_api_keeps_an_idle_connection_longer_than_the_clients_in_front_of_it() -> None:
    # uvicorn's default, 5 s, is httpx's pool expiry: a request sent on a connection as the API closed it failed.
    assert Settings().memories_keep_alive_s > max(httpx.Limits().keepalive_expiry or 0, 60)


async def test_an_idle_connection_is_closed_after_the_keep_alive_setting() -> None:
    app = FastAPI()

    @app.get("/ok")
    async def ok() -> dict[str, bool]:
        return {"ok": True}

    def idle_then_reused(port: int) -> bytes:
        """The second answer on one connection left idle 1.5 s after the first; b"" if the API had closed it."""
        request = b"GET /ok HTTP/1.1\r\nhost: x\r\n\r\n"
        with socket.create_connection((LOOPBACK, port), timeout=5) as connection:
            connection.sendall(request)
            answered = b""
            while not answered.endswith(b'{"ok":true}'):
                answered += connection.recv(65536)
            time.sleep(1.5)
            connection.settimeout(0.1)
            with contextlib.suppress(TimeoutError):
                if connection.recv(1) == b"":
                    return b""
            connection.settimeout(5)
            connection.sendall(request)
            return connection.recv(65536)

    for keep_alive, reused in ((1, False), (3, True)):
        async with served(app, BoundedHeadHttpTools, Settings(memories_keep_alive_s=keep_alive)) as port:
            answer = await asyncio.to_thread(idle_then_reused, port)
            assert answer.startswith(b"HTTP/1.1 200 ") == reused, (keep_alive, answer)


def test_memories_api_stopped_with_ctrl_c_exits_cleanly(server_urls: tuple[str, str]) -> None:
    # uvicorn raises the interrupt again once it has stopped: the command ended in a traceback and status 130.
    port = free_port()
    env = {**os.environ, "DATABASE_URL": server_urls[0], "NATS_URL": server_urls[1], "MEMORIES_PORT": str(port),
           "MEMORIES_PARTITIONS": str(PARTITIONS), "MEMORIES_ADMIN_TOKEN": ADMIN_TOKEN, "MEMORIES_LOG_FORMAT": "text"}
    api = subprocess.Popen([sys.executable, "-m", "services.cli", "api"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not _ready(f"http://{LOOPBACK}:{port}/readyz"):
            assert api.poll() is None and time.monotonic() < deadline, "the API did not start"
            time.sleep(0.2)
        api.send_signal(signal.SIGINT)
        _, stderr = api.communicate(timeout=30)
    finally:
        if api.poll() is None:
            api.kill()
    assert api.returncode == 0 and "Traceback" not in stderr, stderr[-2000:]


def _ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


class QuickHeadTimeout(BoundedHeadHttpTools):
    head_timeout_s = 0.5
    body_timeout_s = 0.5


async def test_a_request_head_that_never_completes_is_answered_408_and_closed() -> None:
    app = FastAPI()

    @app.get("/ok")
    async def ok() -> dict[str, bool]:
        return {"ok": True}

    async with served(app, QuickHeadTimeout) as port:
        # A head that trickles in, and a connection that says nothing: each held a connection for ever.
        counted = refused_by_the_protocol(408)
        trickled = await asyncio.to_thread(raw_exchange, port, b"GET /ok HTTP/1.1\r\n", b"host: x\r\n", pause=0.3)
        assert trickled.startswith(b"HTTP/1.1 408 ") and b'"REQUEST_TIMEOUT"' in trickled
        assert (await asyncio.to_thread(raw_exchange, port, b"", pause=0.8)).startswith(b"HTTP/1.1 408 ")
        assert refused_by_the_protocol(408) == counted + 2
        # Requests whose heads arrive in time are answered, also after an idle pause on a kept-alive connection.
        request = b"GET /ok HTTP/1.1\r\nhost: x\r\n\r\n"
        answered = await asyncio.to_thread(raw_exchange, port, request, request, pause=0.8)
        assert answered.count(b"HTTP/1.1 200 OK") == 2 and b"408" not in answered


async def test_a_request_body_that_never_completes_is_answered_408_and_closed() -> None:
    app = FastAPI()
    bodies: list[bytes] = []

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        bodies.append(await request.body())
        return {"bytes": len(bodies[-1])}

    async with served(app, QuickHeadTimeout) as port:
        head = b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n"
        counted = refused_by_the_protocol(408)
        # Four bytes of ten, then nothing: the connection was held for ever (uvicorn has no body timeout).
        stalled = await asyncio.to_thread(raw_exchange, port, head + b"abcd", pause=0.8)
        assert stalled.startswith(b"HTTP/1.1 408 ") and b"request body must arrive" in stalled, stalled
        assert refused_by_the_protocol(408) == counted + 1 and bodies == []
        # A body that arrives in parts within the time is read whole, and the next request on the connection too.
        answered = await asyncio.to_thread(raw_exchange, port, head + b"abcd", b"efghij" + head, b"0123456789", pause=0.3)
        assert answered.count(b'{"bytes":10}') == 2 and b"408" not in answered, answered
        assert bodies == [b"abcdefghij", b"0123456789"]


async def test_the_body_timeout_counts_only_while_the_server_reads() -> None:
    """uvicorn stops reading while a pipelined request waits for the one before it, and while the app has not read
    a large body it buffered: neither is the client's delay (both were closed as too slow, the first request's
    answer lost)."""
    app = FastAPI()

    @app.post("/slow")
    async def slow(request: Request) -> dict[str, int]:
        await asyncio.sleep(1.2)  # over two body timeouts before the body is read
        return {"bytes": len(await request.body())}

    async with served(app, QuickHeadTimeout) as port:
        small = b"POST /slow HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nab"
        pipelined = small + b"POST /slow HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n"
        answered = await asyncio.to_thread(raw_exchange, port, pipelined, b"cd", pause=0.1, quiet_s=3.0)
        assert answered.count(b'{"bytes":2}') == 2 and b"408" not in answered, answered
        body = b"b" * (200 * 1024)  # beyond what uvicorn buffers before it stops reading
        big = b"POST /slow HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        answered = await asyncio.to_thread(raw_exchange, port, big, quiet_s=3.0)
        assert b'{"bytes":204800}' in answered and b"408" not in answered, answered[:200]


async def test_a_request_the_parser_cannot_read_is_answered_in_the_envelope() -> None:
    app = FastAPI()
    async with served(app, BoundedHeadHttpTools) as port:
        counted = refused_by_the_protocol(400)
        for garbage in (b"GARBAGE\r\n\r\n", b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: abc\r\n\r\n"):
            answered = await asyncio.to_thread(raw_exchange, port, garbage)
            head, _, body = answered.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400 ") and b"application/json" in head, answered  # was text/plain
            assert json.loads(body)["error"]["code"] == "VALIDATION_FAILED"
        assert refused_by_the_protocol(400) == counted + 2


async def test_a_client_gone_before_its_body_arrived_is_a_400_not_an_unhandled_error(settings: Settings) -> None:
    sent: list[dict[str, Any]] = []

    async def gone() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/api/v1/projects", "raw_path": b"/api/v1/projects", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"20"),
                         (b"authorization", f"Bearer {settings.memories_admin_token}".encode())],
             "server": ("test", 80), "client": ("test", 1)}
    async with open_api(settings) as (app, _api):
        await app(scope, gone, send)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 400, sent


@asynccontextmanager
async def served(app: FastAPI, http: type[BoundedHeadHttpTools], settings: Settings | None = None) -> AsyncIterator[int]:
    """`app` behind uvicorn as the API configures it (with a variant of its HTTP protocol), on a free port, until the
    block ends."""
    port = free_port()
    server = uvicorn.Server(server_config(app, settings or Settings(), host=LOOPBACK, port=port, http=http))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        await serving


async def test_an_api_without_an_admin_token_says_so_as_it_starts(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    # Only `memories up` generates a token: a deployment that forgot its secret had no admin, and nothing said so.
    for token, warned in ((None, True), ("a-token", False)):
        caplog.clear()
        app = create_app(settings.model_copy(update={"memories_admin_token": token}))
        async with app.router.lifespan_context(app):
            pass
        said = [r.getMessage() for r in caplog.records if r.name == "memories.api" and r.levelno == logging.WARNING]
        assert bool(said) is warned and all("no MEMORIES_ADMIN_TOKEN" in line for line in said), said


def test_the_api_loads_litellm_and_the_local_model_before_it_serves(settings: Settings) -> None:
    # Loaded by the first search or edit instead, on the event loop: every request of the process, health probes
    # included, waited ~5 s behind it after each start.
    script = (
        "import asyncio, sys\n"
        "from services.api.main import create_app\n"
        "from shared.embeddings import _onnx\n"
        "from shared.settings import Settings\n"
        "async def main():\n"
        "    app = create_app(Settings.model_validate_json(sys.argv[1]))\n"
        "    async with app.router.lifespan_context(app):\n"
        "        loaded = _onnx._encoder is not None and _onnx._encoder._session is not None\n"
        "        print('litellm' in sys.modules, loaded)\n"
        "asyncio.run(main())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, settings.model_dump_json()],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "True"]


async def test_an_answer_to_a_client_that_hung_up_is_dropped_quietly() -> None:
    # A client that pipelined requests and hung up: uvloop refuses each later answer with a RuntimeError, which
    # escaped as an unhandled error (two ERROR lines with tracebacks per request, for anyone to cause).
    from services.api.observed import ResponseCounter

    async def answer(_scope: Any, _receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def closed(_message: Any) -> None:
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")

    async def broken(_message: Any) -> None:
        raise RuntimeError("something else went wrong")

    scope = {"type": "http", "method": "GET"}
    await ResponseCounter(answer)(scope, None, closed)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="something else"):  # any other failure is still one
        await ResponseCounter(answer)(scope, None, broken)  # type: ignore[arg-type]


async def test_readiness_does_not_wait_for_a_connection_the_requests_hold(settings: Settings) -> None:
    # Requests holding every pooled connection (edits waiting for a memory's lock) made /readyz wait for one, past
    # the probe's timeout: every replica under the same load left the load balancer at once.
    async with open_api(settings) as (app, api), contextlib.AsyncExitStack() as held:
        engine = app.state.sessions.kw["bind"]
        for _ in range(engine.pool.size() + engine.pool._max_overflow):
            session = await held.enter_async_context(app.state.sessions())
            await session.connection()
        ready = await asyncio.wait_for(api.get(api.base_url.join("/readyz")), 5)
        assert ready.status_code == 200, ready.text
