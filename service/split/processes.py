"""Process entries' helpers: a front's main (its own ``SO_REUSEPORT`` listener, then uvicorn),
and ``become``: the name each shows in ``ps`` (``lmhead-engine``, ``lmhead-front``), and its
end with the supervisor's."""

from __future__ import annotations

import ctypes
import signal
from collections.abc import MutableSequence

from service.settings import Settings


def front_main(
    settings: Settings, engine_socket: str, connections: MutableSequence[int], index: int
) -> None:
    """Spawned by the supervisor; SIGTERM drains this front's requests, then it exits.
    ``connections[index]`` is this front's count of open connections (see
    ``SharedConnections``)."""
    ignore_ctrl_c()  # the supervisor turns Ctrl-C into SIGTERM
    become("lmhead-front")
    from service.app import create_app
    from service.connection import SharedConnections
    from service.listeners import listening_sockets
    from service.server import run_on
    from service.split.front import connected_plane

    app = create_app(settings, front=lambda: connected_plane(engine_socket, settings))
    shared = SharedConnections(connections, index)
    sockets = listening_sockets(settings.host, settings.port, reuse_port=True)
    run_on(app, settings, sockets, shared)


def ignore_ctrl_c() -> None:
    """Ignore SIGINT, then let through the one the supervisor's start held back (dropped)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


def become(name: str) -> None:
    """Name this child process (Linux ``comm``, shown by ``ps``; spawned children are all
    "python" otherwise) and have the kernel send it SIGTERM if the supervisor dies without
    stopping it (SIGKILL, OOM): it then drains and exits instead of living on orphaned."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass
