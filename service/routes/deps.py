"""Typed FastAPI dependencies: what routes may reach, wired by the app factory.

They are ``async def`` on purpose: FastAPI runs plain ``def`` dependencies in a thread pool,
two thread hops per request for nothing.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from service.metrics import Metrics
from service.registry import Registry
from service.settings import Settings


async def _registry(request: Request) -> Registry:
    registry: Registry = request.app.state.registry
    return registry


async def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def _metrics(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


RegistryDep = Annotated[Registry, Depends(_registry)]
SettingsDep = Annotated[Settings, Depends(_settings)]
MetricsDep = Annotated[Metrics, Depends(_metrics)]
