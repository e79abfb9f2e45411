"""The V2 datatype table both ways: every datatype decoded from the binary extension and from
JSON ``data``, and encoded back, with its byte width and little-endian order. The expected
bytes are written with ``int.to_bytes`` and ``struct`` ('<'), never with the table itself, so
a wrong width or byte order in the table shows here rather than in a gRPC round trip."""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from service.api.codec.v2 import DTYPES, HEADER_LENGTH, bytes_blob, datatype, decode, encode
from service.api.codec.v2outputs import OutputPlan, OutputRequest
from service.errors import InvalidInput
from service.messages import HeadInfo, InferRequest, InferResult, Target, TopKResult

HEAD = HeadInfo("m", 3, True, 100, 2, "float32")
#: Each datatype: its width in bytes and ``struct``'s little-endian format of one value.
WIDTHS = {"FP32": (4, "<f"), "FP16": (2, "<e"), "FP64": (8, "<d"), "INT64": (8, "<q")}
WIDTHS["INT32"] = (4, "<i")
#: Values exact in every datatype (FP16 included), negative ones too.
FLOATS = [1.5, -2.25, 0.0, 1024.0]
INTS = [1, 70000, 0, 2**31 - 1]


def _body(encoded: Any) -> bytes:
    """``encode``'s answer as one byte string (whole, or its pieces joined)."""
    if isinstance(encoded, bytes | bytearray):
        return bytes(encoded)
    return b"".join(bytes(piece) for piece in encoded)


def _little_endian(name: str, values: list[float] | list[int]) -> bytes:
    width, code = WIDTHS[name]
    raw = b"".join(struct.pack(code, value) for value in values)
    assert len(raw) == width * len(values)
    return raw


def _binary_request(name: str, datatype_name: str, shape: list[int], raw: bytes) -> InferRequest:
    tensor = {"name": name, "datatype": datatype_name, "shape": shape}
    header = json.dumps(
        {"inputs": [tensor | {"parameters": {"binary_data_size": len(raw)}}]}
    ).encode()
    request, _ = decode(header + raw, str(len(header)), Target("m"))
    return request


def test_the_table_holds_each_datatype_at_its_width_little_endian() -> None:
    assert set(DTYPES) == set(WIDTHS)
    for name, dtype in DTYPES.items():
        assert dtype.itemsize == WIDTHS[name][0], name
        assert dtype.newbyteorder("<") == dtype, f"{name} is not little-endian"
        assert datatype(dtype) == name
    assert datatype(np.dtype(np.float32)) == "FP32"
    assert datatype(np.dtype(np.int32)) == "INT32"
    with pytest.raises(ValueError, match="no V2 datatype for uint8"):
        datatype(np.dtype(np.uint8))


@pytest.mark.parametrize("name", ["FP32", "FP16"])
def test_binary_hidden_states_are_read_at_their_width_little_endian(name: str) -> None:
    request = _binary_request("hidden_states", name, [2, 2], _little_endian(name, FLOATS))
    assert request.hidden_states is not None
    assert request.hidden_states.dtype.itemsize == WIDTHS[name][0]
    assert request.hidden_states.tolist() == [[1.5, -2.25], [0.0, 1024.0]]


@pytest.mark.parametrize("name", ["INT64", "INT32"])
def test_binary_input_ids_are_read_at_their_width_little_endian(name: str) -> None:
    width = WIDTHS[name][0]
    raw = b"".join(value.to_bytes(width, "little", signed=True) for value in [*INTS, -5])
    request = _binary_request("input_ids", name, [5], raw)
    assert request.input_ids is not None
    assert request.input_ids.tolist() == [*INTS, -5]


@pytest.mark.parametrize(("name", "width"), [("INT32", 4), ("INT64", 8), ("FP16", 2)])
def test_a_binary_size_that_does_not_fit_the_datatype_is_refused_naming_the_need(
    name: str, width: int
) -> None:
    """Three values take 3 x width bytes: one width more or less is refused, the message
    saying how many bytes the shape needs."""
    field = "hidden_states" if name == "FP16" else "input_ids"
    for wrong in (2 * width, 4 * width):
        with pytest.raises(InvalidInput, match=f"needs {3 * width}$"):
            _binary_request(field, name, [3], b"\0" * wrong)


@pytest.mark.parametrize("name", ["INT64", "INT32"])
def test_json_input_ids_keep_their_datatype_range(name: str) -> None:
    header = {"inputs": [{"name": "input_ids", "datatype": name, "shape": [4], "data": INTS}]}
    request, _ = decode(json.dumps(header).encode(), None, Target("m"))
    assert request.input_ids is not None
    assert request.input_ids.dtype.itemsize == WIDTHS[name][0]
    assert request.input_ids.tolist() == INTS
    header["inputs"][0]["data"] = [-(2**31), 0, 0, 2**31 - 1]  # int32's bounds, both taken
    request, _ = decode(json.dumps(header).encode(), None, Target("m"))
    assert request.input_ids is not None
    assert request.input_ids.tolist() == [-(2**31), 0, 0, 2**31 - 1]
    header["inputs"][0]["data"] = [0, 0, 0, 2**31]
    if name == "INT32":
        with pytest.raises(InvalidInput, match="beyond the int32 range"):
            decode(json.dumps(header).encode(), None, Target("m"))
    else:
        request, _ = decode(json.dumps(header).encode(), None, Target("m"))
        assert request.input_ids is not None
        assert request.input_ids.tolist() == [0, 0, 0, 2**31]


@pytest.mark.parametrize("name", ["FP32", "FP16"])
def test_json_hidden_states_are_read_in_their_datatype(name: str) -> None:
    tensor = {"name": "hidden_states", "datatype": name, "shape": [2, 2], "data": FLOATS}
    request, _ = decode(json.dumps({"inputs": [tensor]}).encode(), None, Target("m"))
    assert request.hidden_states is not None
    assert request.hidden_states.dtype == DTYPES[name]
    assert request.hidden_states.tolist() == [[1.5, -2.25], [0.0, 1024.0]]


def _encoded(array: npt.NDArray[Any], binary: bool) -> tuple[dict[str, Any], bytes]:
    """An array answered as the ``embeddings`` output: its header entry and binary part."""
    plan = OutputPlan(None, [OutputRequest("embeddings", binary)])
    pieces, headers = encode(InferResult(HEAD, embeddings=array), plan)
    body = _body(pieces)
    length = int(headers.get(HEADER_LENGTH, len(body)))
    return json.loads(body[:length])["outputs"][0], body[length:]


@pytest.mark.parametrize("name", list(WIDTHS))
def test_every_datatype_is_encoded_at_its_width_little_endian(name: str) -> None:
    values: list[float] | list[int] = INTS if name.startswith("INT") else FLOATS
    array = np.array(values, DTYPES[name].newbyteorder("=")).reshape(2, 2)
    entry, raw = _encoded(array, binary=True)
    assert entry["datatype"] == name
    assert entry["shape"] == [2, 2]
    assert entry["parameters"]["binary_data_size"] == 4 * WIDTHS[name][0]
    assert raw == _little_endian(name, values)
    entry, raw = _encoded(array, binary=False)
    assert (entry["datatype"], raw) == (name, b"")
    assert entry["data"] == values


def test_classification_strings_are_bytes_with_little_endian_lengths() -> None:
    """BYTES: each string as a 4-byte little-endian length, then its UTF-8 bytes."""
    assert bytes_blob(np.array(["ab", "é"], dtype=object)) == b"\x02\0\0\0ab\x02\0\0\0\xc3\xa9"
    ids = np.array([[7, 3]], np.int64)
    logits = np.array([[2.5, 1.0]], np.float32)
    topk = TopKResult(HEAD, ids, logits, np.array([3.0], np.float32))
    plan = OutputPlan(None, [OutputRequest("logits", True, classification=2)])
    pieces, headers = encode(InferResult(HEAD, topk), plan)
    body = _body(pieces)
    length = int(headers[HEADER_LENGTH])
    entry = json.loads(body[:length])["outputs"][0]
    assert entry["datatype"] == "BYTES"
    first, second = b"2.500000:7", b"1.000000:3"
    want = len(first).to_bytes(4, "little") + first + len(second).to_bytes(4, "little") + second
    assert body[length:] == want
    assert entry["parameters"]["binary_data_size"] == len(want)
