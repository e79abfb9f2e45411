"""The shared-memory channel of ``LMHEAD_WORKERS``: arenas, frames and their arrays.

Messages must come back equal (any dtype, layout or size, in the arena or, when it is full,
in the frame), arrays must be read-only views of the sender's memory, and the allocator must
hand back exactly what was freed.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import os
import pickle
from typing import Any

import numpy as np
import pytest

from service.hosting.split.arena import ALIGN, Arena, ArenaFull
from service.hosting.split.channel import FrameProtocol, pack, unpack
from service.messages import HeadInfo, Target, TopKRequest, TopKResult
from service.repository.labels import LabelShipment, LabelTable, TokenStrings

ARRAYS: list[np.ndarray[Any, Any]] = [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3)),
    np.broadcast_to(np.arange(3, dtype=np.int64), (4, 3)),
    np.arange(20, dtype=np.float16)[::3],
    np.zeros((0, 5), np.float32),
    np.array(7, np.int64),
    np.array(["ab", "c"]),
]


@pytest.fixture
def arena() -> Arena:
    made, fd = Arena.create(1 << 20, "lmhead-test")
    os.close(fd)  # the descriptor a peer would get; the mapping stays
    return made


@pytest.mark.parametrize("in_arena", [True, False])
def test_messages_come_back_equal(arena: Arena, in_arena: bool) -> None:
    info = HeadInfo("m", 3, True, 997, 48, "float32")
    result = TopKResult(
        info, np.arange(6).reshape(2, 3), np.ones((2, 3), np.float32), np.ones(2, np.float32)
    )
    request = TopKRequest(Target("m", 2), np.ones((2, 48), np.float32), 3, 0.5, True)
    message = ([1, 2], [("ok", 9, result), ("call", 4, "topk", (request,)), *ARRAYS])
    frame, block = pack(message, arena if in_arena else None)
    assert (block is not None) == in_arena
    back = unpack(memoryview(frame), arena)
    assert back[0] == [1, 2]
    (_, _, got), (_, _, _, (asked,)), *arrays = back[1]
    assert got.head == info
    assert asked.target == Target("m", 2)
    assert asked.logprobs
    np.testing.assert_array_equal(got.token_ids, result.token_ids)
    np.testing.assert_array_equal(asked.hidden_states, request.hidden_states)
    for sent, read in zip(ARRAYS, arrays, strict=True):
        assert (read.dtype, read.shape) == (sent.dtype, sent.shape)
        np.testing.assert_array_equal(read, sent)
        assert not read.flags.writeable  # views of the sender's memory, never written


def test_arrays_are_views_of_the_arena(arena: Arena) -> None:
    """No copy on the reading side: the sender's block is what the receiver sees."""
    frame, block = pack(np.arange(4, dtype=np.int64), arena)
    assert block is not None
    read = unpack(memoryview(frame), arena)
    arena.view[block : block + 8] = np.int64(99).tobytes()
    assert read[0] == 99


def test_a_full_arena_sends_arrays_in_the_frame(arena: Arena) -> None:
    big = np.ones(arena.size // 4 + 1, np.float32)  # more than the whole arena
    frame, block = pack(big, arena)
    assert block is None
    assert len(frame) > big.nbytes
    np.testing.assert_array_equal(unpack(memoryview(frame), arena), big)


def test_the_allocator_hands_back_what_was_freed(arena: Arena) -> None:
    blocks = [arena.allocate(1000) for _ in range(8)]
    assert all(b % ALIGN == 0 for b in blocks)
    assert len(set(blocks)) == 8
    for block in blocks[::2] + blocks[1::2]:  # out of order: neighbours merge
        arena.free(block)
    assert arena.used_bytes == 0
    assert arena.allocate(arena.size) == 0  # one free block again, the whole arena
    with pytest.raises(ArenaFull):
        arena.allocate(1)
    arena.free(12345)  # unknown offsets (a stale release) are ignored


def test_frames_split_anywhere_are_read_whole(arena: Arena) -> None:
    """The stream arrives in arbitrary pieces; each frame is read once it is complete."""
    messages = [("ok", i, np.full(i + 1, i, np.int32)) for i in range(5)]
    stream = b"".join(pack(([i], [m]), arena)[0] for i, m in enumerate(messages))

    class Reader(FrameProtocol):
        def __init__(self) -> None:
            super().__init__(arena, arena)
            self.read: list[Any] = []

        def on_frame(self, released: list[int], messages: list[Any], block: int | None) -> None:
            self.read.append((released, messages))

    async def feed() -> list[Any]:
        reader = Reader()
        for start in range(0, len(stream), 7):
            reader.data_received(stream[start : start + 7])
        return reader.read

    read = asyncio.run(feed())
    assert [released for released, _ in read] == [[i] for i in range(5)]
    for (_, [(_, i, values)]), (_, j, sent) in zip(read, messages, strict=True):
        assert i == j
        np.testing.assert_array_equal(values, sent)


def _labelled(table: LabelTable, ids: list[list[int]]) -> TopKResult:
    token_ids = np.array(ids, np.int64)
    values = np.zeros(token_ids.shape, np.float32)
    info = HeadInfo("m", 1, True, len(table.strings), 8, "float32")
    return TopKResult(info, token_ids, values, values[:, 0], tokens=TokenStrings(table, token_ids))


def test_token_strings_cross_as_ids_once_the_table_is_there(arena: Arena) -> None:
    """The first answer of a head carries its labels; later ones only ids (a smaller frame)."""
    table = LabelTable.of([f"token-{i}" for i in range(500)], vocab_size=512)
    shipment, tables = LabelShipment(), dict[int, LabelTable]()
    sizes = []
    for ids in ([[3, 1], [511, 0]], [[7, 499], [2, 2]]):
        frame, block = pack(_labelled(table, ids), arena, shipment)
        sizes.append(len(frame))
        got = unpack(memoryview(frame), arena, tables)
        assert got.tokens == [[table.strings[i] for i in row] for row in ids]
        assert got.tokens[1][0] == (None if ids[1][0] >= 500 else f"token-{ids[1][0]}")
        assert block is not None
        arena.free(block)
    assert sizes[1] < sizes[0] / 10  # 500 strings went once
    assert list(tables) == [table.key]


def test_a_peer_holds_a_bounded_number_of_tables_and_none_is_sent_twice(arena: Arena) -> None:
    """Past the limit answers carry their strings (a table per answer cost a 128k-token head
    10 ms of engine time when heads took turns, found by a probe); a table the engine lets
    go (its version unloaded) is dropped on both sides, and its place goes to the next one."""
    made = [LabelTable.of([f"{n}:{i}" for i in range(2000)], 2000) for n in range(3)]
    shipment, tables = LabelShipment(limit=2), dict[int, LabelTable]()
    sizes = {}
    for round_ in range(2):
        for n, table in enumerate(made):
            frame, _ = pack(_labelled(table, [[1, 2]]), None, shipment)
            got = unpack(memoryview(frame), arena, tables)
            assert got.tokens == [[table.strings[1], table.strings[2]]]
            sizes[round_, n] = len(frame)
    assert set(tables) == {made[0].key, made[1].key}
    assert sizes[1, 0] < sizes[0, 0] / 10  # held: ids only
    assert sizes[1, 2] == sizes[0, 2] < sizes[0, 0] / 10  # never held: its two strings
    gone = made.pop(0).key
    gc.collect()
    frame, _ = pack(_labelled(made[1], [[3]]), None, shipment)
    assert unpack(memoryview(frame), arena, tables).tokens == [["2:3"]]
    assert set(tables) == {made[0].key, made[1].key}
    assert gone not in tables


def test_token_strings_outside_a_frame_are_the_list_they_stand_for() -> None:
    """Pickled elsewhere (Ray) they become a list of lists; a deep copy keeps its own ids."""
    table = LabelTable.of(["a", "b", "c"], 3)
    ids = np.array([[2, 0]], np.int64)
    tokens = TokenStrings(table, ids)
    assert pickle.loads(pickle.dumps(tokens)) == [["c", "a"]]
    assert type(pickle.loads(pickle.dumps(tokens))) is list
    copied = copy.deepcopy(tokens)
    ids[0, 0] = 1
    assert copied == [["c", "a"]]
    assert TokenStrings(table, ids) == [["b", "a"]]
