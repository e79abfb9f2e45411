"""Native API (``/v1``): model metadata, top-k, full logits, embeddings.

Bodies are JSON (``hidden_states`` beside the options) or ``.npy`` (options as query
parameters). Answers are JSON by default; top-k also answers ``application/x-npy`` (one
structured array with fields ``token_ids``, ``logits`` and, when asked, ``logprobs``) and
``application/x-npz`` (one array per field plus ``logsumexp``); ``/logits`` answers ``.npy`` by
default. Every inference answer carries ``x-lmhead-model``, ``-version`` and ``-tied`` headers.

The inference routes take the bare ``Request``: the body is decoded by ``service.codec`` and
the path and query by ``_target``, because FastAPI's dependency solving and body parsing cost
more than the rest of a one-row request (measured: ~40% of the handler's own time).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt
from fastapi import APIRouter, Request
from pydantic import BaseModel
from starlette.responses import Response

from service.codec import (
    JSON,
    NPY,
    NPZ,
    check_hidden_states,
    check_ids,
    content_type,
    float_array,
    int_array,
    json_bytes,
    npy_bytes,
    npz_bytes,
    options,
    parse_json_object,
    parse_npy,
    read_body,
    response_type,
)
from service.errors import InvalidInput, PayloadTooLarge
from service.model import LoadedVersion
from service.protocol import EmbedOptions, LogitsOptions, TopKOptions
from service.routes.deps import RegistryDep, leased_version
from service.runtime import Projection
from service.settings import Settings

router = APIRouter(prefix="/v1", tags=["native"])


def _body_schema(array_field: str) -> dict[str, Any]:
    """OpenAPI for bodies the framework does not parse: JSON or .npy."""
    array = {"type": "array", "items": {}}
    return {
        "requestBody": {
            "required": True,
            "content": {
                JSON: {
                    "schema": {
                        "type": "object",
                        "required": [array_field],
                        "properties": {array_field: array},
                    }
                },
                NPY: {"schema": {"type": "string", "format": "binary"}},
            },
        }
    }


@router.get("/models")
async def list_models(registry: RegistryDep) -> dict[str, Any]:
    return {"models": [record.describe() for record in registry.records()]}


@router.get("/models/{name}")
async def get_model(name: str, registry: RegistryDep) -> dict[str, Any]:
    return registry.record(name).describe()


@router.post("/models/{name}/topk", openapi_extra=_body_schema("hidden_states"))
@router.post("/models/{name}/versions/{version}/topk", openapi_extra=_body_schema("hidden_states"))
async def topk(request: Request) -> Response:
    """Top-k token ids and logits (and log-probs) for each row of hidden states."""
    with leased_version(request) as (model, settings):
        return await _topk(request, model, settings)


async def _topk(request: Request, model: LoadedVersion, settings: Settings) -> Response:
    answer = response_type(request, (JSON, NPY, NPZ), JSON)
    hidden, opts = await _hidden_states(request, model, settings, TopKOptions)
    k = opts.k or model.default_k
    if k > settings.max_k:
        raise InvalidInput(f"k must be between 1 and {settings.max_k} (max_k), got {k}")
    shadow = request.app.state.shadow
    sampled = shadow.wants(model)  # a sampled request also fetches its full logits
    result = await model.project(hidden, k, temperature=opts.temperature, full_logits=sampled)
    if sampled:
        shadow.submit(model, hidden, result.logits, opts.temperature)  # the answer won't wait
    if answer == JSON:
        return _reply(model, json_bytes(_topk_payload(model, result, opts.logprobs)), JSON)
    if answer == NPZ:
        arrays: dict[str, npt.NDArray[Any]] = {
            "token_ids": result.topk_token_ids,
            "logits": result.topk_logits,
        }
        if opts.logprobs:
            arrays["logprobs"] = result.topk_logprobs
        return _reply(model, npz_bytes({**arrays, "logsumexp": result.logsumexp}), NPZ)
    return _reply(model, npy_bytes(_topk_records(result, opts.logprobs)), NPY)


@router.post("/models/{name}/logits", openapi_extra=_body_schema("hidden_states"))
@router.post(
    "/models/{name}/versions/{version}/logits", openapi_extra=_body_schema("hidden_states")
)
async def logits(request: Request) -> Response:
    """All (rows, vocab) logits: ``.npy`` by default, JSON when asked; bounded in size."""
    with leased_version(request) as (model, settings):
        return await _logits(request, model, settings)


async def _logits(request: Request, model: LoadedVersion, settings: Settings) -> Response:
    answer = response_type(request, (NPY, JSON), NPY)
    hidden, opts = await _hidden_states(request, model, settings, LogitsOptions)
    size = math.prod(hidden.shape[:-1]) * model.vocab_size * 4
    if size > settings.max_logits_bytes:
        raise PayloadTooLarge(
            f"full logits would be {size} bytes; the limit is {settings.max_logits_bytes} "
            "(send fewer rows, or use /topk)"
        )
    result = await model.project(hidden, 1, temperature=opts.temperature, full_logits=True)
    assert result.logits is not None
    if answer == JSON:
        return _reply(model, json_bytes({**_identity(model), "logits": result.logits}), JSON)
    return _reply(model, npy_bytes(result.logits), NPY)


@router.post("/models/{name}/embed", openapi_extra=_body_schema("input_ids"))
@router.post("/models/{name}/versions/{version}/embed", openapi_extra=_body_schema("input_ids"))
async def embed(request: Request) -> Response:
    """Input embeddings for token ids: the Gather side of the same head."""
    with leased_version(request) as (model, settings):
        return await _embed(request, model, settings)


async def _embed(request: Request, model: LoadedVersion, settings: Settings) -> Response:
    answer = response_type(request, (JSON, NPY), JSON)
    body = await read_body(request, settings.max_body_bytes)
    if content_type(request, (JSON, NPY)) == NPY:
        ids = parse_npy(body, "input_ids")
    else:
        payload = parse_json_object(body)
        ids = int_array(_required(payload, "input_ids", "a nested list of token ids"), "input_ids")
        options(EmbedOptions, payload)
    ids = check_ids(ids, model.vocab_size, settings.max_rows)
    embeddings = await model.embed(ids)
    if answer == NPY:
        return _reply(model, npy_bytes(embeddings), NPY)
    return _reply(model, json_bytes({**_identity(model), "embeddings": embeddings}), JSON)


async def _hidden_states(
    request: Request, model: LoadedVersion, settings: Settings, schema: type[BaseModel]
) -> tuple[npt.NDArray[np.float32], Any]:
    body = await read_body(request, settings.max_body_bytes)
    if content_type(request, (JSON, NPY)) == NPY:
        array = parse_npy(body, "hidden_states")
        values: dict[str, Any] = {k: v for k, v in request.query_params.items() if k != "version"}
    else:
        values = parse_json_object(body)
        expected = f"(rows, {model.d_model}) or (batch, tokens, {model.d_model})"
        array = float_array(_required(values, "hidden_states", expected), "hidden_states")
    hidden = check_hidden_states(array, model.d_model, settings.max_rows)
    return hidden, options(schema, values)


def _required(payload: dict[str, Any], field: str, expected: str) -> Any:
    if field not in payload:
        raise InvalidInput(f"{field} is required: {expected}")
    return payload.pop(field)


def _identity(model: LoadedVersion) -> dict[str, Any]:
    return {"model": model.name, "version": model.version, "tied": model.tied}


def _topk_payload(model: LoadedVersion, result: Projection, logprobs: bool) -> dict[str, Any]:
    leading = list(result.topk_token_ids.shape[:-1])
    k = result.topk_token_ids.shape[-1]
    ids = result.topk_token_ids.reshape(-1, k)
    values = result.topk_logits.reshape(-1, k)
    lp = result.topk_logprobs.reshape(-1, k) if logprobs else None
    tokens = model.tokens(ids)
    results = []
    for row, row_ids in enumerate(ids.tolist()):
        item: dict[str, Any] = {"token_ids": row_ids, "logits": values[row]}
        if lp is not None:
            item["logprobs"] = lp[row]
        if tokens is not None:
            item["tokens"] = tokens[row]
        results.append(item)
    return {**_identity(model), "k": k, "shape": leading, "results": results}


def _topk_records(result: Projection, logprobs: bool) -> npt.NDArray[Any]:
    k = result.topk_token_ids.shape[-1]
    fields: list[tuple[str, Any, tuple[int]]] = [
        ("token_ids", np.int64, (k,)),
        ("logits", np.float32, (k,)),
    ]
    if logprobs:
        fields.append(("logprobs", np.float32, (k,)))
    records = np.empty(result.topk_token_ids.shape[:-1], dtype=np.dtype(fields))
    records["token_ids"] = result.topk_token_ids
    records["logits"] = result.topk_logits
    if logprobs:
        records["logprobs"] = result.topk_logprobs
    return records


def _reply(model: LoadedVersion, body: bytes, media_type: str) -> Response:
    headers = {
        "x-lmhead-model": model.name,
        "x-lmhead-version": str(model.version),
        "x-lmhead-tied": str(model.tied).lower(),
    }
    return Response(body, media_type=media_type, headers=headers)
