"""Frames between a front and the engine: a pickled message, its tensors in shared memory.

A frame is a fixed prefix (body bytes, array count, arena offset), the byte size of each
array, and the body: the message (a tuple holding a ``service.messages`` request or result,
or a plain value) pickled with every numpy array set aside (a persistent id: its dtype and
shape, no element is pickled). The sender copies the arrays' bytes into one block of its
arena; the receiver rebuilds them as views of that memory (no copy, nothing through the
socket). Setting arrays aside costs a third of numpy's own pickling (protocol 5, out of
band), measured on a top-k answer. Only when the arena
has no room do the buffers travel in the frame instead. Both ends are processes of one
service, on a Unix socket in a private directory, with the peer's user checked, so
unpickling trusts its input.

The receiver owns nothing it reads: it says when the block may be reused (``free``), in its
next frame or, when none follows soon, in a frame of its own. Frames written in one
event-loop turn go out in one system call.
"""

from __future__ import annotations

import asyncio
import io
import logging
import pickle
import struct
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from service.settings import Settings
from service.split.arena import ALIGN, Arena, ArenaFull

logger = logging.getLogger("lmhead")
PREFIX = struct.Struct("<IIq")  # body bytes, out-of-band buffers, arena offset (-1: in frame)
SIZE = struct.Struct("<Q")
#: A frame larger than this is a bug or a hostile peer: the connection is dropped.
MAX_FRAME = 1 << 31
HANDSHAKE_S = 10.0
HELLO_BYTES = 4096
IN_FRAME = -1


def arena_bytes(settings: Settings) -> int:
    """Room for the tensors in flight one way (sparse: only what is written is resident)."""
    return max(2 * settings.max_inflight_bytes, 2 * settings.max_body_bytes, 64 * 2**20)


class _Pickler(pickle.Pickler):
    """Pickles a message with its arrays set aside (their bytes go to the arena)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.arrays: list[npt.NDArray[Any]] = []

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is np.ndarray and not obj.dtype.hasobject:
            self.arrays.append(obj)
            return obj.dtype.str, obj.shape
        return None


class _Unpickler(pickle.Unpickler):
    """Rebuilds each array set aside as a view of its bytes, in pickling order."""

    def __init__(self, body: memoryview, buffers: list[memoryview]) -> None:
        super().__init__(io.BytesIO(body))
        self._buffers = iter(buffers)

    def persistent_load(self, pid: Any) -> Any:
        dtype, shape = pid
        return np.frombuffer(next(self._buffers), dtype=dtype).reshape(shape)


def pack(message: Any, arena: Arena | None) -> tuple[bytes, int | None]:
    """A frame, and the arena block it holds (free it once the peer is done), if any."""
    stream = io.BytesIO()
    pickler = _Pickler(stream)
    pickler.dump(message)
    body = stream.getvalue()
    raws = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in pickler.arrays]
    sizes = [raw.nbytes for raw in raws]
    spans = [-(-size // ALIGN) * ALIGN for size in sizes]
    offset = _allocate(arena, sum(spans)) if raws else None
    parts = [PREFIX.pack(len(body), len(raws), IN_FRAME if offset is None else offset)]
    parts += [SIZE.pack(size) for size in sizes]
    parts.append(body)
    if offset is None:
        parts += [raw.tobytes() for raw in raws]
    else:
        assert arena is not None
        place = offset
        for raw, size, span in zip(raws, sizes, spans, strict=True):
            arena.view[place : place + size] = raw.data
            place += span
    return b"".join(parts), offset


def _allocate(arena: Arena | None, nbytes: int) -> int | None:
    if arena is None:
        return None
    try:
        return arena.allocate(nbytes)
    except ArenaFull:
        logger.debug("arena full: %d bytes go in the frame", nbytes)
        return None


def unpack(frame: memoryview, arena: Arena) -> Any:
    """The message of a whole frame, its arrays read-only views of ``arena`` (or of the frame)."""
    size, count, offset = PREFIX.unpack_from(frame)
    sizes = [SIZE.unpack_from(frame, PREFIX.size + i * SIZE.size)[0] for i in range(count)]
    start = PREFIX.size + count * SIZE.size
    body = frame[start : start + size]
    if offset == IN_FRAME:
        memory, place = frame, start + size
    else:
        memory, place = arena.readonly, offset
    buffers = []
    for nbytes in sizes:
        buffers.append(memory[place : place + nbytes])
        place += nbytes if offset == IN_FRAME else -(-nbytes // ALIGN) * ALIGN
    return _Unpickler(body, buffers).load()


def frame_bytes(head: bytes | bytearray) -> int | None:
    """The whole frame's length, once its prefix and size table have arrived."""
    size, count, offset = PREFIX.unpack_from(head)
    table = PREFIX.size + count * SIZE.size
    if len(head) < table:
        return None
    if offset != IN_FRAME:
        return int(table + size)
    buffers = sum(SIZE.unpack_from(head, PREFIX.size + i * SIZE.size)[0] for i in range(count))
    return int(table + size + buffers)


class FrameProtocol(asyncio.Protocol):
    """Splits the byte stream into frames, each read as ``on_message(message, block)`` (the
    sender's arena block the message's arrays are views of, or None); batches writes per
    loop turn."""

    def __init__(self, incoming: Arena) -> None:
        self.incoming = incoming
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._outgoing: list[bytes] = []
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        while len(buffer) >= PREFIX.size:
            length = frame_bytes(buffer)
            if length is None:
                return
            if length > MAX_FRAME:
                logger.error("a frame of %d bytes: dropping the connection", length)
                assert self.transport is not None
                self.transport.close()
                return
            if len(buffer) < length:
                return
            frame = memoryview(bytes(buffer[:length]))
            del buffer[:length]
            offset = PREFIX.unpack_from(frame)[2]
            self.on_message(unpack(frame, self.incoming), None if offset == IN_FRAME else offset)

    def on_message(self, message: Any, block: int | None) -> None:
        raise NotImplementedError

    def send(self, frame: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            raise ConnectionError("the connection is closed")
        if not self._outgoing:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outgoing.append(frame)

    def _flush(self) -> None:
        frames, self._outgoing = self._outgoing, []
        if self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(frames)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)
