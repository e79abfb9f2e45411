"""Process entries' helpers: a front's main (its own ``SO_REUSEPORT`` listener, then uvicorn),
and the name each process shows in ``ps``/``top`` (``lmhead-engine``, ``lmhead-front``)."""

from __future__ import annotations

import ctypes
import signal
import socket

from service.settings import Settings


def front_main(settings: Settings, engine_socket: str) -> None:
    """Spawned by the supervisor; SIGTERM drains this front's requests, then it exits."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor turns Ctrl-C into SIGTERM
    name_process("lmhead-front")
    from service.server import run_front

    run_front(settings, engine_socket, listener(settings.host, settings.port))


def listener(host: str, port: int) -> socket.socket:
    """A listening socket on the shared port; the kernel spreads connections over the fronts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


PR_SET_NAME = 15


def name_process(name: str) -> None:
    """Set the process's name (Linux ``comm``, 15 bytes); spawned children are all "python"."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass
