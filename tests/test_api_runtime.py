"""How the API spends a request: no dependency in the thread pool, reads without a transaction."""

from __future__ import annotations

import inspect
from typing import Any

from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from psycopg.pq import TransactionStatus
from sqlalchemy import text

from services.api.main import create_app
from shared.settings import Settings


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
