"""App factory: ``create_app(settings)`` wires settings, metrics, registry, data plane and routes.

Nothing happens at import. The lifespan starts the engine (``service.hosting.engine``: executor,
registry, data plane) and its loading in the background, or, in a front process of
``LMHEAD_WORKERS`` > 1, connects to the engine process instead; so ``/health/live`` answers
at once and ``/health/ready`` turns 200 when every model found at start-up has been loaded and
warmed (or has failed, with its reason in ``/v1/models``). Run it with
``uvicorn --factory service.hosting.app:create_app`` or ``lmhead serve``.

``LMHeadApp`` is where every HTTP request enters: it records the HTTP metrics (one place, for
every route) and serves the routes whose handlers take only the bare ``Request`` (the inference
routes) straight from FastAPI's own routing table, ahead of its middleware stack and dependency
machinery: at 64 concurrent one-row clients that machinery was a fifth of a request's Python
time. Those routes answer exactly as through FastAPI (same handlers, same error mapping).
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from itertools import chain
from time import perf_counter
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Match
from starlette.types import Message, Receive, Scope, Send

from service import __version__
from service.api.codec.wire import header
from service.api.routes import admin, docs_ui, health, native, v2
from service.api.routes.error_handlers import error_response, install_error_handlers
from service.api.routes.openapi import body_components
from service.errors import HostNotAllowed
from service.hosting.hangups import Hangup
from service.metrics import Metrics
from service.plane.protocol import Plane
from service.settings import Settings

logger = logging.getLogger("lmhead")
MATCH_CACHE_SIZE = 4096
#: Longer paths are matched each time (a model name has at most 128 characters).
MATCH_CACHE_PATH_CHARS = 256
#: Host names the app matches itself; any other goes through Starlette's middleware.
PLAIN_HOST = re.compile(r"[a-z0-9][a-z0-9.-]*")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client gone before the answer (metrics only)


def create_app(
    settings: Settings | None = None,
    *,
    front: Callable[[], AbstractAsyncContextManager[Plane]] | None = None,
) -> FastAPI:
    """Build the service; ``Settings()`` reads ``LMHEAD_*`` from the environment when omitted.

    With ``front`` the app is a front process of ``LMHEAD_WORKERS``: ``front()`` opens its
    data plane, which forwards every call to the engine process (``service.hosting.split``);
    without, the engine runs in this process.
    """
    settings = settings or Settings()
    logging.getLogger("lmhead").setLevel(settings.log_level.upper())
    metrics = Metrics(multiprocess=front is not None)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            if front is None:
                from service.hosting.engine import (
                    running_engine,  # a front never imports onnxruntime
                )

                engine = await stack.enter_async_context(running_engine(settings, metrics))
                app.state.registry, app.state.plane = engine.registry, engine.plane
                app.state.loading = engine.loading  # awaitable by embedders and tests
            else:
                app.state.plane = await stack.enter_async_context(front())
            if settings.grpc_port is not None:
                rpc = await _serve_grpc(app.state.plane, settings, metrics)
                # HTTP has drained (uvicorn); now gRPC's calls in flight, before the engine
                stack.push_async_callback(rpc.stop, grace=settings.drain_timeout_s)
            yield

    app = LMHeadApp(
        metrics,
        settings.trusted_hosts,
        title="lmhead",
        version=__version__,
        summary="Serve language-model heads, tied and untied.",
        lifespan=lifespan,
        redirect_slashes=False,  # a 307 to the client's Host for a trailing slash: a 404 here
        docs_url=None,  # FastAPI's pages load their assets from a CDN: routes.docs_ui's do not
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    install_error_handlers(app)
    for module in (health, native, admin, v2, docs_ui):
        app.include_router(module.router)
    return app


async def _serve_grpc(plane: Plane, settings: Settings, metrics: Metrics) -> Any:
    """The gRPC front end (the grpc extra), imported only when a port is set."""
    try:
        from service.api import grpc_server
    except ImportError as error:
        raise RuntimeError(
            f"LMHEAD_GRPC_PORT needs the grpc extra (pip install '.[grpc]'): {error}"
        ) from None
    return await grpc_server.start(plane, settings, metrics)


class LMHeadApp(FastAPI):
    """FastAPI with one entry for every request: HTTP metrics, and raw routes served directly."""

    def __init__(self, metrics: Metrics, trusted_hosts: list[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.metrics = metrics
        #: Starlette's check of the Host header, ahead of everything (the raw routes too).
        self._any_host = "*" in trusted_hosts
        self._trusted = trusted_hosts
        #: Names matched as they are (Starlette's first test), without building its middleware's
        #: ``Headers``; others (``*.domain``, refusals) go through the middleware itself.
        self._exact_hosts = {
            name.encode("latin-1") for name in trusted_hosts if PLAIN_HOST.fullmatch(name)
        }
        self._host_check = TrustedHostMiddleware(
            self._trusted_host, allowed_hosts=trusted_hosts, www_redirect=False
        )
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
        if scope["type"] != "http" or self._any_host or self._exact_host(scope):
            await self._dispatch(scope, receive, send)
            return
        scope["lmhead.send"] = send  # the answer's way out once the Host is trusted
        await self._host_check(scope, receive, self._refuse_host(scope, send))

    def _exact_host(self, scope: Scope) -> bool:
        """The first Host header (``Headers.get``) is one of the plain names, with a port or
        without: what the middleware accepts first."""
        for name, value in scope["headers"]:
            if name == b"host":
                host, colon, port = value.partition(b":")
                return host in self._exact_hosts and (not colon or port.isdigit())
        return False

    async def _trusted_host(self, scope: Scope, receive: Receive, _: Send) -> None:
        await self._dispatch(scope, receive, scope["lmhead.send"])

    def _refuse_host(self, scope: Scope, send: Send) -> Send:
        """Starlette's refusal of an untrusted Host, answered as lmhead's JSON error instead
        of its plain text (its own answer is swallowed)."""

        async def refuse(message: Message) -> None:
            if message["type"] != "http.response.start":
                return
            host = (header(Request(scope), b"host") or "")[:64]
            self.metrics.refused(HostNotAllowed.code)
            error = HostNotAllowed(
                f"Host {host!r} is not a name this service answers to; expected one of "
                f"{', '.join(self._trusted)} (LMHEAD_ALLOWED_HOSTS adds names)"
            )
            await error_response(Request(scope), error)(scope, _no_body, send)

        return refuse

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        if scope["method"] == "HEAD":  # a GET whose body the server drops (RFC 9110 9.3.2)
            scope = {**scope, "method": "GET"}
        scope["app"] = self
        started = perf_counter()
        route = self._raw_route(scope)
        if route is not None:  # the hot path: the response object itself has the status
            await self._serve_raw(route, scope, receive, send, started)
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

    async def _serve_raw(
        self, route: APIRoute, scope: Scope, receive: Receive, send: Send, started: float
    ) -> None:
        """Call the handler, map any error as FastAPI's handlers do, send, record the status
        and time (once answered, before the client has read it); the request's memory is held
        until the answer has left (``service.hosting.connection``)."""
        hangup = Hangup(receive, scope.get("lmhead.on_lost"))  # a client gone stops it
        request = Request(scope, hangup.receive)
        with self.state.plane.admit():  # the request's memory, held until it is sent
            try:
                response: Response = await hangup.run(route.endpoint(request))
            except ClientDisconnect:  # nobody to answer; not an error of ours
                self.metrics.observe_http(
                    route.path, CLIENT_CLOSED_REQUEST, perf_counter() - started
                )
                return
            except Exception as error:
                response = error_response(request, error)
            await response(scope, receive, send)
            self.metrics.observe_http(route.path, response.status_code, perf_counter() - started)
            sent = scope.get("lmhead.sent")
            if sent is not None:
                await sent()

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
            if len(path) <= MATCH_CACHE_PATH_CHARS:  # 4096 paths of 32 KB names held 265 MB
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


async def _no_body() -> Message:
    """``receive`` for an answer sent without reading the request (nothing is read)."""
    return {"type": "http.disconnect"}


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
