"""The inference routes served ahead of the framework's per-request machinery.

``POST /v1/models/{name}[/versions/{v}]/topk|logits|embed`` are the hot path: at 64 concurrent
one-row clients the server spends its time in HTTP handling, not in onnxruntime. FastAPI runs
every request through its telemetry check, ``ServerErrorMiddleware``, the telemetry and body
limit middlewares, the exception middleware and the router before a handler starts; measured
here that was a fifth of a one-row request's Python time. ``InferenceFastPath.serve`` matches
these paths with one regex, calls the very same handlers (``service.routes.native``) with a
Starlette ``Request``, maps errors with the same ``error_response``, and records the same
request metrics. It is called by the app itself before anything else (``service.app``);
everything else, and these routes' OpenAPI entries, stay with FastAPI. One consequence:
FastAPI's built-in OpenTelemetry instrumentation does not see these three routes; their
counts and latencies are in ``/metrics``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from service.errors import error_response
from service.metrics import Metrics
from service.routes import native

ROUTE = re.compile(r"^/v1/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?/(?P<op>\w+)$")
Handler = Callable[[Request], Awaitable[Response]]
HANDLERS: dict[str, Handler] = {
    "topk": native.topk,
    "logits": native.logits,
    "embed": native.embed,
}


ENDPOINTS = {  # the metrics label: the path template, as FastAPI's routes report it
    (op, versioned): "/v1/models/{name}" + ("/versions/{version}" if versioned else "") + f"/{op}"
    for op in HANDLERS
    for versioned in (False, True)
}


class InferenceFastPath:
    """Serve the three inference routes directly; ``serve`` says whether it took the request."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> bool:
        if scope["type"] != "http" or scope["method"] != "POST":
            return False
        match = ROUTE.match(scope["path"])
        handler = HANDLERS.get(match["op"]) if match else None
        if match is None or handler is None:
            return False
        started = time.perf_counter()
        params = {"name": match["name"]}
        if match["version"] is not None:
            params["version"] = match["version"]
        scope["path_params"] = params
        endpoint = ENDPOINTS[(match["op"], match["version"] is not None)]
        request = Request(scope, receive)
        try:
            response = await handler(request)
        except Exception as error:  # mapped exactly as FastAPI's handlers map it
            response = error_response(request, error)
        try:
            await response(scope, receive, send)
        finally:
            self.metrics.observe_request(
                known_model(scope, params["name"]),
                response.headers.get("x-lmhead-version", ""),
                endpoint,
                response.status_code,
                time.perf_counter() - started,
            )
        return True


def known_model(scope: Scope, name: str) -> str:
    """The model label for metrics: only known names, so unknown ones cannot grow the series."""
    registry = getattr(scope["app"].state, "registry", None)
    return name if registry is not None and registry.knows(name) else ""
