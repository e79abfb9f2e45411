"""The calls that read or change what is loaded: readiness, model metadata, the repository
index, load and unload, with the control API's rules (who may load and unload, and when).
``DataPlane`` inherits them, so every front end reaches them through the data plane."""

from __future__ import annotations

from service.errors import Forbidden, ModelLoadFailed, ModelNotReady
from service.messages import HeadInfo, IndexEntry, ModelStatus, Target
from service.plane.protocol import check_token
from service.repository.records import ModelRecord, ModelState
from service.repository.registry import Registry
from service.settings import Settings


class ControlAPI:
    """Metadata, and load, unload and the index behind the admin token and read-only modes."""

    def __init__(self, registry: Registry, settings: Settings) -> None:
        self._registry = registry
        self._settings = settings

    async def check_ready(self) -> None:
        """503 until start-up loading is done (or for good, with the reason, if it failed),
        and while every model start-up loaded has FAILED and none serves (a pod that serves
        nothing must not take traffic: a bad image or a full GPU would otherwise roll out as
        "ready"). Models loaded later by call or by the poller do not count: a failed load
        of one would take a pod out of the Service its next load call comes through."""
        if self._registry.startup_error is not None:
            raise ModelNotReady(f"start-up failed: {self._registry.startup_error}")
        if not self._registry.ready:
            raise ModelNotReady("models are still loading")
        started = self._registry.started_with
        everything = self._registry.records()
        records = [record for record in everything if record.name in started]
        serving = any(record.state == ModelState.READY for record in everything)
        if records and not serving and all(r.state == ModelState.FAILED for r in records):
            reasons = "; ".join(f"{r.name}: {r.reason}" for r in records[:5])
            raise ModelNotReady(f"no model could be loaded ({reasons[:800]})")

    async def models(self) -> list[ModelStatus]:
        return [record.status() for record in self._registry.records()]

    async def model(self, name: str) -> ModelStatus:
        return self._registry.record(name).status()

    async def head(self, target: Target) -> HeadInfo:
        """The version a target resolves to (404 unknown, 503 not ready)."""
        return self._registry.get(target.model, target.version).info

    async def versions(self, name: str) -> list[int]:
        """The loaded versions of a model."""
        return sorted(self._registry.record(name).versions)

    def authorize(self, presented: str | None) -> None:
        """The control API needs the admin token when one is set (constant-time compare)."""
        token = self._settings.admin_token
        check_token(None if token is None else token.get_secret_value(), presented)

    async def index(self) -> list[IndexEntry]:
        return self._registry.index()

    async def load(self, name: str, version: int | None = None) -> ModelStatus:
        """(Re)load a model, or pin one version; the old version serves until the new one is
        published, and keeps serving if the load fails (then ``ModelLoadFailed``)."""
        self._check_writable()
        record = await self._registry.load(name, version)
        if record.state is not ModelState.READY or record.reason:
            raise ModelLoadFailed(
                f"loading {name!r} failed: {record.reason}"
                + ("; the previous version keeps serving" if record.versions else "")
            )
        return record.status()

    async def unload(self, name: str) -> ModelStatus:
        self._check_writable()
        record: ModelRecord = await self._registry.unload(name)
        return record.status()

    def _check_writable(self) -> None:
        if self._settings.read_only:
            raise Forbidden("the service is read-only (LMHEAD_READ_ONLY); load/unload are disabled")
        if self._settings.control_mode == "none":
            raise Forbidden("LMHEAD_CONTROL_MODE is none; load/unload are disabled")
