"""Repository (control) API, on Triton's paths (``/v2/repository/...``) and mirrored at ``/v1``.

The rules (admin token, read-only, control mode) are the data plane's; this reads the bearer
token and the optional body. ``load`` returns once the new version is published (the replaced
one drains in the background); ``unload`` once the versions are drained and released.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlsplit

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from service.api.codec.wire import (
    JSON,
    content_type,
    header,
    options,
    parse_json_object,
    read_body,
)
from service.api.routes.deps import PlaneDep, plane_of
from service.api.routes.openapi import errors, operation
from service.api.schemas import ModelDescription, RepositoryIndexRow
from service.errors import Forbidden, InvalidInput, few

LOAD_BODY_LIMIT = 64 * 1024


async def _authorized(request: Request) -> None:
    """The admin token (when set), and never a browser's cross-site request: with no token
    on a loopback service, a web page's "simple" POST could otherwise load and unload."""
    site = header(request, b"sec-fetch-site")
    origin = header(request, b"origin")
    if site in ("cross-site", "same-site") or (
        origin is not None and urlsplit(origin).netloc != header(request, b"host")
    ):
        raise Forbidden("cross-origin requests may not use the repository API")
    scheme, _, presented = (header(request, b"authorization") or "").partition(" ")
    plane_of(request).authorize(presented if scheme.lower() == "bearer" else None)


router = APIRouter(tags=["repository"], dependencies=[Depends(_authorized)])
#: V2 paths answer the protocol's error shape, with 400 for every bad request.
NATIVE_ERRORS = errors(400, 401, 403, 404, 415, 422)
V2_ERRORS = errors(400, 401, 403, 404, 415, v2=True)


class LoadRequest(BaseModel):
    """Optional body of ``load``: pin one version instead of the config's version policy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int | None = Field(default=None, ge=0, examples=[1])


class IndexRequest(BaseModel):
    """Optional body of ``index``: ``{"ready": true}`` lists only versions ready to serve."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ready: bool = False


class UnloadRequest(BaseModel):
    """Optional body of ``unload``: Triton's client sends ``{"parameters":
    {"unload_dependents": ...}}`` (a head has no dependents); anything else is refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    parameters: dict[str, Any] | None = Field(default=None, examples=[{"unload_dependents": False}])


def _optional_body(schema: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI for a JSON body the handler reads itself (``_body``)."""
    content = {"application/json": {"schema": schema.model_json_schema()}}
    return {"requestBody": {"required": False, "content": content}}


LOAD_BODY = _optional_body(LoadRequest)
UNLOAD_BODY = _optional_body(UnloadRequest)  # it was taken, and missing from the document


@router.post(
    "/v2/repository/index",
    response_model=list[RepositoryIndexRow],
    responses=errors(401, v2=True),
    openapi_extra=_optional_body(IndexRequest),
)
@router.post(
    "/v1/repository/index",
    response_model=list[RepositoryIndexRow],
    responses=errors(401),
    openapi_extra=_optional_body(IndexRequest),
)
async def index(request: Request, plane: PlaneDep) -> list[dict[str, Any]]:
    """Every model in memory or on disk: ``[{name, version, state, reason}]``; with the body
    ``{"ready": true}`` (Triton's), only the versions ready to serve."""
    asked: IndexRequest = await _body(request, IndexRequest)
    rows = await plane.index()
    return [row.to_json() for row in rows if row.state == "READY" or not asked.ready]


def _control(action: str, v2: bool) -> dict[str, Any]:
    """Route arguments of load/unload on the V2 or the native prefix."""
    path = f"/{'v2' if v2 else 'v1'}/repository/models/{{name}}/{action}"
    extra = operation(path) | (LOAD_BODY if action == "load" else UNLOAD_BODY)
    return {
        "path": path,
        "response_model": ModelDescription,
        "responses": V2_ERRORS if v2 else NATIVE_ERRORS,
        "openapi_extra": extra,
    }


@router.post(**_control("load", v2=True))
@router.post(**_control("load", v2=False))
async def load(request: Request, plane: PlaneDep) -> dict[str, Any]:
    """Load or reload a model from the repository; body ``{"version": N}`` pins a version."""
    pin: LoadRequest = await _body(request, LoadRequest)
    status = await plane.load(request.path_params["name"], pin.version)
    return status.to_json()


def _no_query(request: Request) -> None:
    """Control calls take their options in the body: a query (``?version=1``, as inference
    routes take it) would be ignored, and the call do what was not asked."""
    if request.url.query:
        names = few([name for name, _ in parse_qsl(request.url.query, keep_blank_values=True)])
        raise InvalidInput(
            f"control calls take no query parameters (got {names}); send options as a JSON "
            'body, e.g. {"version": 1}'
        )


@router.post(**_control("unload", v2=True))
@router.post(**_control("unload", v2=False))
async def unload(request: Request, plane: PlaneDep) -> dict[str, Any]:
    """Stop serving a model; answers once its versions are drained and released."""
    await _body(request, UnloadRequest)
    status = await plane.unload(request.path_params["name"])
    return status.to_json()


async def _body(request: Request, schema: type[BaseModel]) -> Any:
    """The optional JSON body of a control call, checked (an empty body: the defaults). Only
    ``application/json`` (or no Content-Type): a page's ``text/plain`` or form POST, which a
    browser sends across sites without asking, is refused before it is read (415)."""
    _no_query(request)
    content_type(request, (JSON,))
    body = await read_body(request, LOAD_BODY_LIMIT, "the control API's own limit")
    return options(schema, parse_json_object(body) if body.strip() else {})
