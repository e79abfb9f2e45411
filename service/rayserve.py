"""lmhead as a Ray Serve application: the same app (native API, V2, one data plane) in every
replica, behind Serve's HTTP proxy; Serve balances, autoscales and restarts replicas.

Each replica is a whole lmhead service built from ``LMHEAD_*`` settings (the deployment's
environment): it reads the model repository from a path every node reaches, follows it
(``LMHEAD_CONTROL_MODE=poll``: a published version is loaded and swapped in by every replica),
and batches dynamically inside itself. With ``multiplexed=True`` a replica starts empty and
loads the models it is asked for (Serve's model multiplexing routes a request carrying the
``serve_multiplexed_model_id`` header to a replica that holds that model; a replica keeps at
most ``max_models_per_replica``, least recently used first out), so a repository larger than
one machine's memory can be served.

    serve run service.rayserve:app                     # defaults; or deploy/ray/serve.yaml
    lmhead serve --ray [--replicas N]                  # the same, from the command line

Needs the ``ray`` extra (``pip install .[ray]``); nothing else imports this module.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from ray import serve
from ray.serve import Application
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.app import create_app
from service.settings import Settings

logger = logging.getLogger("lmhead")
#: Every answer names the node and replica that computed it (spread and failover are visible).
NODE_HEADER = b"x-lmhead-node"
REPLICA_HEADER = b"x-lmhead-replica"


class Replica:
    """One lmhead service per replica (``LMHead`` is this class as a Serve deployment)."""

    def __init__(self, settings: dict[str, Any] | None = None, max_models: int = 0) -> None:
        self._settings = Settings(**(settings or {}))
        self._max_models = max_models
        context = serve.get_replica_context()
        self._replica = context.replica_id.unique_id
        self._node = f"{socket.gethostname()}:{os.getpid()}"

    def __serve_build_asgi_app__(self) -> ASGIApp:
        app = create_app(self._settings)
        self._app_state = app.state
        served = self._named(app)
        return self._multiplexing(served) if self._max_models else served

    def _named(self, app: Any) -> ASGIApp:
        """Add the node and replica headers to every answer, and finish start-up only once
        the models are loaded: Serve routes to a replica as soon as its start-up completes."""
        headers = [(NODE_HEADER, self._node.encode()), (REPLICA_HEADER, self._replica.encode())]

        async def named(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "lifespan":
                await app(scope, receive, self._after_loading(send))
                return
            if scope["type"] != "http":
                await app(scope, receive, send)
                return

            async def send_named(message: Message) -> None:
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", []), *headers]}
                await send(message)

            await app(scope, receive, send_named)

        return named

    def _after_loading(self, send: Send) -> Send:
        async def send_when_loaded(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                await self._app_state.loading  # failures are reported by readiness, not here
            await send(message)

        return send_when_loaded

    def _multiplexing(self, app: ASGIApp) -> ASGIApp:
        """Load the model a request names (Serve's multiplexed id) before it runs."""

        async def multiplexed(scope: Scope, receive: Receive, send: Send) -> None:
            name = serve.get_multiplexed_model_id() if scope["type"] == "http" else ""
            if name:
                await self.model(name)
            await app(scope, receive, send)

        return multiplexed

    @serve.multiplexed(max_num_models_per_replica=8)
    async def model(self, name: str) -> _Resident:
        """Load ``name`` into this replica's registry; Serve evicts the least recently used
        past the limit (``_Resident.__del__`` unloads it)."""
        registry = self._app_state.registry
        await registry.load(name)
        return _Resident(registry, name)


LMHead: Any = serve.deployment(serve.ingress()(Replica))


class _Resident:
    """A model held by a replica for Serve's multiplexing; unloaded when evicted."""

    def __init__(self, registry: Any, name: str) -> None:
        self._registry = registry
        self.name = name

    async def __del__(self) -> None:  # Serve awaits it on eviction
        await self._registry.unload(self.name)


def build(args: dict[str, Any]) -> Application:
    """Serve's application builder (``serve run service.rayserve:build key=value ...``)."""
    options: dict[str, Any] = {}
    if "replicas" in args:
        options["num_replicas"] = int(args["replicas"])
    settings = {key: value for key, value in args.items() if key in Settings.model_fields}
    max_models = int(args.get("max_models", 0))
    return LMHead.options(**options).bind(settings, max_models)


app = LMHead.bind()
