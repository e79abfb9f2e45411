"""The decoding step's options off the wire: a JSON body's lists of lists, a binary body's
values and lengths, the scalars beside them; each shape the wire cannot carry refused, named."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest

from service.api.codec.decoding_wire import binary_arrays, decoding, json_arrays
from service.api.schemas import TopKOptions
from service.client.calls import Calls
from service.errors import InvalidInput
from service.npyio import NpyError, read_npz_body


def test_json_lists_of_lists_become_values_and_lengths() -> None:
    values: dict[str, Any] = {
        "prompt_token_ids": [[1, 2], [], [3]],
        "token_bitmask": [[-1, 7]],
        "stop_token_ids": None,
        "k": 3,
    }
    arrays = json_arrays(values, booleans=False)
    assert values == {"k": 3}  # taken out; a null is not given
    prompts = arrays["prompt_token_ids"]
    assert prompts.values.tolist() == [1, 2, 3]
    assert prompts.lengths.tolist() == [2, 0, 1]
    assert arrays["token_bitmask"].tolist() == [[-1, 7]]
    assert "stop_token_ids" not in arrays


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([1, 2], "output_token_ids must be a list of lists of token ids .one per row., got"),
        ({"a": 1}, "must be a list of lists of token ids"),
        ([[1, [2]]], "output_token_ids"),
        ([[1.5]], "output_token_ids must hold integers only"),
        ([[True]], "output_token_ids must hold integers only, got booleans"),
    ],
)
def test_json_lists_the_wire_cannot_carry_are_refused(value: Any, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        json_arrays({"output_token_ids": value}, booleans=True)


def test_binary_lists_come_as_values_and_lengths_together() -> None:
    entries = {
        "bad_words_ids": np.array([4, 5, 6]),
        "bad_words_ids_lengths": np.array([1, 2]),
        "token_bitmask": np.array([[-1]], np.int32),
        "hidden_states": np.zeros((1, 2), np.float32),
    }
    arrays = binary_arrays(entries)
    assert list(entries) == ["hidden_states"]
    assert arrays["bad_words_ids"].lengths.tolist() == [1, 2]
    with pytest.raises(InvalidInput, match="prompt_token_ids_lengths is missing"):
        binary_arrays({"prompt_token_ids": np.array([1])})
    with pytest.raises(InvalidInput, match="prompt_token_ids is missing"):
        binary_arrays({"prompt_token_ids_lengths": np.array([1])})
    with pytest.raises(InvalidInput, match="token_bitmask must hold integers, got float32"):
        binary_arrays({"token_bitmask": np.zeros(3, np.float32)})


def test_the_step_is_asked_by_any_of_its_options_and_only_then() -> None:
    assert decoding(TopKOptions(), {}) is None
    assert decoding(TopKOptions(k=3, temperature=0.5), {"allowed_token_ids": [1]}) is None
    asked = decoding(TopKOptions(repetition_penalty=1.2, processor_order="vllm"), {})
    assert asked is not None
    assert (asked.repetition_penalty, asked.processor_order) == (1.2, "vllm")
    by_array = decoding({"min_tokens": 2}, {"stop_token_ids": np.array([2])})
    assert by_array is not None
    assert by_array.min_tokens == 2
    assert by_array.stop_token_ids is not None


def _npz(arrays: dict[str, Any], compressed: bool = False) -> bytes:
    buffer = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buffer, **arrays)
    return buffer.getvalue()


def test_an_npz_body_is_read_stored_entry_by_entry() -> None:
    hidden = np.arange(6, dtype=np.float32).reshape(2, 3)
    read = read_npz_body(
        _npz({"hidden_states": hidden, "token_bitmask": np.array([[-1]], np.int32)})
    )
    np.testing.assert_array_equal(read["hidden_states"], hidden)
    assert read["token_bitmask"].dtype == np.int32
    with pytest.raises(NpyError, match="'x' is compressed; send it stored"):
        read_npz_body(_npz({"x": np.zeros(4)}, compressed=True))
    with pytest.raises(NpyError, match="not a .npz"):
        read_npz_body(b"PK not really")
    with pytest.raises(NpyError, match="at most 32"):
        read_npz_body(_npz({f"a{i}": np.zeros(1) for i in range(33)}))


def test_the_client_sends_array_options_as_npz_entries_and_scalars_in_the_query() -> None:
    calls = Calls(binary=True, token=None)
    hidden = np.zeros((2, 4), np.float32)
    options = {
        "output_token_ids": [[1, 2], [3]],
        "token_bitmask": np.array([[-1]], np.int32),
        "allowed_token_ids": np.arange(1000),
        "repetition_penalty": 1.1,
        "sample": {"n": 2, "seed": None},
    }
    call = calls.topk("m", hidden, 3, True, 1.0, False, None, options)
    assert call.headers is not None
    assert call.headers["content-type"] == "application/x-npz"
    assert call.params == {
        "logprobs": "true",
        "temperature": "1.0",
        "repetition_penalty": "1.1",
        "sample": '{"n": 2}',
        "k": "3",
    }
    assert call.content is not None
    entries = read_npz_body(call.content)
    assert sorted(entries) == [
        "allowed_token_ids",
        "hidden_states",
        "output_token_ids",
        "output_token_ids_lengths",
        "token_bitmask",
    ]
    assert entries["output_token_ids_lengths"].tolist() == [2, 1]
    assert entries["token_bitmask"].dtype == np.int32
    plain = calls.topk("m", hidden, 3, False, 1.0, False, None, {})
    assert plain.headers is not None
    assert plain.headers["content-type"] == "application/x-npy"
