"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from service.api.routes.deps import MetricsDep, PlaneDep
from service.api.routes.openapi import errors

router = APIRouter(tags=["health"])


class PrometheusText(Response):
    media_type = CONTENT_TYPE_LATEST


@router.get("/health/live")
async def live() -> dict[str, str]:
    """200 as soon as the process serves HTTP."""
    return {"status": "live"}


@router.get("/health/ready", responses=errors(503))
async def ready(plane: PlaneDep) -> dict[str, object]:
    """200 once every model found at start-up was loaded and warmed (or failed), unless every
    one failed; 503 before, and then."""
    await plane.check_ready()
    models = {status.name: status.state for status in await plane.models()}
    if not models:  # ready (models may be added), but say it: nothing is served yet
        return {"status": "ready", "models": models, "warning": "the repository has no models"}
    return {"status": "ready", "models": models}


@router.get(
    "/metrics",
    response_class=PrometheusText,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}},
)
async def metrics(collectors: MetricsDep) -> Response:
    """Prometheus text exposition of every lmhead collector."""
    return PrometheusText(collectors.render())
