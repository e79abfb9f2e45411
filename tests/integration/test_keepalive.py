"""After an unexpected error (a 500) the keep-alive connection stays usable: behind a proxy
that reuses upstream connections, a dropped one is a 502 for somebody else's request."""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import BinaryIO

import numpy as np
import numpy.typing as npt
import uvicorn

from service.heads.files import HeadWeights, save_head
from service.hosting.app import create_app
from service.hosting.server import limited_protocol
from service.settings import Settings
from tests.server import free_port, poll


def _answer(stream: BinaryIO) -> tuple[int, bytes]:
    status = int(stream.readline().split(b" ", 2)[1])
    length = 0
    while (line := stream.readline()) not in (b"\r\n", b""):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return status, stream.read(length)


def test_a_500_on_a_framework_route_keeps_the_connection(
    tmp_path: Path, table: npt.NDArray[np.float32]
) -> None:
    save_head(HeadWeights.from_arrays(table), tmp_path / "tied" / "1")
    settings = Settings(repository=tmp_path, port=free_port())
    app = create_app(settings)

    @app.get("/explode")
    async def explode() -> None:  # a bug in some route, as FastAPI would run it
        raise RuntimeError("a bug")

    config = uvicorn.Config(
        app,
        port=settings.port,
        http=limited_protocol(settings),
        # as service.hosting.server (uvicorn < 0.50 auto-imports websockets.legacy: deprecated)
        ws="none",
        log_level="critical",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        poll(lambda: True if server.started else None, "the in-process server to start")
        with (
            socket.create_connection(("127.0.0.1", settings.port), timeout=10) as sock,
            sock.makefile("rb") as stream,
        ):
            for path, expected in (("/explode", 500), ("/health/live", 200), ("/explode", 500)):
                sock.sendall(b"GET %s HTTP/1.1\r\nHost: localhost\r\n\r\n" % path.encode())
                status, body = _answer(stream)
                assert status == expected
                assert b"a bug" not in body
    finally:
        server.should_exit = True
        thread.join(timeout=30)
