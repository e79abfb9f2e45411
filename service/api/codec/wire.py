"""HTTP wire helpers shared by the native and V2 codecs: body, media types, arrays, target.

Hot path: JSON is parsed with orjson and converted with one ``np.array`` call; ``.npy`` bodies
are read without pickle. These judge the wire format only (valid JSON, numbers, a readable
array); what a model can take is the data plane's call. Messages name the field, and show a
value only when it is a number or a short word.
"""

from __future__ import annotations

import asyncio
import io
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from service.api.codec import memo
from service.budget import BODY_EXPANSION, charge, charge_json
from service.digits import decimal
from service.errors import (
    InvalidInput,
    MalformedBody,
    NotAcceptable,
    PayloadTooLarge,
    UnsupportedMediaType,
    describe_validation_errors,
    few,
)
from service.limits import kind_name
from service.messages import Target
from service.npyio import NpyError, read_npy, read_npz_body, write_npz

JSON = "application/json"
NPY = "application/x-npy"
NPZ = "application/x-npz"
MAX_DEPTH = 8  # the deepest array an endpoint takes is 3-D; numpy is never shown more
#: Parsing or encoding more than this runs in a worker thread, off the event loop.
OFFLOAD_BYTES = 1 << 20
T = TypeVar("T")


async def off_loop(size: int, function: Callable[..., T], *args: Any) -> T:
    """``function(*args)``, in a worker thread when ``size`` (bytes of work) is large.

    A 700 MB JSON answer encoded on the event loop held every other request, health checks
    included, for seconds; small ones stay inline, where a thread hop would cost more. Large
    pieces of work run one at a time (``_one_at_a_time``).
    """
    if size <= OFFLOAD_BYTES:
        return function(*args)
    return await asyncio.to_thread(_one_at_a_time, function, *args)


#: Held by the large piece of codec work running (``off_loop``).
_LARGE_WORK = threading.Lock()


def _one_at_a_time(function: Callable[..., T], *args: Any) -> T:
    """Decoding a 41 MB JSON body makes ~2 million Python objects, which the interpreter
    holds the GIL to make: two at once take no less time than one after the other, but they
    interleave their objects in the allocator's arenas, which stay resident once either is
    freed (16 concurrent 4096-row JSON requests left ~0.9 GB more once idle, and their peak
    was 0.9 GB higher). One at a time, each one's objects go back whole."""
    with _LARGE_WORK:
        return function(*args)


def header(request: Request, name: bytes, default: str | None = None) -> str | None:
    """One request header (``name`` in lower case); the headers are indexed once per request
    (Starlette's ``Headers.get`` scans them all on every call)."""
    scope = request.scope
    index: dict[bytes, bytes] | None = scope.get("lmhead.headers")
    if index is None:
        index = scope["lmhead.headers"] = dict(scope["headers"])
    value = index.get(name)
    return default if value is None else value.decode("latin-1")


def target(request: Request) -> Target:
    """The model and version a request addresses: path ``/versions/{v}`` or ``?version=v``."""
    params = request.path_params
    raw = params.get("version")
    query = request.scope["query_string"]
    if query:  # parsing an empty query costs ~10 us
        twice, named, given = memo.query_facts(query)
        if twice:  # which one would count? (Starlette's: the last)
            raise InvalidInput(f"query parameter {few(twice)} given more than once")
        if raw is not None and named:
            raise InvalidInput("the version is in the path; ?version= says it again")
        raw = given if raw is None else raw
    version = None if raw is None else decimal(raw)
    if raw is not None and version is None:
        raise InvalidInput(f"version must be a non-negative integer, got {raw[:32]!r}")
    return Target(params["name"], version)


#: Why query parameters beside a JSON body are refused (``no_query_options``).
BESIDE_JSON = (
    "beside a JSON body: give options in the body (query parameters carry them with an "
    ".npy body only)"
)


def no_query_options(
    request: Request, why: str = BESIDE_JSON, read: Sequence[str] = ("version",)
) -> None:
    """A request's options come from one place: query parameters other than those ``read``
    are refused, named, where they would not be read (``?k=2`` or ``?bogus=1`` beside a JSON
    body was served with the body's options, silently)."""
    if not request.scope["query_string"]:
        return
    given = [name for name in dict.fromkeys(request.query_params) if name not in read]
    if given:
        raise InvalidInput(f"query parameter{'s' * (len(given) > 1)} {few(given)} {why}")


async def read_body(request: Request, limit: int, setting: str = "LMHEAD_MAX_BODY_BYTES") -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``limit`` bytes (named by
    ``setting``), and with 415 when compressed (it would be read as garbage, and
    misdiagnosed)."""
    encoding = header(request, b"content-encoding")
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        raise UnsupportedMediaType(
            f"Content-Encoding {encoding[:32]!r} is not accepted: send the body uncompressed"
        )
    declared = header(request, b"content-length")
    size = None if declared is None else decimal(declared)
    if size is not None and size > limit:
        # A client waiting for 100 Continue never sends the body: the connection closes (RFC
        # 9110 10.1.1 asks to say so); any other's body is read and dropped, so that it reads
        # this answer (closing while it still sends would reset the connection instead).
        expecting = (header(request, b"expect") or "").strip().lower() == "100-continue"
        raise PayloadTooLarge(
            f"request body is {size} bytes; the limit is {limit} ({setting})",
            headers={"Connection": "close"} if expecting else None,
        )
    chunks, size = [], 0
    while True:  # the ASGI messages themselves: Request.stream() costs more for one chunk
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes ({setting})")
        charge(len(chunk) * BODY_EXPANSION)  # 503 when the requests in flight hold too much
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)  # a single chunk comes back as is, no copy


#: Charsets whose JSON is not ASCII bytes (any other reads the same as UTF-8 while ASCII).
WIDE_CHARSETS = ("utf-16", "utf16", "utf-32", "utf32", "ucs-2", "ucs-4", "ucs2", "ucs4")


def content_type(request: Request, accepted: Iterable[str]) -> str:
    """The body's media type (JSON when absent), or 415 naming what is accepted."""
    given = header(request, b"content-type", JSON) or JSON
    media = given.split(";", 1)[0].strip().lower()
    accepted = tuple(accepted)
    if media not in accepted:
        raise UnsupportedMediaType(
            f"Content-Type {media[:64]!r} is not supported here; send one of {', '.join(accepted)}"
        )
    for parameter in given.split(";")[1:] if media == JSON else ():  # read as UTF-8 (RFC 8259)
        key, _, value = parameter.partition("=")
        charset = value.strip().strip('"').lower()
        if key.strip().lower() == "charset" and charset.startswith(WIDE_CHARSETS):
            raise UnsupportedMediaType(f"charset {charset[:32]!r} is not read: send UTF-8")
    return media


def response_type(request: Request, offered: Iterable[str], default: str) -> str:
    """Pick the answer's media type from Accept: the client's highest ``q`` first (its order
    among equals); ``q=0`` refuses a type, wildcards included."""
    accept = header(request, b"accept", "") or ""
    if accept in ("", "*/*"):  # what most clients send
        return default
    offered = tuple(offered)
    wanted = _preferences(accept)
    if not wanted:
        return default
    refused = {media for media, q in wanted if q == 0}
    for media, _ in sorted((item for item in wanted if item[1] > 0), key=lambda item: -item[1]):
        if media in offered and media not in refused:
            return media
        if media in ("*/*", "application/*"):
            choice = next((o for o in (default, *offered) if o not in refused), None)
            if choice is not None:
                return choice
    raise NotAcceptable(
        f"cannot answer in {accept[:64]!r}; this endpoint offers {', '.join(offered)}"
    )


def _preferences(accept: str) -> list[tuple[str, float]]:
    """(media type, q) of each Accept entry (at most 32); a q that is no number in [0, 1]
    counts as 1."""
    found = []
    for part in accept.split(",")[:32]:
        media, *parameters = part.split(";")
        media = media.strip().lower()
        if not media:
            continue
        q = 1.0
        for parameter in parameters:
            key, _, value = parameter.partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 1.0
                q = q if 0 <= q <= 1 else 1.0
        found.append((media, q))
    return found


def parse_json_object(body: bytes) -> dict[str, Any]:
    charge_json(body)
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        if "infinity" in error.msg:  # 1e999: valid JSON, but Inf as a float
            raise InvalidInput(f"a number at byte {error.pos} is beyond float range") from None
        raise MalformedBody(f"body is not valid JSON ({json_error(error, body)})") from None
    if not isinstance(payload, dict):
        raise MalformedBody(f"body must be a JSON object, got a JSON {json_type(payload)}")
    return payload


#: What Python's ``json.dumps`` (and JavaScript's) write for non-finite floats; no JSON number.
NON_STANDARD = re.compile(rb"(nan|infinity|inf)(?![A-Za-z0-9_])", re.IGNORECASE)


def json_error(error: orjson.JSONDecodeError, text: bytes) -> str:
    """Why ``text`` is no JSON, where: a ``NaN`` or ``Infinity`` is named as the non-standard
    number it is (orjson says "unexpected character"), never shown beyond that word."""
    if NON_STANDARD.match(text, error.pos):
        return f"NaN or Infinity at byte {error.pos}: JSON has no such numbers, send finite ones"
    return f"{error.msg} at byte {error.pos}"


def parse_npz(body: bytes) -> dict[str, npt.NDArray[Any]]:
    """A request's ``.npz`` body, its entries by name (``npyio.read_npz_body``: stored
    entries only, each read as an ``.npy``)."""
    try:
        return read_npz_body(body)
    except NpyError as error:
        raise MalformedBody(f"body is not a valid .npz archive ({error})") from None
    except Exception:  # numpy raises ValueError/OSError/EOFError for broken members
        raise MalformedBody("body is not a valid .npz archive") from None


def parse_npy(body: bytes, field: str) -> npt.NDArray[Any]:
    try:
        return read_npy(body)
    except NpyError as error:  # our own reasons: say which
        raise MalformedBody(f"{field}: body is not a valid .npy array ({error})") from None
    except Exception:  # numpy raises ValueError/OSError/EOFError for broken files
        raise MalformedBody(f"{field}: body is not a valid .npy array") from None


def options(
    model: type[BaseModel],
    values: Mapping[str, Any],
    *,
    strict: bool = True,
    taken: Sequence[str] = (),
) -> Any:
    """Validate the small option fields; errors name the field, and show the value only when
    it is a number or a short word (``service.errors``).

    JSON options are strict (``"5"`` or ``true`` is no k); query strings are text by nature.
    ``taken``: the fields read before these (the rows, id lists), named with them when a
    field is unknown.
    """
    key = memo.options_key(model, strict, values)
    known = memo.VALIDATED.get(key) if key is not None else None
    if known is not None:  # the same scalars validated before: the same (frozen) options
        return known
    unknown = [name for name in values if name not in model.model_fields]
    if unknown:  # pydantic would make an error of each: a million keys took 17 s and 1.2 GB
        fields = ", ".join([*taken, *model.model_fields])
        listed = f"the options here are {fields}" if model.model_fields else f"{fields} alone"
        raise InvalidInput(f"unknown field{'s' * (len(unknown) > 1)} {few(unknown)}; {listed}")
    try:
        validated = model.model_validate(dict(values), strict=strict)
    except ValidationError as error:
        raise InvalidInput(describe_validation_errors(error.errors())) from None
    if key is not None and model.model_config.get("frozen"):
        memo.remember(key, validated)
    return validated


def booleans_hidden(body: bytes, payload: dict[str, Any]) -> bool:
    """Could a JSON boolean sit inside the payload's arrays? numpy turns ``true`` into 1.0
    silently, so arrays are scanned for them, but only when the raw body has more boolean
    literals than the top-level options hold (a cheap count; nearly always no)."""
    literals = body.count(b"true") + body.count(b"false")
    return literals > sum(isinstance(value, bool) for value in payload.values())


def float_array(value: Any, field: str, booleans: bool = True) -> npt.NDArray[np.float32]:
    """A nested JSON list of numbers -> float32; strings, booleans, ragged rows are refused.

    ``booleans=False`` skips the scan for booleans hidden among numbers (see
    ``booleans_hidden``). Values beyond float32's range become Inf, which the data plane
    refuses as non-finite.
    """
    array = _numbers(value, field, "numbers", booleans)
    if array.dtype.kind not in "fiu":
        raise InvalidInput(f"{field} must hold numbers only, got {kind_name(array.dtype)}")
    return array.astype(np.float32)


def int_array(value: Any, field: str, booleans: bool = True) -> npt.NDArray[np.int64]:
    """A nested JSON list of integers -> int64; floats, strings, booleans are refused."""
    array = _numbers(value, field, "integers", booleans)
    if array.size and array.dtype.kind not in "iu":
        raise InvalidInput(f"{field} must hold integers only, got {kind_name(array.dtype)}")
    if array.dtype.kind == "u" and array.size and int(array.max()) > np.iinfo(np.int64).max:
        raise InvalidInput(f"{field} holds integers beyond the int64 range")
    return array.astype(np.int64, copy=False)


def _numbers(value: Any, field: str, what: str, booleans: bool) -> npt.NDArray[Any]:
    if not isinstance(value, list):
        raise InvalidInput(f"{field} must be a nested list of {what}, got {json_type(value)}")
    depth, inner = 0, value
    while isinstance(inner, list) and inner and depth <= MAX_DEPTH:
        depth, inner = depth + 1, inner[0]
    if depth > MAX_DEPTH:
        raise InvalidInput(f"{field} is nested deeper than {MAX_DEPTH} levels")
    try:
        array = np.array(value)
    except (ValueError, TypeError, RecursionError):
        raise InvalidInput(_diagnose(value, field, what)) from None
    if booleans and array.dtype.kind in "iuf" and _holds_boolean(value):
        raise InvalidInput(f"{field} must hold {what} only; found a JSON boolean")
    return array


def _holds_boolean(value: list[Any]) -> bool:
    pending = [value]
    while pending:
        for item in pending.pop():
            if item is True or item is False:
                return True
            if isinstance(item, list):
                pending.append(item)
    return False


def json_bytes(payload: Any) -> bytes:
    return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)


def npy_bytes(array: npt.NDArray[Any]) -> bytes:
    stream = io.BytesIO()
    np.save(stream, array, allow_pickle=False)
    return stream.getvalue()


def npz_bytes(arrays: Mapping[str, npt.NDArray[Any]]) -> bytes:
    return write_npz(dict(arrays))


def _diagnose(value: list[Any], field: str, what: str) -> str:
    try:
        array = np.array(value, dtype=object)
    except (ValueError, RecursionError):
        array = None
    if array is None or array.dtype == object and any(isinstance(v, list) for v in array.flat):
        return f"{field} rows have different lengths (ragged); every row must be equally long"
    return f"{field} must hold {what} only; found a JSON {json_type(_first_odd(array.flat))}"


def _first_odd(values: Iterable[Any]) -> Any:
    for item in values:
        if not isinstance(item, int | float) or isinstance(item, bool):
            return item
    return None


def json_type(value: Any) -> str:
    """A JSON value's type as JSON names it (for messages that must not echo the value)."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")
