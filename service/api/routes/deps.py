"""Typed FastAPI dependencies: what routes may reach, wired by the app factory.

They are ``async def`` on purpose: FastAPI runs plain ``def`` dependencies in a thread pool,
two thread hops per request for nothing. Handlers that take the bare ``Request`` (served
ahead of FastAPI) use ``plane_of`` and ``body_limit`` instead.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from starlette.requests import Request as StarletteRequest

from service.metrics import Metrics
from service.plane.protocol import Plane
from service.settings import Settings


def plane_of(request: StarletteRequest) -> Plane:
    plane: Plane = request.app.state.plane
    return plane


def body_limit(request: StarletteRequest) -> int:
    settings: Settings = request.app.state.settings
    return settings.max_body_bytes


async def _plane(request: Request) -> Plane:
    return plane_of(request)


async def _metrics(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


PlaneDep = Annotated[Plane, Depends(_plane)]
MetricsDep = Annotated[Metrics, Depends(_metrics)]
