"""Small writes of one event-loop turn sent together: an answer's head and body leave in one
segment, not two (each wakes the client). ``service.hosting.connection`` wraps every
connection's transport in it.
"""

from __future__ import annotations

import asyncio
from typing import Any

#: Writes held for the end of the event-loop turn, at most (an answer's head and a small body).
COALESCE_BYTES = 64 * 1024


class CoalescedWrites:
    """A transport whose small writes in one event-loop turn leave together: uvicorn writes an
    answer's head and body apart, two syscalls and two TCP segments that wake the client
    twice. Pending bytes past ``COALESCE_BYTES`` go at once (a large body is not held back a
    turn, nor copied: uvloop's ``writelines`` is one ``writev``; asyncio's joins the parts).
    Everything else is the transport's own."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._parts: list[bytes] = []
        self._pending = 0

    def write(self, data: bytes) -> None:
        if not self._parts:
            self._loop.call_soon(self._flush)
        self._parts.append(data)
        self._pending += len(data)
        if self._pending > COALESCE_BYTES:
            self._flush()

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._parts, self._pending = [], 0
        self._transport.abort()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def _flush(self) -> None:
        parts, self._parts, self._pending = self._parts, [], 0
        if not parts or self._transport.is_closing():
            return
        if len(parts) == 1:
            self._transport.write(parts[0])
        else:
            self._transport.writelines(parts)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
