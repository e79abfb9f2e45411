"""The inference routes without the framework's per-request machinery.

``POST /v1/models/{name}[/versions/{v}]/topk|logits|embed`` are the hot path: at 64 concurrent
one-row clients the server spends its time in HTTP handling, and FastAPI's router, dependency
solving and exception middleware measured ~0.4 ms of the ~1.1 ms a one-row request costs here.
This ASGI middleware matches those paths with one regex and calls the very same handlers
(``service.routes.native``) with a Starlette ``Request``, and maps errors with the same
``error_response``. Everything else, and these routes' OpenAPI entries, stay with FastAPI.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from service.errors import error_response
from service.routes import native

ROUTE = re.compile(r"^/v1/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?/(?P<op>\w+)$")
Handler = Callable[[Request], Awaitable[Response]]
HANDLERS: dict[str, Handler] = {
    "topk": native.topk,
    "logits": native.logits,
    "embed": native.embed,
}


class _Route:
    """What the request-metrics middleware reads from ``scope["route"]``."""

    def __init__(self, path: str) -> None:
        self.path = path


ROUTES = {
    (op, versioned): _Route(
        "/v1/models/{name}" + ("/versions/{version}" if versioned else "") + f"/{op}"
    )
    for op in HANDLERS
    for versioned in (False, True)
}


class InferenceFastPath:
    """Pure ASGI middleware: serve the three inference routes directly."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = None
        if scope["type"] == "http" and scope["method"] == "POST":
            match = ROUTE.match(scope["path"])
        handler = HANDLERS.get(match["op"]) if match else None
        if match is None or handler is None:
            await self.app(scope, receive, send)
            return
        params = {"name": match["name"]}
        if match["version"] is not None:
            params["version"] = match["version"]
        scope["path_params"] = params
        scope["route"] = ROUTES[(match["op"], match["version"] is not None)]
        request = Request(scope, receive)
        try:
            response = await handler(request)
        except Exception as error:  # mapped exactly as FastAPI's handlers map it
            response = error_response(request, error)
        await response(scope, receive, send)
