"""A minimal HTTP/1.1 keep-alive load generator for closed-loop benchmarks on loopback.

The benchmark's clients share this machine's two cores with the server. aiohttp costs about
0.3 ms of CPU per request here (measured: 2.4 s of client CPU for 7,800 requests), which at
~1,000 requests/s is a third of a core taken from the server being measured. This client
sends one pre-built request per connection and parses only the status line and
``Content-Length`` of the answer (the service always sends it), so nearly all CPU goes to the
server. It speaks plain HTTP/1.1 over real TCP; it is a measuring instrument, not a general
client (no chunked bodies, no redirects, no TLS). Benchmarks that check answers or drive the
control API (``bench.soak``, ``bench.swap``, ``bench.client``) use ``service.client``; only the
throughput generators, where client CPU is taken from the server measured, use this one.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import cast


class HTTPStatusError(RuntimeError):
    """The server answered something other than 200."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection that carries one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future[bytes] | None = None
        self.answer: tuple[int, int, int] | None = None  # status, body start, body end

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.answer is None:
            self.answer = self._parse_head()
            if self.answer is None:
                return
        status, start, end = self.answer
        if len(self.buffer) < end:
            return
        body = bytes(self.buffer[start:end])
        del self.buffer[:end]
        self.answer = None
        if status != 200:
            self._fail(HTTPStatusError(f"HTTP {status}: {body[:200]!r}"))
        elif self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(body)

    def _parse_head(self) -> tuple[int, int, int] | None:
        head_end = self.buffer.find(b"\r\n\r\n")
        if head_end < 0:
            return None
        head = bytes(self.buffer[:head_end]).lower()
        marker = head.find(b"\r\ncontent-length:")
        if not head.startswith(b"http/1.1 ") or marker < 0:
            raise HTTPStatusError(f"unexpected answer head: {head[:200]!r}")
        stop = head.find(b"\r\n", marker + 2)
        length = int(head[marker + 17 : stop if stop > 0 else None])
        return int(head[9:12]), head_end + 4, head_end + 4 + length

    def _fail(self, error: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(error)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionError("server closed the connection"))

    async def request(self, raw: bytes) -> bytes:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return await self.waiter


@dataclass
class ClosedLoop:
    """``clients`` connections, each sending its next request when its answer is in."""

    latencies: list[float] = field(default_factory=list)
    elapsed: float = 0.0


def build_request(host: str, port: int, target: str, body: bytes, headers: dict[str, str]) -> bytes:
    """One raw HTTP/1.1 POST, sent as is for every request of a run."""
    lines = [f"POST {target} HTTP/1.1", f"host: {host}:{port}", f"content-length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


async def closed_loop(
    host: str, port: int, raw: bytes, clients: int, *, max_seconds: float, max_requests: int
) -> ClosedLoop:
    """Open every connection and answer one round first, then measure a bounded window."""
    loop = asyncio.get_running_loop()
    connections = []
    for _ in range(clients):
        _, connection = await loop.create_connection(_Connection, host, port)
        connections.append(connection)
    try:
        await asyncio.gather(*(conn.request(raw) for conn in connections))  # warm: all connected
        run = ClosedLoop()
        tickets = iter(range(max_requests))
        start = time.perf_counter()

        async def client(conn: _Connection) -> None:
            for _ in tickets:
                if time.perf_counter() - start > max_seconds:
                    return
                begin = time.perf_counter()
                await conn.request(raw)
                run.latencies.append(time.perf_counter() - begin)

        await asyncio.gather(*(client(conn) for conn in connections))
        run.elapsed = time.perf_counter() - start
        return run
    finally:
        for conn in connections:
            if conn.transport is not None:
                conn.transport.close()


async def timed_requests(
    host: str, port: int, raw: bytes, clients: int, stop: asyncio.Event
) -> list[tuple[float, float]]:
    """Closed-loop clients until ``stop`` is set: each request's start and latency (s), so a
    benchmark can keep the ones sent while something else happened."""
    loop = asyncio.get_running_loop()
    connections = []
    for _ in range(clients):
        _, connection = await loop.create_connection(_Connection, host, port)
        connections.append(connection)
    timed: list[tuple[float, float]] = []

    async def client(conn: _Connection) -> None:
        while not stop.is_set():
            begin = time.perf_counter()
            await conn.request(raw)
            timed.append((begin, time.perf_counter() - begin))

    try:
        await asyncio.gather(*(client(conn) for conn in connections))
    finally:
        for conn in connections:
            if conn.transport is not None:
                conn.transport.close()
    return timed
