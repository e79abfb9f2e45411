"""Frames between a front and the engine: a small pickled header, tensors in shared memory.

A frame is ``<meta bytes><body bytes>`` after an 8-byte length prefix. The body is the
message (a ``service.messages`` request or result, or a plain value) pickled with protocol 5
and every array buffer *out of band*: the sender copies each buffer into its arena and the
header lists ``(offset, bytes)``; the receiver rebuilds the arrays as views of that memory
(no copy, nothing through the socket). Only when the arena has no room does a buffer travel
in the frame. Both ends are processes of one service, on a Unix socket in a private
directory, with the peer's user checked, so unpickling trusts its input.

The receiver owns nothing it reads: it says when the blocks may be reused (``free``).
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import struct
from collections.abc import Callable
from typing import Any, cast

from service.settings import Settings
from service.split.arena import Arena, ArenaFull

logger = logging.getLogger("lmhead")
PREFIX = struct.Struct("<II")  # meta bytes, body bytes
#: A frame larger than this is a bug or a hostile peer: the connection is dropped.
MAX_FRAME = 1 << 31

HANDSHAKE_S = 10.0
HELLO_BYTES = 4096


def arena_bytes(settings: Settings) -> int:
    """Room for the tensors in flight one way (sparse: only what is written is resident)."""
    return max(2 * settings.max_inflight_bytes, 2 * settings.max_body_bytes, 64 * 2**20)


Blocks = list[tuple[int, int]]
"""(offset, bytes) of each out-of-band buffer, in pickling order."""


def pack(meta: tuple[Any, ...], message: Any, arena: Arena | None) -> tuple[bytes, list[int]]:
    """A frame, and the arena offsets it holds (free them once the peer is done)."""
    blocks: Blocks = []

    def place(buffer: pickle.PickleBuffer) -> bool:
        raw = buffer.raw()
        if arena is None or raw.nbytes == 0:
            return True  # in band
        try:
            offset = arena.allocate(raw.nbytes)
        except ArenaFull:
            logger.debug("arena full: %d bytes go in the frame", raw.nbytes)
            return True
        arena.view[offset : offset + raw.nbytes] = raw
        blocks.append((offset, raw.nbytes))
        return False

    try:
        body = pickle.dumps(message, protocol=5, buffer_callback=place)
        head = pickle.dumps((*meta, blocks), protocol=5)
    except BaseException:
        for offset, _ in blocks:
            if arena is not None:
                arena.free(offset)
        raise
    return PREFIX.pack(len(head), len(body)) + head + body, [offset for offset, _ in blocks]


def unpack(body: bytes, blocks: Blocks, arena: Arena, *, copy: bool = False) -> Any:
    """The message, its arrays read-only views of ``arena`` (or copies, with ``copy``)."""
    memory = arena.readonly
    if copy:
        buffers: list[Any] = [bytearray(memory[o : o + n]) for o, n in blocks]
    else:
        buffers = [memory[o : o + n] for o, n in blocks]
    return pickle.loads(body, buffers=buffers)


class FrameProtocol(asyncio.Protocol):
    """Splits the byte stream into frames: ``on_frame(meta, body)`` for each."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._need: tuple[int, int] | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        while True:
            if self._need is None:
                if len(buffer) < PREFIX.size:
                    return
                self._need = PREFIX.unpack_from(buffer)
                if sum(self._need) > MAX_FRAME:
                    logger.error("a frame of %d bytes: dropping the connection", sum(self._need))
                    assert self.transport is not None
                    self.transport.close()
                    return
            head, size = self._need
            end = PREFIX.size + head + size
            if len(buffer) < end:
                return
            meta = pickle.loads(buffer[PREFIX.size : PREFIX.size + head])
            body = bytes(buffer[PREFIX.size + head : end])
            del buffer[:end]
            self._need = None
            self.on_frame(meta, body)

    def on_frame(self, meta: tuple[Any, ...], body: bytes) -> None:
        raise NotImplementedError

    def send(self, frame: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            raise ConnectionError("the connection is closed")
        self.transport.write(frame)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


def coalesce(send: Callable[[list[int]], None]) -> Callable[[list[int]], None]:
    """Batch releases made in one event-loop turn into one frame."""
    pending: list[int] = []

    def flush() -> None:
        offsets = pending[:]
        pending.clear()
        send(offsets)

    def release(offsets: list[int]) -> None:
        if not offsets:
            return
        if not pending:
            asyncio.get_running_loop().call_soon(flush)
        pending.extend(offsets)

    return release
