"""The client's typed answers and how each is read from a response (no I/O).

Apart from ``calls.py`` (what each call sends) so that each stays short: an answer is read the
same way whichever client sent the call, and whichever body the service chose (``.npz`` or
JSON), into one dataclass of numpy arrays. A body that is not the call's answer is an
``UnreadableAnswer``, never the parser's own ``KeyError`` or ``ValueError``.
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt

from service.errors import ServiceError
from service.npyio import read_npy, read_npz

NPY, NPZ, JSON = "application/x-npy", "application/x-npz", "application/json"


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
    tokens: list[Any] | None = None
    """Each row's token strings, nested as ``token_ids``' leading dims (a (batch, tokens)
    request: ``tokens[b][t]`` holds row (b, t)'s k strings); over JSON only."""
    sampled_token_ids: npt.NDArray[np.int64] | None = None
    """One draw per row (leading dims as sent), or (..., n) with ``sample={"n": n}``."""
    sampled_logprobs: npt.NDArray[np.float32] | None = None
    seed: int | None = None
    """The seed the draws came from (the service's own when none was given): pass it as
    ``sample={"seed": ...}`` to draw the same tokens again."""
    logprobs_mode: str | None = None
    """With the decoding step's options: ``raw`` or ``processed`` (a filtered token's logit
    and log-prob are -inf)."""


@dataclass(frozen=True)
class Arrays:
    """Logits or embeddings, and who answered."""

    model: str
    version: int
    tied: bool
    array: npt.NDArray[np.float32]


@dataclass(frozen=True)
class Lens:
    """The logit lens: every layer's states read through the head. Arrays are indexed
    [layer][token] (and [k] for the top tokens), in nats; ``target_*`` when targets were
    sent (a rank counts the tokens above the target: 0 is the top token);
    ``token_strings`` when asked (``tokens=True``) and the model has labels."""

    model: str
    version: int
    tied: bool
    token_ids: npt.NDArray[np.int64]
    logprobs: npt.NDArray[np.float32]
    entropy: npt.NDArray[np.float32]
    kl_to_last: npt.NDArray[np.float32]
    """KL(last layer's distribution || this layer's): 0 on the last layer."""
    target_ids: npt.NDArray[np.int64] | None = None
    target_logprobs: npt.NDArray[np.float32] | None = None
    target_ranks: npt.NDArray[np.int64] | None = None
    token_strings: list[list[list[str | None]]] | None = None

    @property
    def layers(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def tokens(self) -> int:
        return int(self.token_ids.shape[1])

    @property
    def k(self) -> int:
        return int(self.token_ids.shape[2])


def read_topk(answer: httpx.Response) -> TopK:
    with unreadable(answer):
        return _topk(answer)


def _topk(answer: httpx.Response) -> TopK:
    model, version, tied = identity(answer)
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
            str(arrays["logprobs_mode"]) if "logprobs_mode" in arrays else None,
        )
    payload = answer.json()
    rows, shape = payload["results"], tuple(payload["shape"])

    def field(name: str, dtype: Any) -> Any:
        if not rows or name not in rows[0]:
            return None
        values = [row[name] for row in rows]
        if dtype is np.float32:  # JSON writes -inf (a filtered token's) as null
            values = [_infinite(value) for value in values]
        return np.array(values, dtype).reshape(*shape, -1)

    draws = bool(rows) and "sampled_token_ids" in rows[0]  # n per row (``sample.n``)
    plural = "s" if draws else ""
    sampled = field(f"sampled_token_id{plural}", np.int64)
    drawn = field(f"sampled_logprob{plural}", np.float32)
    if not draws:  # one per row: shaped as the rows
        sampled = None if sampled is None else sampled.reshape(shape)
        drawn = None if drawn is None else drawn.reshape(shape)
    return TopK(
        model,
        version,
        tied,
        field("token_ids", np.int64),
        field("logits", np.float32),
        field("logprobs", np.float32),
        None,
        _nested([row["tokens"] for row in rows], shape) if rows and "tokens" in rows[0] else None,
        sampled,
        drawn,
        payload.get("seed"),
        payload.get("logprobs_mode"),
    )


def _infinite(value: Any) -> Any:
    """A row's value or list of values, each null (JSON's -inf) as -inf."""
    if isinstance(value, list):
        return [-np.inf if item is None else item for item in value]
    return -np.inf if value is None else value


def _nested(rows: list[Any], shape: tuple[int, ...]) -> list[Any]:
    """Per-row items nested as the rows' leading dims (they came flat, while ``token_ids``
    kept the shape)."""
    for size in reversed(shape[1:]):
        rows = [rows[start : start + size] for start in range(0, len(rows), size)]
    return rows


def read_array(answer: httpx.Response) -> Arrays:
    with unreadable(answer):
        array = read_npy(answer.content).copy()  # writable, as np.load gives it
        return Arrays(*identity(answer), array)


def read_lens(answer: httpx.Response) -> Lens:
    """The lens from its ``.npz`` arrays or its JSON (the only form with token strings);
    both come out as the same arrays. JSON's nested lists are shaped by its ``layers``,
    ``tokens`` and ``k`` (an empty list would read as fewer dimensions)."""
    with unreadable(answer):
        if answer.headers.get("content-type", "").startswith(NPZ):
            fields: dict[str, Any] = read_npz(answer.content)
            grid: tuple[int, ...] | None = None
        else:
            fields = answer.json()
            grid = (fields["layers"], fields["tokens"])

        def array(name: str, dtype: Any, per_token: int = 0, required: bool = True) -> Any:
            if not required and fields.get(name) is None:
                return None
            values = np.asarray(fields[name], dtype)  # a required field missing: KeyError
            if grid is None:
                return values
            return values.reshape(*grid, *((per_token,) if per_token else ()))

        k = 0 if grid is None else int(fields["k"])
        return Lens(
            *identity(answer),
            array("token_ids", np.int64, k),
            array("logprobs", np.float32, k),
            array("entropy", np.float32),
            array("kl_to_last", np.float32),
            None
            if fields.get("target_ids") is None
            else np.asarray(fields["target_ids"], np.int64),
            array("target_logprobs", np.float32, required=False),
            array("target_ranks", np.int64, required=False),
            None if grid is None else fields.get("token_strings"),
        )


def identity(answer: httpx.Response) -> tuple[str, int, bool]:
    """Which model, version and tie answered (the ``x-lmhead-*`` headers)."""
    headers = answer.headers
    return (
        headers.get("x-lmhead-model", ""),
        int(headers.get("x-lmhead-version", "0")),
        headers.get("x-lmhead-tied") == "true",
    )
