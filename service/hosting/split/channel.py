"""Frames between a front and the engine: a pickled message, its tensors in shared memory.

A frame is a fixed prefix (body bytes, array count, arena offset), the byte size of each
array, and the body: the message (a tuple holding a ``service.messages`` request or result,
or a plain value) pickled with every numpy array set aside (a reference to its bytes, its
dtype and shape: no element is pickled). The sender copies the arrays' bytes into one block of its
arena; the receiver rebuilds them as views of that memory (no copy, nothing through the
socket). Setting arrays aside costs a third of numpy's own pickling (protocol 5, out of
band), measured on a top-k answer. Only when the arena
has no room do the buffers travel in the frame instead. Token strings travel as ids: a
head's label table crosses once per connection (``service.repository.labels``). Both ends are
processes of one service, on a Unix socket in a private directory, with the peer's user checked, so
unpickling trusts its input.

The receiver owns nothing it reads: it says when the block may be reused, in its next
frame or, when none follows soon, in a frame of its own. Every message posted in one
event-loop turn (a batch's answers, a front's concurrent calls) travels in one frame.
"""

from __future__ import annotations

import asyncio
import io
import logging
import pickle
import struct
import threading
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from service.hosting.split.arena import ALIGN, Arena, ArenaFull
from service.repository.labels import LabelShipment, LabelTable, TokenStrings, receiving
from service.settings import Settings

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


_reading = threading.local()


def _array(index: int, dtype: str, shape: tuple[int, ...]) -> npt.NDArray[Any]:
    """An array set aside by ``_Pickler``, rebuilt as a view of its bytes (``unpack`` only)."""
    buffers: list[memoryview] = _reading.buffers
    return np.ndarray(shape, dtype, buffer=buffers[index])


class _Pickler(pickle.Pickler):
    """Pickles a message with its arrays set aside (their bytes go to the arena).

    ``reducer_override`` is asked only about objects that are not plain ints, strings, lists
    and the like, so the common fields cost nothing extra (``persistent_id``, asked about every
    object, made pickling 2.4x slower on a batch of top-k answers)."""

    def __init__(self, file: io.BytesIO, shipment: LabelShipment | None) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.arrays: list[npt.NDArray[Any]] = []
        self._shipment = shipment

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is np.ndarray and not obj.dtype.hasobject:
            self.arrays.append(obj)
            return _array, (len(self.arrays) - 1, obj.dtype.str, obj.shape)
        if type(obj) is TokenStrings and self._shipment is not None:
            return self._shipment.reduce(obj)  # ids only, once the peer has the table
        return NotImplemented


def pack(
    message: Any, arena: Arena | None, shipment: LabelShipment | None = None
) -> tuple[bytes, int | None]:
    """A frame, and the arena block it holds (free it once the peer is done), if any.
    ``shipment``: the peer's label tables, to send token strings as ids
    (``service.repository.labels``)."""
    stream = io.BytesIO()
    pickler = _Pickler(stream, shipment)
    pickler.dump(message)
    body = stream.getvalue()
    arrays = pickler.arrays
    sizes = [array.nbytes for array in arrays]
    spans = [-(-size // ALIGN) * ALIGN for size in sizes]
    offset = _allocate(arena, sum(spans)) if arrays else None
    parts = [PREFIX.pack(len(body), len(arrays), IN_FRAME if offset is None else offset)]
    parts += [SIZE.pack(size) for size in sizes]
    parts.append(body)
    if offset is None:
        parts += [array.tobytes() for array in arrays]
    else:
        assert arena is not None
        place = offset
        for array, span in zip(arrays, spans, strict=True):  # C order, whatever the layout
            np.copyto(np.ndarray(array.shape, array.dtype, buffer=arena.view, offset=place), array)
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


def unpack(frame: memoryview, arena: Arena, tables: dict[int, LabelTable] | None = None) -> Any:
    """The message of a whole frame, its arrays read-only views of ``arena`` (or of the frame);
    ``tables``: the label tables received on this connection so far (added to as they come)."""
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
    _reading.buffers = buffers
    try:
        with receiving({} if tables is None else tables):
            return pickle.loads(body)
    finally:
        _reading.buffers = None


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
    """Messages both ways, coalesced: everything posted in one event-loop turn goes out as one
    frame ``(released, messages)`` (one pickle, one arena block, one write), and each frame
    read comes in as ``on_frame(released, messages, block)``: ``released`` are blocks of the
    receiver's own arena the sender is done with, ``block`` the sender's arena block the
    messages' arrays are views of (None when they came in the frame)."""

    def __init__(self, incoming: Arena, outgoing: Arena) -> None:
        self.incoming = incoming
        self.outgoing = outgoing
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._queued: list[Any] = []
        self._flushing = False
        self._shipment = LabelShipment()  # tables the peer holds (this side sends answers)
        self._tables: dict[int, LabelTable] = {}  # tables the peer sent (this side reads them)
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
            released, messages = unpack(frame, self.incoming, self._tables)
            self.on_frame(released, messages, None if offset == IN_FRAME else offset)

    def on_frame(self, released: list[int], messages: list[Any], block: int | None) -> None:
        raise NotImplementedError

    def post(self, message: Any) -> None:
        """Queue a message for this turn's frame (``ConnectionError`` once closed)."""
        if self.transport is None or self.transport.is_closing():
            raise ConnectionError("the connection is closed")
        self._queued.append(message)
        self.flush_soon()

    def flush_soon(self) -> None:
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().call_soon(self._flush)

    def released(self) -> list[int]:
        """Blocks of the peer's arena to hand back with the next frame (none by default)."""
        return []

    def on_sent(self, messages: list[Any], block: int | None) -> None:
        """The frame holding ``messages`` went out; its arrays are in ``block``."""

    def on_unsent(self, messages: list[Any]) -> None:
        """The connection closed before ``messages`` could go out."""

    def _flush(self) -> None:
        self._flushing = False
        messages, self._queued = self._queued, []
        if self.transport is None or self.transport.is_closing():
            self.on_unsent(messages)
            return
        released = self.released()
        if not messages and not released:
            return
        frame, block = pack((released, messages), self.outgoing, self._shipment)
        self.on_sent(messages, block)
        self.transport.write(frame)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)
