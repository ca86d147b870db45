"""Liveness and readiness."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import text

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="The process is alive")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


PROBE_TIMEOUT_S = 2.0
"""Within a probe's timeout (deploy/k8s: 3 s): a database that does not answer by then is unavailable."""


@router.get(
    "/readyz",
    summary="The database is reachable",
    description=(
        "200 while the database answers, 503 otherwise. The bus is reported, not required: without it writes answer "
        "503, while reads and searches go on; every replica shares one bus, so an outage of it would otherwise take "
        "every replica out of its load balancer at once, reads included."
    ),
    responses={503: {"description": "The database does not answer"}},
)
async def readyz(request: Request) -> JSONResponse:
    checks: dict[str, str] = {}
    try:
        # On a connection of its own: requests holding every pooled connection (edits waiting for a memory's lock)
        # made the probe wait for one, and fail, and every replica under the same load left the load balancer.
        async with asyncio.timeout(PROBE_TIMEOUT_S), request.app.state.probe_engine.connect() as connection:
            await connection.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:  # noqa: BLE001 - any failure means not ready
        checks["database"] = f"unavailable: {type(exc).__name__}"
    checks["bus"] = "ok" if request.app.state.nats.is_connected else "unavailable"
    if checks["database"] != "ok":
        return JSONResponse({"status": "unavailable", "checks": checks}, 503)
    return JSONResponse({"status": "ready" if checks["bus"] == "ok" else "degraded", "checks": checks}, 200)
