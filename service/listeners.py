"""The listening sockets of the HTTP (and gRPC) ports, made before anything is loaded.

uvicorn binds only after its start-up, i.e. after every model has loaded: a port in use or a
host that does not resolve failed minutes late. So the server binds and listens first and
hands the sockets to uvicorn. They are made as asyncio's ``create_server`` makes them (what
``uvicorn.run`` did): one per address the host resolves to (``localhost`` may be IPv4 and
IPv6), IPv6 ones v6-only, ``""`` for every interface. The fronts of ``LMHEAD_WORKERS`` add
``SO_REUSEPORT`` (the kernel spreads connections over them); the supervisor's check that a
port is free is the same call without it, its sockets closed at once.
"""

from __future__ import annotations

import socket

BACKLOG = 2048  # uvicorn's default


def listening_sockets(host: str, port: int, *, reuse_port: bool = False) -> list[socket.socket]:
    """Sockets listening on ``host:port``, or ``SystemExit`` naming it and why not.

    Listening, not only bound: two sockets with ``SO_REUSEADDR`` may both bind one port while
    neither listens, so only ``listen`` proves the port is this process's."""
    try:
        addresses = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError as error:
        raise SystemExit(f"cannot serve on {host}:{port}: {error}") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(addresses):
            listener = socket.socket(family, kind, proto)
            sockets.append(listener)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            listener.bind(address)
            listener.listen(BACKLOG)
    except OSError as error:
        for listener in sockets:
            listener.close()
        raise SystemExit(f"cannot serve on {host}:{port}: {error}") from None
    return sockets


def check_free(host: str, port: int) -> None:
    """``SystemExit`` unless ``host:port`` could be listened on now (nobody else holds it)."""
    for listener in listening_sockets(host, port):
        listener.close()


def describe(sockets: list[socket.socket]) -> str:
    """``http://127.0.0.1:8000, http://[::1]:8000``: where the service listens."""
    places = []
    for listener in sockets:
        host, port = listener.getsockname()[:2]
        places.append(f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}")
    return ", ".join(places)
