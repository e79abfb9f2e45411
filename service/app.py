"""App factory: ``create_app(settings)`` wires settings, metrics, registry, data plane and routes.

Nothing happens at import. The lifespan creates the inference executor, the registry and the
data plane, and starts loading the repository in the background, so ``/health/live`` answers
at once and ``/health/ready`` turns 200 when every model found at start-up has been loaded and
warmed (or has failed, with its reason in ``/v1/models``). Run it with
``uvicorn --factory service.app:create_app`` or ``lmhead serve``.

``LMHeadApp`` is where every HTTP request enters: it records the HTTP metrics (one place, for
every route) and serves the routes whose handlers take only the bare ``Request`` (the inference
routes) straight from FastAPI's own routing table, ahead of its middleware stack and dependency
machinery: at 64 concurrent one-row clients that machinery was a fifth of a request's Python
time. Those routes answer exactly as through FastAPI (same handlers, same error mapping).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from itertools import chain
from time import perf_counter
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Match
from starlette.types import Message, Receive, Scope, Send

from service import __version__
from service.dataplane import DataPlane
from service.demo import write_demo_models
from service.metrics import Metrics
from service.poller import RepositoryPoller
from service.registry import Registry
from service.repository import model_names
from service.routes import health, native, repository, v2
from service.routes.errors import error_response, install_error_handlers
from service.routes.openapi import body_components
from service.settings import Settings

logger = logging.getLogger("lmhead")
MATCH_CACHE_SIZE = 4096
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client gone before the answer (metrics only)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the service; ``Settings()`` reads ``LMHEAD_*`` from the environment when omitted."""
    settings = settings or Settings()
    logging.getLogger("lmhead").setLevel(settings.log_level.upper())
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        executor = ThreadPoolExecutor(settings.inference_threads, thread_name_prefix="lmhead-infer")
        registry = Registry(settings, executor, metrics)
        plane = DataPlane(registry, settings, metrics)
        app.state.registry, app.state.plane = registry, plane
        rpc = None if settings.grpc_port is None else await _serve_grpc(plane, settings, metrics)
        loading = asyncio.create_task(_start(settings, registry), name="lmhead-startup-load")
        app.state.loading = loading  # awaitable by embedders and in-process tests
        background = [loading]
        if settings.control_mode == "poll":
            poller = RepositoryPoller(
                registry,
                settings.repository,
                settings.poll_interval_s,
                metrics,
                settings.model_name,
                lazy=not settings.load_at_start,
            )
            background.append(asyncio.create_task(_follow(loading, poller), name="lmhead-poll"))
        try:
            yield
        finally:
            if rpc is not None:  # HTTP has drained (uvicorn); now gRPC's calls in flight
                await rpc.stop(grace=settings.drain_timeout_s)
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await plane.close()
            await registry.close()
            executor.shutdown(wait=True, cancel_futures=True)

    app = LMHeadApp(
        metrics,
        title="lmhead",
        version=__version__,
        summary="Serve language-model heads, tied and untied.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    install_error_handlers(app)
    for module in (health, native, repository, v2):
        app.include_router(module.router)
    return app


async def _serve_grpc(plane: DataPlane, settings: Settings, metrics: Metrics) -> Any:
    """The gRPC front end (the grpc extra), imported only when a port is set."""
    try:
        from service import grpcserver
    except ImportError as error:
        raise RuntimeError(
            f"LMHEAD_GRPC_PORT needs the grpc extra (pip install '.[grpc]'): {error}"
        ) from None
    return await grpcserver.start(plane, settings, metrics)


async def _start(settings: Settings, registry: Registry) -> None:
    """Write the demo heads into an empty repository when asked, then load everything."""
    try:
        demo = (
            settings.create_demo_models and settings.model_name is None and settings.load_at_start
        )
        if demo and not model_names(settings.repository):
            written = await asyncio.to_thread(write_demo_models, settings.repository)
            logger.info("repository was empty: wrote the demo heads %s", written)
        await registry.load_all()
    except Exception as error:  # readiness must say why, not "still loading" forever
        logger.exception("start-up failed")
        registry.fail_startup(f"{type(error).__name__}: {error}")


async def _follow(loading: asyncio.Task[None], poller: RepositoryPoller) -> None:
    """Poll mode: once start-up loading is done, follow the repository until shutdown."""
    await loading
    await poller.prime()
    await poller.run()


class LMHeadApp(FastAPI):
    """FastAPI with one entry for every request: HTTP metrics, and raw routes served directly."""

    def __init__(self, metrics: Metrics, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.metrics = metrics
        self._routers: list[APIRouter] = []
        self._raw_routes: list[APIRoute] | None = None
        self._matched: dict[str, tuple[APIRoute | None, dict[str, Any]]] = {}

    def include_router(self, router: APIRouter, *args: Any, **kwargs: Any) -> None:
        """Include as FastAPI does, and remember the router: its routes are the table the raw
        dispatch matches against (newer FastAPI keeps included routes behind a wrapper)."""
        if args or kwargs.get("prefix"):
            raise ValueError("include lmhead routers without a prefix: their paths are final")
        super().include_router(router, **kwargs)
        self._routers.append(router)
        self._raw_routes = None
        self._matched.clear()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self
        started = perf_counter()
        route = self._raw_route(scope)
        if route is not None:  # the hot path: the response object itself has the status
            status = await _serve_raw(route, scope, receive, send)
            self.metrics.observe_http(route.path, status, perf_counter() - started)
            return
        status, answered = 500, False

        async def observe(message: Message) -> None:
            nonlocal status, answered
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                answered = True
            await send(message)

        try:
            await super().__call__(scope, receive, observe)
        except Exception:
            # Starlette re-raises a handled error after its 500 went out (logged by our
            # handler); passed on, the server would drop a keep-alive connection that is
            # still good. Only an error before a complete answer goes on up.
            if not answered:
                raise
        finally:
            route_seen = scope.get("route")
            endpoint = route_seen.path if isinstance(route_seen, APIRoute) else "unmatched"
            self.metrics.observe_http(endpoint, status, perf_counter() - started)

    def openapi(self) -> dict[str, Any]:
        """FastAPI's document plus the request bodies that raw-request handlers parse."""
        if self.openapi_schema is None:
            document = super().openapi()
            document.setdefault("components", {}).setdefault("schemas", {}).update(
                body_components()
            )
        return self.openapi_schema or {}

    def _raw_route(self, scope: Scope) -> APIRoute | None:
        """The raw-request route matching this request, if any (FastAPI's own matching).

        Matches are remembered by path (a few hundred paths in practice, bounded anyway):
        matching against the table cost ~8 us per request.
        """
        if scope["method"] != "POST":
            return None
        path = scope["path"]
        known = self._matched.get(path)
        if known is None:
            known = self._match(scope)
            if len(self._matched) >= MATCH_CACHE_SIZE:
                self._matched.clear()
            self._matched[path] = known
        route, child = known
        if route is not None:
            scope.update(child)
            scope["path_params"] = dict(child["path_params"])  # the cached one stays pristine
        return route

    def _match(self, scope: Scope) -> tuple[APIRoute | None, dict[str, Any]]:
        if self._raw_routes is None:
            routes = chain(self.router.routes, *(router.routes for router in self._routers))
            self._raw_routes = [
                route
                for route in routes
                if isinstance(route, APIRoute)
                and "POST" in (route.methods or ())
                and _takes_only_request(route)
            ]
        for route in self._raw_routes:
            match, child = route.matches(scope)
            if match is Match.FULL:
                return route, dict(child)
        return None, {}


def _takes_only_request(route: APIRoute) -> bool:
    """Routes whose handler needs nothing from FastAPI: no parameters, body or dependencies."""
    dependant = route.dependant
    return dependant.request_param_name is not None and not (
        dependant.path_params
        or dependant.query_params
        or dependant.header_params
        or dependant.cookie_params
        or dependant.body_params
        or dependant.dependencies
    )


async def _serve_raw(route: APIRoute, scope: Scope, receive: Receive, send: Send) -> int:
    """Call the handler, map any error as FastAPI's handlers do, send; return the status."""
    request = Request(scope, receive)
    with scope["app"].state.plane.admit():  # the request's memory, held until it is sent
        try:
            response: Response = await route.endpoint(request)
        except ClientDisconnect:
            return CLIENT_CLOSED_REQUEST  # nobody to answer; not an error of ours
        except Exception as error:
            response = error_response(request, error)
        await response(scope, receive, send)
    return response.status_code
