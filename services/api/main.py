"""The REST API: gathers the routers and owns the process's connections."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute

from services.api import errors
from services.api.keys import LiveKeys
from services.api.limits import BodySizeLimit
from services.api.observed import HeadAsGet, ResponseCounter
from services.api.owners import MemoryOwners
from services.api.routes import (
    agents,
    api_keys,
    entries,
    generations,
    health,
    knowledge,
    memories,
    metrics,
    projects,
    provenance,
    providers,
    writes,
)
from shared import bus, bus_connection
from shared import metrics as service_metrics
from shared.db.session import create_engine, session_factory
from shared.embeddings import EmbeddingError, preload
from shared.lifecycle import freeze_long_lived_objects
from shared.settings import Settings
from shared.write_gateway import WriteGateway

log = logging.getLogger("memories.api")

API_PREFIX = "/api/v1"
MAX_BODY_BYTES = 256 * 1024


def operation_id(route: APIRoute) -> str:
    """The route's function name in camelCase (each is unique: a test says so)."""
    first, *rest = route.name.split("_")
    return first + "".join(word.capitalize() for word in rest)


def create_app(settings: Settings) -> FastAPI:
    service_metrics.reserve_model_labels(settings.embedding_model, settings.memories_merge_model)
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        assert settings.database_url and settings.nats_url, "resolve the servers before building the app"
        # litellm's imports and the in-process model: seconds that the first search or edit would otherwise spend
        # on the event loop, every other request of the process (health probes too) waiting behind them.
        try:
            await asyncio.to_thread(preload, settings.embedding_model)
        except EmbeddingError as exc:  # what needs no embedding still serves
            log.error("%s: searches and edits of content answer 503", exc)
        # No ping per checkout (a round trip on each of a write's two): after a database restart the first
        # query on a dropped connection fails (503) and invalidates the whole pool, so the next one reconnects.
        # A request waits for a memory's lock (a writer deciding, maybe with a slow model) no longer than for a
        # write, and is then told to retry: a 503, not a connection held for minutes.
        engine = create_engine(settings.database_url, pre_ping=False, lock_timeout_s=settings.memories_write_timeout_s)
        # /readyz's own. It pings before its statement: without, the first probe after a database restart failed on
        # the connection the restart had dropped (the suite's fault tests caught it), a flap of readiness for nothing.
        app.state.probe_engine = create_engine(settings.database_url, pool_size=1, max_overflow=0)
        nc = await bus_connection.connect(settings.nats_url, name="memories-api", settings=settings)
        await bus.ensure_layout(nc.jetstream(), settings, bus.Role.API)
        sessions = session_factory(engine)
        memory_owners = MemoryOwners()
        # A memory deleted through another API process: forgotten here once a writer finds it gone.
        gateway = WriteGateway(nc, sessions, settings.memories_partitions, on_memory_gone=memory_owners.forget)
        await gateway.start()
        app.state.settings = settings
        app.state.admin_token = settings.memories_admin_token
        if not settings.memories_admin_token:
            log.warning(
                "no MEMORIES_ADMIN_TOKEN: the admin routes (projects, API keys, AI providers, model routes, usage) "
                "answer 401 to every token"
            )
        app.state.sessions = sessions
        app.state.read_sessions = session_factory(engine.execution_options(isolation_level="AUTOCOMMIT"))
        app.state.nats = nc
        app.state.announcing = set()  # change events on their way (routes/entries.py), waited for at shutdown
        app.state.gateway = gateway
        app.state.memory_owners = memory_owners
        app.state.live_keys = LiveKeys(nc, settings.memories_api_key_cache_s)
        await app.state.live_keys.start()
        # Every consumer of the layout, whichever replicas run: the backlog of a partition range whose writer is
        # down shows here too (each writer reports only its own).
        every_consumer = service_metrics.writer_consumers(settings) + service_metrics.queue_consumers(settings)
        lag_poller = asyncio.create_task(
            service_metrics.run_lag_poller(nc.jetstream(), every_consumer), name="api-lag-poller"
        )
        freeze_long_lived_objects()
        try:
            yield
        finally:
            lag_poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await lag_poller
            if app.state.announcing:
                await asyncio.wait(app.state.announcing, timeout=bus.PUBLISH_TIMEOUT_S)
            if not nc.is_closed:  # closed for good by the server: nothing to drain
                await nc.drain()
            await engine.dispose()
            await app.state.probe_engine.dispose()

    app = FastAPI(
        title="Memories",
        version="0.1.0",
        description="Named memories of deduplicated, embedded facts for AI agents. See docs/api.md.",
        lifespan=lifespan,
        # A path with a trailing slash is a 404 in the error envelope, not a bare 307 to an address built from
        # the request's Host header.
        redirect_slashes=False,
        # `createMemory`, not `create_memory_api_v1_memories_post`: the method names of a client generated from it.
        generate_unique_id_function=operation_id,
    )
    errors.install(app)
    app.add_middleware(BodySizeLimit, max_bytes=MAX_BODY_BYTES)
    app.add_middleware(HeadAsGet)  # every layer within sees a GET
    app.add_middleware(ResponseCounter)  # outermost of ours: counts the body limit's 413s too, and a HEAD as one
    api = APIRouter(prefix=API_PREFIX)
    for module in (projects, api_keys, memories, entries, writes, knowledge, agents, generations, provenance, providers):
        api.include_router(module.router)
    app.include_router(api)
    app.include_router(health.router)
    app.include_router(metrics.router)
    errors.document_errors(app, API_PREFIX)
    return app
