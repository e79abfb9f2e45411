"""The OpenAPI document tells the truth: valid 3.1, every parameter and body declared, and a
client that knows nothing but the document can call the service and get what it promises.

"Try it out", done by a program: operations are called on a real server with the path
parameters, content types and example bodies the document gives (only the rows widened to the
model's d_model, which the documented metadata answer carries), and every request and answer,
errors included, is validated against the document with openapi-core.

The walk goes both ways, from whatever the document holds when it runs: every field it marks
nullable, sent as null (in a JSON body, in a nested object, as an ``.npy`` body's query
parameter), gives the answer of leaving it out; and a request using every documented field,
each with the document's own example (or default), validates and is served.
"""

from __future__ import annotations

import copy
import io
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import pytest
from openapi_core import OpenAPI
from openapi_core.datatypes import RequestParameters
from openapi_spec_validator import validate
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


#: The document's validator, made once per document (it takes a while to build).
_SPECS: dict[int, OpenAPI] = {}


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


@pytest.fixture(scope="module")
def url(
    tmp_path_factory: pytest.TempPathFactory,
    table: npt.NDArray[np.float32],
    output_weight: npt.NDArray[np.float32],
) -> Iterator[str]:
    root = tmp_path_factory.mktemp("openapi")
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


@pytest.fixture(scope="module")
def document(url: str) -> dict[str, Any]:
    answer = httpx.get(f"{url}/openapi.json")
    assert answer.status_code == 200
    doc: dict[str, Any] = answer.json()
    return doc


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


def _call(
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
    spec = _SPECS.get(id(document)) or _SPECS.setdefault(id(document), OpenAPI.from_dict(document))
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
    described = _call(url, document, "get", "/v1/models/{name}").json()
    d_model = described["d_model"]
    for template in (
        "/v1/models/{name}/topk",
        "/v1/models/{name}/versions/{version}/topk",
        "/v1/models/{name}/score",
        "/v1/models/{name}/embed",
        "/v2/models/{name}/infer",
    ):
        response = _call(url, document, "post", template, _example(document, template, d_model))
        assert response.status_code == 200, f"{template}: {response.text}"
    compare = _example(document, "/v1/compare", d_model) | {"models": ["tied", "untied"]}
    assert _call(url, document, "post", "/v1/compare", compare).status_code == 200
    for template in ("/v2/models/{name}", "/v2/models/{name}/ready", "/v1/models", "/v2"):
        assert _call(url, document, "get", template).status_code == 200


def test_documented_errors_are_the_errors_sent(url: str, document: dict[str, Any]) -> None:
    wrong_width = {"hidden_states": [[0.5, 1.0]]}
    native = _call(url, document, "post", "/v1/models/{name}/topk", wrong_width)
    assert native.status_code == 422
    assert native.json()["error"]["code"] == "invalid_input"
    v2 = _call(url, document, "post", "/v2/models/{name}/infer", {"inputs": []})
    assert v2.status_code == 400
    assert isinstance(v2.json()["error"], str)


def test_the_version_path_parameter_takes_the_documented_example(
    url: str, document: dict[str, Any]
) -> None:
    body = {"hidden_states": [[0.0] * D_MODEL]}
    response = _call(url, document, "post", "/v1/models/{name}/versions/{version}/logits", body)
    assert response.status_code == 200
    assert response.headers["x-lmhead-version"] == "1"


# The walk: generated from the document as it is when the test runs.


def _resolved(document: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """``schema``, its ``$ref`` followed into the document's components."""
    while "$ref" in schema:
        schema = document["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def _nullable(schema: dict[str, Any]) -> bool:
    choices = [schema, *schema.get("anyOf", ())]
    return any(choice.get("type") == "null" for choice in choices)


def _object(document: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any] | None:
    """The object schema with properties that a field holds (itself, a ``$ref``, or one of
    its ``anyOf`` choices), or None."""
    for choice in (schema, *schema.get("anyOf", ())):
        found = _resolved(document, choice)
        if found.get("properties"):
            return found
    return None


def _value(document: dict[str, Any], name: str, schema: dict[str, Any]) -> Any:
    """The value the document itself gives a field: its example, its default (when not
    null), or an object of such values; a field with none fails, named."""
    if schema.get("examples"):
        return schema["examples"][0]
    if schema.get("default") is not None:
        return schema["default"]
    nested = _object(document, schema)
    assert nested is not None, f"{name}: the document gives no example (service/api/schemas.py)"
    return _every_field(document, nested, {}, name)


def _every_field(
    document: dict[str, Any], schema: dict[str, Any], base: dict[str, Any], where: str
) -> dict[str, Any]:
    """``base`` (the required fields), with every other documented field added."""
    filled = dict(base)
    for name, field in schema["properties"].items():
        if name not in filled:
            filled[name] = _value(document, f"{where}.{name}", field)
    return filled


def _widened(value: Any, d_model: int) -> Any:
    """An example's rows (lists of numbers) widened to the model's d_model."""
    if isinstance(value, list) and value and all(isinstance(v, float) for v in value):
        return np.linspace(-1, 1, d_model).round(4).tolist()
    if isinstance(value, list):
        return [_widened(item, d_model) for item in value]
    return value


def _base(document: dict[str, Any], template: str, d_model: int) -> dict[str, Any]:
    """The operation's documented example body, its rows widened; an optional body (the
    control calls) starts empty. Compare names the module's two heads."""
    content = document["paths"][template]["post"]["requestBody"]["content"]["application/json"]
    body: dict[str, Any] = copy.deepcopy(content.get("example", {}))
    if template == "/v1/compare":
        body["models"] = [MODEL, "untied"]
    body["hidden_states"] = _widened(body.get("hidden_states"), d_model)
    for tensor in body.get("inputs", []):
        tensor["shape"], tensor["data"] = [1, d_model], _widened(tensor["data"], d_model)
    return {key: value for key, value in body.items() if value is not None}


def _json_bodies(document: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every POST operation with a JSON body, and that body's schema."""
    for template, item in document["paths"].items():
        content = item.get("post", {}).get("requestBody", {}).get("content", {})
        if "application/json" in content:
            yield template, _resolved(document, content["application/json"]["schema"])


def _without_draws(answer: Any) -> Any:
    """An answer less what a random seed changes (a seed left out is drawn anew)."""
    if isinstance(answer, dict):
        return {
            key: _without_draws(value)
            for key, value in answer.items()
            if key != "seed"
            and not key.startswith("sampled")
            and not str(answer.get("name", "")).startswith("sampled")
        }
    if isinstance(answer, list):
        return [_without_draws(item) for item in answer if _without_draws(item) != {}]
    return answer


def _same_answer(with_null: httpx.Response, left_out: httpx.Response, what: str) -> None:
    assert left_out.status_code == 200, f"{what} left out: {left_out.text[:300]}"
    assert with_null.status_code == 200, f"{what} sent as null: {with_null.text[:300]}"
    random = what.endswith("seed")  # "A random seed (returned) when absent"
    ours, theirs = with_null.json(), left_out.json()
    assert (_without_draws(ours) if random else ours) == (
        _without_draws(theirs) if random else theirs
    ), what


def _null_cases(
    document: dict[str, Any], template: str, schema: dict[str, Any], base: dict[str, Any]
) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(field, body without it, body with it null) for every nullable field, and for every
    nullable field of an object a field holds (that object otherwise empty, but its seed)."""
    for name, field in schema["properties"].items():
        if _nullable(field) and name not in schema.get("required", ()):
            without = {key: value for key, value in base.items() if key != name}
            yield name, without, {**without, name: None}
        inner_fields = (_object(document, field) or {}).get("properties", {})
        for inner, inner_field in inner_fields.items():
            if not _nullable(inner_field):
                continue
            # A seed left out is drawn at random ("A random seed (returned) when absent"):
            # the other fields are compared at the documented seed, the seed without draws.
            fixed = {
                other: _value(document, other, inner_fields[other])
                for other in ("seed",)
                if other in inner_fields and other != inner
            }
            without = {**base, name: fixed}
            yield f"{name}.{inner}", without, {**base, name: {**fixed, inner: None}}


def _npy_body(base: dict[str, Any]) -> npt.NDArray[Any]:
    """The array of a documented JSON body, as an ``.npy`` body sends it."""
    if "input_ids" in base:
        return np.asarray(base["input_ids"], np.int64)
    return np.asarray(base["hidden_states"], np.float32)


def _d_model(url: str, document: dict[str, Any]) -> int:
    described: dict[str, Any] = _call(url, document, "get", "/v1/models/{name}").json()
    return int(described["d_model"])


def test_every_nullable_field_sent_as_null_is_left_out(url: str, document: dict[str, Any]) -> None:
    """On every operation with a JSON body: a field the document marks nullable, sent as
    null, gets the answer of leaving it out (``"allowed_token_ids": null`` was refused as an
    unknown field, ``"k": null`` on /score as no integer)."""
    d_model = _d_model(url, document)
    walked = []
    for template, schema in _json_bodies(document):
        if "/versions/" in template:
            continue  # the same operation as its unversioned path
        base = _base(document, template, d_model)
        for field, without, with_null in _null_cases(document, template, schema, base):
            left_out = _call(url, document, "post", template, without)
            _same_answer(_call(url, document, "post", template, with_null), left_out, field)
            walked.append(f"{template} {field}")
    for needed in (
        "/v1/models/{name}/topk allowed_token_ids",
        "/v1/models/{name}/topk banned_token_ids",
        "/v1/models/{name}/topk sample.seed",
        "/v1/models/{name}/logits allowed_token_ids",
        "/v1/models/{name}/lens target_ids",
        "/v1/models/{name}/score k",
        "/v2/models/{name}/infer parameters.k",
    ):
        assert needed in walked, needed  # the document marks them nullable


def test_every_nullable_query_parameter_sent_as_null_is_left_out(
    url: str, document: dict[str, Any]
) -> None:
    """With an ``.npy`` body the options are query parameters; those holding JSON take
    ``null`` as "not given" (``?allowed_token_ids=null`` was an unknown field)."""
    d_model = _d_model(url, document)
    walked = []
    for template, item in document["paths"].items():
        operation = item.get("post", {})
        if (
            NPY not in operation.get("requestBody", {}).get("content", {})
            or "/versions/" in template
        ):
            continue
        rows = _npy_body(_base(document, template, d_model))
        for parameter in operation["parameters"]:
            schema = parameter.get("content", {}).get("application/json", {}).get("schema")
            if schema is None or not _nullable(schema):
                continue
            name = parameter["name"]
            with_null = _call(url, document, "post", template, npy=rows, query={name: "null"})
            _same_answer(with_null, _call(url, document, "post", template, npy=rows), name)
            walked.append(f"{template} {name}")
    assert "/v1/models/{name}/topk allowed_token_ids" in walked
    assert "/v1/models/{name}/lens target_ids" in walked


def test_a_request_using_every_documented_field_validates_and_is_served(
    url: str, document: dict[str, Any]
) -> None:
    """Each JSON body with every field the document lists, each at the document's own example
    or default (nested objects too), and each ``.npy`` operation with every query parameter:
    valid against the document, and served (``ScoreBody`` left out k, logprobs_over and
    states while the service took them)."""
    d_model = _d_model(url, document)
    for template, schema in _json_bodies(document):
        base = _base(document, template, d_model)
        body = _every_field(document, schema, base, template)
        response = _call(url, document, "post", template, body)
        assert response.status_code == 200, f"{template} {sorted(body)}: {response.text[:300]}"
        operation = document["paths"][template]["post"]
        if NPY in operation["requestBody"]["content"]:
            query = {}
            for parameter in operation["parameters"]:
                if parameter["in"] != "query" or parameter["name"] == "version":
                    continue
                schema_of = (
                    parameter.get("schema") or parameter["content"]["application/json"]["schema"]
                )
                value = _value(document, parameter["name"], schema_of)
                structured = "content" in parameter or isinstance(value, bool)
                query[parameter["name"]] = json.dumps(value) if structured else str(value)
            answer = _call(url, document, "post", template, npy=_npy_body(base), query=query)
            assert answer.status_code == 200, f"{template} ?{sorted(query)}: {answer.text[:300]}"


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
