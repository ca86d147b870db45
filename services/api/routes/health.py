"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import text

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="The process is alive")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", summary="The database and the bus are reachable")
async def readyz(request: Request) -> JSONResponse:
    checks: dict[str, str] = {}
    try:
        async with request.app.state.sessions() as session:
            await session.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:  # noqa: BLE001 - any failure means not ready
        checks["database"] = f"unavailable: {type(exc).__name__}"
    checks["bus"] = "ok" if request.app.state.nats.is_connected else "unavailable"
    ready = all(value == "ok" for value in checks.values())
    return JSONResponse({"status": "ready" if ready else "unavailable", "checks": checks}, 200 if ready else 503)
