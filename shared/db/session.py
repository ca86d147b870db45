"""Engine and session factory. The edge (a route or a handler) owns the transaction; services never commit."""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import psycopg
from pgvector.psycopg.vector import register_vector_info
from psycopg.types import TypeInfo
from sqlalchemy import event, make_url, text
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

from shared.settings import ConfiguredUnlike

log = logging.getLogger("memories.db")

# A dead server must surface as an error quickly (a 503, a write waited out and retried), not hang. libpq's TCP
# settings bound a wait on a server whose host vanished without closing the connection (a failover, a dropped
# route): with the kernel's defaults a statement waiting for its answer would wait about two hours for the
# first keepalive probe, and a writer would keep its partitions (and their pins) the whole time. Here it is
# given up after ~45 s, as a hung NATS server is (shared.bus_connection.connect).
CONNECTION_DEFAULTS: dict[str, int] = {
    "connect_timeout": 5,
    "keepalives": 1,
    "keepalives_idle": 15,
    "keepalives_interval": 5,
    "keepalives_count": 6,
    "tcp_user_timeout": 45_000,  # ms: data sent and never acknowledged
}


def create_engine(
    database_url: str,
    *,
    pool_size: int = 24,
    max_overflow: int = 8,
    pre_ping: bool = True,
    lock_timeout_s: float | None = None,
) -> AsyncEngine:
    """`pool_size` should cover the usual concurrency: a connection beyond it is opened and closed per use,
    and a new PostgreSQL backend costs more than the queries it runs. `pre_ping` costs a round trip per
    checkout; a consumer whose failed message is redelivered anyway can do without it. `lock_timeout_s`:
    how long a statement may wait for a lock before it fails (SQLSTATE 55P03); unset, for as long as it takes."""
    url = make_url(database_url)
    engine = create_async_engine(
        url,
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_pre_ping=pre_ping,
        # A failed statement's error (logged, with its trace) would list its parameters: tenants' facts, a
        # turn's extracted facts, embeddings. The statement and the server's message say what went wrong.
        hide_parameters=True,
        # What the URL sets itself is kept: an operator's choice for their network.
        connect_args={name: value for name, value in CONNECTION_DEFAULTS.items() if name not in url.query},
    )
    settings = ["SET hnsw.iterative_scan = strict_order"]
    if lock_timeout_s is not None:
        settings.append(f"SET lock_timeout = {max(1, round(lock_timeout_s * 1000))}")
    event.listen(engine.sync_engine, "connect", partial(_configure_connection, settings=settings))
    return engine


def _configure_connection(dbapi_connection: Any, _record: Any, *, settings: list[str]) -> None:
    dbapi_connection.run_async(_register_vector_type)
    # Filtered nearest-neighbour queries keep scanning the HNSW index until enough rows pass the filter, in
    # exact distance order (strict): the dedup lookup takes the first row as the nearest
    # (pgvector 0.8). Set once per connection rather than per query: one round trip less on the hot path.
    # (Statements, not libpq's `options` at connect, which a PgBouncer in front may refuse.)
    cursor = dbapi_connection.cursor()
    for statement in settings:
        cursor.execute(statement)
    cursor.close()
    dbapi_connection.commit()


async def _register_vector_type(connection: psycopg.AsyncConnection[Any]) -> None:
    """Let psycopg send a numpy array as a pgvector `vector` in binary form (`models.BinaryVector`)."""
    info = await TypeInfo.fetch(connection, "vector")
    if info is not None:  # None before the first migration has created the extension
        register_vector_info(connection, info)


class _Session(AsyncSession):
    async def close(self) -> None:
        # Closing rolls back; on a connection the server dropped (a restart) that raises, and from the API's
        # session dependency it would surface after the response started: a dropped connection, not a 503.
        # Nothing is left to roll back on a dead connection, so it is discarded instead.
        try:
            await super().close()
        except DBAPIError as exc:
            if not exc.connection_invalidated:
                raise
            await self.invalidate()


def session_factory(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False, class_=_Session)


class DimensionMismatch(ConfiguredUnlike):
    """EMBEDDING_DIMENSIONS unlike the stored vectors': every write would fail (and be dead-lettered)."""


# pgvector keeps a vector column's dimension as its type modifier; no row before the first migration.
_STORED_DIMENSIONS = text(
    "SELECT atttypmod FROM pg_attribute WHERE attrelid = to_regclass('memory_entries') AND attname = 'embedding'"
)


async def check_embedding_dimensions(engine: AsyncEngine, dimensions: int) -> None:
    """Raises DimensionMismatch unless the stored vectors have `dimensions` (or nothing is migrated yet). A database
    that cannot be reached now is not checked: a service starts all the same and waits for it, as it would later."""
    try:
        async with engine.connect() as connection:
            stored = await connection.scalar(_STORED_DIMENSIONS)
    except (OperationalError, OSError) as exc:
        log.warning("the stored vectors' dimension could not be checked: %s", str(exc).splitlines()[0])
        return
    if stored is not None and stored > 0 and stored != dimensions:
        raise DimensionMismatch(
            f"EMBEDDING_DIMENSIONS is {dimensions} here, but the database stores vectors of {stored} dimensions "
            "(fixed by its first migration): configure the model and dimensions it was created with"
        )
