"""Open Inference Protocol (V2) front end: metadata, readiness and infer for LM heads.

A second front end over the same data plane as ``/v1``: ``infer`` is decode
(``service.api.codec.v2``) -> ``DataPlane.infer`` -> encode. Errors take the protocol's
``{"error": "..."}`` shape.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from service import __version__
from service.api.codec import v2, v2_verify
from service.api.codec.wire import target
from service.api.routes.deps import PlaneDep, body_limit, plane_of
from service.api.routes.openapi import (
    BINARY,
    INFERENCE_ERRORS,
    OCTET,
    VERSION_QUERY,
    errors,
    operation,
)
from service.api.v2_schemas import V2InferAnswer, V2InferBody, V2ModelMetadata, V2ServerMetadata

router = APIRouter(prefix="/v2", tags=["v2"])
HEADER_LENGTH = {
    "name": "Inference-Header-Content-Length",
    "in": "header",
    "description": "Binary extension: bytes of the JSON header before the raw tensors.",
    "schema": {"type": "integer", "minimum": 0},
}
V2_ERRORS = errors(400, 404, 413, 503, v2=True)


@router.get("", response_model=V2ServerMetadata)
async def server_metadata() -> dict[str, Any]:
    return {
        "name": "lmhead",
        "version": __version__,
        "extensions": ["binary_tensor_data", "classification", "model_repository"],
    }


@router.get("/health/live")
async def live() -> dict[str, bool]:
    return {"live": True}


@router.get("/health/ready", responses=errors(503, v2=True))
async def ready(plane: PlaneDep) -> dict[str, bool]:
    await plane.check_ready()
    return {"ready": True}


def _metadata_route(path: str, answer: type[Any] | None = None) -> dict[str, Any]:
    return {
        "path": path,
        "response_model": answer,
        "responses": V2_ERRORS,
        "openapi_extra": operation(router.prefix + path, parameters=(VERSION_QUERY,)),
    }


@router.get(**_metadata_route("/models/{name}", V2ModelMetadata))
@router.get(**_metadata_route("/models/{name}/versions/{version}", V2ModelMetadata))
async def model_metadata(request: Request) -> dict[str, Any]:
    """Inputs, outputs and versions of a model, as the protocol describes them."""
    plane = plane_of(request)
    head = await plane.head(target(request))
    return v2.model_metadata(head, await plane.versions(head.name))


@router.get(**_metadata_route("/models/{name}/ready"))
@router.get(**_metadata_route("/models/{name}/versions/{version}/ready"))
async def model_ready(request: Request) -> dict[str, bool]:
    """200 when the model (version) can serve; 404 unknown, 503 loading or failed."""
    await plane_of(request).head(target(request))  # 404 unknown, 503 not ready
    return {"ready": True}


def _infer_operation(path: str) -> dict[str, Any]:
    return operation(
        path,
        body=V2InferBody,
        alternatives={OCTET: BINARY},
        parameters=(VERSION_QUERY, HEADER_LENGTH),
        answers=(OCTET,),
    )


@router.post(
    "/models/{name}/infer",
    response_model=V2InferAnswer,
    responses=errors(*INFERENCE_ERRORS, v2=True),
    openapi_extra=_infer_operation("/v2/models/{name}/infer"),
)
@router.post(
    "/models/{name}/versions/{version}/infer",
    response_model=V2InferAnswer,
    responses=errors(*INFERENCE_ERRORS, v2=True),
    openapi_extra=_infer_operation("/v2/models/{name}/versions/{version}/infer"),
)
async def infer(request: Request) -> Response:
    """Top-k, log-probs, full logits, classification and embeddings (JSON or binary); with
    the input draft_token_ids, speculative verification (docs/verify.md)."""
    decoded = await v2_verify.decode_http(request, body_limit(request))
    if isinstance(decoded, v2_verify.VerifyCall):
        result = await plane_of(request).verify(decoded.request)
        return await v2_verify.encode_http(result, decoded.plan)
    infer_request, plan = decoded
    return await v2.encode_http(await plane_of(request).infer(infer_request), plan)
