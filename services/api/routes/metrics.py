"""Prometheus metrics of this API process, outside /api/v1 like the health routes."""

from __future__ import annotations

from fastapi import APIRouter, Response

from shared import metrics

router = APIRouter(tags=["metrics"])


@router.get("/metrics", summary="Prometheus text exposition", include_in_schema=False)
async def prometheus_metrics() -> Response:
    return Response(metrics.render(), media_type=metrics.CONTENT_TYPE)
