"""The codecs' own promises: big work leaves the event loop; JSON numbers stay numbers."""

from __future__ import annotations

import asyncio

import numpy as np
import orjson
import pytest

from service.api.codec import native
from service.api.codec.answer_bodies import topk_json
from service.api.codec.wire import (
    JSON,
    OFFLOAD_BYTES,
    float_array,
    int_array,
    off_loop,
    options,
    parse_json_object,
)
from service.api.schemas import EmbedOptions, LensOptions
from service.errors import InvalidInput, MalformedBody
from service.messages import HeadInfo, LogitsResult, TopKResult

HEAD = HeadInfo("m", 1, True, 50000, 64, "float32")


def _loop_turns_during(work: object) -> int:
    """How often the event loop ran other tasks while ``work`` (a coroutine) was awaited."""

    async def scenario() -> int:
        turns = 0
        done = False

        async def ticker() -> None:
            nonlocal turns
            while not done:
                turns += 1
                await asyncio.sleep(0)  # a yield to the loop, not a wait

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        start = turns
        await work  # type: ignore[misc]
        done = True
        await task
        return turns - start

    return asyncio.run(scenario())


def test_a_large_json_answer_is_encoded_off_the_event_loop() -> None:
    logits = np.random.default_rng(0).standard_normal((64, 50000)).astype(np.float32)
    assert logits.nbytes * 3 > OFFLOAD_BYTES
    result = LogitsResult(HEAD, logits)
    assert _loop_turns_during(native.encode_logits(result, JSON)) > 0


def test_small_work_stays_inline() -> None:
    async def small() -> int:
        return await off_loop(10, int, "7")

    assert _loop_turns_during(small()) == 0


@pytest.mark.parametrize(
    ("value", "found"),
    [
        ([[1.5, "2.5"]], "strings"),
        ([[1.5, True]], "boolean"),
        ([[1.5], [2.5, 3.5]], "ragged"),
        ([[[[[[[[[[1.0]]]]]]]]]], "deeper than 8"),
    ],
)
def test_json_floats_are_numbers_only(value: list[object], found: str) -> None:
    with pytest.raises(InvalidInput, match=found):
        float_array(value, "hidden_states")


@pytest.mark.parametrize(
    ("value", "found"),
    [
        ([1.9, 2.9], "integers only"),
        (["1"], "integers only"),
        ([1, False], "boolean"),
        ([2**64], "beyond the int64 range|objects"),
    ],
)
def test_json_ids_are_integers_only(value: list[object], found: str) -> None:
    with pytest.raises(InvalidInput, match=found):
        int_array(value, "input_ids")


def test_a_large_topk_answer_is_encoded_in_pieces_that_read_as_one() -> None:
    """Rows encoded a piece at a time (the event loop gets the GIL between pieces) make the
    same document as the whole: every row, in order, with the answer's fields."""
    rng = np.random.default_rng(0)
    rows, k = 300, 500  # three pieces of 131 rows
    ids = rng.integers(0, 50000, (rows, k))
    values = -np.sort(rng.random((rows, k), dtype=np.float32), axis=1)
    lse = np.zeros(rows, np.float32)
    result = TopKResult(HEAD, ids.reshape(3, 100, k), values.reshape(3, 100, k), lse, values)
    document = orjson.loads(b"".join(topk_json(result)))
    assert (document["model"], document["k"], document["shape"]) == ("m", k, [3, 100])
    assert [row["token_ids"] for row in document["results"]] == ids.tolist()
    logprobs = np.array([row["logprobs"] for row in document["results"]], np.float32)
    np.testing.assert_array_equal(logprobs, values)


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (b'{"hidden_states": [[0.5, NaN]]}', "NaN or Infinity at byte 25"),
        (b'{"hidden_states": [[Infinity]]}', "NaN or Infinity at byte 20"),
        (b'{"hidden_states": [[0.5, -Infinity]]}', "NaN or Infinity at byte 26"),
        (b'{"k": inflate}', "unexpected character"),  # a bare word is no number
    ],
)
def test_non_standard_json_numbers_are_named(body: bytes, said: str) -> None:
    """orjson says "unexpected character": Python's json.dumps writes NaN and Infinity."""
    with pytest.raises(MalformedBody, match=said):
        parse_json_object(body)


def test_an_unknown_field_beside_no_options_names_what_the_body_takes() -> None:
    """``/embed`` has no options: its message listed nothing ("the options here are ")."""
    with pytest.raises(InvalidInput, match=r"^unknown field 'bogus'; input_ids alone$"):
        options(EmbedOptions, {"bogus": 1}, taken=("input_ids",))
    with pytest.raises(InvalidInput, match="the options here are hidden_states, k, states"):
        options(LensOptions, {"bogus": 1}, taken=("hidden_states",))
