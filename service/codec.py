"""Decode request bodies to numpy and encode answers; shared by every front end.

Hot path: JSON is parsed with orjson and converted with one ``np.array`` call; ``.npy`` bodies
are read without pickle. Every check says which field, what was expected and what came,
without echoing values.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from service.errors import (
    InvalidInput,
    MalformedBody,
    NotAcceptable,
    PayloadTooLarge,
    UnsupportedMediaType,
    describe_validation_errors,
)

JSON = "application/json"
NPY = "application/x-npy"
NPZ = "application/x-npz"
FLOAT_DTYPES = (np.float32, np.float16, np.float64)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is {int(declared)} bytes; the limit is {limit}")
    chunks, size = [], 0
    while True:  # the ASGI messages themselves: Request.stream() costs more for one chunk
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)  # a single chunk comes back as is, no copy


def content_type(request: Request, accepted: Iterable[str]) -> str:
    """The body's media type (JSON when absent), or 415 naming what is accepted."""
    header = request.headers.get("content-type", JSON)
    media = header.split(";", 1)[0].strip().lower()
    accepted = tuple(accepted)
    if media not in accepted:
        raise UnsupportedMediaType(
            f"Content-Type {media!r} is not supported here; send one of {', '.join(accepted)}"
        )
    return media


def response_type(request: Request, offered: Iterable[str], default: str) -> str:
    """Pick the answer's media type from Accept (first acceptable, in the client's order)."""
    header = request.headers.get("accept", "")
    if header in ("", "*/*"):  # what most clients send
        return default
    offered = tuple(offered)
    wanted = [part.split(";", 1)[0].strip().lower() for part in header.split(",") if part.strip()]
    if not wanted:
        return default
    for media in wanted:
        if media in offered:
            return media
        if media in ("*/*", "application/*"):
            return default
    raise NotAcceptable(f"cannot answer in {header!r}; this endpoint offers {', '.join(offered)}")


def parse_json_object(body: bytes) -> dict[str, Any]:
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise MalformedBody(f"body is not valid JSON ({error.msg} at byte {error.pos})") from None
    if not isinstance(payload, dict):
        raise MalformedBody(f"body must be a JSON object, got a JSON {_json_type(payload)}")
    return payload


def parse_npy(body: bytes, field: str) -> npt.NDArray[Any]:
    try:
        return np.load(io.BytesIO(body), allow_pickle=False)  # type: ignore[no-any-return]
    except Exception:  # numpy raises ValueError/OSError/EOFError for broken files
        raise MalformedBody(f"{field}: body is not a valid .npy array") from None


def options(model: type[BaseModel], values: Mapping[str, Any]) -> Any:
    """Validate the small option fields; errors name the field, never echo the value."""
    try:
        return model.model_validate(dict(values))
    except ValidationError as error:
        raise InvalidInput(describe_validation_errors(error.errors())) from None


def float_array(value: Any, field: str) -> npt.NDArray[np.float32]:
    """A nested JSON list of numbers -> float32 array; ragged or non-numeric is refused."""
    if not isinstance(value, list):
        raise InvalidInput(f"{field} must be a nested list of numbers, got {_json_type(value)}")
    try:
        return np.array(value, dtype=np.float32)
    except (ValueError, TypeError):
        raise InvalidInput(_diagnose(value, field, "numbers")) from None


def int_array(value: Any, field: str) -> npt.NDArray[np.int64]:
    """A nested JSON list of integers -> int64 array."""
    if not isinstance(value, list):
        raise InvalidInput(f"{field} must be a nested list of integers, got {_json_type(value)}")
    try:
        array = np.array(value)
    except (ValueError, TypeError):
        raise InvalidInput(_diagnose(value, field, "integers")) from None
    if array.size and array.dtype.kind not in "iu":
        raise InvalidInput(f"{field} must hold integers only, got {_kind_name(array.dtype)}")
    return array.astype(np.int64, copy=False)


def check_hidden_states(
    array: npt.NDArray[Any], d_model: int, max_rows: int, field: str = "hidden_states"
) -> npt.NDArray[np.float32]:
    """(rows, d_model) or (batch, tokens, d_model), finite, within the row limit -> float32."""
    if array.dtype.kind != "f":
        raise InvalidInput(f"{field} must be float32 or float16, got {_kind_name(array.dtype)}")
    if array.ndim not in (2, 3):
        raise InvalidInput(
            f"{field} must have shape (rows, {d_model}) or (batch, tokens, {d_model}), "
            f"got {array.ndim}-D shape {list(array.shape)}"
        )
    if array.shape[-1] != d_model:
        raise InvalidInput(
            f"{field} rows must have d_model={d_model} values, got {array.shape[-1]}"
        )
    rows = math.prod(array.shape[:-1])
    if rows == 0:
        raise InvalidInput(f"{field} is empty (shape {list(array.shape)}); send at least one row")
    if rows > max_rows:
        raise PayloadTooLarge(f"{field} has {rows} rows; the limit is {max_rows} per request")
    hidden = np.ascontiguousarray(array, dtype=np.float32)
    if not np.isfinite(hidden).all():
        raise InvalidInput(f"{field} contains NaN, Inf or null (or a value beyond float32's range)")
    return hidden


def check_ids(
    ids: npt.NDArray[np.int64], vocab_size: int, max_rows: int, field: str = "input_ids"
) -> npt.NDArray[np.int64]:
    if ids.dtype.kind not in "iu":
        raise InvalidInput(f"{field} must hold integers, got {_kind_name(ids.dtype)}")
    if ids.size == 0:
        raise InvalidInput(f"{field} is empty; send at least one token id")
    if ids.size > max_rows:
        raise PayloadTooLarge(f"{field} has {ids.size} ids; the limit is {max_rows} per request")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        raise InvalidInput(f"{field} must be in [0, {vocab_size}), got values in [{low}, {high}]")
    return ids.astype(np.int64, copy=False)


def json_bytes(payload: Any) -> bytes:
    return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)


def npy_bytes(array: npt.NDArray[Any]) -> bytes:
    stream = io.BytesIO()
    np.save(stream, array, allow_pickle=False)
    return stream.getvalue()


def npz_bytes(arrays: Mapping[str, npt.NDArray[Any]]) -> bytes:
    stream = io.BytesIO()
    np.savez(stream, allow_pickle=False, **arrays)
    return stream.getvalue()


def _diagnose(value: list[Any], field: str, what: str) -> str:
    try:
        array = np.array(value, dtype=object)
    except ValueError:
        array = None
    if array is None or array.dtype == object and any(isinstance(v, list) for v in array.flat):
        return f"{field} rows have different lengths (ragged); every row must be equally long"
    return f"{field} must hold {what} only; found a JSON {_json_type(_first_odd(array.flat))}"


def _first_odd(values: Iterable[Any]) -> Any:
    for item in values:
        if not isinstance(item, int | float) or isinstance(item, bool):
            return item
    return None


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def _kind_name(dtype: np.dtype[Any]) -> str:
    return {"b": "booleans", "U": "strings", "S": "bytes", "O": "objects", "c": "complex"}.get(
        dtype.kind, str(dtype)
    )
