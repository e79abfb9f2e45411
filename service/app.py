"""App factory: ``create_app(settings)`` wires settings, metrics, registry and routes.

Nothing happens at import. The lifespan creates the inference executor and the registry, and
starts loading the repository in the background, so ``/health/live`` answers at once and
``/health/ready`` turns 200 when every model found at start-up has been loaded and warmed
(or has failed, with its reason in ``/v1/models``). Run it with
``uvicorn --factory service.app:create_app`` or ``lmhead serve``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service import __version__
from service.errors import install_error_handlers
from service.metrics import Metrics
from service.poller import RepositoryPoller
from service.registry import Registry
from service.routes import contrast, health, native, repository, v2
from service.routes.fastpath import InferenceFastPath, known_model
from service.settings import Settings
from service.shadow import ShadowTraffic

logger = logging.getLogger("lmhead")


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the service; ``Settings()`` reads ``LMHEAD_*`` from the environment when omitted."""
    settings = settings or Settings()
    logging.getLogger("lmhead").setLevel(settings.log_level.upper())
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        executor = ThreadPoolExecutor(settings.inference_threads, thread_name_prefix="lmhead-infer")
        registry = Registry(settings, executor, metrics)
        app.state.registry = registry
        shadow = ShadowTraffic(registry, metrics, settings.shadow_max_pending)
        app.state.shadow = shadow
        loading = asyncio.create_task(registry.load_all(), name="lmhead-startup-load")
        app.state.loading = loading  # awaitable by embedders and in-process tests
        background = [loading]
        if settings.control_mode == "poll":
            poller = RepositoryPoller(
                registry, settings.repository, settings.poll_interval_s, metrics
            )
            background.append(asyncio.create_task(_follow(loading, poller), name="lmhead-poll"))
        try:
            yield
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await shadow.close()
            await registry.close()
            executor.shutdown(wait=True, cancel_futures=True)

    app = LMHeadApp(
        InferenceFastPath(metrics),
        title="lmhead",
        version=__version__,
        summary="Serve language-model heads, tied and untied.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(native.router)
    app.include_router(contrast.router)
    app.include_router(repository.router)
    app.include_router(v2.router)
    app.add_middleware(RequestMetrics, metrics=metrics)
    return app


async def _follow(loading: asyncio.Task[None], poller: RepositoryPoller) -> None:
    """Poll mode: once start-up loading is done, follow the repository until shutdown."""
    await loading
    await poller.prime()
    await poller.run()


class LMHeadApp(FastAPI):
    """FastAPI whose inference routes are served before its middleware stack (see fastpath)."""

    def __init__(self, fast_path: InferenceFastPath, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fast_path = fast_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope["app"] = self
        if not await self.fast_path.serve(scope, receive, send):
            await super().__call__(scope, receive, send)


class RequestMetrics:
    """Pure ASGI middleware: count and time requests by route, model, version and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status, version = 500, ""

        async def observe(message: Message) -> None:
            nonlocal status, version
            if message["type"] == "http.response.start":
                status = message["status"]
                for key, value in message.get("headers", ()):
                    if key == b"x-lmhead-version":
                        version = value.decode()
            await send(message)

        try:
            await self.app(scope, receive, observe)
        finally:
            self._record(scope, status, version, time.perf_counter() - started)

    def _record(self, scope: Scope, status: int, version: str, seconds: float) -> None:
        route = scope.get("route")
        endpoint = getattr(route, "path", "unmatched")
        name = scope.get("path_params", {}).get("name", "")
        self.metrics.observe_request(known_model(scope, name), version, endpoint, status, seconds)
