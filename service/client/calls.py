"""The client's requests and answers without I/O: what each method sends, how its answer is
read, when to retry. ``Client`` and ``AsyncClient`` only send."""

from __future__ import annotations

import io
import json
import math
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx
import numpy as np
import numpy.typing as npt

from service.errors import (
    Forbidden,
    InvalidInput,
    ModelNotFound,
    PayloadTooLarge,
    ServiceError,
    Unauthorized,
    by_code,
)
from service.npyio import read_npy, read_npz

NPY, NPZ, JSON = "application/x-npy", "application/x-npz", "application/json"
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


class UnreadableAnswer(ServiceError):
    """A success status whose body is not what the call returns (a proxy's page, a cut-off
    body, another service on the port): raised like every other failed call, not as the
    parser's ``ValueError`` or ``KeyError``. Its status is 502 (a bad answer from upstream,
    as a gateway would say); the service's own status is in the message."""

    status = 502
    code = "unreadable_answer"


@contextmanager
def unreadable(answer: httpx.Response) -> Iterator[None]:
    """Read ``answer`` inside this: what its body lacks is an ``UnreadableAnswer``."""
    try:
        yield
    except (ValueError, KeyError, TypeError, IndexError, EOFError, zipfile.BadZipFile) as error:
        request = answer.request
        raise UnreadableAnswer(
            f"the {answer.status_code} answer to {request.method} {request.url.path} is not "
            f"what the call returns ({type(error).__name__}: {str(error)[:200]}); content-type "
            f"{answer.headers.get('content-type', 'none')!r}"
        ) from error


def read_json(answer: httpx.Response, key: str | None = None, has: str | None = None) -> Any:
    """The answer's JSON (or its ``key``), or ``UnreadableAnswer``; ``has``: a field the
    whole answer must hold (``{}`` or a list came back as the answer itself)."""
    with unreadable(answer):
        payload = answer.json()
        if has is not None and has not in payload:
            raise KeyError(has)
        return payload if key is None else payload[key]


@dataclass(frozen=True)
class TopK:
    """Top-k per row, leading dims as sent; ``logprobs`` when asked, ``tokens`` over JSON."""

    model: str
    version: int
    tied: bool
    token_ids: npt.NDArray[np.int64]
    logits: npt.NDArray[np.float32]
    logprobs: npt.NDArray[np.float32] | None = None
    logsumexp: npt.NDArray[np.float32] | None = None
    tokens: list[list[str | None]] | None = None
    sampled_token_ids: npt.NDArray[np.int64] | None = None
    sampled_logprobs: npt.NDArray[np.float32] | None = None
    seed: int | None = None
    """The seed the draws came from (the service's own when none was given): pass it as
    ``sample={"seed": ...}`` to draw the same tokens again."""


@dataclass(frozen=True)
class Arrays:
    """Logits or embeddings, and who answered."""

    model: str
    version: int
    tied: bool
    array: npt.NDArray[np.float32]


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
    """What each method sends, and how its answer is read: shared by both clients."""

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
        params = _fitting_query(values) if self.binary and not tokens else None
        if params is not None:
            return self._npy("POST", _path(model, "topk", version), _floats(hidden), params, NPZ)
        # JSON: asked for token strings, or options too long for a URL (thousands of ids)
        return self._json(_path(model, "topk", version), {"hidden_states": hidden, **values})

    def read_topk(self, answer: httpx.Response) -> TopK:
        with unreadable(answer):
            return self._topk(answer)

    def _topk(self, answer: httpx.Response) -> TopK:
        model, version, tied = _identity(answer)
        if answer.headers.get("content-type", "").startswith(NPZ):
            arrays = read_npz(answer.content)
            return TopK(
                model,
                version,
                tied,
                arrays["token_ids"],
                arrays["logits"],
                arrays.get("logprobs"),
                arrays.get("logsumexp"),
                None,
                arrays.get("sampled_token_ids"),
                arrays.get("sampled_logprobs"),
                int(arrays["seed"]) if "seed" in arrays else None,
            )
        payload = answer.json()
        rows, shape = payload["results"], tuple(payload["shape"])

        def field(name: str, dtype: Any) -> Any:
            if not rows or name not in rows[0]:
                return None
            return np.array([row[name] for row in rows], dtype).reshape(*shape, -1)

        sampled = field("sampled_token_id", np.int64)
        drawn = field("sampled_logprob", np.float32)
        return TopK(
            model,
            version,
            tied,
            field("token_ids", np.int64),
            field("logits", np.float32),
            field("logprobs", np.float32),
            None,
            [row["tokens"] for row in rows] if rows and "tokens" in rows[0] else None,
            None if sampled is None else sampled.reshape(shape),
            None if drawn is None else drawn.reshape(shape),
            payload.get("seed"),
        )

    def logits(
        self, model: str, hidden: Any, temperature: float, version: int | None, allowed: Any
    ) -> Call:
        """All logits, or only the columns of ``allowed`` token ids (then in that order)."""
        values: dict[str, Any] = {"temperature": temperature}
        if allowed is not None:
            values["allowed_token_ids"] = allowed
        params = _fitting_query(values)
        path = _path(model, "logits", version)
        if params is not None:
            return self._npy("POST", path, _floats(hidden), params, NPY)
        body = self._json(path, {"hidden_states": hidden, **values})
        return Call("POST", path, body.content, {"content-type": JSON, "accept": NPY})

    def embed(self, model: str, ids: Any, version: int | None) -> Call:
        body = np.asarray(ids)
        if body.dtype.kind in "iu":  # other kinds go as they are: the service says what is wrong
            body = body.astype(np.int64, copy=False)
        return self._npy("POST", _path(model, "embed", version), body, {}, NPY)

    def read_array(self, answer: httpx.Response) -> Arrays:
        with unreadable(answer):
            array = read_npy(answer.content).copy()  # writable, as np.load gives it
            return Arrays(*_identity(answer), array)

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

    def _npy(self, method: str, path: str, array: Any, params: dict[str, str], accept: str) -> Call:
        headers = {"content-type": NPY, "accept": accept}
        return Call(method, path, _npy_bytes(array), headers, params)

    def _json(self, path: str, body: dict[str, Any]) -> Call:
        try:  # Python writes NaN as a literal no JSON parser takes: say so here instead
            content = json.dumps(body, default=_jsonable, allow_nan=False).encode()
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


def _identity(answer: httpx.Response) -> tuple[str, int, bool]:
    headers = answer.headers
    return (
        headers.get("x-lmhead-model", ""),
        int(headers.get("x-lmhead-version", "0")),
        headers.get("x-lmhead-tied") == "true",
    )


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
    params = {name: _query(value) for name, value in values.items()}
    return params if sum(len(text) for text in params.values()) <= MAX_QUERY_CHARS else None


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
