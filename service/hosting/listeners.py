"""The listening sockets of the HTTP (and gRPC) ports, made before anything is loaded.

uvicorn binds only after its start-up, i.e. after every model has loaded: a port in use or a
host that does not resolve failed minutes late. So the server binds and listens first and
hands the sockets to uvicorn. They are made as asyncio's ``create_server`` makes them (what
``uvicorn.run`` did): one per address the host resolves to (``localhost`` may be IPv4 and
IPv6), IPv6 ones v6-only, ``""`` for every interface. The fronts of ``LMHEAD_WORKERS`` add
``SO_REUSEPORT`` (the kernel spreads connections over them); the supervisor checks that a
port is free with the same call without it, then holds the port for them (``reserve``).
"""

from __future__ import annotations

import socket

BACKLOG = 2048  # uvicorn's default
PORT_SETTING = "--port or LMHEAD_PORT"


def listening_sockets(
    host: str, port: int, *, reuse_port: bool = False, setting: str = ""
) -> list[socket.socket]:
    """Sockets listening on ``host:port``, or ``SystemExit`` naming it, why not, and the
    ``setting`` that chose the port (a user whose port is busy needs to know what to change).

    Listening, not only bound: two sockets with ``SO_REUSEADDR`` may both bind one port while
    neither listens, so only ``listen`` proves the port is this process's."""
    try:
        return _sockets(host, port, reuse_addr=True, reuse_port=reuse_port, listen=True)
    except SystemExit as refused:
        if not setting:
            raise
        raise SystemExit(f"{refused} (choose another with {setting})") from None


def reserve(host: str, port: int) -> list[socket.socket]:
    """Hold ``host:port`` for this service's fronts until they listen (and while they are
    restarted): bound with ``SO_REUSEPORT`` alone and never listening, so no connection comes
    to it and only this user's ``SO_REUSEPORT`` sockets may bind beside it. Another service's
    check (``check_free``) and any plain socket now fail, where checking and letting go left
    the port to whoever came next in the seconds before the fronts bound it (two services
    started a second apart shared one port). Port 0 becomes the port it got."""
    return _sockets(host, port, reuse_addr=False, reuse_port=True, listen=False)


def _sockets(
    host: str, port: int, *, reuse_addr: bool, reuse_port: bool, listen: bool
) -> list[socket.socket]:
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
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, int(reuse_addr))
            if reuse_port:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:  # every address on the port the first got
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            listener.bind(address)
            if listen:
                listener.listen(BACKLOG)
    except OSError as error:
        for listener in sockets:
            listener.close()
        raise SystemExit(f"cannot serve on {host}:{port}: {error}") from None
    return sockets


def check_free(host: str, port: int, setting: str = PORT_SETTING) -> None:
    """``SystemExit`` unless ``host:port`` could be listened on now (nobody else holds it);
    the message names the ``setting`` that chose the port."""
    for listener in listening_sockets(host, port, setting=setting):
        listener.close()


def describe(sockets: list[socket.socket]) -> str:
    """``http://127.0.0.1:8000, http://[::1]:8000``: where the service listens."""
    places = []
    for listener in sockets:
        host, port = listener.getsockname()[:2]
        places.append(f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}")
    return ", ".join(places)
