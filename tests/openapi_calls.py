"""The OpenAPI document read as a client reads it, for the tests that check it
(``test_openapi.py``, ``test_openapi_walk.py``): a server of three heads, the document it
serves, and ``call``, which sends what the document describes and validates the request and
the answer against it with openapi-core."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
from openapi_core import OpenAPI
from openapi_core.datatypes import RequestParameters
from werkzeug.datastructures import Headers, ImmutableMultiDict

from service.heads.files import HeadWeights, save_head
from service.heads.norm import FinalNorm
from service.tools.demo import demo_tokens
from tests.conftest import D_MODEL, VOCAB
from tests.server import running_server

MODEL = "tied"
#: What the walk loads and unloads (the control calls), so the others keep serving.
SPARE = "spare"
NPY = "application/x-npy"


#: The document's validator, made once per document (it takes a while to build); the document
#: is kept beside it, so an id reused by another document never finds it.
_SPECS: dict[int, tuple[dict[str, Any], OpenAPI]] = {}


@dataclass
class DocRequest:
    """openapi-core's request protocol, filled from an httpx request."""

    host_url: str
    path: str
    method: str
    parameters: RequestParameters
    content_type: str
    body: bytes | None


@dataclass
class DocResponse:
    status_code: int
    content_type: str
    headers: Headers
    data: bytes | None


def serving(
    root: Path, table: npt.NDArray[np.float32], output_weight: npt.NDArray[np.float32]
) -> Iterator[str]:
    """The three heads under ``root``, served: MODEL and untied with a final norm (residual
    states read), SPARE without."""
    norm = FinalNorm("rms", np.linspace(0.9, 1.1, D_MODEL), 1e-5)  # residual states too
    for name, weights in (
        (MODEL, HeadWeights.from_arrays(table, norm=norm)),
        ("untied", HeadWeights.from_arrays(table, output_weight, norm=norm)),
        (SPARE, HeadWeights.from_arrays(table)),
    ):
        save_head(weights, root / name / "1")
        (root / name / "1" / "vocab.txt").write_text("\n".join(demo_tokens(VOCAB)) + "\n")
    with running_server(root) as base_url:
        yield base_url


def fetch_document(url: str) -> dict[str, Any]:
    answer = httpx.get(f"{url}/openapi.json")
    assert answer.status_code == 200
    doc: dict[str, Any] = answer.json()
    return doc


def call(
    url: str,
    document: dict[str, Any],
    method: str,
    template: str,
    body: Any = None,
    *,
    npy: npt.NDArray[Any] | None = None,
    query: dict[str, str] | None = None,
) -> httpx.Response:
    """Call an operation with the document's own path-parameter examples (name -> MODEL, or
    SPARE for the control calls), a JSON body or an ``.npy`` one with ``query`` parameters;
    request and answer are validated against the document. JSON answers are asked for."""
    operation = document["paths"][template][method]
    model = SPARE if "/repository/" in template else MODEL
    values = {
        p["name"]: model if p["name"] == "name" else p["example"]
        for p in operation.get("parameters", [])
        if p["in"] == "path"
    }
    path = template.format(**values)
    headers = {"accept": "application/json"}
    content = None
    if npy is not None:
        stream = io.BytesIO()
        np.save(stream, npy)
        content, headers["content-type"] = stream.getvalue(), NPY
    elif body is not None:
        content, headers["content-type"] = json.dumps(body).encode(), "application/json"
    response = httpx.request(
        method, f"{url}{path}", content=content, headers=headers, params=query, timeout=30
    )
    spec = _spec(document)
    request = DocRequest(
        url,
        path,
        method,
        RequestParameters(
            query=ImmutableMultiDict(list((query or {}).items())),
            header=Headers(headers),
            cookie={},
        ),
        headers.get("content-type", ""),
        content,
    )
    spec.validate_request(request)
    spec.validate_response(
        request,
        DocResponse(
            response.status_code,
            response.headers.get("content-type", ""),
            Headers(list(response.headers.items())),
            response.content,
        ),
    )
    return response


def _spec(document: dict[str, Any]) -> OpenAPI:
    kept = _SPECS.get(id(document))
    if kept is None or kept[0] is not document:
        kept = _SPECS[id(document)] = (document, OpenAPI.from_dict(document))
    return kept[1]
