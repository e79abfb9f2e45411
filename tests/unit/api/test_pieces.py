"""Answers made in pieces are the bytes one encoder call made: JSON and ``.npy`` alike, sent
with the ``Content-Length`` of the whole."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson
import pytest

from service.api.codec.pieces import (
    PIECE_BYTES,
    PIECE_VALUES,
    PieceResponse,
    json_pieces,
    npy_pieces,
    reply,
)
from service.api.codec.v2 import HEADER_LENGTH, encode
from service.api.codec.v2outputs import OutputPlan, OutputRequest
from service.api.codec.wire import json_bytes, npy_bytes
from service.messages import HeadInfo, InferResult, TopKResult

RNG = np.random.default_rng(0)
LONG_ROW = RNG.standard_normal((3, PIECE_VALUES * 2 + 7), dtype=np.float32)
SHORT_ROWS = RNG.standard_normal((500, 300), dtype=np.float32)
PAYLOADS: list[Any] = [
    LONG_ROW,  # rows cut themselves
    SHORT_ROWS,  # runs of rows per call
    RNG.standard_normal((2, 3, PIECE_VALUES // 2 + 1)),  # 3-D
    RNG.standard_normal(PIECE_VALUES * 3 + 1, dtype=np.float32),  # 1-D, as V2 sends data
    RNG.integers(-(2**40), 2**40, (40, 4000)),
    np.zeros((5, 0), np.float32),
    np.array([f"{i / 7:f}:{i}" for i in range(PIECE_VALUES + 3)], dtype=object),
    [[["ab", 'c"d'] * 300 for _ in range(60)] for _ in range(3)],  # the lens's token strings
    {"model": "m", "é": "ü", "logits": SHORT_ROWS, "token_ids": np.arange(9)},
    {"outputs": [{"name": "a", "data": LONG_ROW.reshape(-1)}, {"name": "b", "data": [1, 2]}]},
    {},
]


def _plain(value: Any) -> Any:
    """What today's callers hand one ``orjson`` call: string arrays as lists."""
    if isinstance(value, np.ndarray) and value.dtype.hasobject:
        return value.tolist()
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value


@pytest.mark.parametrize("payload", PAYLOADS, ids=range(len(PAYLOADS)))
def test_json_in_pieces_is_the_json_of_the_whole(payload: Any) -> None:
    pieces = json_pieces(payload)
    assert b"".join(pieces) == json_bytes(_plain(payload))


def test_a_large_answer_is_many_pieces_of_bounded_size() -> None:
    """Each piece joins a few encoder calls' output: more than one piece, none far past
    ``PIECE_BYTES`` plus one call's output."""
    pieces = json_pieces({"logits": LONG_ROW})
    longest_call = len(json_bytes(LONG_ROW[0, :PIECE_VALUES]))
    assert len(pieces) > 2
    assert max(len(piece) for piece in pieces) < PIECE_BYTES + longest_call


@pytest.mark.parametrize(
    "array",
    [
        SHORT_ROWS,
        np.zeros((4, 6), dtype=[("token_ids", np.int64, (3,)), ("logits", np.float32, (3,))]),
        np.float32(2.5).reshape(()),
        np.zeros((0, 7), np.float32),
        np.asfortranarray(SHORT_ROWS),  # np.save writes it itself
        SHORT_ROWS[:, ::2],
        RNG.standard_normal(PIECE_BYTES // 2 + 3),  # views of PIECE_BYTES
    ],
    ids=["rows", "records", "scalar", "empty", "fortran", "strided", "1-D"],
)
def test_npy_in_pieces_is_what_np_save_writes(array: npt.NDArray[Any]) -> None:
    assert b"".join(npy_pieces(array)) == npy_bytes(array)


def _sent(response: Any) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        messages.append(message)

    async def receive() -> Any:
        return {"type": "http.disconnect"}

    asyncio.run(response({"type": "http", "method": "POST"}, receive, send))
    return messages


def test_pieces_go_out_one_message_each_under_the_whole_length() -> None:
    pieces = npy_pieces(RNG.standard_normal(PIECE_BYTES // 2 + 3))
    response = reply(pieces, "application/x-npy", {"x-lmhead-model": "m"})
    assert isinstance(response, PieceResponse)
    start, *bodies = _sent(response)
    headers = dict(start["headers"])
    assert list(headers) == [b"x-lmhead-model", b"content-length", b"content-type"]
    assert int(headers[b"content-length"]) == sum(len(b["body"]) for b in bodies)
    assert all(isinstance(b["body"], bytes) for b in bodies)  # views copied as they go
    assert [b["more_body"] for b in bodies] == [True] * (len(pieces) - 1) + [False]
    assert b"".join(b["body"] for b in bodies) == b"".join(pieces)


def test_a_small_answer_is_one_plain_answer() -> None:
    """Small answers (nearly all) go in one write, as before."""
    small = npy_pieces(np.arange(6, dtype=np.float32))
    assert len(small) == 2  # header, data
    response = reply(small, "application/x-npy", {})
    assert not isinstance(response, PieceResponse)
    assert response.body == npy_bytes(np.arange(6, dtype=np.float32))


def test_v2_binary_outputs_follow_their_json_header() -> None:
    """A binary output's data is the array's own bytes, after the header it measures."""
    head = HeadInfo("m", 1, True, 100000, 4, "float32")
    logits = RNG.standard_normal((3, 100000), dtype=np.float32)
    topk = TopKResult(head, np.zeros((3, 1), np.int64), logits[:, :1], np.zeros(3, np.float32))
    result = InferResult(head, topk, logits)
    pieces, headers = encode(result, OutputPlan(None, [OutputRequest("logits", binary=True)]))
    body = b"".join(pieces)
    length = int(headers[HEADER_LENGTH])
    header = orjson.loads(body[:length])
    assert header["outputs"][0]["parameters"]["binary_data_size"] == logits.nbytes
    assert body[length:] == logits.tobytes()
    assert len(pieces) > 2
