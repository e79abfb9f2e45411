"""Repository (control) API, on Triton's paths (``/v2/repository/...``) and mirrored at ``/v1``.

The rules (admin token, read-only, control mode) are the data plane's; this reads the bearer
token and the optional body. ``load`` returns once the new version is published (the replaced
one drains in the background); ``unload`` once the versions are drained and released.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from service.codec import options, parse_json_object, read_body
from service.protocol import ModelDescription, RepositoryIndexRow
from service.routes.deps import PlaneDep, plane_of
from service.routes.openapi import errors

LOAD_BODY_LIMIT = 64 * 1024


async def _authorized(request: Request) -> None:
    scheme, _, presented = request.headers.get("authorization", "").partition(" ")
    plane_of(request).authorize(presented if scheme.lower() == "bearer" else None)


router = APIRouter(
    tags=["repository"], dependencies=[Depends(_authorized)], responses=errors(401, 422)
)


class LoadRequest(BaseModel):
    """Optional body of ``load``: pin one version instead of the config's version policy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int | None = Field(default=None, ge=0)


LOAD_BODY = {
    "requestBody": {
        "required": False,
        "content": {"application/json": {"schema": LoadRequest.model_json_schema()}},
    }
}


@router.post("/v2/repository/index", response_model=list[RepositoryIndexRow])
@router.post("/v1/repository/index", response_model=list[RepositoryIndexRow])
async def index(plane: PlaneDep) -> list[dict[str, Any]]:
    """Every model in memory or on disk: ``[{name, version, state, reason}]``."""
    return plane.index()


@router.post(
    "/v2/repository/models/{name}/load",
    response_model=ModelDescription,
    responses=errors(400, 403, 404, 500),
    openapi_extra=LOAD_BODY,
)
@router.post(
    "/v1/repository/models/{name}/load",
    response_model=ModelDescription,
    responses=errors(400, 403, 404, 500),
    openapi_extra=LOAD_BODY,
)
async def load(name: str, request: Request, plane: PlaneDep) -> dict[str, Any]:
    """Load or reload ``name`` from the repository; body ``{"version": N}`` pins a version."""
    body = await read_body(request, LOAD_BODY_LIMIT)
    pin: LoadRequest = options(LoadRequest, parse_json_object(body) if body.strip() else {})
    return await plane.load(name, pin.version)


@router.post(
    "/v2/repository/models/{name}/unload",
    response_model=ModelDescription,
    responses=errors(400, 403, 404),
)
@router.post(
    "/v1/repository/models/{name}/unload",
    response_model=ModelDescription,
    responses=errors(400, 403, 404),
)
async def unload(name: str, plane: PlaneDep) -> dict[str, Any]:
    """Stop serving ``name``; answers once its versions are drained and released."""
    return await plane.unload(name)
