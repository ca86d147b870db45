"""Real PostgreSQL+pgvector and NATS JetStream, started once per test session (or taken from
DATABASE_URL / NATS_URL), the schema built by the real migrations, the API and two writer replicas
running in-process against them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import pytest_asyncio
from fastapi import FastAPI
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from services.api.main import create_app
from services.extractor.main import ExtractorService
from services.writer.main import Writer
from shared.db.migrate import upgrade
from shared.db.session import create_engine, session_factory
from shared.embeddings import LOCAL_MODEL, EmbeddingError, embed_texts
from shared.events import MemoryWriteOutcome, MemoryWriteRequested
from shared.scripted_llm import ScriptedLLM, scripted_llm
from shared.servers import LOOPBACK, EmbeddedNats, EmbeddedPostgres
from shared.settings import Settings
from shared.writes import WriteApplier

ADMIN_TOKEN = "test-admin-token"
PARTITIONS = 4


@pytest.fixture(scope="session")
def server_urls() -> Iterator[tuple[str, str]]:
    root = Path(tempfile.mkdtemp(prefix="memories-tests-"))
    started: list[EmbeddedPostgres | EmbeddedNats] = []
    try:
        database_url = os.environ.get("DATABASE_URL")
        if not database_url:
            postgres = EmbeddedPostgres(root / "postgres")
            database_url = postgres.start()
            started.append(postgres)
        nats_url = os.environ.get("NATS_URL")
        if not nats_url:
            nats_server = EmbeddedNats(root / "nats")
            nats_url = nats_server.start()
            started.append(nats_server)
        upgrade(database_url)
        yield database_url, nats_url
    finally:
        for server in reversed(started):
            server.stop()
        shutil.rmtree(root, ignore_errors=True)


# pg_locks, not pg_stat_activity: a transaction sees pg_stat_activity as it was at its first read of it, so a
# backend that connected after the first poll would never show up; pg_locks is read afresh by every query.
_BLOCKED_BY_ME = text(
    "SELECT count(*) FROM pg_locks WHERE NOT granted AND pg_backend_pid() = ANY(pg_blocking_pids(pid))"
)


@pytest.fixture
def llm() -> ScriptedLLM:
    """The scripted model provider, its record of calls cleared."""
    provider = scripted_llm()
    provider.calls.clear()
    return provider


async def local_embed(texts: Sequence[str]) -> list[list[float]]:
    """The default model's embeddings, as a writer's embedder is called."""
    return await embed_texts(list(texts), model=LOCAL_MODEL)


async def wait_until_blocked_by(session: AsyncSession, what: str) -> None:
    """Until another backend waits for a lock that this session's transaction holds: proof that the request
    started meanwhile is parked behind it (a race made deterministic). Fails after ~5 s."""
    for _ in range(100):
        if await session.scalar(_BLOCKED_BY_ME):
            return
        await asyncio.sleep(0.05)
    activity = (await session.execute(text(
        "SELECT pid, state, wait_event_type, wait_event, pg_blocking_pids(pid), left(query, 80) FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()"))).all()
    raise AssertionError(f"{what} never waited for this transaction's lock; other backends: {activity}")


class WriterWithoutEmbedder:
    """Stands where the write gateway stands, and decides each write as a writer does while its embedder is
    down: the write stored as failed, its outcome a 503."""

    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        async def embedder_down(_texts: list[str]) -> list[list[float]]:
            raise EmbeddingError("remote-embedder", "503 Service Unavailable: provider down")

        self._applier = WriteApplier(sessions, embedder_down, "remote-embedder")

    async def submit(self, event: MemoryWriteRequested, **_options: Any) -> MemoryWriteOutcome:
        return (await self._applier.apply(event)).outcome


def make_settings(server_urls: tuple[str, str], **overrides: Any) -> Settings:
    database_url, nats_url = server_urls
    values: dict[str, Any] = {
        "database_url": database_url,
        "nats_url": nats_url,
        "memories_admin_token": ADMIN_TOKEN,
        "memories_partitions": PARTITIONS,
        "memories_ack_wait_s": 5.0,
        "memories_write_timeout_s": 15.0,
        "memories_max_deliver": 3,
        "memories_retry_backoff_s": 0.05,
    }
    values.update(overrides)
    return Settings(**values)


@pytest.fixture(scope="session")
def settings(server_urls: tuple[str, str]) -> Settings:
    return make_settings(server_urls)


@pytest_asyncio.fixture(scope="session")
async def sessions(settings: Settings) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    assert settings.database_url
    engine = create_engine(settings.database_url, pool_size=4)
    yield session_factory(engine)
    await engine.dispose()


@pytest_asyncio.fixture(scope="session")
async def writers(settings: Settings) -> AsyncIterator[list[Writer]]:
    """Two writer replicas, both pulling every partition (JetStream serves each to one), as an operator would scale them."""
    replicas = [Writer(settings), Writer(settings)]
    for writer in replicas:
        await writer.start()
    yield replicas
    for writer in replicas:
        await writer.stop()


@pytest_asyncio.fixture(scope="session")
async def extractors(settings: Settings, writers: list[Writer]) -> AsyncIterator[list[ExtractorService]]:
    """Two extractor replicas sharing the one durable consumer."""
    replicas = [ExtractorService(settings, concurrency=4), ExtractorService(settings, concurrency=4)]
    for replica in replicas:
        await replica.start()
    yield replicas
    for replica in replicas:
        await replica.stop()


@asynccontextmanager
async def open_api(settings: Settings) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """An API app of its own (as another API process would be), with an admin client of it."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport,
            base_url="http://test/api/v1",
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            timeout=30,
        ) as client:
            yield app, client


async def open_client(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    async with open_api(settings) as (_app, client):
        yield client


@pytest_asyncio.fixture(scope="session")
async def client(settings: Settings, writers: list[Writer]) -> AsyncIterator[httpx.AsyncClient]:
    async for opened in open_client(settings):
        yield opened


@pytest_asyncio.fixture
async def project(client: httpx.AsyncClient) -> dict[str, Any]:
    response = await client.post("/projects", json={"name": "test project"})
    assert response.status_code == 201, response.text
    return response.json()


@pytest_asyncio.fixture
async def memory(client: httpx.AsyncClient, project: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(
        "/memories", json={"project_id": project["id"], "name": "Customer Preferences", "tags": ["customer", "crm"]}
    )
    assert response.status_code == 201, response.text
    return response.json()


def raw_exchange(port: int, *requests: bytes, pause: float = 0.0, quiet_s: float = 1.0) -> bytes:
    """Send raw HTTP/1.1 on one connection (`pause` seconds between the parts, so that each arrives as one
    read); everything the server answered until it closed or went quiet for `quiet_s`."""
    with socket.create_connection((LOOPBACK, port), timeout=5) as connection:
        for request in requests:
            connection.sendall(request)
            time.sleep(pause)
        answered = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            connection.settimeout(quiet_s)
            while chunk := connection.recv(65536):
                answered += chunk
    return answered


def connections_held_while_embedding(monkeypatch: pytest.MonkeyPatch, app: FastAPI, caller: ModuleType) -> list[int]:
    """How many of `app`'s pooled connections are checked out at each embedding `caller` (a module that imported
    `embed_texts`) asks for: a request must hold none over a model call, which may take seconds."""
    pool = app.state.sessions.kw["bind"].pool
    held: list[int] = []
    embed = caller.embed_texts

    async def watched(texts: list[str], **options: Any) -> list[list[float]]:
        held.append(pool.checkedout())
        return await embed(texts, **options)

    monkeypatch.setattr(caller, "embed_texts", watched)
    return held
