"""Repository (control) API, on Triton's paths (``/v2/repository/...``) and mirrored at ``/v1``.

Every call needs ``Authorization: Bearer <LMHEAD_ADMIN_TOKEN>`` when a token is set (compared
in constant time). ``load`` and ``unload`` answer 403 on a read-only service or with
``control_mode=none``. ``load`` returns once the new version is published (the replaced one
drains in the background); ``unload`` once the versions are drained and released.
"""

from __future__ import annotations

import secrets
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from service.codec import options, parse_json_object, read_body
from service.errors import Forbidden, ModelLoadFailed, Unauthorized
from service.registry import ModelState
from service.routes.deps import RegistryDep, SettingsDep
from service.settings import Settings


async def _authorized(request: Request) -> None:
    settings: Settings = request.app.state.settings
    if settings.admin_token is None:
        return
    scheme, _, presented = request.headers.get("authorization", "").partition(" ")
    expected = settings.admin_token.get_secret_value().encode()
    if scheme.lower() != "bearer" or not secrets.compare_digest(presented.encode(), expected):
        raise Unauthorized("the repository API needs 'Authorization: Bearer <admin token>'")


def _writable(settings: Settings) -> None:
    if settings.read_only:
        raise Forbidden("the service is read-only (LMHEAD_READ_ONLY); load/unload are disabled")
    if settings.control_mode == "none":
        raise Forbidden("LMHEAD_CONTROL_MODE is none; load/unload are disabled")


router = APIRouter(tags=["repository"], dependencies=[Depends(_authorized)])


class LoadRequest(BaseModel):
    """Optional body of ``load``: pin one version instead of the config's version policy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int | None = Field(default=None, ge=0)


@router.post("/v2/repository/index")
@router.post("/v1/repository/index")
async def index(registry: RegistryDep) -> list[dict[str, Any]]:
    """Every model in memory or on disk: ``[{name, version, state, reason}]``."""
    return registry.index()


@router.post("/v2/repository/models/{name}/load")
@router.post("/v1/repository/models/{name}/load")
async def load(
    name: str, request: Request, registry: RegistryDep, settings: SettingsDep
) -> dict[str, Any]:
    """Load or reload ``name`` from the repository; body ``{"version": N}`` pins a version."""
    _writable(settings)
    body = await read_body(request, 64 * 1024)
    pin: LoadRequest = options(LoadRequest, parse_json_object(body) if body.strip() else {})
    record = await registry.load(name, pin.version)
    if record.state is not ModelState.READY or record.reason:
        raise ModelLoadFailed(
            f"loading {name!r} failed: {record.reason}"
            + ("; the previous version keeps serving" if record.versions else "")
        )
    return record.describe()


@router.post("/v2/repository/models/{name}/unload")
@router.post("/v1/repository/models/{name}/unload")
async def unload(name: str, registry: RegistryDep, settings: SettingsDep) -> dict[str, Any]:
    """Stop serving ``name``; answers once its versions are drained and released."""
    _writable(settings)
    return (await registry.unload(name)).describe()
