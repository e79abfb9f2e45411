"""The gRPC codec's datatypes both ways: typed ``contents`` in their own field per datatype,
raw contents at the datatype's width, little-endian, and answers the same two ways. Expected
bytes are written with ``int.to_bytes`` and ``struct`` ('<'), never with the codec's tables."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from tritonclient.grpc import service_pb2 as pb

from service.api.codec import grpc
from service.api.codec.v2outputs import OutputPlan, OutputRequest
from service.errors import InvalidInput
from service.messages import HeadInfo, InferRequest, InferResult, TopKResult

HEAD = HeadInfo("m", 3, True, 100, 2, "float32")
#: Each numeric datatype: its typed contents field, its width, ``struct``'s little-endian code.
TYPED = {
    "FP32": ("fp32_contents", 4, "<f"),
    "FP64": ("fp64_contents", 8, "<d"),
    "INT64": ("int64_contents", 8, "<q"),
    "INT32": ("int_contents", 4, "<i"),
}
#: The numpy type of an answer of each datatype (the host's byte order).
NUMPY = {"FP32": np.float32, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32}
FLOATS = [1.5, -2.25, 0.0, 1024.0]
INTS = [1, -70000, 0, 2**31 - 1]


def _request(name: str, datatype: str, shape: list[int], **fields: Any) -> pb.ModelInferRequest:
    """One input: typed contents (``contents=...``) or raw bytes (``raw=...``)."""
    request = pb.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name=name, datatype=datatype, shape=shape)
    if "raw" in fields:
        request.raw_input_contents.append(fields["raw"])
    else:
        field, _, _ = TYPED[datatype]
        getattr(tensor.contents, field).extend(fields["contents"])
    return request


def _decoded(request: pb.ModelInferRequest) -> InferRequest:
    decoded, _ = grpc.decode(request)
    return decoded


def test_the_contents_fields_are_the_protocols() -> None:
    assert {name: field for name, (field, _, _) in TYPED.items()} == grpc.CONTENTS


@pytest.mark.parametrize("datatype", ["INT64", "INT32"])
def test_typed_input_ids_are_read_from_their_field(datatype: str) -> None:
    decoded = _decoded(_request("input_ids", datatype, [4], contents=INTS))
    assert decoded.input_ids is not None
    assert decoded.input_ids.tolist() == INTS
    assert decoded.input_ids.dtype.itemsize == TYPED[datatype][1]


def test_typed_hidden_states_are_read_from_fp32_contents() -> None:
    decoded = _decoded(_request("hidden_states", "FP32", [2, 2], contents=FLOATS))
    assert decoded.hidden_states is not None
    assert decoded.hidden_states.tolist() == [[1.5, -2.25], [0.0, 1024.0]]


def test_values_in_another_datatypes_field_are_refused_naming_the_right_one() -> None:
    request = _request("input_ids", "INT32", [2], contents=[1, 2])
    request.inputs[0].contents.int64_contents.extend([3, 4])
    with pytest.raises(InvalidInput, match="INT32: its values go in int_contents"):
        grpc.decode(request)
    fp16 = pb.ModelInferRequest(model_name="m")
    fp16.inputs.add(name="hidden_states", datatype="FP16", shape=[1, 2])
    with pytest.raises(InvalidInput, match="FP16 travels in raw_input_contents only"):
        grpc.decode(fp16)


@pytest.mark.parametrize(("datatype", "width"), [("INT64", 8), ("INT32", 4)])
def test_raw_input_ids_are_read_at_their_width_little_endian(datatype: str, width: int) -> None:
    raw = b"".join(value.to_bytes(width, "little", signed=True) for value in INTS)
    decoded = _decoded(_request("input_ids", datatype, [4], raw=raw))
    assert decoded.input_ids is not None
    assert decoded.input_ids.tolist() == INTS
    with pytest.raises(InvalidInput, match=f"needs {4 * width}$"):
        grpc.decode(_request("input_ids", datatype, [4], raw=raw + b"\0" * width))


@pytest.mark.parametrize(("datatype", "code"), [("FP32", "<f"), ("FP16", "<e")])
def test_raw_hidden_states_are_read_at_their_width_little_endian(datatype: str, code: str) -> None:
    raw = b"".join(struct.pack(code, value) for value in FLOATS)
    decoded = _decoded(_request("hidden_states", datatype, [2, 2], raw=raw))
    assert decoded.hidden_states is not None
    assert decoded.hidden_states.tolist() == [[1.5, -2.25], [0.0, 1024.0]]


def _answer(array: npt.NDArray[Any], raw: bool) -> Any:
    plan = OutputPlan(None, [OutputRequest("embeddings", raw)])
    return grpc.encode(InferResult(HEAD, embeddings=array), plan)


@pytest.mark.parametrize("datatype", list(TYPED))
def test_every_datatype_is_answered_raw_and_typed(datatype: str) -> None:
    field, width, code = TYPED[datatype]
    values: list[float] | list[int] = INTS if datatype.startswith("INT") else FLOATS
    array = np.array(values, NUMPY[datatype]).reshape(2, 2)
    response = _answer(array, raw=True)
    (tensor,) = response.outputs
    assert (tensor.name, tensor.datatype, list(tensor.shape)) == ("embeddings", datatype, [2, 2])
    (raw,) = response.raw_output_contents
    assert raw == b"".join(struct.pack(code, value) for value in values)
    assert len(raw) == 4 * width
    response = _answer(array, raw=False)
    assert not response.raw_output_contents
    (tensor,) = response.outputs
    assert tensor.datatype == datatype
    assert list(getattr(tensor.contents, field)) == values
    assert [found.name for found, _ in tensor.contents.ListFields()] == [field]


def test_float16_answers_travel_raw_at_two_bytes() -> None:
    response = _answer(np.array(FLOATS, np.float16).reshape(2, 2), raw=True)
    assert response.outputs[0].datatype == "FP16"
    assert response.raw_output_contents[0] == b"".join(struct.pack("<e", v) for v in FLOATS)


def test_classification_strings_are_bytes_raw_and_typed() -> None:
    topk = TopKResult(
        HEAD,
        np.array([[7, 3]], np.int64),
        np.array([[2.5, 1.0]], np.float32),
        np.array([3.0], np.float32),
    )
    result = InferResult(HEAD, topk)
    strings = [b"2.500000:7", b"1.000000:3"]
    raw = grpc.encode(result, OutputPlan(None, [OutputRequest("logits", True, 2)]))
    assert raw.outputs[0].datatype == "BYTES"
    framed = b"".join(len(s).to_bytes(4, "little") + s for s in strings)
    assert raw.raw_output_contents[0] == framed
    typed = grpc.encode(result, OutputPlan(None, [OutputRequest("logits", False, 2)]))
    assert list(typed.outputs[0].contents.bytes_contents) == strings
