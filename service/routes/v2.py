"""Open Inference Protocol (V2) front end: metadata, readiness and infer for LM heads.

A second thin front end over the same registry, leases, batcher and metrics as ``/v1``. The
``logits`` output with ``parameters: {"classification": k}`` answers Triton's BYTES tensor of
``"value:index[:label]"`` strings from the in-graph top-k, never by sorting the vocabulary.
"""

from __future__ import annotations

import math
from typing import Any

import numpy.typing as npt
from fastapi import APIRouter, Request
from starlette.responses import Response

from service import __version__, v2
from service.codec import check_hidden_states, check_ids, read_body
from service.errors import InvalidInput, ModelNotReady, PayloadTooLarge
from service.model import LoadedVersion
from service.routes.deps import RegistryDep, leased_version, target_version
from service.settings import Settings
from service.shadow import ShadowTraffic

router = APIRouter(prefix="/v2", tags=["v2"])
PROJECTION_OUTPUTS = {"topk_token_ids", "topk_logits", "topk_logprobs", "logsumexp", "logits"}


@router.get("")
async def server_metadata() -> dict[str, Any]:
    return {
        "name": "lmhead",
        "version": __version__,
        "extensions": ["binary_tensor_data", "classification", "model_repository"],
    }


@router.get("/health/live")
async def live() -> dict[str, bool]:
    return {"live": True}


@router.get("/health/ready")
async def ready(registry: RegistryDep) -> dict[str, bool]:
    if not registry.ready:
        raise ModelNotReady("models are still loading")
    return {"ready": True}


@router.get("/models/{name}")
@router.get("/models/{name}/versions/{version}")
async def model_metadata(request: Request) -> dict[str, Any]:
    model, _ = target_version(request)
    d, vocab = model.d_model, model.vocab_size
    record = request.app.state.registry.record(model.name)
    return {
        "name": model.name,
        "versions": [str(v) for v in sorted(record.versions)],
        "platform": "onnx_onnxv1",
        "inputs": [
            {"name": "hidden_states", "datatype": "FP32", "shape": [-1, d]},
            {"name": "input_ids", "datatype": "INT64", "shape": [-1]},
        ],
        "outputs": [
            {"name": "topk_token_ids", "datatype": "INT64", "shape": [-1, -1]},
            {"name": "topk_logits", "datatype": "FP32", "shape": [-1, -1]},
            {"name": "topk_logprobs", "datatype": "FP32", "shape": [-1, -1]},
            {"name": "logsumexp", "datatype": "FP32", "shape": [-1]},
            {"name": "logits", "datatype": "FP32", "shape": [-1, vocab]},
            {"name": "embeddings", "datatype": "FP32", "shape": [-1, d]},
        ],
        "parameters": {"tied": model.tied, "version": model.version},
    }


@router.get("/models/{name}/ready")
@router.get("/models/{name}/versions/{version}/ready")
async def model_ready(request: Request) -> dict[str, bool]:
    target_version(request)  # 404 unknown, 503 not ready
    return {"ready": True}


@router.post("/models/{name}/infer")
@router.post("/models/{name}/versions/{version}/infer")
async def infer(request: Request) -> Response:
    with leased_version(request) as (model, settings):
        body = await read_body(request, settings.max_body_bytes)
        decoded = v2.decode(body, request.headers.get(v2.HEADER_LENGTH))
        tensors = await _compute(model, settings, decoded, request.app.state.shadow)
        payload, headers = v2.encode(model.name, model.version, decoded.id, tensors)
    headers |= {"x-lmhead-version": str(model.version), "x-lmhead-tied": str(model.tied).lower()}
    return Response(payload, headers=headers)


async def _compute(
    model: LoadedVersion, settings: Settings, request: v2.InferRequest, shadow: ShadowTraffic
) -> list[tuple[v2.OutputRequest, npt.NDArray[Any]]]:
    outputs = request.outputs or _default_outputs(request)
    names = {output.name for output in outputs}
    results: dict[str, npt.NDArray[Any]] = {}
    if names & PROJECTION_OUTPUTS:
        results |= await _project(model, settings, request, outputs, shadow)
    if "embeddings" in names:
        if "input_ids" not in request.inputs:
            raise InvalidInput("output embeddings needs the input input_ids")
        ids = check_ids(request.inputs["input_ids"], model.vocab_size, settings.max_rows)
        results["embeddings"] = await model.embed(ids)
    return [(output, _select(output, results, model)) for output in outputs]


def _default_outputs(request: v2.InferRequest) -> list[v2.OutputRequest]:
    binary = bool(request.parameters.get("binary_data_output", False))
    if "hidden_states" not in request.inputs:
        return [v2.OutputRequest("embeddings", binary)]
    names = ["topk_token_ids", "topk_logits"]
    if request.parameters.get("logprobs"):
        names.append("topk_logprobs")
    return [v2.OutputRequest(name, binary) for name in names]


async def _project(
    model: LoadedVersion,
    settings: Settings,
    request: v2.InferRequest,
    outputs: list[v2.OutputRequest],
    shadow: ShadowTraffic,
) -> dict[str, npt.NDArray[Any]]:
    if "hidden_states" not in request.inputs:
        raise InvalidInput("projection outputs need the input hidden_states")
    hidden = check_hidden_states(request.inputs["hidden_states"], model.d_model, settings.max_rows)
    asked = [n for o in outputs for n in (o.classification, o.k) if n is not None]
    k = max(asked) if asked else _int(request.parameters, "k", model.default_k)
    if k > settings.max_k:
        raise InvalidInput(f"k must be between 1 and {settings.max_k} (max_k), got {k}")
    temperature = request.parameters.get("temperature", 1.0)
    if not isinstance(temperature, int | float) or not 0 < temperature < float("inf"):
        raise InvalidInput("parameter temperature must be a finite number > 0")
    full = any(o.name == "logits" and o.classification is None for o in outputs)
    size = math.prod(hidden.shape[:-1]) * model.vocab_size * 4
    if full and size > settings.max_logits_bytes:
        raise PayloadTooLarge(
            f"the logits output would be {size} bytes; the limit is {settings.max_logits_bytes}"
        )
    sampled = shadow.wants(model)
    result = await model.project(
        hidden, k, temperature=float(temperature), full_logits=full or sampled
    )
    if sampled:
        shadow.submit(model, hidden, result.logits, float(temperature))
    arrays: dict[str, npt.NDArray[Any]] = {
        "topk_token_ids": result.topk_token_ids,
        "topk_logits": result.topk_logits,
        "topk_logprobs": result.topk_logprobs,
        "logsumexp": result.logsumexp,
    }
    if result.logits is not None:
        arrays["logits"] = result.logits
    return arrays


def _select(
    output: v2.OutputRequest, results: dict[str, npt.NDArray[Any]], model: LoadedVersion
) -> npt.NDArray[Any]:
    if output.classification is not None:
        count = output.classification
        values = results["topk_logits"][..., :count]
        ids = results["topk_token_ids"][..., :count]
        return v2.classification_strings(values, ids, model.labels)
    array = results[output.name]
    if output.k is not None and output.name.startswith("topk_"):
        return array[..., : output.k]
    return array


def _int(parameters: dict[str, Any], name: str, default: int) -> int:
    value = parameters.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidInput(f"parameter {name} must be an integer >= 1")
    return value
