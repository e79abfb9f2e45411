"""lmhead as a Ray Serve application: the same app (native API, V2, one data plane) in every
replica, behind Serve's HTTP proxy; Serve balances, autoscales and restarts replicas.

Each replica is a whole lmhead service built from ``LMHEAD_*`` settings (the application's
args or environment): it reads the model repository from a path every node reaches, follows
it (poll mode and read-only by default: a control-API call through the proxy would reach one
replica only), and batches dynamically inside itself. With ``max_models`` > 0 a replica starts
empty and loads the models it is asked for (Serve's model multiplexing routes a request
carrying the ``serve_multiplexed_model_id`` header to a replica that holds that model; a
replica keeps at most ``max_models``, least recently used first out), so a repository larger
than one machine's memory can be served.

    serve run deploy/ray/serve.yaml          # autoscaling, settings in runtime_env
    lmhead serve --ray [--replicas N]        # on the Ray cluster of RAY_ADDRESS, or a local one

Needs the ``ray`` extra (``pip install .[ray]``); nothing else imports this module.
"""

from __future__ import annotations

import os
from typing import Any

import ray
from ray import serve
from ray.serve import Application
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.hosting.app import create_app
from service.settings import Settings

#: Every answer names the Ray node and replica that computed it (spread and failover show).
NODE_HEADER = b"x-lmhead-node"
REPLICA_HEADER = b"x-lmhead-replica"
#: ``build`` args that are no setting.
BUILD_ARGS = frozenset({"replicas", "max_models"})


class Replica:
    """One lmhead service per replica (``LMHead`` is this class as a Serve deployment)."""

    def __init__(self, settings: dict[str, Any] | None = None, max_models: int = 0) -> None:
        self._settings = _threads_for_replica(_replica_settings(settings or {}))
        self._max_models = max_models
        self._replica = serve.get_replica_context().replica_id.unique_id
        self._node = ray.get_runtime_context().get_node_id()

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

        model = self._loader()

        async def multiplexed(scope: Scope, receive: Receive, send: Send) -> None:
            name = serve.get_multiplexed_model_id() if scope["type"] == "http" else ""
            if name:
                await model(name)
            await app(scope, receive, send)

        return multiplexed

    def _loader(self) -> Any:
        """Serve's multiplexed loader for this replica: loads a model into the registry; Serve
        evicts the least recently used past ``max_models`` (``_Resident.__del__`` unloads)."""

        async def load(name: str) -> _Resident:
            registry = self._app_state.registry
            await registry.load(name)
            return _Resident(registry, name)

        return serve.multiplexed(max_num_models_per_replica=self._max_models)(load)


#: Serve's defaults suit one-request-at-a-time models: a replica that batches wants more
#: requests in flight (at Serve's default of 5 the proxy holds the rest back and retries with
#: backoff: 1-row requests at 16 clients ran at 0.04x one process), and a drain as long as
#: LMHEAD_DRAIN_TIMEOUT_S's default (30 s) before it is stopped.
LMHead: Any = serve.deployment(max_ongoing_requests=32, graceful_shutdown_timeout_s=35)(
    serve.ingress()(Replica)
)


#: A control-API call through Serve's proxy reaches one replica, not all: unless told otherwise
#: (args or ``LMHEAD_*``), replicas follow the shared repository and refuse load/unload (403).
#: A replica binds nothing itself: requests carry the Host clients gave Serve's proxy, so any
#: name is answered (with load/unload refused, a rebound page could only run inference).
REPLICA_DEFAULTS = {"control_mode": "poll", "read_only": True, "allowed_hosts": "*"}


def _replica_settings(given: dict[str, Any]) -> Settings:
    defaults = {
        key: value
        for key, value in REPLICA_DEFAULTS.items()
        if f"LMHEAD_{key.upper()}" not in os.environ
    }
    settings = Settings(**{**defaults, **given})
    if settings.grpc_port is not None:  # every replica would bind it; Serve proxies HTTP here
        raise ValueError("LMHEAD_GRPC_PORT: gRPC is served by single lmhead processes, not Ray")
    return settings


def _threads_for_replica(settings: Settings) -> Settings:
    """onnxruntime ignores ``OMP_NUM_THREADS``, Ray's per-actor thread limit: unless set, a
    replica's onnxruntime threads follow its ``num_cpus``, so replicas sharing a node do not
    each start a thread per core and fight over them."""
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0)
    if settings.intra_op_threads or not cpus:
        return settings
    return settings.model_copy(update={"intra_op_threads": max(1, int(cpus))})


class _Resident:
    """A model held by a replica for Serve's multiplexing; unloaded when evicted."""

    def __init__(self, registry: Any, name: str) -> None:
        self._registry = registry
        self.name = name

    async def __del__(self) -> None:  # Serve awaits it on eviction
        await self._registry.unload(self.name)


def build(args: dict[str, Any]) -> Application:
    """Serve's application builder (``serve run service.hosting.rayserve:build key=value ...``)."""
    options: dict[str, Any] = {}
    if "replicas" in args:
        options["num_replicas"] = int(args["replicas"])
    unknown = sorted(set(args) - set(Settings.model_fields) - BUILD_ARGS)
    if unknown:  # a typo'd key (``repositry``) was dropped silently: the default served
        raise ValueError(f"unknown args {unknown}: expected settings' names, replicas, max_models")
    settings = {key: value for key, value in args.items() if key in Settings.model_fields}
    max_models = int(args.get("max_models", 0))
    return LMHead.options(**options).bind(settings, max_models)


app = LMHead.bind()


def run(settings: Settings, replicas: int | None, max_models: int = 0) -> None:
    """``lmhead serve --ray``: this application on the Ray cluster ``RAY_ADDRESS`` names (a
    local one otherwise), Serve's proxy on the settings' host and port; blocks until Ctrl-C."""
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, logging_level="warning")
    else:  # a cluster of this machine alone: Ray's own ports stay on loopback
        ray.init(
            address="local",  # a new one, never a stale cluster `ray start` left on the machine
            _node_ip_address="127.0.0.1",
            logging_level="warning",
            include_dashboard=False,
        )
    serve.start(http_options={"host": settings.host, "port": settings.port})
    fields = settings.model_dump(exclude_unset=True, exclude={"host", "port"})
    args = {**fields, "max_models": max_models}
    if replicas is not None:
        args["replicas"] = replicas
    serve.run(build(args), name="lmhead", route_prefix="/", blocking=True)
