"""Open Inference Protocol (V2) codec, with the binary tensor and classification extensions.

Decodes an infer request (JSON, or a JSON header followed by raw little-endian tensors whose
header length is ``Inference-Header-Content-Length``) into numpy arrays and options, and
encodes the answer the same two ways. Every check names the input or output, what was expected
and what came, and never echoes data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from service.codec import json_bytes
from service.errors import InvalidInput, MalformedBody

HEADER_LENGTH = "inference-header-content-length"
DTYPES: dict[str, np.dtype[Any]] = {
    "FP32": np.dtype("<f4"),
    "FP16": np.dtype("<f2"),
    "FP64": np.dtype("<f8"),
    "INT64": np.dtype("<i8"),
    "INT32": np.dtype("<i4"),
}
INPUT_TYPES = {"hidden_states": ("FP32", "FP16"), "input_ids": ("INT64", "INT32")}
OUTPUTS = ("topk_token_ids", "topk_logits", "topk_logprobs", "logsumexp", "logits", "embeddings")


@dataclass
class OutputRequest:
    name: str
    binary: bool
    classification: int | None = None
    k: int | None = None


@dataclass
class InferRequest:
    """A decoded V2 infer request."""

    id: str | None
    inputs: dict[str, npt.NDArray[Any]]
    parameters: dict[str, Any]
    outputs: list[OutputRequest] = field(default_factory=list)


def decode(body: bytes, header_length: str | None) -> InferRequest:
    """Split header and binary part, then read inputs and requested outputs."""
    header_bytes, binary = _split(body, header_length)
    try:
        header = orjson.loads(header_bytes)
    except orjson.JSONDecodeError as error:
        raise MalformedBody(f"inference header is not valid JSON ({error.msg})") from None
    if not isinstance(header, dict):
        raise MalformedBody("inference header must be a JSON object")
    parameters = _mapping(header.get("parameters"), "parameters")
    inputs = _inputs(header.get("inputs"), binary)
    default_binary = bool(parameters.get("binary_data_output", False))
    outputs = _outputs(header.get("outputs"), default_binary)
    request_id = header.get("id")
    return InferRequest(
        None if request_id is None else str(request_id)[:256], inputs, parameters, outputs
    )


def encode(
    model_name: str,
    version: int,
    request_id: str | None,
    tensors: list[tuple[OutputRequest, npt.NDArray[Any]]],
) -> tuple[bytes, dict[str, str]]:
    """JSON answer, or a JSON header + binary tensors when any output asked for binary."""
    outputs, blobs = [], []
    for request, array in tensors:
        datatype = "BYTES" if array.dtype.kind in "OUS" else _datatype(array.dtype)
        entry: dict[str, Any] = {
            "name": request.name,
            "datatype": datatype,
            "shape": list(array.shape),
        }
        if request.binary:
            blob = (
                _bytes_blob(array) if datatype == "BYTES" else np.ascontiguousarray(array).tobytes()
            )
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = array.reshape(-1).tolist() if datatype == "BYTES" else array.reshape(-1)
        outputs.append(entry)
    payload: dict[str, Any] = {
        "model_name": model_name,
        "model_version": str(version),
        "outputs": outputs,
    }
    if request_id is not None:
        payload["id"] = request_id
    header = json_bytes(payload)
    if not blobs:
        return header, {"content-type": "application/json"}
    headers = {"content-type": "application/octet-stream", HEADER_LENGTH: str(len(header))}
    return header + b"".join(blobs), headers


def classification_strings(
    values: npt.NDArray[np.float32], ids: npt.NDArray[np.int64], labels: list[Any] | None
) -> npt.NDArray[np.object_]:
    """Triton's classification format: ``"value:index"`` or ``"value:index:label"``."""
    rows = []
    for value_row, id_row in zip(
        values.reshape(-1, values.shape[-1]), ids.reshape(-1, ids.shape[-1]), strict=True
    ):
        row = []
        for value, index in zip(value_row.tolist(), id_row.tolist(), strict=True):
            label = labels[index] if labels is not None and index < len(labels) else None
            row.append(f"{value:f}:{index}" + (f":{label}" if label is not None else ""))
        rows.append(row)
    return np.array(rows, dtype=object).reshape(*ids.shape)


def _split(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    if header_length is None:
        return body, b""
    if not header_length.isdigit():
        raise MalformedBody(f"{HEADER_LENGTH} must be a byte count, got {header_length[:32]!r}")
    length = int(header_length)
    if length > len(body):
        raise MalformedBody(f"{HEADER_LENGTH} is {length} but the body has only {len(body)} bytes")
    return body[:length], body[length:]


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInput(f"{where} must be a JSON object")
    return value


def _inputs(entries: Any, binary: bytes) -> dict[str, npt.NDArray[Any]]:
    if not isinstance(entries, list) or not entries:
        raise InvalidInput(
            "inputs must be a non-empty list of tensors (hidden_states or input_ids)"
        )
    arrays: dict[str, npt.NDArray[Any]] = {}
    offset = 0
    for entry in entries:
        if not isinstance(entry, dict):
            raise InvalidInput("each input must be a JSON object with name, shape, datatype")
        name, shape, datatype = entry.get("name"), entry.get("shape"), entry.get("datatype")
        if name not in INPUT_TYPES:
            raise InvalidInput(
                f"unknown input {str(name)[:64]!r}; inputs: hidden_states, input_ids"
            )
        if datatype not in INPUT_TYPES[name]:
            raise InvalidInput(
                f"input {name} must have datatype {' or '.join(INPUT_TYPES[name])}, "
                f"got {str(datatype)[:16]!r}"
            )
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise InvalidInput(f"input {name} needs a shape of non-negative integers")
        dtype = DTYPES[datatype]
        size = _mapping(entry.get("parameters"), f"input {name} parameters").get("binary_data_size")
        if size is not None:
            array, offset = _binary_tensor(name, shape, dtype, size, binary, offset)
        else:
            array = _json_tensor(name, shape, dtype, entry.get("data"))
        arrays[name] = array
    if offset != len(binary):
        raise MalformedBody(
            f"binary inputs use {offset} bytes but the body carries {len(binary)} after the header"
        )
    return arrays


def _binary_tensor(
    name: str, shape: list[int], dtype: np.dtype[Any], size: Any, binary: bytes, offset: int
) -> tuple[npt.NDArray[Any], int]:
    expected = math.prod(shape) * dtype.itemsize
    if not isinstance(size, int) or size != expected:
        raise InvalidInput(
            f"input {name}: binary_data_size is {size} but shape {shape} of {dtype} "
            f"needs {expected} bytes"
        )
    if offset + size > len(binary):
        raise MalformedBody(
            f"input {name}: needs {size} bytes at offset {offset}, the body has {len(binary)}"
        )
    array = np.frombuffer(binary, dtype=dtype, count=math.prod(shape), offset=offset).reshape(shape)
    return array, offset + size


def _json_tensor(name: str, shape: list[int], dtype: np.dtype[Any], data: Any) -> npt.NDArray[Any]:
    if not isinstance(data, list):
        raise InvalidInput(f"input {name} needs data (a flat or nested list) or binary_data_size")
    try:
        array = np.array(data, dtype=dtype)
    except (ValueError, TypeError):
        raise InvalidInput(
            f"input {name}: data must be a list of numbers of one length per row"
        ) from None
    if dtype.kind == "i" and any(isinstance(v, float) for v in array.reshape(-1)[:1].tolist()):
        raise InvalidInput(f"input {name} must hold integers")
    if array.size != math.prod(shape):
        raise InvalidInput(
            f"input {name}: shape {shape} needs {math.prod(shape)} values, data has {array.size}"
        )
    return array.reshape(shape)


def _outputs(entries: Any, default_binary: bool) -> list[OutputRequest]:
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise InvalidInput("outputs must be a list of {name, parameters}")
    requests = []
    for entry in entries:
        name = entry.get("name") if isinstance(entry, dict) else None
        if name not in OUTPUTS:
            raise InvalidInput(f"unknown output {str(name)[:64]!r}; outputs: {', '.join(OUTPUTS)}")
        parameters = _mapping(entry.get("parameters"), f"output {name} parameters")
        classification = parameters.get("classification")
        if classification is not None and (
            not isinstance(classification, int) or classification < 1
        ):
            raise InvalidInput(f"output {name}: classification must be an integer >= 1")
        if classification is not None and name != "logits":
            raise InvalidInput("classification applies to the logits output only")
        k = parameters.get("k")
        if k is not None and (not isinstance(k, int) or k < 1):
            raise InvalidInput(f"output {name}: k must be an integer >= 1")
        binary = bool(parameters.get("binary_data", default_binary))
        requests.append(OutputRequest(name, binary, classification, k))
    return requests


def _datatype(dtype: np.dtype[Any]) -> str:
    for name, candidate in DTYPES.items():
        if candidate == dtype:
            return name
    raise ValueError(f"no V2 datatype for {dtype}")


def _bytes_blob(array: npt.NDArray[Any]) -> bytes:
    parts = []
    for item in array.reshape(-1).tolist():
        raw = item.encode() if isinstance(item, str) else bytes(item)
        parts.append(len(raw).to_bytes(4, "little") + raw)
    return b"".join(parts)
