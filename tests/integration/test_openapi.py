"""The OpenAPI document tells the truth: valid 3.1, every parameter and body declared, and a
client that knows nothing but the document can call the service and get what it promises.

"Try it out", done by a program: operations are called on a real server with the path
parameters, content types and example bodies the document gives (only the rows widened to the
model's d_model, which the documented metadata answer carries), and every request and answer,
errors included, is validated against the document with openapi-core.
``test_openapi_walk.py`` walks every field both ways.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import pytest
from openapi_spec_validator import validate

from tests.conftest import D_MODEL
from tests.openapi_calls import call, fetch_document, serving


@pytest.fixture(scope="module")
def url(
    tmp_path_factory: pytest.TempPathFactory,
    table: npt.NDArray[np.float32],
    output_weight: npt.NDArray[np.float32],
) -> Iterator[str]:
    yield from serving(tmp_path_factory.mktemp("openapi"), table, output_weight)


@pytest.fixture(scope="module")
def document(url: str) -> dict[str, Any]:
    return fetch_document(url)


def _operations(document: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in document["paths"].items():
        for method, operation in item.items():
            yield path, method, operation


def test_the_document_is_valid_openapi_3_1(document: dict[str, Any]) -> None:
    assert document["openapi"].startswith("3.1")
    validate(document)  # raises with the first violation


def test_every_path_parameter_is_declared(document: dict[str, Any]) -> None:
    for path, method, operation in _operations(document):
        in_path = set(re.findall(r"{(\w+)}", path))
        declared = {p["name"] for p in operation.get("parameters", []) if p["in"] == "path"}
        assert declared == in_path, f"{method.upper()} {path}"


def test_bodies_answers_and_errors_are_documented(document: dict[str, Any]) -> None:
    bodiless = re.compile(r".*/(index|unload)$")
    for path, method, operation in _operations(document):
        if method == "post" and not bodiless.match(path):
            content = operation["requestBody"]["content"]
            assert "schema" in content["application/json"], path
        assert "200" in operation["responses"], path
        for status, answer in operation["responses"].items():
            if status.startswith(("4", "5")):
                schema = answer["content"]["application/json"]["schema"]["$ref"]
                expected = "V2ErrorAnswer" if path.startswith("/v2/") else "ErrorAnswer"
                assert schema.endswith(f"/{expected}"), f"{status} of {path}"
    assert "HTTPValidationError" not in json.dumps(document)  # FastAPI's {"detail"} shape
    metrics = document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert [media.split(";")[0] for media in metrics] == ["text/plain"]
    topk = document["paths"]["/v1/models/{name}/topk"]["post"]
    assert {"k", "logprobs", "temperature", "version"} <= {p["name"] for p in topk["parameters"]}
    assert "application/x-npy" in topk["requestBody"]["content"]


def _example(document: dict[str, Any], template: str, d_model: int) -> Any:
    """The documented example body, its rows widened to the model's d_model."""
    media = document["paths"][template]["post"]["requestBody"]["content"]["application/json"]
    body = copy.deepcopy(media["example"])
    row = np.linspace(-1, 1, d_model).round(4).tolist()
    if "hidden_states" in body:
        body["hidden_states"] = [row]
    for tensor in body.get("inputs", []):
        tensor["shape"], tensor["data"] = [1, d_model], row
    return body


def test_a_client_that_reads_only_the_document_can_call_the_service(
    url: str, document: dict[str, Any]
) -> None:
    described = call(url, document, "get", "/v1/models/{name}").json()
    d_model = described["d_model"]
    for template in (
        "/v1/models/{name}/topk",
        "/v1/models/{name}/versions/{version}/topk",
        "/v1/models/{name}/score",
        "/v1/models/{name}/embed",
        "/v2/models/{name}/infer",
    ):
        response = call(url, document, "post", template, _example(document, template, d_model))
        assert response.status_code == 200, f"{template}: {response.text}"
    compare = _example(document, "/v1/compare", d_model) | {"models": ["tied", "untied"]}
    assert call(url, document, "post", "/v1/compare", compare).status_code == 200
    for template in ("/v2/models/{name}", "/v2/models/{name}/ready", "/v1/models", "/v2"):
        assert call(url, document, "get", template).status_code == 200


def test_documented_errors_are_the_errors_sent(url: str, document: dict[str, Any]) -> None:
    wrong_width = {"hidden_states": [[0.5, 1.0]]}
    native = call(url, document, "post", "/v1/models/{name}/topk", wrong_width)
    assert native.status_code == 422
    assert native.json()["error"]["code"] == "invalid_input"
    v2 = call(url, document, "post", "/v2/models/{name}/infer", {"inputs": []})
    assert v2.status_code == 400
    assert isinstance(v2.json()["error"], str)


def test_the_version_path_parameter_takes_the_documented_example(
    url: str, document: dict[str, Any]
) -> None:
    body = {"hidden_states": [[0.0] * D_MODEL]}
    response = call(url, document, "post", "/v1/models/{name}/versions/{version}/logits", body)
    assert response.status_code == 200
    assert response.headers["x-lmhead-version"] == "1"


def test_the_pages_load_nothing_from_elsewhere(url: str) -> None:
    """``/docs`` and ``/redoc`` name only this service's own assets, which it serves: they
    work offline (FastAPI's loaded Swagger UI from a CDN: a blank page without internet)."""
    for page in ("/docs", "/redoc"):
        html = httpx.get(f"{url}{page}").text
        sources = re.findall(r'(?:src|href)="([^"]+)"', html)
        assert sources, page
        for source in sources:
            assert source.startswith("/"), f"{page} loads {source}"
            asset = httpx.get(f"{url}{source}")
            assert asset.status_code == 200, source
            assert len(asset.content) > 1000, source
        assert re.search(r"url: '/openapi.json'|spec-url=\"/openapi.json\"", html), page
    bundle = httpx.get(f"{url}/docs/assets/swagger-ui-bundle.js").text
    assert re.search(r'"5\.\d+\.\d+"', bundle)  # Swagger UI 5: it reads OpenAPI 3.1
    assert httpx.get(f"{url}/docs/assets/..%2Fcore.py").status_code == 404
