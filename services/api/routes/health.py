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


@router.get("/readyz", summary="The database and the bus are reachable")
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
    ready = all(value == "ok" for value in checks.values())
    return JSONResponse({"status": "ready" if ready else "unavailable", "checks": checks}, 200 if ready else 503)
