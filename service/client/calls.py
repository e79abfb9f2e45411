"""The client's requests without I/O: what each method sends, which errors an answer raises,
when to retry (``answers.py`` reads what comes back). ``Client`` and ``AsyncClient`` only send."""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx
import numpy as np
import numpy.typing as npt

from service.client.answers import JSON, NPY, NPZ
from service.errors import (
    Forbidden,
    InvalidInput,
    ModelNotFound,
    PayloadTooLarge,
    ServiceError,
    Unauthorized,
    by_code,
)

#: Array options that travel in an ``.npz`` body (never in a URL), and the ragged ones among
#: them (a list per row or per word: their values and ``<name>_lengths``).
RAGGED_OPTIONS = ("prompt_token_ids", "output_token_ids", "bad_words_ids")
BINARY_OPTIONS = (
    "allowed_token_ids",
    "banned_token_ids",
    "stop_token_ids",
    "token_bitmask",
    *RAGGED_OPTIONS,
)
#: The status the client retries (with backoff, after the service's ``Retry-After``).
RETRY_STATUS = 503
#: Options longer than this go in a JSON body instead of the query (the service refuses
#: header bytes past ``LMHEAD_MAX_HEADER_BYTES``, 32 KiB by default: 4096 ids did not fit).
MAX_QUERY_CHARS = 8192
#: V2 errors carry a message and no code (the protocol's ``{"error": "..."}``): by status.
V2_ERRORS: dict[int, type[ServiceError]] = {
    400: InvalidInput,
    401: Unauthorized,
    403: Forbidden,
    404: ModelNotFound,
    413: PayloadTooLarge,
}


@dataclass(frozen=True)
class Call:
    """One HTTP request, built once and sent by either client (sans I/O)."""

    method: str
    path: str
    content: bytes | None = None
    headers: dict[str, str] | None = None
    params: dict[str, str] | None = None
    idempotent: bool = True


class Calls:
    """What each method sends: shared by both clients (``answers.py`` reads the answers)."""

    def __init__(self, binary: bool, token: str | None) -> None:
        self.binary = binary
        self.token = token

    def topk(
        self,
        model: str,
        hidden: Any,
        k: int | None,
        logprobs: bool,
        temperature: float,
        tokens: bool,
        version: int | None,
        options: dict[str, Any],
    ) -> Call:
        values = {"logprobs": logprobs, "temperature": temperature, **options}
        if k is not None:
            values["k"] = k
        path = _path(model, "topk", version)
        if self.binary and any(given(values).get(name) is not None for name in BINARY_OPTIONS):
            return _npz_call(path, hidden, values, JSON if tokens else NPZ)
        return self._arrays(path, hidden, values, tokens)

    def lens(
        self, model: str, hidden: Any, options: dict[str, Any], tokens: bool, version: int | None
    ) -> Call:
        """(layers, tokens, d_model) states; ``options`` left None are not sent (the model's
        default k)."""
        values = {name: value for name, value in options.items() if value is not None}
        return self._arrays(_path(model, "lens", version), hidden, values, tokens)

    def logits(
        self,
        model: str,
        hidden: Any,
        temperature: float,
        version: int | None,
        allowed: Any,
        states: str | None = None,
        decoding: dict[str, Any] | None = None,
    ) -> Call:
        """All logits, or only the columns of ``allowed`` token ids (then in that order);
        ``decoding``: the decoding step's options (the logits after its processors)."""
        values: dict[str, Any] = {"temperature": temperature, **(decoding or {})}
        if allowed is not None:
            values["allowed_token_ids"] = allowed
        if states is not None:
            values["states"] = states
        path = _path(model, "logits", version)
        if self.binary and any(given(values).get(name) is not None for name in BINARY_OPTIONS):
            return _npz_call(path, hidden, values, NPY)
        params = _fitting_query(values)
        if params is not None:
            return self._npy("POST", path, _floats(hidden), params, NPY)
        body = self._json(path, {"hidden_states": hidden, **values})
        return Call("POST", path, body.content, {"content-type": JSON, "accept": NPY})

    def embed(self, model: str, ids: Any, version: int | None) -> Call:
        body = np.asarray(ids)
        if body.dtype.kind in "iu":  # other kinds go as they are: the service says what is wrong
            body = body.astype(np.int64, copy=False)
        return self._npy("POST", _path(model, "embed", version), body, {}, NPY)

    def score(
        self, model: str, hidden: Any, targets: Any, version: int | None, **options: Any
    ) -> Call:
        body = {"hidden_states": hidden, "target_ids": targets, **options}
        return self._json(_path(model, "score", version), body)

    def compare(self, models: tuple[str, str], hidden: Any, **options: Any) -> Call:
        return self._json(
            "/v1/compare", {"models": list(models), "hidden_states": hidden, **options}
        )

    def control(self, verb: str, model: str | None, version: int | None) -> Call:
        # The native routes: their errors carry a code (V2's only a message, read by status:
        # a missing version came back as ModelNotFound)
        path = (
            "/v1/repository/index"
            if model is None
            else f"/v1/repository/models/{quote(model, safe='')}/{verb}"
        )
        body = json.dumps({} if version is None else {"version": version}).encode()
        headers = {"content-type": JSON}
        if self.token is not None:
            headers["authorization"] = f"Bearer {self.token}"
        return Call("POST", path, body, headers, idempotent=False)

    def _arrays(self, path: str, hidden: Any, values: dict[str, Any], tokens: bool) -> Call:
        """``.npy`` in and ``.npz`` back, the options in the query; JSON both ways when token
        strings are asked (only JSON carries them), in JSON mode, or when the options would
        not fit a URL (thousands of ids)."""
        params = _fitting_query(values) if self.binary and not tokens else None
        if params is not None:
            return self._npy("POST", path, _floats(hidden), params, NPZ)
        return self._json(path, {"hidden_states": hidden, **values})

    def _npy(self, method: str, path: str, array: Any, params: dict[str, str], accept: str) -> Call:
        headers = {"content-type": NPY, "accept": accept}
        return Call(method, path, _npy_bytes(array), headers, params)

    def _json(self, path: str, body: dict[str, Any]) -> Call:
        try:  # Python writes NaN as a literal no JSON parser takes: say so here instead
            content = json.dumps(given(body), default=_jsonable, allow_nan=False).encode()
        except ValueError:
            raise ValueError("a JSON body cannot carry NaN or Inf; this one holds one") from None
        return Call("POST", path, content, {"content-type": JSON, "accept": JSON})


class Retry:
    """Waits before each try: ``None`` marks the last one (exponential backoff)."""

    def __init__(self, retries: int, backoff_s: float) -> None:
        self.retries = retries
        self.backoff_s = backoff_s

    def waits(self) -> Iterator[float | None]:
        for attempt in range(self.retries):
            yield self.backoff_s * 2**attempt
        yield None


def retry_after(answer: httpx.Response, backoff_s: float) -> float:
    """The service's ``Retry-After`` (seconds), never longer than 10 x the backoff."""
    try:
        asked = float(answer.headers.get("retry-after", backoff_s))
    except ValueError:
        asked = backoff_s
    if not math.isfinite(asked):  # "nan" parses, and compares false with everything
        asked = backoff_s
    return min(max(asked, backoff_s), 10 * backoff_s)


def checked(answer: httpx.Response) -> httpx.Response:
    """The answer, or the service's error raised as its ``service.errors`` class."""
    if answer.is_success:
        return answer
    code, message = "", answer.text[:500]
    try:
        error = answer.json()["error"]
        code, message = (
            (error["code"], error["message"]) if isinstance(error, dict) else ("", error)
        )
    except (ValueError, KeyError, TypeError):
        pass
    kind = by_code(code) if code else V2_ERRORS.get(answer.status_code, ServiceError)
    raised = kind(message)
    raised.status = answer.status_code  # an unknown code keeps what the service said
    raise raised


def model_path(model: str) -> str:
    """A model's route, its name escaped (``a/../b`` was sent as a path and served ``b``)."""
    return f"/v1/models/{quote(model, safe='')}"


def _path(model: str, verb: str, version: int | None) -> str:
    where = model_path(model) + ("" if version is None else f"/versions/{version}")
    return f"{where}/{verb}"


def _query(value: Any) -> str:
    """A query parameter: JSON for lists, objects and booleans, text for numbers and words
    (``logprobs_over=vocabulary``; as JSON it arrived quoted and was refused)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | str):
        return str(value)
    return json.dumps(value, default=_jsonable, allow_nan=False)


def _fitting_query(values: dict[str, Any]) -> dict[str, str] | None:
    """``values`` as query parameters, or None when they would not fit a URL
    (``MAX_QUERY_CHARS``): the caller sends them in a JSON body instead."""
    params = {name: _query(value) for name, value in given(values).items()}
    return params if sum(len(text) for text in params.values()) <= MAX_QUERY_CHARS else None


def given(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` without those left None, in nested objects too (``sample={"seed": None}``):
    None means "not given", so it is never sent (``allowed_token_ids=None`` went as a null
    the service refused, ``logprobs_over=None`` as the text "null")."""
    return {
        name: given(value) if isinstance(value, dict) else value
        for name, value in options.items()
        if value is not None
    }


def _ids(values: npt.NDArray[np.int64]) -> npt.NDArray[Any]:
    """Ids as int32 where they fit (every vocabulary's do: half the bytes of int64, which
    the service widens back), else as they are (the service says what is wrong)."""
    if values.size and (values.min() < -(2**31) or values.max() >= 2**31):
        return values
    return values.astype(np.int32)


def _npz_call(path: str, hidden: Any, values: dict[str, Any], accept: str) -> Call:
    """An ``.npz`` body: the rows and every array option an entry (a list of lists as its
    values and ``<name>_lengths``), the scalars in the query: thousands of ids cost their
    bytes, never a URL's text (1,000 allowed ids took ~3 ms to write into one)."""
    options = given(values)
    arrays: dict[str, Any] = {"hidden_states": _floats(hidden)}
    for name in BINARY_OPTIONS:
        value = options.pop(name, None)
        if value is None:
            continue
        if name in RAGGED_OPTIONS:
            lists = [np.asarray(row, np.int64).reshape(-1) for row in value]
            arrays[name] = _ids(np.concatenate(lists) if lists else np.zeros(0, np.int64))
            arrays[name + "_lengths"] = _ids(np.array([len(row) for row in lists], np.int64))
        elif name == "token_bitmask" and np.asarray(value).dtype.itemsize == 4:
            arrays[name] = np.asarray(value).astype(np.int32, copy=False)
        else:
            arrays[name] = _ids(np.asarray(value).astype(np.int64, copy=False))
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # stored, not compressed: what the service reads
    params = {name: _query(value) for name, value in options.items()}
    headers = {"content-type": NPZ, "accept": accept}
    return Call("POST", path, buffer.getvalue(), headers, params)


def _floats(hidden: Any) -> Any:
    """Hidden states as an ``.npy`` body takes them: integers as float32, as JSON reads them
    (an int64 array was refused in binary mode and served in JSON mode)."""
    values = np.asarray(hidden)
    return values.astype(np.float32) if values.dtype.kind in "iu" else values


def _npy_bytes(array: Any) -> bytes:
    values = np.asarray(array)
    if values.dtype.kind == "f" and values.dtype not in (np.float16, np.float32):
        values = values.astype(np.float32)
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(values), allow_pickle=False)
    return buffer.getvalue()


def _jsonable(value: Any) -> Any:
    """Arrays (and anything with ``__array__``) as nested lists in JSON bodies."""
    return np.asarray(value).tolist()


def with_states(options: dict[str, Any], states: str | None) -> dict[str, Any]:
    """``states`` as one more option, when given (else the service's default, ``final``)."""
    return options if states is None else {**options, "states": states}


def lens_options(k: int | None, targets: Any, states: str, last_layer: str) -> dict[str, Any]:
    return {"k": k, "target_ids": targets, "states": states, "last_layer": last_layer}
