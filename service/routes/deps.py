"""Typed FastAPI dependencies: what routes may reach, wired by the app factory.

They are ``async def`` on purpose: FastAPI runs plain ``def`` dependencies in a thread pool,
two thread hops per request for nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

from fastapi import Depends, Request

from service.errors import InvalidInput
from service.metrics import Metrics
from service.model import LoadedVersion
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


def target_version(request: Request) -> tuple[LoadedVersion, Settings]:
    """The model version a request addresses (path or ``?version=``), and the settings.

    Routes that run the model use ``leased_version``, which takes the lease right away.
    """
    state = request.app.state
    registry: Registry = state.registry
    raw = request.path_params.get("version")
    if raw is None and request.scope["query_string"]:  # parsing an empty query costs ~10 us
        raw = request.query_params.get("version")
    if raw is not None and not raw.isdigit():
        raise InvalidInput(f"version must be a non-negative integer, got {raw[:32]!r}")
    model = registry.get(request.path_params["name"], None if raw is None else int(raw))
    return model, state.settings


@contextmanager
def leased_version(request: Request) -> Iterator[tuple[LoadedVersion, Settings]]:
    """``target_version`` with the lease taken at once, held for the ``with`` block.

    The one place that pairs lookup and lease: no ``await`` can slip between them, so a
    concurrent swap never releases a version a request was already given.
    """
    model, settings = target_version(request)
    with model.lease():
        yield model, settings
