"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from service.errors import ModelNotReady
from service.routes.deps import MetricsDep, RegistryDep

router = APIRouter(tags=["health"])


@router.get("/health/live")
async def live() -> dict[str, str]:
    """200 as soon as the process serves HTTP."""
    return {"status": "live"}


@router.get("/health/ready")
async def ready(registry: RegistryDep) -> dict[str, object]:
    """200 once every model found at start-up was loaded and warmed (or failed); 503 before."""
    if not registry.ready:
        raise ModelNotReady("models are still loading")
    return {"status": "ready", "models": {r.name: r.state.value for r in registry.records()}}


@router.get("/metrics")
async def metrics(collectors: MetricsDep) -> Response:
    return Response(collectors.render(), media_type=CONTENT_TYPE_LATEST)
