"""The HTTP server: uvicorn, with the connection limits a public endpoint needs
(``service.hosting.connection``), on sockets taken before any model loads
(``service.hosting.listeners``).

``run(settings)`` starts the app with these limits; ``uvicorn --factory`` runs without them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import signal
import socket
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
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.Server(config).run(sockets=sockets)


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
        "timeout_graceful_shutdown": max(settings.drain_timeout_s, MIN_STOP_DRAIN_S),
        "timeout_keep_alive": settings.keep_alive_s,  # a float: 0.5 s must not become 0
        "http": limited_protocol(settings, shared, metrics),
        # No WebSocket routes: an upgraded connection would escape the limits above.
        "ws": "none",
        # X-Forwarded-* would only rewrite the client address that access logs show; the
        # middleware that reads them wraps every request (~3% of a one-row request's CPU).
        "proxy_headers": settings.access_log,
    }


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
