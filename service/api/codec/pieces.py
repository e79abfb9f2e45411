"""Large answers encoded and sent in pieces, so that the event loop never waits long for the GIL.

One ``orjson.dumps`` of a 2,048-row ``/logits`` answer (715 MB of JSON) held the GIL for ~2 s:
in a worker thread still, the event loop could not run, and ``/health/live`` answered after
1.7-3.5 s (a Kubernetes probe gives up after 1 s). Copying 262 MB of ``.npy`` into one buffer
held it ~150 ms, and a 715 MB body written at once held the loop until the client had read it.
Here an answer is made a piece at a time instead: ``json_pieces`` encodes at most
``PIECE_VALUES`` values per encoder call (~1 ms of GIL), and the interpreter hands the GIL to
the loop between calls; ``array_pieces`` cuts an array's memory into views, copied a piece at a
time only as each is sent. ``PieceResponse`` sends the pieces one per turn of the event loop,
none while the client's connection is paused (uvicorn's flow control). The bytes are exactly
those one encoder call would have made, ``Content-Length`` included: the pieces are all made
before the head is sent, so the answer holds the memory its request was charged for, as before.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from service.api.codec.wire import json_bytes, npy_bytes

#: Values one encoder call takes: ~1 ms of GIL for float32 logits (~360 KB of JSON).
PIECE_VALUES = 1 << 15
#: Pieces of an answer are about this long when sent (encoder calls' output joined), and an
#: array's memory is sent in views this long. Below the 1 MiB from which every buffer is mapped
#: alone (``service.allocator``): pieces of 1 MiB, each mapped fresh, page-faulted and unmapped,
#: took twice as long to send. An answer no longer goes as one piece, in a plain ``Response``.
PIECE_BYTES = 1 << 18

Piece = bytes | memoryview


def json_pieces(value: Any) -> list[Piece]:
    """The bytes of ``json_bytes(value)``, as pieces each made by short encoder calls.

    Dicts and lists are walked; a numpy array or a list of more than ``PIECE_VALUES`` values
    is encoded a few rows at a time (rows cut further when one row alone is too long), in
    C order; anything else in one call. An object array (strings) is encoded as its
    ``tolist()``."""
    if _values_within(value, PIECE_VALUES):  # a small answer: one encoder call, if it can
        try:
            return [json_bytes(value)]
        except TypeError:  # strings or a strided view inside: walked below
            pass
    fragments: list[Piece] = []
    _encode(value, fragments)
    return joined(fragments)


def _values_within(value: Any, budget: int) -> bool:
    """Whether ``value`` holds at most ``budget`` values in its arrays and lists (dicts and
    lists of dicts walked, as ``_encode`` walks them)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list) and item and isinstance(item[0], dict):
            pending.extend(item)
        elif isinstance(item, np.ndarray | list):
            budget -= _values(item)
            if budget < 0:
                return False
    return True


def _encode(value: Any, out: list[Piece]) -> None:
    if isinstance(value, dict):
        out.append(b"{")
        for index, (key, item) in enumerate(value.items()):
            out.append((b"," if index else b"") + json_bytes(key) + b":")
            _encode(item, out)
        out.append(b"}")
    elif isinstance(value, list) and value and isinstance(value[0], dict):  # V2's outputs
        out.append(b"[")
        for index, item in enumerate(value):
            if index:
                out.append(b",")
            _encode(item, out)
        out.append(b"]")
    elif isinstance(value, np.ndarray | list) and _values(value) > PIECE_VALUES:
        _rows(value, out)
    else:
        out.append(_whole(value))


def _values(value: npt.NDArray[Any] | list[Any]) -> int:
    """How many values ``value`` holds (a nested list read as rectangular, as numpy reads it)."""
    if isinstance(value, np.ndarray):
        return value.size
    count = 1
    while isinstance(value, list):
        count *= len(value)
        if not value:
            return 0
        value = value[0]
    return count


def _rows(value: npt.NDArray[Any] | list[Any], out: list[Piece]) -> None:
    """``value`` (more than ``PIECE_VALUES`` values), a run of rows per encoder call: each run's
    brackets dropped, the runs joined with commas; a row too long alone is cut itself."""
    row = value[0]
    per_row = _values(row) if isinstance(row, np.ndarray | list) else 1
    step = max(1, PIECE_VALUES // max(1, per_row))
    out.append(b"[")
    if per_row > PIECE_VALUES:
        for index in range(len(value)):
            if index:
                out.append(b",")
            _rows(value[index], out)
    else:
        for start in range(0, len(value), step):
            if start:
                out.append(b",")
            out.append(memoryview(_whole(value[start : start + step]))[1:-1])
    out.append(b"]")


def _whole(value: Any) -> bytes:
    """One encoder call: numpy arrays as orjson writes them (C order: a view is copied first),
    arrays of strings or objects as lists (orjson takes numbers only)."""
    if isinstance(value, np.ndarray):
        strings = value.dtype.kind in "OUS"
        value = value.tolist() if strings else np.require(value, requirements="C")
    return json_bytes(value)


def joined(fragments: list[Piece]) -> list[Piece]:
    """``fragments`` joined into pieces of about ``PIECE_BYTES`` (an encoder call's output is
    one, or part of one): few ``send`` calls, each copy of the join short."""
    pieces: list[Piece] = []
    run: list[Piece] = []
    size = 0
    for fragment in fragments:
        run.append(fragment)
        size += len(fragment)
        if size >= PIECE_BYTES:
            pieces.append(b"".join(run))
            run, size = [], 0
    if run or not pieces:
        pieces.append(b"".join(run))
    return pieces


def array_pieces(array: npt.NDArray[Any]) -> list[Piece]:
    """An array's bytes in C order (``array.tobytes()``), as views of ``PIECE_BYTES``: no copy
    of the whole; ``PieceResponse`` copies each view as it sends it."""
    array = np.require(array, requirements="C")
    data = array.reshape(-1).view(np.uint8).data
    return [data[start : start + PIECE_BYTES] for start in range(0, len(data), PIECE_BYTES)]


def npy_pieces(array: npt.NDArray[Any]) -> list[Piece]:
    """``np.save``'s bytes of ``array``: its header, then its memory as ``array_pieces``; an
    array ``np.save`` would write otherwise (Fortran order, a header past version 1.0's
    64 KiB) is written by it, whole."""
    header = _NpyHeader()
    try:
        if not array.flags.c_contiguous or array.dtype.hasobject:
            raise ValueError("not C-ordered numbers")
        data = np.lib.format.header_data_from_array_1_0(array)
        np.lib.format.write_array_header_1_0(header, data)
    except ValueError:
        return [npy_bytes(array)]
    return [bytes(header.data), *array_pieces(array)]


class _NpyHeader:
    """A file object that ``numpy.lib.format`` writes a header into."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data


def size(pieces: Sequence[Piece]) -> int:
    return sum(len(piece) for piece in pieces)


class PieceResponse(Response):
    """An answer sent as the pieces it was made in: one ``http.response.body`` each, then a
    turn of the event loop (uvicorn's ``send`` returns without one while the client keeps up,
    and 715 MB read that fast held the loop for the whole send); uvicorn waits, before each,
    while the connection's writing is paused. Views are copied as they go (the memory they
    show may be an engine's arena block, released once the request is done, before the
    transport's last bytes leave); each piece is let go once sent."""

    def __init__(
        self, pieces: list[Piece], media_type: str | None, headers: Mapping[str, str]
    ) -> None:
        self._pieces = deque(pieces)
        super().__init__(
            None, headers={**headers, "content-length": str(size(pieces))}, media_type=media_type
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = {"type": "http.response.start", "status": self.status_code}
        await send({**start, "headers": self.raw_headers})
        pieces = self._pieces
        while True:
            piece = pieces.popleft() if pieces else b""
            body = piece if isinstance(piece, bytes) else bytes(piece)
            await send({"type": "http.response.body", "body": body, "more_body": bool(pieces)})
            if not pieces:
                return
            await asyncio.sleep(0)  # the loop's other work between two pieces


def reply(pieces: list[Piece], media_type: str | None, headers: Mapping[str, str]) -> Response:
    """The answer: a ``PieceResponse`` when it is large, else a plain ``Response`` of its
    pieces joined (every small answer: one write, no turn of the loop between pieces)."""
    if size(pieces) > PIECE_BYTES:
        return PieceResponse(pieces, media_type, headers)
    body = pieces[0] if len(pieces) == 1 and isinstance(pieces[0], bytes) else b"".join(pieces)
    return SmallResponse(body, media_type, headers)


class SmallResponse(Response):
    """A 200 with its whole body: Starlette's ``Response`` with the same headers in the same
    order (given ones lower-cased, then content-length and content-type unless given), made
    without its general path (rendering, charset rules: answers here are bytes, never
    ``text/*``)."""

    def __init__(self, body: bytes, media_type: str | None, headers: Mapping[str, str]) -> None:
        self.status_code = 200
        self.background = None
        self.body = body
        if media_type is not None:
            self.media_type = media_type
        raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        given = {name for name, _ in raw}
        if b"content-length" not in given:
            raw.append((b"content-length", b"%d" % len(body)))
        if media_type is not None and b"content-type" not in given:
            raw.append((b"content-type", media_type.encode("latin-1")))
        self.raw_headers = raw
