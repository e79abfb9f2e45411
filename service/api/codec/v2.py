"""Open Inference Protocol (V2) codec, with the binary tensor and classification extensions.

``decode`` turns an infer request (JSON, or a JSON header followed by raw little-endian tensors
whose header length is ``Inference-Header-Content-Length``) into the data plane's
``InferRequest`` plus the plan of outputs to answer; ``encode`` turns the ``InferResult`` back
into the answer, the same two ways. The ``logits`` output with ``parameters: {"classification":
k}`` is Triton's BYTES tensor of ``"value:index[:label]"`` strings, taken from the in-graph
top-k, never by sorting the vocabulary. Every check names the input or output, what was
expected and what came, and never echoes data.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson
from starlette.requests import Request
from starlette.responses import Response

from service.api.codec.decoding_wire import BINARY_NAMES
from service.api.codec.pieces import Piece, array_pieces, json_pieces, reply, size
from service.api.codec.v2outputs import (
    PROJECTION_OUTPUTS,
    OutputPlan,
    requested_outputs,
    select,
    takes_default_k,
)
from service.api.codec.v2params import flag, mapping, number, optional_int, states, vocabulary
from service.api.codec.wire import (
    float_array,
    header,
    int_array,
    json_error,
    json_type,
    no_query_options,
    off_loop,
    read_body,
    target,
)
from service.budget import charge_json
from service.digits import decimal
from service.errors import InvalidInput, MalformedBody
from service.messages import HeadInfo, InferRequest, InferResult, Target

HEADER_LENGTH = "inference-header-content-length"
DTYPES: dict[str, np.dtype[Any]] = {
    "FP32": np.dtype("<f4"),
    "FP16": np.dtype("<f2"),
    "FP64": np.dtype("<f8"),
    "INT64": np.dtype("<i8"),
    "INT32": np.dtype("<i4"),
}
INPUT_TYPES = {
    "hidden_states": ("FP32", "FP16"),
    "input_ids": ("INT64", "INT32"),
    # the distribution's array options, binary as any tensor (``decoding_wire``)
    **dict.fromkeys(("allowed_token_ids", "banned_token_ids"), ("INT64", "INT32")),
    **dict.fromkeys(BINARY_NAMES, ("INT64", "INT32")),
    "token_bitmask": ("INT32",),
}
#: Inputs that carry options: every one but the rows and the ids to embed.
OPTION_INPUTS = tuple(name for name in INPUT_TYPES if name not in ("hidden_states", "input_ids"))
MAX_RANK = 4
#: Why a V2 infer's query parameters (but ``version``) are refused.
V2_OPTIONS = "is not read: V2 options go in the body's parameters"
#: A request id is echoed in the answer as sent (cut short, it matched no request).
MAX_ID_CHARS = 256


async def decode_http(request: Request, body_limit: int) -> tuple[InferRequest, OutputPlan]:
    """An HTTP infer request: body (JSON or binary extension), target from the path."""
    body, length, to = await read_http(request, body_limit)
    return await off_loop(len(body), decode, body, length, to)


async def read_http(request: Request, body_limit: int) -> tuple[bytes, str | None, Target]:
    """An HTTP infer request's body, its header length (binary extension) and target."""
    no_query_options(request, V2_OPTIONS)
    body = await read_body(request, body_limit)
    length = header(request, HEADER_LENGTH.encode())
    names = [name for name, _ in request.scope["headers"]]
    if length is not None and names.count(HEADER_LENGTH.encode()) > 1:  # the last one won
        raise MalformedBody(f"{HEADER_LENGTH} is given more than once")
    return body, length, target(request)


async def encode_http(result: InferResult, plan: OutputPlan) -> Response:
    """The answer, with the headers every lmhead inference answer carries."""
    size = sum(a.nbytes for a in (result.logits, result.embeddings) if a is not None) * 3
    if result.topk is not None:  # classification strings are made from it too
        size += result.topk.token_ids.size * 32
    pieces, headers = await off_loop(size, encode, result, plan)
    return reply(pieces, None, headers | head_headers(result.head))


def head_headers(head: HeadInfo) -> dict[str, str]:
    """The headers every lmhead inference answer carries: the head that answered."""
    return {
        "x-lmhead-model": head.name,
        "x-lmhead-version": str(head.version),
        "x-lmhead-tied": "true" if head.tied else "false",
    }


def decode(body: bytes, header_length: str | None, to: Target) -> tuple[InferRequest, OutputPlan]:
    """Split header and binary part, read inputs, parameters and requested outputs."""
    return decode_header(*parse(body, header_length), to)


def parse(body: bytes, header_length: str | None) -> tuple[dict[str, Any], bytes, bool]:
    """The JSON header as an object, the binary part after it, and whether the header has
    JSON booleans (which numpy would read as numbers inside data)."""
    header_bytes, binary = _split(body, header_length)
    charge_json(header_bytes)
    try:
        header = orjson.loads(header_bytes)
    except orjson.JSONDecodeError as error:
        why = json_error(error, header_bytes)
        raise MalformedBody(f"inference header is not valid JSON ({why})") from None
    if not isinstance(header, dict):
        raise MalformedBody("inference header must be a JSON object")
    # numpy reads a JSON ``true`` inside data as 1: scan for them when the header has any.
    booleans = b"true" in header_bytes or b"false" in header_bytes
    return header, binary, booleans


def decode_header(
    header: dict[str, Any], binary: bytes, booleans: bool, to: Target
) -> tuple[InferRequest, OutputPlan]:
    """The request once parsed: inputs (typed ``data`` or ``binary_data_size`` bytes of
    ``binary``), parameters and outputs. The gRPC front end builds the same header."""
    parameters = mapping(header.get("parameters"), "parameters")
    inputs = read_inputs(header.get("inputs"), binary, booleans)
    binary_output = flag(parameters, "binary_data_output")
    outputs = requested_outputs(header.get("outputs"), parameters, inputs, binary_output)
    names = {output.name for output in outputs}
    hidden = inputs.get("hidden_states")
    if names & set(PROJECTION_OUTPUTS) and hidden is None:
        raise InvalidInput("projection outputs need the input hidden_states")
    ids = inputs.get("input_ids")
    if "embeddings" in names and ids is None:
        raise InvalidInput("output embeddings needs the input input_ids")
    asked = [n for o in outputs for n in (o.classification, o.k) if n is not None]
    request = InferRequest(
        to,
        hidden if names & set(PROJECTION_OUTPUTS) else None,
        ids if "embeddings" in names else None,
        max(asked) if asked else optional_int(parameters, "k"),
        number(parameters, "temperature", 1.0),
        full_logits=any(o.name == "logits" and o.classification is None for o in outputs),
        tokens=any(o.classification is not None for o in outputs),
        vocabulary=vocabulary(
            parameters, {name: inputs[name] for name in OPTION_INPUTS if name in inputs}
        ),
        at_least_default_k=bool(asked) and takes_default_k(outputs),
        states=states(parameters, header.get("inputs")),
    )
    return request, OutputPlan(request_id(header), outputs)


def request_id(header: dict[str, Any]) -> str | None:
    """The request's ``id``, echoed in the answer: a string of at most ``MAX_ID_CHARS``."""
    given = header.get("id")
    if given is not None and not isinstance(given, str):
        raise InvalidInput(f"id must be a string, got a JSON {type(given).__name__}")
    if given is not None and len(given) > MAX_ID_CHARS:  # echoed whole, or refused
        raise InvalidInput(f"id has {len(given)} characters; at most {MAX_ID_CHARS}")
    return given


def encode(result: InferResult, plan: OutputPlan) -> tuple[list[Piece], dict[str, str]]:
    """JSON answer, or a JSON header + binary tensors when any output asked for binary; in
    pieces (``service.api.codec.pieces``): a large tensor's JSON a few rows per encoder call,
    its binary data as views of its memory."""
    return encode_arrays(result.head, plan, (select(request, result) for request in plan.outputs))


def encode_arrays(
    head: HeadInfo,
    plan: OutputPlan,
    arrays: Iterable[npt.NDArray[Any]],
    parameters: dict[str, Any] | None = None,
) -> tuple[list[Piece], dict[str, str]]:
    """``encode`` of the outputs' ``arrays`` (one per output of the plan, in order), with
    the answer's ``parameters`` when given."""
    outputs: list[dict[str, Any]] = []
    blobs: list[Piece] = []
    for request, selected in zip(plan.outputs, arrays, strict=True):
        array = np.require(selected, requirements="C")  # k-cut views are strided
        kind = "BYTES" if array.dtype.kind in "OUS" else datatype(array.dtype)
        entry: dict[str, Any] = {"name": request.name, "datatype": kind, "shape": list(array.shape)}
        if request.binary:
            blob = [bytes_blob(array)] if kind == "BYTES" else array_pieces(array)
            entry["parameters"] = {"binary_data_size": size(blob)}
            blobs += blob
        else:  # a few rows per encoder call (strings: as lists)
            entry["data"] = array.reshape(-1)
        outputs.append(entry)
    payload: dict[str, Any] = {
        "model_name": head.name,
        "model_version": str(head.version),
        "outputs": outputs,
    }
    if parameters:
        payload["parameters"] = parameters
    if plan.request_id is not None:
        payload["id"] = plan.request_id
    header = json_pieces(payload)
    if not blobs:
        return header, {"content-type": "application/json"}
    headers = {"content-type": "application/octet-stream", HEADER_LENGTH: str(size(header))}
    return [*header, *blobs], headers


def model_metadata(head: HeadInfo, versions: list[int]) -> dict[str, Any]:
    """Inputs, outputs and versions of a model, as the protocol describes them (REST, gRPC)."""
    return {
        "name": head.name,
        "versions": [str(v) for v in versions],
        "platform": "onnx_onnxv1",
        "inputs": [
            {"name": "hidden_states", "datatype": "FP32", "shape": [-1, head.d_model]},
            {"name": "input_ids", "datatype": "INT64", "shape": [-1]},
        ],
        "outputs": [
            {"name": "topk_token_ids", "datatype": "INT64", "shape": [-1, -1]},
            {"name": "topk_logits", "datatype": "FP32", "shape": [-1, -1]},
            {"name": "topk_logprobs", "datatype": "FP32", "shape": [-1, -1]},
            {"name": "logsumexp", "datatype": "FP32", "shape": [-1]},
            {"name": "logits", "datatype": "FP32", "shape": [-1, head.vocab_size]},
            {"name": "embeddings", "datatype": "FP32", "shape": [-1, head.d_model]},
            {"name": "sampled_token_ids", "datatype": "INT64", "shape": [-1]},
            {"name": "sampled_logprobs", "datatype": "FP32", "shape": [-1]},
        ],
        "parameters": {"tied": head.tied, "version": head.version, "dtype": head.dtype}
        | (_quantization(head) if head.block_size else {}),
    }


def _quantization(head: HeadInfo) -> dict[str, Any]:
    """A block-quantized head's layout, as ``/v1/models`` gives it (``tied``: one tensor)."""
    bits = int(head.dtype.removeprefix("int"))
    return {"bits": bits, "block_size": head.block_size, "table_quantized": head.table_quantized}


def _split(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    if header_length is None:
        return body, b""
    length = decimal(header_length)
    if length is None:
        raise MalformedBody(f"{HEADER_LENGTH} must be a byte count, got {header_length[:32]!r}")
    if length > len(body):
        raise MalformedBody(f"{HEADER_LENGTH} is {length} but the body has only {len(body)} bytes")
    return body[:length], body[length:]


def _dimension(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31


def read_inputs(
    entries: Any, binary: bytes, booleans: bool, types: dict[str, tuple[str, ...]] = INPUT_TYPES
) -> dict[str, npt.NDArray[Any]]:
    """Each input's array, ``types`` naming the inputs taken and their datatypes."""
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
        if name not in types:
            raise InvalidInput(f"unknown input {str(name)[:64]!r}; inputs: {', '.join(types)}")
        if name in arrays:
            raise InvalidInput(f"input {name} is given twice; give each input once")
        if datatype not in types[name]:
            raise InvalidInput(
                f"input {name} must have datatype {' or '.join(types[name])}, "
                f"got {str(datatype)[:16]!r}"
            )
        if (
            not isinstance(shape, list)
            or not 1 <= len(shape) <= MAX_RANK
            or not all(_dimension(d) for d in shape)
        ):
            raise InvalidInput(
                f"input {name} needs a shape of 1 to {MAX_RANK} non-negative integers below 2**31"
            )
        dtype = DTYPES[datatype]
        size = mapping(entry.get("parameters"), f"input {name} parameters").get("binary_data_size")
        if size is not None:
            array, offset = _binary_tensor(name, shape, dtype, size, binary, offset)
        else:
            array = _json_tensor(name, shape, dtype, entry.get("data"), booleans)
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
    if not isinstance(size, int) or isinstance(size, bool):  # never echoed: it may be anything
        raise InvalidInput(
            f"input {name}: binary_data_size must be an integer, got a JSON {json_type(size)}"
        )
    if size != expected:
        raise InvalidInput(
            f"input {name} has {size} bytes of binary data (binary_data_size, or its "
            f"raw_input_contents entry over gRPC) but shape {shape} of {dtype} needs {expected}"
        )
    if offset + size > len(binary):
        raise MalformedBody(
            f"input {name}: needs {size} bytes at offset {offset}, the body has {len(binary)}"
        )
    array = np.frombuffer(binary, dtype=dtype, count=math.prod(shape), offset=offset).reshape(shape)
    return array, offset + size


def _json_tensor(
    name: str, shape: list[int], dtype: np.dtype[Any], data: Any, booleans: bool
) -> npt.NDArray[Any]:
    field = f"input {name}"
    if isinstance(data, np.ndarray):  # gRPC's typed contents, already numbers of its type
        array: npt.NDArray[Any] = data
    elif not isinstance(data, list):
        raise InvalidInput(
            f"input {name} has no values: send them as data (a flat or nested list) or "
            "binary_data_size (over gRPC: contents or raw_input_contents)"
        )
    elif dtype.kind == "f":
        array = float_array(data, field, booleans)
    else:
        array = int_array(data, field, booleans)
        limits = np.iinfo(dtype)
        if array.size and (int(array.min()) < limits.min or int(array.max()) > limits.max):
            raise InvalidInput(f"{field}: values beyond the {dtype.name} range")
    if array.size != math.prod(shape):
        raise InvalidInput(
            f"{field}: shape {shape} needs {math.prod(shape)} values, got {array.size}"
        )
    return array.astype(dtype, copy=False).reshape(shape)


def datatype(dtype: np.dtype[Any]) -> str:
    for name, candidate in DTYPES.items():
        if candidate == dtype:
            return name
    raise ValueError(f"no V2 datatype for {dtype}")


def bytes_blob(array: npt.NDArray[Any]) -> bytes:
    parts = []
    for item in array.reshape(-1).tolist():
        raw = item.encode() if isinstance(item, str) else bytes(item)
        parts.append(len(raw).to_bytes(4, "little") + raw)
    return b"".join(parts)
