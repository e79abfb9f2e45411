"""The OpenAPI document walked both ways, from whatever it holds when the test runs: every
field it marks nullable, sent as null (in a JSON body, in a nested object, as an ``.npy`` body's
query parameter), gives the answer of leaving it out; and a request using every documented
field, each at the document's own example (or default), validates and is served (the document
left fields out the service took, and the service refused a null the document allowed)."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import pytest

from tests.openapi_calls import MODEL, NPY, call, fetch_document, serving


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


def _vocab(url: str, document: dict[str, Any]) -> int:
    described: dict[str, Any] = call(url, document, "get", "/v1/models/{name}").json()
    return int(described["vocab_size"])


def _d_model(url: str, document: dict[str, Any]) -> int:
    described: dict[str, Any] = call(url, document, "get", "/v1/models/{name}").json()
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
            left_out = call(url, document, "post", template, without)
            _same_answer(call(url, document, "post", template, with_null), left_out, field)
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
            with_null = call(url, document, "post", template, npy=rows, query={name: "null"})
            _same_answer(with_null, call(url, document, "post", template, npy=rows), name)
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
    vocab = _vocab(url, document)
    for template, schema in _json_bodies(document):
        base = _base(document, template, d_model)
        body = _every_field(document, schema, base, template)
        if "token_bitmask" in body:  # as wide as the model's vocabulary, as rows are d_model
            body["token_bitmask"] = [-1] * -(-vocab // 32)
        response = call(url, document, "post", template, body)
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
            answer = call(url, document, "post", template, npy=_npy_body(base), query=query)
            assert answer.status_code == 200, f"{template} ?{sorted(query)}: {answer.text[:300]}"
