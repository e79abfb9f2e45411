"""The V2 wire beyond its datatypes: a request decoded into the data plane's message and the
plan of outputs to answer, every refusal with its exact message (messages say what to fix and
never echo more than a short cut of what was sent), the model's metadata, and the answer's
framing (JSON, or a JSON header and binary tensors)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import pytest
from starlette.requests import Request
from starlette.responses import Response

from service.api.codec.v2 import (
    HEADER_LENGTH,
    decode,
    decode_http,
    encode,
    encode_http,
    model_metadata,
)
from service.api.codec.v2outputs import OutputPlan, OutputRequest
from service.errors import InvalidInput, MalformedBody, PayloadTooLarge
from service.messages import HeadInfo, InferRequest, InferResult, Target, TopKResult

TARGET = Target("m", 2)
HEAD = HeadInfo("m", 3, False, 100, 2, "float32")
HIDDEN = {"name": "hidden_states", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}
IDS = {"name": "input_ids", "datatype": "INT64", "shape": [2], "data": [4, 5]}


def _decode(header: Any, binary: bytes = b"") -> tuple[InferRequest, OutputPlan]:
    text = json.dumps(header).encode()
    return decode(text + binary, str(len(text)) if binary else None, TARGET)


def _refused(header: Any, binary: bytes = b"") -> str:
    with pytest.raises((InvalidInput, MalformedBody)) as refused:
        _decode(header, binary)
    return str(refused.value)


def _outputs(*entries: dict[str, Any]) -> dict[str, Any]:
    return {"inputs": [HIDDEN], "outputs": list(entries)}


def test_a_request_becomes_the_planes_message_and_its_plan() -> None:
    request, plan = _decode(
        {
            "id": "r-7",
            "parameters": {"temperature": 0.5, "k": 3, "binary_data_output": True},
            "inputs": [HIDDEN | {"parameters": {"states": "residual"}}],
            "outputs": [
                {"name": "topk_token_ids", "parameters": {"k": 5}},
                {"name": "logits", "parameters": {"classification": 2, "binary_data": False}},
                {"name": "logsumexp"},
            ],
        }
    )
    assert request.target == TARGET
    assert request.hidden_states is not None
    assert request.hidden_states.tolist() == [[1.0, 2.0]]
    assert request.input_ids is None
    assert (request.k, request.temperature, request.states) == (5, 0.5, "residual")
    assert (request.full_logits, request.tokens, request.at_least_default_k) == (False, True, False)
    assert request.vocabulary is None
    assert plan == OutputPlan(
        "r-7",
        [
            OutputRequest("topk_token_ids", True, None, 5),
            OutputRequest("logits", False, 2, 3),
            OutputRequest("logsumexp", True, None, 3),
        ],
    )


def test_without_outputs_the_defaults_answer_at_the_requests_k_in_json() -> None:
    request, plan = _decode({"parameters": {"k": 4}, "inputs": [HIDDEN]})
    assert (request.k, request.temperature, request.states) == (4, 1.0, "final")
    assert (request.full_logits, request.tokens, request.at_least_default_k) == (
        False,
        False,
        False,
    )
    assert plan == OutputPlan(
        None,
        [
            OutputRequest("topk_token_ids", False, None, 4),
            OutputRequest("topk_logits", False, None, 4),
        ],
    )
    request, plan = _decode({"parameters": {"binary_data_output": True}, "inputs": [HIDDEN]})
    assert request.k is None
    assert [output.binary for output in plan.outputs] == [True, True]


def test_full_logits_are_run_only_for_the_logits_output_without_classification() -> None:
    full, _ = _decode(_outputs({"name": "logits"}))
    assert (full.full_logits, full.tokens) == (True, False)
    top, _ = _decode(_outputs({"name": "topk_logits"}))
    assert (top.full_logits, top.tokens) == (False, False)


def test_an_output_without_k_beside_one_with_a_k_keeps_the_default_width() -> None:
    """A 2-way classification must not narrow the top-k outputs to 2: the run is as wide as
    the model's default k, or the widest asked."""
    request, _ = _decode(
        _outputs(
            {"name": "topk_token_ids"}, {"name": "logits", "parameters": {"classification": 2}}
        )
    )
    assert (request.k, request.at_least_default_k, request.tokens) == (2, True, True)


def test_each_output_takes_the_inputs_it_needs_and_nothing_more() -> None:
    both = [HIDDEN, IDS]
    request, _ = _decode({"inputs": both, "outputs": [{"name": "embeddings"}]})
    assert request.hidden_states is None
    assert request.input_ids is not None
    assert request.input_ids.tolist() == [4, 5]
    request, _ = _decode({"inputs": both, "outputs": [{"name": "topk_token_ids"}]})
    assert request.hidden_states is not None
    assert request.input_ids is None
    request, _ = _decode({"inputs": [IDS]})  # embeddings by default
    assert request.input_ids is not None
    assert request.hidden_states is None


def test_the_states_may_be_given_on_the_hidden_states_input() -> None:
    request, _ = _decode({"inputs": [HIDDEN | {"parameters": {"states": "residual"}}]})
    assert request.states == "residual"
    request, _ = _decode({"parameters": {"states": "residual"}, "inputs": [HIDDEN]})
    assert request.states == "residual"


def test_the_distribution_options_reach_the_plane() -> None:
    request, _ = _decode({"parameters": {"logit_bias": {"5": 1.5}}, "inputs": [HIDDEN]})
    assert request.vocabulary is not None
    assert request.vocabulary.logit_bias == {"5": 1.5}


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ([1], "inference header must be a JSON object"),
        ({"parameters": [1], "inputs": [HIDDEN]}, "parameters must be a JSON object"),
        ({"inputs": []}, "inputs must be a non-empty list of tensors (hidden_states or input_ids)"),
        ({"inputs": {}}, "inputs must be a non-empty list of tensors (hidden_states or input_ids)"),
        ({"inputs": [7]}, "each input must be a JSON object with name, shape, datatype"),
        (
            {"inputs": [HIDDEN | {"name": "h" * 80}]},
            f"unknown input {'h' * 64!r}; inputs: hidden_states, input_ids, allowed_token_ids, "
            "banned_token_ids, stop_token_ids, token_bitmask, prompt_token_ids, "
            "output_token_ids, bad_words_ids, prompt_token_ids_lengths, "
            "output_token_ids_lengths, bad_words_ids_lengths",
        ),
        ({"inputs": [HIDDEN, HIDDEN]}, "input hidden_states is given twice; give each input once"),
        (
            {"inputs": [HIDDEN | {"datatype": "FP64-and-then-some"}]},
            "input hidden_states must have datatype FP32 or FP16, got 'FP64-and-then-so'",
        ),
        (
            {"inputs": [IDS | {"datatype": "FP32"}]},
            "input input_ids must have datatype INT64 or INT32, got 'FP32'",
        ),
        (
            {"inputs": [HIDDEN | {"data": None}]},
            "input hidden_states has no values: send them as data (a flat or nested list) or "
            "binary_data_size (over gRPC: contents or raw_input_contents)",
        ),
        (
            {"inputs": [HIDDEN | {"data": [1.0, 2.0, 3.0]}]},
            "input hidden_states: shape [1, 2] needs 2 values, got 3",
        ),
        (
            {"inputs": [HIDDEN | {"data": [1.0, "2"]}]},
            "input hidden_states must hold numbers only, got strings",
        ),
        (
            {"inputs": [IDS | {"data": [1, 2.5]}]},
            "input input_ids must hold integers only, got float64",
        ),
        (
            {"inputs": [HIDDEN], "outputs": [{"name": "embeddings"}]},
            "output embeddings needs the input input_ids",
        ),
        (
            {"inputs": [IDS], "outputs": [{"name": "logits"}]},
            "projection outputs need the input hidden_states",
        ),
        ({"id": 7, "inputs": [HIDDEN]}, "id must be a string, got a JSON int"),
        (
            {"inputs": [HIDDEN | {"parameters": [1]}]},
            "input hidden_states parameters must be a JSON object",
        ),
        ({"id": "i" * 257, "inputs": [HIDDEN]}, "id has 257 characters; at most 256"),
    ],
)
def test_each_refusal_says_what_to_fix(header: Any, message: str) -> None:
    assert _refused(header) == message


@pytest.mark.parametrize("shape", [[], [1, 1, 1, 1, 2], [True, 2], [-1, 2], [2**31, 2], [1, 2.0]])
def test_a_shape_of_one_to_four_dimensions_below_2_31_is_required(shape: list[Any]) -> None:
    message = "input hidden_states needs a shape of 1 to 4 non-negative integers below 2**31"
    assert _refused({"inputs": [HIDDEN | {"shape": shape}]}) == message


@pytest.mark.parametrize("shape", [[1, 1, 1, 2], [0, 2]])
def test_shapes_at_the_bounds_are_taken(shape: list[int]) -> None:
    data = [1.0, 2.0] if shape[0] else []
    request, _ = _decode({"inputs": [HIDDEN | {"shape": shape, "data": data}]})
    assert request.hidden_states is not None
    assert list(request.hidden_states.shape) == shape


def test_a_largest_dimension_is_checked_against_the_data_not_refused_as_a_shape() -> None:
    message = f"input input_ids: shape [{2**31 - 1}] needs {2**31 - 1} values, got 2"
    assert _refused({"inputs": [IDS | {"shape": [2**31 - 1]}]}) == message


def test_an_id_of_256_characters_is_echoed_whole() -> None:
    _, plan = _decode({"id": "i" * 256, "inputs": [HIDDEN]})
    assert plan.request_id == "i" * 256


@pytest.mark.parametrize("word", ["true", "false"])
def test_a_json_boolean_among_the_numbers_is_refused(word: str) -> None:
    """numpy reads ``true`` as 1: the header is scanned for booleans when it holds either word."""
    for tensor in (HIDDEN, IDS):
        text = json.dumps({"inputs": [tensor | {"data": [1, 0]}]}).replace("[1, 0]", f"[1, {word}]")
        with pytest.raises(InvalidInput, match="found a JSON boolean"):
            decode(text.encode(), None, TARGET)


def test_a_header_that_is_not_json_is_malformed() -> None:
    with pytest.raises(MalformedBody) as refused:
        decode(b"{nope", None, TARGET)
    assert str(refused.value).startswith("inference header is not valid JSON (")


def _binary_input(size: Any, name: str = "input_ids") -> dict[str, Any]:
    return {
        "name": name,
        "datatype": "INT64",
        "shape": [2],
        "parameters": {"binary_data_size": size},
    }


def test_binary_inputs_follow_the_header_in_order() -> None:
    raw = np.array([7, 9], "<i8").tobytes()
    hidden = np.array([[0.5, 1.5]], "<f4").tobytes()
    tensor = HIDDEN | {"parameters": {"binary_data_size": 8}}
    del tensor["data"]
    request, _ = _decode({"inputs": [_binary_input(16), tensor]}, raw + hidden)
    assert request.input_ids is None  # no embeddings asked
    assert request.hidden_states is not None
    assert request.hidden_states.tolist() == [[0.5, 1.5]]  # read at its offset, 16
    request, _ = _decode(
        {"inputs": [_binary_input(16), tensor], "outputs": [{"name": "embeddings"}]}, raw + hidden
    )
    assert request.input_ids is not None
    assert request.input_ids.tolist() == [7, 9]


@pytest.mark.parametrize(
    ("size", "binary", "message"),
    [
        (
            True,
            b"\0" * 16,
            "input input_ids: binary_data_size must be an integer, got a JSON boolean",
        ),
        (
            "16",
            b"\0" * 16,
            "input input_ids: binary_data_size must be an integer, got a JSON string",
        ),
        (16, b"\0" * 8, "input input_ids: needs 16 bytes at offset 0, the body has 8"),
        (16, b"\0" * 20, "binary inputs use 16 bytes but the body carries 20 after the header"),
    ],
)
def test_binary_sizes_are_checked_against_the_body(size: Any, binary: bytes, message: str) -> None:
    assert _refused({"inputs": [_binary_input(size)]}, binary) == message


@pytest.mark.parametrize(
    ("length", "message"),
    [
        ("twelve", f"{HEADER_LENGTH} must be a byte count, got 'twelve'"),
        ("9" * 40, f"{HEADER_LENGTH} must be a byte count, got '{'9' * 32}'"),
        ("100", f"{HEADER_LENGTH} is 100 but the body has only 99 bytes"),
    ],
)
def test_the_header_length_must_be_a_count_within_the_body(length: str, message: str) -> None:
    with pytest.raises(MalformedBody) as refused:
        decode(b"{" + b" " * 97 + b"}", length, TARGET)
    assert str(refused.value) == message


def test_a_header_length_of_the_whole_body_leaves_no_binary_part() -> None:
    text = json.dumps({"inputs": [HIDDEN]}).encode()
    request, _ = decode(text, str(len(text)), TARGET)
    assert request.hidden_states is not None


def test_the_metadata_describes_the_models_inputs_and_outputs() -> None:
    described = model_metadata(HEAD, [1, 3])
    assert described == {
        "name": "m",
        "versions": ["1", "3"],
        "platform": "onnx_onnxv1",
        "inputs": [
            {"name": "hidden_states", "datatype": "FP32", "shape": [-1, 2]},
            {"name": "input_ids", "datatype": "INT64", "shape": [-1]},
        ],
        "outputs": [
            {"name": "topk_token_ids", "datatype": "INT64", "shape": [-1, -1]},
            {"name": "topk_logits", "datatype": "FP32", "shape": [-1, -1]},
            {"name": "topk_logprobs", "datatype": "FP32", "shape": [-1, -1]},
            {"name": "logsumexp", "datatype": "FP32", "shape": [-1]},
            {"name": "logits", "datatype": "FP32", "shape": [-1, 100]},
            {"name": "embeddings", "datatype": "FP32", "shape": [-1, 2]},
            {"name": "sampled_token_ids", "datatype": "INT64", "shape": [-1]},
            {"name": "sampled_logprobs", "datatype": "FP32", "shape": [-1]},
        ],
        "parameters": {"tied": False, "version": 3, "dtype": "float32"},
    }
    quantized = HeadInfo("q", 1, True, 100, 2, "int4", block_size=32, table_quantized=True)
    assert model_metadata(quantized, [1])["parameters"] == {
        "tied": True,
        "version": 1,
        "dtype": "int4",
        "bits": 4,
        "block_size": 32,
        "table_quantized": True,
    }


def _body(encoded: Any) -> bytes:
    """``encode``'s answer as one byte string (whole, or its pieces joined)."""
    if isinstance(encoded, bytes | bytearray):
        return bytes(encoded)
    return b"".join(bytes(piece) for piece in encoded)


def _topk() -> InferResult:
    ids = np.array([[7, 3, 1]], np.int64)
    logits = np.array([[2.5, 1.0, 0.5]], np.float32)
    lse = np.array([3.0], np.float32)
    return InferResult(HEAD, TopKResult(HEAD, ids, logits, lse, logits - lse[:, None]))


def test_a_json_answer_names_the_model_and_carries_each_output_flat() -> None:
    plan = OutputPlan(
        "r-1",
        [
            OutputRequest("logits", False, classification=2),
            OutputRequest("topk_token_ids", False, k=2),
        ],
    )
    pieces, headers = encode(_topk(), plan)
    assert headers == {"content-type": "application/json"}
    assert json.loads(_body(pieces)) == {
        "model_name": "m",
        "model_version": "3",
        "id": "r-1",
        "outputs": [
            {
                "name": "logits",
                "datatype": "BYTES",
                "shape": [1, 2],
                "data": ["2.500000:7", "1.000000:3"],
            },
            {"name": "topk_token_ids", "datatype": "INT64", "shape": [1, 2], "data": [7, 3]},
        ],
    }


def test_a_binary_answer_is_a_json_header_then_the_tensors_raw() -> None:
    plan = OutputPlan(None, [OutputRequest("topk_token_ids", True, k=2)])
    pieces, headers = encode(_topk(), plan)
    body = _body(pieces)
    length = int(headers[HEADER_LENGTH])
    assert headers["content-type"] == "application/octet-stream"
    assert set(headers) == {"content-type", HEADER_LENGTH}
    header = json.loads(body[:length])
    assert "id" not in header
    assert header["outputs"] == [
        {
            "name": "topk_token_ids",
            "datatype": "INT64",
            "shape": [1, 2],
            "parameters": {"binary_data_size": 16},
        }
    ]
    assert body[length:] == (7).to_bytes(8, "little") + (3).to_bytes(8, "little")


def _http(body: bytes, headers: list[tuple[bytes, bytes]], version: str = "2") -> Request:
    """A Starlette request for ``/v2/models/m/versions/{version}/infer`` with ``body``."""
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    scope = {
        "type": "http",
        "method": "POST",
        "path": f"/v2/models/m/versions/{version}/infer",
        "headers": headers,
        "query_string": b"",
        "path_params": {"name": "m", "version": version},
    }
    return Request(scope, receive)


def test_an_http_request_is_split_at_its_header_length_for_the_paths_version() -> None:
    text = json.dumps({"inputs": [_binary_input(16)], "outputs": [{"name": "embeddings"}]})
    raw = np.array([7, 9], "<i8").tobytes()
    length = [(HEADER_LENGTH.encode(), str(len(text)).encode())]
    request, plan = asyncio.run(decode_http(_http(text.encode() + raw, length), 1 << 20))
    assert request.target == Target("m", 2)
    assert request.input_ids is not None
    assert request.input_ids.tolist() == [7, 9]
    assert plan.outputs == [OutputRequest("embeddings", False)]


def test_an_http_request_with_two_header_lengths_is_malformed() -> None:
    body = json.dumps({"inputs": [HIDDEN]}).encode()
    twice = [(HEADER_LENGTH.encode(), str(len(body)).encode())] * 2
    with pytest.raises(MalformedBody) as refused:
        asyncio.run(decode_http(_http(body, twice), 1 << 20))
    assert str(refused.value) == f"{HEADER_LENGTH} is given more than once"
    once = asyncio.run(decode_http(_http(body, twice[:1]), 1 << 20))
    assert once[0].hidden_states is not None


def test_an_http_body_past_the_limit_is_refused() -> None:
    body = json.dumps({"inputs": [HIDDEN]}).encode()
    with pytest.raises(PayloadTooLarge, match=f"exceeds the limit of {len(body) - 1} bytes"):
        asyncio.run(decode_http(_http(body, []), len(body) - 1))


async def _sent(response: Response) -> tuple[dict[str, str], bytes]:
    """What the response sends: its headers and its body, as a server would write them."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(message)

    await response({"type": "http", "method": "POST", "path": "/"}, receive, send)
    headers = {key.decode(): value.decode() for key, value in sent[0]["headers"]}
    return headers, b"".join(message.get("body", b"") for message in sent[1:])


@pytest.mark.parametrize("tied", [True, False])
def test_an_http_answer_names_the_version_that_answered(tied: bool) -> None:
    head = HeadInfo("m", 3, tied, 100, 2, "float32")
    result = InferResult(head, embeddings=np.array([[0.5, 1.5]], np.float32))
    plan = OutputPlan(None, [OutputRequest("embeddings", True)])
    headers, body = asyncio.run(_sent(asyncio.run(encode_http(result, plan))))
    assert headers["x-lmhead-model"] == "m"
    assert headers["x-lmhead-version"] == "3"
    assert headers["x-lmhead-tied"] == ("true" if tied else "false")
    assert headers["content-type"] == "application/octet-stream"
    length = int(headers[HEADER_LENGTH])
    assert int(headers["content-length"]) == len(body)
    assert json.loads(body[:length])["outputs"][0]["parameters"] == {"binary_data_size": 8}
    assert body[length:] == np.array([0.5, 1.5], "<f4").tobytes()
    plan = OutputPlan(None, [OutputRequest("logits", False, classification=2)])
    headers, body = asyncio.run(_sent(asyncio.run(encode_http(_topk(), plan))))
    assert headers["content-type"] == "application/json"
    assert json.loads(body)["outputs"][0]["data"] == ["2.500000:7", "1.000000:3"]
