"""OpenAPI declarations: parameters, bodies and answers that FastAPI cannot infer.

The inference handlers take the bare ``Request`` (the codec parses bodies several times faster
than FastAPI's machinery, and the app serves them ahead of it), so FastAPI sees no parameters
and no body. ``operation`` declares them: every ``{param}`` of the path, the query parameters,
the JSON body (schema and example, ``.npy`` as an alternative where accepted) and every answer,
errors included in their real shape. ``tests/integration/test_openapi.py`` validates the document.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from service.api.decoding_fields import BODY_ONLY
from service.api.schemas import (
    CompareBody,
    EmbedBody,
    ErrorAnswer,
    LensBody,
    LogitsBody,
    ScoreBody,
    TopKBody,
)
from service.api.v2_schemas import V2ErrorAnswer, V2InferBody
from service.api.verify_schemas import VerifyBody

NPY = "application/x-npy"
NPZ = "application/x-npz"
OCTET = "application/octet-stream"
#: OpenAPI 3.1 describes raw bytes by their media type alone: no JSON schema applies.
BINARY: dict[str, Any] = {}
REF = "#/components/schemas/{model}"
#: Request bodies the handlers parse themselves; ``body_components`` puts them in the document.
BODIES: tuple[type[BaseModel], ...] = (
    TopKBody,
    LogitsBody,
    EmbedBody,
    ScoreBody,
    CompareBody,
    LensBody,
    V2InferBody,
    VerifyBody,
)
PATH_PARAMETERS: dict[str, dict[str, Any]] = {
    "name": {
        "description": "Model name (a directory of the repository).",
        "schema": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"},
        "example": "demo-tied",
    },
    "version": {
        "description": "Model version (a numbered directory); the served one when omitted.",
        "schema": {"type": "integer", "minimum": 0},
        "example": 1,
    },
}
ERROR_REASONS = {
    400: "Malformed body (not JSON, not .npy), a bad V2 request, or (load endpoint) a model "
    "on disk that failed to load; the old version keeps serving",
    401: "The admin token is missing or wrong",
    403: "The repository API is disabled (read-only, or control mode none)",
    404: "Unknown model or version",
    406: "An Accept header this endpoint cannot answer in",
    413: "Body, rows or full-logits bytes over a configured limit",
    415: "A Content-Type this endpoint does not read",
    422: "A value is wrong: shape, dtype, range, NaN, unknown field",
    503: "Model loading or failed, or its queue is full (Retry-After)",
}
INFERENCE_ERRORS = (400, 404, 406, 413, 415, 422, 503)


def path_parameters(path: str) -> list[dict[str, Any]]:
    """A declaration for every ``{param}`` in the path, in order."""
    return [
        {"name": name, "in": "path", "required": True, **PATH_PARAMETERS[name]}
        for name in re.findall(r"{(\w+)}", path)
    ]


def query(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "schema": schema, "description": description}


VERSION_QUERY = query(
    "version", {"type": "integer", "minimum": 0}, "Model version, instead of /versions/{version}."
)


def npy_query(body: type[BaseModel], array: str = "hidden_states") -> tuple[dict[str, Any], ...]:
    """The query parameters of an ``.npy`` body: one per field of ``body`` but its ``array``,
    typed as in the JSON body (so the document lists every option the service reads there;
    it listed three of topk's nine). Lists and objects travel as their JSON text, which
    may be ``null`` where the field is nullable: a ``content`` parameter."""
    schema = body.model_json_schema(ref_template=REF)
    parameters = []
    for name, field in schema["properties"].items():
        if name == array or name in BODY_ONLY:  # arrays of the step: the body's, never a URL's
            continue
        described = {"description": f"With an .npy body: {field.get('description', name)}"}
        plain = _not_null(field)
        if _structured(plain):
            json_text = {"content": {"application/json": {"schema": field}}}
            parameters.append({"name": name, "in": "query", **json_text, **described})
        else:
            parameters.append({"name": name, "in": "query", "schema": plain, **described})
    return tuple(parameters)


def _not_null(field: dict[str, Any]) -> dict[str, Any]:
    """A field's schema without its ``null`` choice: a query parameter left out is not given,
    and ``?k=null`` is no integer."""
    choices = [c for c in field.get("anyOf", ()) if c.get("type") != "null"]
    if "anyOf" not in field or len(choices) > 1:
        return field
    rest = {key: value for key, value in field.items() if key not in ("anyOf", "default")}
    return {**choices[0], **rest}


def _structured(schema: dict[str, Any]) -> bool:
    """Whether values of ``schema`` are lists or objects (sent as JSON text in a query)."""
    if "$ref" in schema or schema.get("type") in ("array", "object"):
        return True
    return any(_structured(choice) for choice in schema.get("anyOf", ()))


def errors(*statuses: int, v2: bool = False) -> dict[int | str, dict[str, Any]]:
    """Error answers in the shape the service really sends (native, or V2's ``{"error"}``)."""
    model = V2ErrorAnswer if v2 else ErrorAnswer
    return {status: {"model": model, "description": ERROR_REASONS[status]} for status in statuses}


def operation(
    path: str,
    *,
    body: type[BaseModel] | None = None,
    alternatives: dict[str, dict[str, Any]] | None = None,
    parameters: tuple[dict[str, Any], ...] = (),
    answers: tuple[str, ...] = (),
) -> dict[str, Any]:
    """``openapi_extra`` for a handler that reads the raw request.

    ``alternatives`` maps other request media types to their schemas (``.npy``, V2 binary);
    ``answers`` lists binary media types the 200 answer may also have.
    """
    in_path = path_parameters(path)
    named = {parameter["name"] for parameter in in_path}  # /versions/{version} wins over ?version
    extra: dict[str, Any] = {
        "parameters": in_path + [p for p in parameters if p["name"] not in named]
    }
    if body is not None:
        assert body in BODIES, f"add {body.__name__} to BODIES"
        example = body.model_json_schema()["examples"][0]
        schema = {"$ref": REF.format(model=body.__name__)}
        content: dict[str, Any] = {"application/json": {"schema": schema, "example": example}}
        for media, alternative in (alternatives or {}).items():
            content[media] = alternative
        extra["requestBody"] = {"required": True, "content": content}
    if answers:
        extra["responses"] = {"200": {"content": dict.fromkeys(answers, BINARY)}}
    return extra


def body_components() -> dict[str, Any]:
    """Schemas of ``BODIES`` (and the models they nest) for ``components/schemas``."""
    _, schema = models_json_schema([(model, "validation") for model in BODIES], ref_template=REF)
    components: dict[str, Any] = schema["$defs"]
    return components
