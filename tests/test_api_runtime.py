"""How the API spends a request: no dependency in the thread pool, reads without a transaction."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import httpx
from fastapi import FastAPI
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from psycopg.pq import TransactionStatus
from sqlalchemy import text
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from services.api import errors
from services.api.main import create_app
from shared import repository as repo
from shared.settings import Settings
from tests.conftest import open_api


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
