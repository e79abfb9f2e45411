"""Memory side of the repository: model name -> loaded versions, with state and reasons.

Loading is serialized per name (and onnxruntime session creation runs in one loader thread:
concurrent creation has been reported to race) and happens off the event loop; models load
side by side (a slow warm-up holds up no other model, ``service.repository.loading``). A swap is
*load before you retire*: the new version is read, inspected, opened, warmed and only then
published by replacing the model's record in one assignment. Requests hold a lease on the
``LoadedVersion`` they were given, so they finish on it; the replaced version is released once
its last lease is returned (bounded by ``drain_timeout_s``) and its memory goes back to the OS.
A load that fails leaves the serving version untouched and records the reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Executor
from pathlib import Path

from service.allocator import trim_heap
from service.errors import InvalidModelName, ModelNotFound, ModelNotReady, VersionNotFound
from service.messages import IndexEntry
from service.metrics import Metrics
from service.repository.disk import (
    RepositoryError,
    is_valid_name,
    maybe_dir,
    model_names,
    version_entries,
)
from service.repository.journal import ControlJournal, Served
from service.repository.loaded_version import LoadedVersion
from service.repository.loading import RecordBuilder
from service.repository.records import ModelRecord, ModelState
from service.repository.staging import sweep_stale_copies
from service.settings import Settings

logger = logging.getLogger("lmhead")
#: Why a model is UNAVAILABLE: a control call unloaded it (it stays so until a load), or
#: its directory left the repository (the poller; loaded again should it come back).
UNLOADED_BY_CALL = "unloaded"
REMOVED = "removed from the repository"


class Registry:
    """Loads, swaps and unloads models from the repository and hands out loaded versions."""

    def __init__(
        self,
        settings: Settings,
        executor: Executor,
        metrics: Metrics,
        journal: ControlJournal | None = None,
    ) -> None:
        self._settings = settings
        self.journal = journal or ControlJournal()
        self._metrics = metrics
        self._records: dict[str, ModelRecord] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        self._builder = RecordBuilder(settings, executor, metrics)
        self.ready = False
        self.startup_error: str | None = None
        #: The models start-up loaded (readiness fails while every one of them failed).
        self.started_with: frozenset[str] = frozenset()

    def fail_startup(self, error: Exception) -> None:
        """Start-up could not finish: readiness reports this instead of "still loading"."""
        self.startup_error = self._builder.reason(error)

    def records(self) -> list[ModelRecord]:
        return [self._records[name] for name in sorted(self._records)]

    async def load_all(self) -> None:
        """Load every model in the repository, then report ready (failures included). An
        engine started again first applies the control calls made of the one before it
        (``service.repository.journal``): its pins, its unloads, what it loaded by hand.

        A repository path that is missing or not a directory is a start-up failure (the
        service reports it in readiness), never a healthy service with nothing to serve.
        """
        repository = self._settings.repository
        if not repository.is_dir():
            raise RepositoryError(
                f"the repository {str(repository)[:200]!r} is not a directory "
                "(LMHEAD_REPOSITORY or --repository)"
            )
        removed = await asyncio.to_thread(sweep_stale_copies, self._settings.scratch_dir)
        if removed:
            logger.warning("removed %d version copies left by stopped processes", len(removed))
        names = model_names(repository, self._settings.model_name)
        only = self._settings.model_name
        if only is not None and not names:
            raise RepositoryError(
                f"LMHEAD_MODEL_NAME is {only!r} but the repository has no such model "
                f"directory (it holds {model_names(repository)[:20]}): expected "
                f"{only}/<version>/model.onnx"
            )
        wanted, unloaded = self.journal.plan(names if self._settings.load_at_start else [])
        on_disk = set(names)  # a model gone since the last engine is no more, as for a new one
        for name in unloaded:  # an engine before this one had it unloaded
            if name in on_disk:
                self._records[name] = ModelRecord(name, ModelState.UNAVAILABLE, UNLOADED_BY_CALL)
        # Side by side: a model that is slow to load keeps none of the others unready (their
        # files are still copied and opened one at a time, in this order, on the loader thread).
        await asyncio.gather(
            *(self._start(name, served) for name, served in wanted.items() if name in on_disk)
        )
        self.started_with = frozenset(name for name in wanted if name in on_disk)
        self.ready = True
        states = {record.name: record.state.value for record in self.records()}
        if not states:
            logger.warning("the repository %s has no models: nothing is served", repository)
        logger.info("lmhead ready: %s", states or "no models")

    async def _start(self, name: str, served: Served) -> None:
        """One model's start-up load; a bad model must not keep the service unready."""
        try:
            await self._load_as_left(name, served)
        except Exception as error:
            logger.exception("loading %s failed", name)
            self._records[name] = ModelRecord(name, ModelState.FAILED, self._builder.reason(error))

    async def _load_as_left(self, name: str, served: Served) -> None:
        """Load as the engine before this one served it: its pinned version may be gone, and
        what it served falls back if the policy's choice fails now (as it did then)."""
        await self._load(name, self._unless_gone(name, served.pin), served.versions)

    async def reload(self, name: str) -> ModelRecord:
        """Load again as it serves now (the poller: files changed): its pin stands while its
        version is on disk; a model the control API unloaded stays unloaded."""
        return await self._load(name, None, following=True)

    def _unless_gone(self, name: str, pin: int | None) -> int | None:
        """The pin, unless its version left the repository (then None, and the log says
        so). One still there but refused for now (unreadable, held twice) stays pinned: its
        loads fail with the reason until it is fixed, never serve another version."""
        on_disk = None if pin is None else self._on_disk(name)
        if pin is None or on_disk is None or pin in on_disk[0] or pin in on_disk[1]:
            return pin
        logger.warning("%s: pinned version %d left the repository: unpinned", name, pin)
        return None

    def _on_disk(self, name: str) -> tuple[dict[int, Path], dict[int, str]] | None:
        """The model's complete and refused versions on disk; None when its directory
        cannot be read (a load then fails with that reason)."""
        root = self._settings.repository
        try:
            return version_entries(root / name, root.resolve())
        except OSError:
            return None

    async def load(self, name: str, pin: int | None = None) -> ModelRecord:
        """(Re)load ``name`` from disk and publish the result in one step (a control call).

        Versions whose files are unchanged stay as they are; new or changed ones are loaded
        and warmed first. If nothing new could be loaded, the serving versions stay.
        """
        _check_name(name)
        only = self._settings.model_name
        if only is not None and name != only:
            raise ModelNotFound(f"this server serves only {only!r} (LMHEAD_MODEL_NAME)")
        if name not in self._records and not maybe_dir(self._settings.repository / name):
            raise ModelNotFound(f"no model directory {name!r} in the repository")
        if pin is not None:
            self._check_pin(name, pin)
        return await self._load(name, pin)

    def _check_pin(self, name: str, pin: int) -> None:
        """404 for a version the call cannot pin: absent, or refused (and why)."""
        on_disk = self._on_disk(name)
        if on_disk is None:
            return
        found, refused = on_disk
        if pin in refused:
            raise VersionNotFound(f"model {name!r} version {pin}: {refused[pin]}")
        if pin not in found:
            raise VersionNotFound(f"model {name!r} has no complete version {pin} on disk")

    async def _load(
        self,
        name: str,
        pin: int | None,
        fallback: tuple[int, ...] = (),
        following: bool = False,
    ) -> ModelRecord:
        """``load`` without its checks; with nothing serving, the ``fallback`` versions
        (what an engine before this one served) serve if the policy's choice fails.
        ``following``: ``reload``'s pin and unload by call, read once the lock is held (a
        control call just before it decides them)."""
        async with self._locks.setdefault(name, asyncio.Lock()):
            started = time.monotonic()
            previous = self._records.get(name)
            if following:
                if previous is not None and previous.reason == UNLOADED_BY_CALL:
                    return previous
                pin = self._unless_gone(name, None if previous is None else previous.pinned)
            if previous is None:
                self._records[name] = ModelRecord(name, ModelState.LOADING)
            try:
                record = await self._builder.build(name, previous, pin, fallback)
            except Exception as error:  # a bug: reported as a failed load, never LOADING for good
                logger.exception("loading %s failed", name)
                record = self._builder.failed(name, previous, self._builder.reason(error), {})
            self._records[name] = record
            # What serves now, whoever asked (operator, poller, start-up); what was asked if
            # nothing does, so that an engine started again tries it again.
            await self.journal.loaded(
                name, record.pinned if record.versions else pin, tuple(sorted(record.versions))
            )
            self._metrics.swap_duration.labels(name).observe(time.monotonic() - started)
            kept = {id(version) for version in record.versions.values()}
            for version in previous.versions.values() if previous else ():
                if id(version) not in kept:
                    self._retire_later(version)
            return record

    async def unload(self, name: str, removed: bool = False) -> ModelRecord:
        """Stop serving ``name``; returns once its versions are drained and released.
        ``removed``: its directory left the repository (the poller), so it is not an unload
        that a poll or a new engine must respect should the directory come back."""
        _check_name(name)
        if name not in self._records:  # before a lock is made for it: names are the client's
            raise ModelNotFound(f"model {name!r} is not loaded")
        # Its loads warming up now, or queued before this, fail at once (not at their deadline).
        self._builder.cancel(name)
        try:
            return await self._unload(name, removed)
        finally:  # done (or the call was dropped): loads asked for since may warm up
            self._builder.resume(name)

    async def _unload(self, name: str, removed: bool) -> ModelRecord:
        async with self._locks.setdefault(name, asyncio.Lock()):
            previous = self._records.get(name)
            if previous is None:
                raise ModelNotFound(f"model {name!r} is not loaded")
            reason = REMOVED if removed else UNLOADED_BY_CALL
            record = ModelRecord(name, ModelState.UNAVAILABLE, reason)
            self._records[name] = record
            await (self.journal.forget(name) if removed else self.journal.unloaded(name))
            await asyncio.gather(*(self._retire(v) for v in previous.versions.values()))
            return record

    def index(self) -> list[IndexEntry]:
        """Every model in memory or on disk, one row per version, with state and reason."""
        on_disk = model_names(self._settings.repository, self._settings.model_name)
        names = set(self._records) | set(on_disk)
        rows: list[IndexEntry] = []
        for name in sorted(names):
            record = self._records.get(name, ModelRecord(name, ModelState.UNAVAILABLE))
            rows += record.index_rows()
        return rows

    def get(self, name: str, version: int | None = None) -> LoadedVersion:
        """The version to serve; raises 404/503 errors that say what exists."""
        record = self._records.get(name)
        if record is None and not self.ready:  # start-up has not reached it yet: no 404 so far
            raise ModelNotReady(
                f"model {name[:64]!r} is not loaded yet: models are still loading",
                headers={"Retry-After": "1"},
            )
        if record is None:
            raise self._not_found(name)
        if version is None:
            if record.latest is None:
                detail = f": {record.reason}" if record.reason else ""
                raise ModelNotReady(f"model {name!r} is {record.state.value}{detail}")
            return record.latest
        if version in record.versions:
            return record.versions[version]
        if version in record.failed:
            raise ModelNotReady(f"{name}/{version} failed to load: {record.failed[version]}")
        versions = sorted(record.versions) or "none loaded"
        raise VersionNotFound(f"model {name!r} has no version {version}; versions: {versions}")

    def knows(self, name: str) -> bool:
        return name in self._records

    def holds(self, name: str) -> bool:
        """Loaded, loading or failed: asked for and not unloaded since."""
        record = self._records.get(name)
        return record is not None and record.state != ModelState.UNAVAILABLE

    def record(self, name: str) -> ModelRecord:
        if name not in self._records:
            raise self._not_found(name)
        return self._records[name]

    def _not_found(self, name: str) -> ModelNotFound:
        """404 for a name without a record. A model on disk that is not loaded says so, and
        how to load it (a bare "not found" sent its user looking for a typo); any other
        name gets the models there are."""
        _check_name(name)  # a name outside the pattern is 400, whatever the route
        settings = self._settings
        if settings.model_name in (None, name) and maybe_dir(settings.repository / name):
            how = (
                f"load it with POST /v1/repository/models/{name}/load (or "
                f"/v2/repository/models/{name}/load)"
                if settings.admin_api_writable
                else "load calls are off here (LMHEAD_READ_ONLY, or LMHEAD_CONTROL_MODE=none)"
            )
            return ModelNotFound(f"model {name!r} is in the repository but not loaded: {how}")
        known = ", ".join(sorted(self._records)) or "none"
        return ModelNotFound(f"model {name[:64]!r} not found; models: {known}")

    def stopping(self) -> None:
        """A stop has begun (a signal; call it on the event loop): loads end their warm-ups
        now, rather than hold the drain, and the stop, until their deadline."""
        self._builder.stopping()

    async def close(self) -> None:
        """Stop: the service has drained, so runs still going (a client's gone, a warm-up)
        are ended now rather than waited for, and every session is released."""
        versions = [v for record in self._records.values() for v in record.versions.values()]
        for version in versions:
            version.session.terminate()
        self._builder.close()
        for version in versions:
            await version.close()
        await self.retired()

    async def retired(self) -> None:
        """Wait until the versions replaced or unloaded so far have drained and left memory."""
        await asyncio.gather(*self._retiring, return_exceptions=True)

    def _retire_later(self, version: LoadedVersion) -> None:
        task = asyncio.get_running_loop().create_task(self._retire(version))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _retire(self, version: LoadedVersion) -> None:
        drained = await version.retire(self._settings.drain_timeout_s)
        if not drained:
            logger.warning("%s released with requests still running", version.label)
        self._metrics.unloads.labels(version.name).inc()
        successor = self._successor(version)  # its series are the successor's, where shared
        if successor is None or successor.tied != version.tied:
            self._metrics.model_released(
                version.name,
                str(version.version),
                str(version.tied).lower(),
                runs=successor is None,
            )
        trim_heap()

    def _successor(self, retired: LoadedVersion) -> LoadedVersion | None:
        """Another object serving the retired one's model and version (its files changed on
        disk, and the version was loaded again under its number), if any."""
        record = self._records.get(retired.name)
        served = None if record is None else record.versions.get(retired.version)
        return None if served is retired else served


def _check_name(name: str) -> None:
    if not is_valid_name(name):
        raise InvalidModelName(
            f"invalid model name {name[:64]!r}: letters, digits, '.', '_', '-', "
            "starting with a letter or digit"
        )
