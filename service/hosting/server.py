"""The HTTP server: uvicorn, with the connection limits a public endpoint needs
(``service.hosting.connection``), on sockets taken before any model loads
(``service.hosting.listeners``).

``run(settings)`` starts the app with these limits; ``uvicorn --factory`` runs without them.
A stop (SIGTERM, SIGINT, SIGHUP) drains, then the engine ends the runs still going; should
anything still hold the process (a session being opened, a kernel that never checks
onnxruntime's terminate flag), it exits ``STOP_MARGIN_S`` after the drain's grace anyway:
a run that never ended kept a stopped process at 100% CPU until SIGKILL (issue 43).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import signal
import socket
import threading
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.allocator import settle_allocator
from service.hosting.app import create_app
from service.hosting.connection import LimitedHttp, SharedConnections
from service.hosting.listeners import PORT_SETTING, check_free, describe, listening_sockets
from service.metrics import Metrics
from service.settings import Settings

logger = logging.getLogger("lmhead")
FD_MARGIN = 64  # descriptors for model files, the log, the event loop itself
MIN_STOP_DRAIN_S = 10.0
#: What a stop may take past its drain (the engine's close) before the process exits anyway.
STOP_MARGIN_S = 5.0
#: The exit status of a process that had to exit so (a clean stop exits 0).
FORCED_EXIT_STATUS = 1


def run(settings: Settings) -> None:
    """Serve ``create_app(settings)`` in this process until SIGINT/SIGTERM (graceful: requests
    drain); ``lmhead serve`` with ``LMHEAD_WORKERS`` > 1 runs ``service.hosting.split.supervisor``.
    The ports are taken before any model loads (``service.hosting.listeners``)."""
    _raise_descriptor_limit(settings.max_connections + FD_MARGIN)
    settle_allocator()
    sockets = listening_sockets(settings.host, settings.port, setting=PORT_SETTING)
    if settings.grpc_port is not None:
        check_free(settings.host, settings.grpc_port, "--grpc-port or LMHEAD_GRPC_PORT")
    app = create_app(settings)
    config = uvicorn.Config(app, **_options(settings, app.state.metrics))
    logger.info("lmhead serving on %s", describe(sockets))
    # uvicorn drains on SIGINT/SIGTERM, then raises the signal again with the handler it found:
    # Ctrl-C's KeyboardInterrupt, and SIGTERM's default (death by signal, status -15, where
    # the split service exits 0). Both end as a clean exit 0.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # `nohup lmhead serve` stays
        signal.signal(signal.SIGHUP, _stop_on_hang_up)
    grace = _drain_s(settings) + STOP_MARGIN_S
    with contextlib.suppress(KeyboardInterrupt):
        _BoundedStop(config, grace, app).run(sockets=sockets)


class _BoundedStop(uvicorn.Server):
    """uvicorn's server, whose process ends within ``grace_s`` of the first stop signal."""

    def __init__(self, config: uvicorn.Config, grace_s: float, app: FastAPI) -> None:
        super().__init__(config)
        self._grace_s = grace_s
        self._app = app
        self._stopping = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The first stop signal: the process exits within the grace whatever happens, and
        versions loading end their warm-ups now (a load call would hold the drain)."""
        super().handle_exit(sig, frame)
        if self._stopping:
            return
        self._stopping = True
        exit_after(self._grace_s)
        registry = getattr(self._app.state, "registry", None)  # once the engine started
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # the loop has ended: nothing loads any more
            return
        if registry is not None:  # from a signal handler: on the loop, which owns its state
            loop.call_soon_threadsafe(registry.stopping)


def exit_after(seconds: float) -> None:
    """End the process ``seconds`` from now, whatever it is doing then (a daemon timer: it
    holds nothing up, and it still runs while the interpreter, exiting, joins the threads
    that would keep it alive)."""

    def exit_now() -> None:
        logger.error(
            "lmhead did not stop within %g s of the stop signal: exiting now (a run or a "
            "load was still in progress)",
            seconds,
        )
        logging.shutdown()
        os._exit(FORCED_EXIT_STATUS)

    timer = threading.Timer(seconds, exit_now)
    timer.daemon = True
    timer.name = "lmhead-stop-deadline"
    timer.start()


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def _stop_on_hang_up(signum: int, frame: FrameType | None) -> None:
    """A closed terminal (or a SIGHUP sent to stop it) drains as SIGTERM does: its default
    ended the process at once, mid-request, with a version copy left in the scratch dir."""
    os.kill(os.getpid(), signal.SIGTERM)


def run_on(
    app: FastAPI, settings: Settings, sockets: list[socket.socket], shared: SharedConnections
) -> None:
    """Serve ``app`` on sockets already listening (a front process of ``LMHEAD_WORKERS``,
    whose port the fronts share), with the same limits as ``run``, the connection cap counted
    over every front."""
    _raise_descriptor_limit(settings.max_connections + FD_MARGIN)
    settle_allocator()
    options = _options(settings, app.state.metrics, shared)
    uvicorn.Server(uvicorn.Config(app, **options)).run(sockets=sockets)


def _options(
    settings: Settings, metrics: Metrics, shared: SharedConnections | None = None
) -> dict[str, Any]:
    return {
        "log_level": settings.log_level,
        "access_log": settings.access_log,
        # A stop drains as a swap does, never less than uvicorn's 10 s (0 cancels at once).
        "timeout_graceful_shutdown": _drain_s(settings),
        "timeout_keep_alive": settings.keep_alive_s,  # a float: 0.5 s must not become 0
        "http": limited_protocol(settings, shared, metrics),
        # No WebSocket routes: an upgraded connection would escape the limits above.
        "ws": "none",
        # X-Forwarded-* would only rewrite the client address that access logs show; the
        # middleware that reads them wraps every request (~3% of a one-row request's CPU).
        "proxy_headers": settings.access_log,
    }


def _drain_s(settings: Settings) -> float:
    return max(settings.drain_timeout_s, MIN_STOP_DRAIN_S)


def limited_protocol(
    settings: Settings, shared: SharedConnections | None = None, metrics: Metrics | None = None
) -> type[HttpToolsProtocol]:
    """``LimitedHttp`` with this service's limits (uvicorn builds one per connection), its
    refusals counted in ``metrics``."""
    return type(
        "LMHeadHttp",
        (LimitedHttp,),
        {
            "max_header_bytes": settings.max_header_bytes,
            "header_timeout_s": settings.header_timeout_s,
            "body_timeout_s": settings.body_timeout_s,
            "max_connections": settings.max_connections,
            "shared": shared,
            "refused": None if metrics is None else metrics.refused,
        },
    )


def _raise_descriptor_limit(needed: int) -> None:
    """Allow ``needed`` open files (up to the hard limit), or say the cap cannot be held."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < needed:
        logger.warning(
            "open-file limit %d is below LMHEAD_MAX_CONNECTIONS + %d; lower the setting",
            target,
            FD_MARGIN,
        )
