"""The V2 wire of speculative verification (``v2_verify``, ``grpc_verify``): an infer with the
input ``draft_token_ids`` decodes to the plane's ``VerifyRequest`` (every array as a tensor,
the options as parameters), any other stays an infer; outputs named as the native answer,
refusals with their messages; answers as JSON (NaN padding as null) and binary tensors, and
over gRPC with the parameter ``logprobs_mode``."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from service.api.codec import grpc_verify
from service.api.codec.pieces import Piece
from service.api.codec.v2 import HEADER_LENGTH, encode_arrays
from service.api.codec.v2_verify import VERIFY_OUTPUTS, VerifyCall, decode, outputs
from service.api.codec.v2outputs import OutputPlan, OutputRequest
from service.errors import InvalidInput
from service.messages import HeadInfo, InferRequest, Target
from service.verify_messages import VerifyResult

TARGET = Target("m", None)
HEAD = HeadInfo("m", 3, True, 100, 2, "float32")
HIDDEN = {"name": "hidden_states", "datatype": "FP32", "shape": [1, 3, 2], "data": [0.5] * 6}
DRAFTS = {"name": "draft_token_ids", "datatype": "INT64", "shape": [1, 2], "data": [4, 5]}


def _tensor(name: str, array: Any, kind: str = "INT64") -> dict[str, Any]:
    array = np.asarray(array)
    return {"name": name, "datatype": kind, "shape": list(array.shape), "data": array.tolist()}


def _verify(header: dict[str, Any]) -> VerifyCall:
    decoded = decode(json.dumps(header).encode(), None, TARGET)
    assert isinstance(decoded, VerifyCall)
    return decoded


def test_a_request_with_draft_token_ids_is_a_verification() -> None:
    call = _verify(
        {
            "id": "v-1",
            "inputs": [
                HIDDEN | {"parameters": {"states": "residual"}},
                DRAFTS,
                _tensor("draft_parents", [-1, 0]),
                _tensor("seeds", [9]),
                _tensor("allowed_token_ids", [[4, 5, 6]], "INT32"),
                _tensor("output_token_ids", [1, 2]),
                _tensor("output_token_ids_lengths", [2]),
                _tensor("draft_hidden_states", np.ones((1, 2, 3)), "FP32"),
            ],
            "parameters": {
                "temperature": 0.5,
                "draft_model": "small",
                "sample": {"top_p": 0.9},
                "presence_penalty": 0.5,
                "binary_data_output": True,
            },
            "outputs": [
                {"name": "token_ids"},
                {"name": "seed", "parameters": {"binary_data": False}},
            ],
        }
    )
    request = call.request
    assert request.hidden_states.shape == (1, 3, 2)
    assert request.draft_token_ids.tolist() == [[4, 5]]
    assert request.draft_parents is not None
    assert request.draft_parents.tolist() == [-1, 0]
    assert request.seeds is not None
    assert request.seeds.tolist() == [9]
    assert request.draft_probs is None
    assert (request.temperature, request.states, request.draft_model) == (0.5, "residual", "small")
    assert request.draft_hidden_states is not None
    assert request.draft_hidden_states.shape == (1, 2, 3)
    vocabulary = request.vocabulary
    assert vocabulary is not None
    assert vocabulary.allowed_token_ids is not None
    assert vocabulary.allowed_token_ids.tolist() == [[4, 5, 6]]
    assert vocabulary.sample is not None
    assert vocabulary.sample.top_p == 0.9
    assert vocabulary.decoding is not None
    assert vocabulary.decoding.presence_penalty == 0.5
    assert vocabulary.decoding.output_token_ids is not None
    assert call.plan == OutputPlan(
        "v-1", [OutputRequest("token_ids", True), OutputRequest("seed", False)]
    )


def test_without_draft_token_ids_it_stays_an_infer() -> None:
    decoded = decode(json.dumps({"inputs": [HIDDEN | {"shape": [3, 2]}]}).encode(), None, TARGET)
    assert not isinstance(decoded, VerifyCall)
    assert isinstance(decoded[0], InferRequest)


def test_every_output_by_default() -> None:
    call = _verify({"inputs": [HIDDEN, DRAFTS]})
    assert [output.name for output in call.plan.outputs] == list(VERIFY_OUTPUTS)
    assert call.request.vocabulary is None
    assert call.request.temperature == 1.0


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (
            {"inputs": [HIDDEN, DRAFTS], "parameters": {"k": 3}},
            "parameter k does not apply to a verification (a request with the input "
            "draft_token_ids); its outputs are accepted, token_ids, logprobs, nodes, seed",
        ),
        (
            {"inputs": [DRAFTS]},
            "a verification (the input draft_token_ids) needs the input hidden_states "
            "(sequences, K + 1, d_model)",
        ),
        (
            {"inputs": [HIDDEN, DRAFTS, _tensor("input_ids", [1])]},
            "unknown input 'input_ids'; inputs: hidden_states, draft_token_ids, draft_probs",
        ),
        (
            {"inputs": [HIDDEN, DRAFTS], "outputs": [{"name": "topk_token_ids"}]},
            "unknown output 'topk_token_ids' of a verification (the input draft_token_ids); "
            "outputs: accepted, token_ids, logprobs, nodes, seed",
        ),
        (
            {"inputs": [HIDDEN, DRAFTS], "outputs": [{"name": "logprobs", "parameters": {"k": 2}}]},
            "output logprobs takes only the parameter binary_data, got 'k'",
        ),
        (
            {"inputs": [HIDDEN, DRAFTS], "outputs": [{"name": "seed"}, {"name": "seed"}]},
            "output 'seed' is requested twice; name each output once",
        ),
        (
            {"inputs": [HIDDEN, DRAFTS], "parameters": {"draft_model": 3}},
            "parameter draft_model must be a string: a model of the repository",
        ),
        (
            {"inputs": [HIDDEN, DRAFTS | {"datatype": "FP32"}]},
            "input draft_token_ids must have datatype INT64 or INT32",
        ),
    ],
)
def test_refusals_name_what_to_fix(header: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        _verify(header)
    assert str(refused.value).startswith(message)


def _result() -> VerifyResult:
    return VerifyResult(
        HEAD,
        np.array([2, 0], np.int64),
        np.array([[4, 5, 7], [8, -1, -1]], np.int64),
        np.array([[-0.5, -1.0, -2.0], [-0.25, np.nan, np.nan]], np.float32),
        np.array([[0, 1], [-1, -1]], np.int64),
        np.array([9, 10], np.int64),
        "processed",
    )


def _joined(pieces: list[Piece]) -> bytes:
    return b"".join(bytes(piece) for piece in pieces)


def test_the_answer_as_json_and_as_binary_tensors() -> None:
    result = _result()
    plan = OutputPlan("a", [OutputRequest(name, False) for name in VERIFY_OUTPUTS])
    parameters = {"logprobs_mode": "processed"}
    pieces, headers = encode_arrays(HEAD, plan, outputs(result, plan), parameters)
    assert headers == {"content-type": "application/json"}
    answer = json.loads(_joined(pieces))
    assert answer["parameters"] == parameters
    assert answer["id"] == "a"
    by_name = {entry["name"]: entry for entry in answer["outputs"]}
    assert by_name["accepted"] == {
        "name": "accepted",
        "datatype": "INT64",
        "shape": [2],
        "data": [2, 0],
    }
    assert by_name["token_ids"]["data"] == [4, 5, 7, 8, -1, -1]
    assert by_name["logprobs"]["datatype"] == "FP32"
    assert by_name["logprobs"]["data"] == [-0.5, -1.0, -2.0, -0.25, None, None]
    assert by_name["nodes"]["shape"] == [2, 2]
    assert by_name["seed"]["data"] == [9, 10]
    binary = OutputPlan(None, [OutputRequest("logprobs", True), OutputRequest("nodes", True)])
    pieces, headers = encode_arrays(HEAD, binary, outputs(result, binary), parameters)
    body = _joined(pieces)
    length = int(headers[HEADER_LENGTH])
    assert json.loads(body[:length])["outputs"][0]["parameters"] == {"binary_data_size": 24}
    logprobs = np.frombuffer(body[length : length + 24], "<f4").reshape(2, 3)
    np.testing.assert_array_equal(logprobs, result.logprobs)
    np.testing.assert_array_equal(np.frombuffer(body[length + 24 :], "<i8"), [0, 1, -1, -1])


def test_grpc_requests_dispatch_and_answers_carry_logprobs_mode() -> None:
    request = pb.ModelInferRequest(model_name="m", id="g")
    for name, kind, shape in (
        ("hidden_states", "FP32", [1, 3, 2]),
        ("draft_token_ids", "INT64", [1, 2]),
    ):
        request.inputs.add(name=name, datatype=kind, shape=shape)
    request.raw_input_contents.append(np.full(6, 0.5, np.float32).tobytes())
    request.raw_input_contents.append(np.array([4, 5], np.int64).tobytes())
    call = grpc_verify.decode(request)
    assert isinstance(call, VerifyCall)
    assert call.request.draft_token_ids.tolist() == [[4, 5]]
    assert all(output.binary for output in call.plan.outputs)  # raw contents by default
    answer = grpc_verify.encode(_result(), call.plan)
    assert answer.id == "g"
    assert answer.parameters["logprobs_mode"].string_param == "processed"
    assert [tensor.name for tensor in answer.outputs] == list(VERIFY_OUTPUTS)
    token_ids = np.frombuffer(answer.raw_output_contents[1], "<i8").reshape(2, 3)
    assert token_ids.tolist() == [[4, 5, 7], [8, -1, -1]]
