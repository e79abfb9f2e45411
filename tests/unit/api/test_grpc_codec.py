"""The gRPC codec beyond its datatypes: the target and parameters a request names, the header
it becomes (the REST codec's own, so both share every check), refusals with their exact
messages (a name or datatype cut short, never echoed whole), and the answer's names."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from service.api.codec import grpc
from service.api.codec.v2outputs import OutputPlan, OutputRequest
from service.errors import InvalidInput
from service.messages import HeadInfo, InferResult, Target

HEAD = HeadInfo("m", 3, True, 100, 2, "float32")


def _request(**fields: object) -> pb.ModelInferRequest:
    """A request for ``m`` with one FP32 hidden_states input of two typed values."""
    request = pb.ModelInferRequest(model_name="m", **fields)
    tensor = request.inputs.add(name="hidden_states", datatype="FP32", shape=[1, 2])
    tensor.contents.fp32_contents.extend([1.0, 2.0])
    return request


def _refusal(request: pb.ModelInferRequest) -> str:
    with pytest.raises(InvalidInput) as refused:
        grpc.decode(request)
    return str(refused.value)


@pytest.mark.parametrize(
    ("version", "number"), [("", None), ("0", 0), ("12", 12)], ids=["served", "zero", "twelve"]
)
def test_the_target_is_the_model_and_its_version_if_named(version: str, number: int) -> None:
    assert grpc.target("m", version) == Target("m", number)
    request, _ = grpc.decode(_request(model_version=version))
    assert request.target == Target("m", number)


def test_a_version_that_is_not_a_count_is_refused_cut_short() -> None:
    with pytest.raises(InvalidInput) as refused:
        grpc.target("m", "v" * 40)
    assert str(refused.value) == f"model_version must be a non-negative integer, got {'v' * 32!r}"


def test_parameters_are_read_as_plain_values_whatever_their_kind() -> None:
    request = pb.ModelInferRequest()
    request.parameters["flag"].bool_param = True
    request.parameters["count"].int64_param = 7
    request.parameters["name"].string_param = "x"
    request.parameters["empty"].CopyFrom(pb.InferParameter())
    assert grpc.parameters(request.parameters) == {
        "flag": True,
        "count": 7,
        "name": "x",
        "empty": None,
    }


def test_a_request_becomes_the_rest_codecs_header_answered_raw_by_default() -> None:
    request = _request(id="r-9")
    request.parameters["k"].int64_param = 4
    request.parameters["temperature"].double_param = 0.5
    output = request.outputs.add(name="logits")
    output.parameters["classification"].int64_param = 2
    request.outputs.add(name="topk_token_ids")
    decoded, plan = grpc.decode(request)
    assert decoded.hidden_states is not None
    assert decoded.hidden_states.tolist() == [[1.0, 2.0]]
    assert (decoded.k, decoded.temperature, decoded.tokens) == (4, 0.5, True)
    assert plan == OutputPlan(
        "r-9",
        [OutputRequest("logits", True, 2, 4), OutputRequest("topk_token_ids", True, None, 4)],
    )


def test_typed_answers_are_asked_with_binary_data_output_false() -> None:
    request = _request()
    request.parameters["binary_data_output"].bool_param = False
    _, plan = grpc.decode(request)
    assert plan == OutputPlan(
        None,
        [OutputRequest("topk_token_ids", False), OutputRequest("topk_logits", False)],
    )


def test_raw_contents_must_be_one_per_input() -> None:
    request = _request()
    request.inputs.add(name="input_ids", datatype="INT64", shape=[1])
    request.raw_input_contents.append(b"\0" * 8)
    assert _refusal(request) == (
        "raw_input_contents has 1 entries for 2 inputs; expected one per input, in order, or "
        "none (typed contents)"
    )


def test_an_input_with_both_contents_and_raw_contents_is_refused_naming_it_cut_short() -> None:
    request = _request()
    request.inputs[0].name = "h" * 80
    request.raw_input_contents.append(b"\0" * 8)
    assert _refusal(request) == f"input {'h' * 64!r}: both contents and raw contents"


def test_typed_fp16_is_refused_saying_how_to_send_it() -> None:
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="hidden_states" + "s" * 70, datatype="FP16", shape=[1, 2])
    name = ("hidden_states" + "s" * 70)[:64]
    assert _refusal(request) == (
        f"input {name!r}: FP16 travels in raw_input_contents only (the protocol has no typed "
        "FP16 contents); or send FP32 contents"
    )


def test_values_in_the_wrong_field_are_refused_naming_the_right_one_cut_short() -> None:
    request = pb.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="i" * 70, datatype="INT32", shape=[2])
    tensor.contents.int64_contents.extend([1, 2])
    tensor.contents.fp32_contents.extend([1.0, 2.0])
    assert _refusal(request) == (
        f"input {'i' * 64!r} is INT32: its values go in int_contents, got "
        "int64_contents, fp32_contents"
    )
    request = pb.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="x", datatype="UNKNOWN-TYPE-NAME-LONG", shape=[1])
    tensor.contents.bool_contents.append(True)
    assert _refusal(request) == (
        "input 'x' is UNKNOWN-TYPE-NAM: its values go in raw_input_contents, got bool_contents"
    )


def test_the_answer_names_the_model_its_version_the_request_and_the_tie() -> None:
    embeddings = InferResult(HEAD, embeddings=np.zeros((1, 2), np.float32))
    response = grpc.encode(embeddings, OutputPlan("r-2", [OutputRequest("embeddings", True)]))
    assert (response.model_name, response.model_version, response.id) == ("m", "3", "r-2")
    assert grpc.parameters(response.parameters) == {"tied": True}


def test_the_metadata_is_the_rest_codecs_as_a_message() -> None:
    response = grpc.model_metadata(HEAD, [1, 3])
    assert (response.name, list(response.versions), response.platform) == (
        "m",
        ["1", "3"],
        "onnx_onnxv1",
    )
    inputs = [(t.name, t.datatype, list(t.shape)) for t in response.inputs]
    assert inputs == [("hidden_states", "FP32", [-1, 2]), ("input_ids", "INT64", [-1])]
    outputs = [(t.name, t.datatype, list(t.shape)) for t in response.outputs]
    assert outputs[0] == ("topk_token_ids", "INT64", [-1, -1])
    assert outputs[4] == ("logits", "FP32", [-1, 100])
    assert [name for name, _, _ in outputs] == [
        "topk_token_ids",
        "topk_logits",
        "topk_logprobs",
        "logsumexp",
        "logits",
        "embeddings",
        "sampled_token_ids",
        "sampled_logprobs",
    ]


def test_raw_inputs_are_cut_one_after_another() -> None:
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="hidden_states", datatype="FP32", shape=[1, 2])
    request.inputs.add(name="input_ids", datatype="INT64", shape=[2])
    request.raw_input_contents.append(np.array([[0.5, 1.5]], "<f4").tobytes())
    request.raw_input_contents.append(np.array([7, 9], "<i8").tobytes())
    request.outputs.add(name="topk_token_ids")
    request.outputs.add(name="embeddings")
    decoded, _ = grpc.decode(request)
    assert decoded.hidden_states is not None
    assert decoded.input_ids is not None
    assert decoded.hidden_states.tolist() == [[0.5, 1.5]]
    assert decoded.input_ids.tolist() == [7, 9]


def test_typed_int64_ids_keep_every_bit() -> None:
    """Read as int64, never through float64 (which holds 53 bits)."""
    request = pb.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="input_ids", datatype="INT64", shape=[2])
    tensor.contents.int64_contents.extend([2**62 + 1, -(2**62) - 3])
    decoded, _ = grpc.decode(request)
    assert decoded.input_ids is not None
    assert decoded.input_ids.tolist() == [2**62 + 1, -(2**62) - 3]
