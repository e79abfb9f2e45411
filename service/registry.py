"""Memory side of the repository: model name -> loaded versions, with state and reasons.

Loading is serialized per name (and onnxruntime session creation runs in one loader thread:
concurrent creation has been reported to race) and happens off the event loop. A swap is
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
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from service.allocator import trim_heap
from service.batch import BatchStats
from service.batching import BatchLimits
from service.errors import InvalidModelName, ModelNotFound, ModelNotReady, VersionNotFound
from service.journal import ControlJournal
from service.limits import Limits
from service.loaded_version import LoadedVersion, LoadOptions, VersionLoadError, load_version
from service.metrics import Metrics
from service.records import ModelRecord, ModelState
from service.repository import (
    ModelSource,
    RepositoryError,
    is_valid_name,
    model_names,
    read_source,
    version_entries,
)
from service.runtime import select_providers
from service.settings import Settings

logger = logging.getLogger("lmhead")
MAX_REASON_CHARS = 500


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
        self._executor = executor
        self._metrics = metrics
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="lmhead-load")
        self._records: dict[str, ModelRecord] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        self._options = LoadOptions(
            settings.memory_mode,
            settings.intra_op_threads,
            settings.default_k,
            Limits.from_settings(settings),
            settings.repository,
            select_providers(settings.provider),
            settings.scratch_dir,
            settings.cuda_tf32,
        )
        self._limits = BatchLimits(
            merge=settings.batching,
            max_batch_rows=settings.max_batch_rows,
            max_wait_s=settings.max_wait_ms / 1000,
            max_queue_rows=settings.max_queue_rows,
        )
        self.ready = False
        self.startup_error: str | None = None

    def fail_startup(self, reason: str) -> None:
        """Start-up could not finish: readiness reports this instead of "still loading"."""
        self.startup_error = reason[:MAX_REASON_CHARS]

    def records(self) -> list[ModelRecord]:
        return [self._records[name] for name in sorted(self._records)]

    async def load_all(self) -> None:
        """Load every model in the repository, then report ready (failures included). An
        engine started again first applies the control calls made of the one before it
        (``service.journal``): its pins, its unloads, what it loaded by hand.

        A repository path that is missing or not a directory is a start-up failure (the
        service reports it in readiness), never a healthy service with nothing to serve.
        """
        repository = self._settings.repository
        if not repository.is_dir():
            raise RepositoryError(
                f"the repository {str(repository)[:200]!r} is not a directory "
                "(LMHEAD_REPOSITORY or --repository)"
            )
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
                self._records[name] = ModelRecord(name, ModelState.UNAVAILABLE, "unloaded")
        for name, pin in wanted.items():
            if name not in on_disk:
                continue
            try:
                await self._load_as_left(name, pin)
            except Exception as error:  # one bad model must not keep the service unready
                logger.exception("loading %s failed", name)
                self._records[name] = ModelRecord(name, ModelState.FAILED, self._reason(error))
        self.ready = True
        states = {record.name: record.state.value for record in self.records()}
        if not states:
            logger.warning("the repository %s has no models: nothing is served", repository)
        logger.info("lmhead ready: %s", states or "no models")

    async def _load_as_left(self, name: str, pin: int | None) -> None:
        """Load as the engine before this one served it; its pinned version may be gone."""
        try:
            await self.load(name, pin)
        except VersionNotFound as error:
            if pin is None:
                raise
            logger.warning("%s: not pinned again (%s); serving as the repository says", name, error)
            await self.load(name)

    async def load(self, name: str, pin: int | None = None) -> ModelRecord:
        """(Re)load ``name`` from disk and publish the result in one step.

        Versions whose files are unchanged stay as they are; new or changed ones are loaded
        and warmed first. If nothing new could be loaded, the serving versions stay.
        """
        _check_name(name)
        only = self._settings.model_name
        if only is not None and name != only:
            raise ModelNotFound(f"this server serves only {only!r} (LMHEAD_MODEL_NAME)")
        if name not in self._records and not (self._settings.repository / name).is_dir():
            raise ModelNotFound(f"no model directory {name!r} in the repository")
        if pin is not None:
            root = self._settings.repository
            found, refused = version_entries(root / name, root.resolve())
            if pin in refused:
                raise VersionNotFound(f"model {name!r} version {pin}: {refused[pin]}")
            if pin not in found:
                raise VersionNotFound(f"model {name!r} has no complete version {pin} on disk")
        async with self._locks.setdefault(name, asyncio.Lock()):
            started = time.monotonic()
            previous = self._records.get(name)
            if previous is None:
                self._records[name] = ModelRecord(name, ModelState.LOADING)
            record = await self._build_record(name, previous, pin)
            self._records[name] = record
            # What serves now, whoever asked (operator, poller, start-up); what was asked if
            # nothing does, so that an engine started again tries it again.
            await self.journal.loaded(name, record.pinned if record.versions else pin)
            self._metrics.swap_duration.labels(name).observe(time.monotonic() - started)
            kept = {id(version) for version in record.versions.values()}
            for version in previous.versions.values() if previous else ():
                if id(version) not in kept:
                    self._retire_later(version)
            return record

    async def unload(self, name: str) -> ModelRecord:
        """Stop serving ``name``; returns once its versions are drained and released."""
        _check_name(name)
        if name not in self._records:  # before a lock is made for it: names are the client's
            raise ModelNotFound(f"model {name!r} is not loaded")
        async with self._locks.setdefault(name, asyncio.Lock()):
            previous = self._records.get(name)
            if previous is None:
                raise ModelNotFound(f"model {name!r} is not loaded")
            record = ModelRecord(name, ModelState.UNAVAILABLE, "unloaded")
            self._records[name] = record
            await self.journal.unloaded(name)
            await asyncio.gather(*(self._retire(v) for v in previous.versions.values()))
            return record

    def index(self) -> list[dict[str, Any]]:
        """Every model in memory or on disk, one row per version, with state and reason."""
        on_disk = model_names(self._settings.repository, self._settings.model_name)
        names = set(self._records) | set(on_disk)
        rows = []
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
            _check_name(name)  # a name outside the pattern is 400, whatever the route
            known = ", ".join(sorted(self._records)) or "none"
            raise ModelNotFound(f"model {name[:64]!r} not found; models: {known}")
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
            _check_name(name)  # 400, as on the inference routes
            raise ModelNotFound(f"model {name[:64]!r} not found")
        return self._records[name]

    async def close(self) -> None:
        for record in self._records.values():
            for version in record.versions.values():
                await version.close()
        await self.retired()
        self._loader.shutdown(wait=False, cancel_futures=True)

    async def retired(self) -> None:
        """Wait until the versions replaced or unloaded so far have drained and left memory."""
        await asyncio.gather(*self._retiring, return_exceptions=True)

    async def _build_record(
        self, name: str, previous: ModelRecord | None, pin: int | None
    ) -> ModelRecord:
        loop = asyncio.get_running_loop()
        try:
            source = await loop.run_in_executor(
                self._loader, read_source, self._settings.repository, name
            )
            selected = source.selected(pin)
        except RepositoryError as error:
            return self._failed(name, previous, str(error), {})
        lost = sorted(set(previous.versions if previous else ()) & set(source.refused))
        if lost:  # an operator's slip beside a served version: it keeps serving, no roll-back
            reason = "; ".join(f"version {v}: {source.refused[v]}" for v in lost)
            return self._failed(name, previous, reason, dict(source.refused))
        loaded: dict[int, LoadedVersion] = {}
        failed: dict[int, str] = dict(source.refused)
        changed: list[str] = []
        for version in selected:
            reused = previous.versions.get(version) if previous else None
            if reused is not None and reused.signature == source.signature(version):
                loaded[version] = reused
                continue
            if reused is not None:  # same number, other files: a new load, never a mix
                changed.append(f"version {version}'s files changed on disk: loaded again")
                self._metrics.loads.labels(name, "changed_in_place").inc()
            try:
                loaded[version] = await self._load_version(source, version)
            except Exception as error:  # any load failure is reported, never fatal
                failed[version] = self._reason(error)
                self._metrics.load_failures.labels(name).inc()
                logger.warning("failed to load %s/%d: %s", name, version, failed[version])
        if not loaded:
            reason = "; ".join(f"version {v}: {r}" for v, r in failed.items()) or (
                "no version directory with a model.onnx"
            )
            return self._failed(name, previous, reason, failed)
        self._metrics.loads.labels(name, "published").inc()
        notes = (
            *changed,
            *_changes(previous, loaded[pin] if pin in loaded else loaded[max(loaded)]),
        )
        for note in notes:
            logger.info("%s: %s", name, note)
        return ModelRecord(name, ModelState.READY, "", loaded, failed, pin, notes)

    async def _load_version(self, source: ModelSource, version: int) -> LoadedVersion:
        loop = asyncio.get_running_loop()
        model = await loop.run_in_executor(
            self._loader, load_version, source, version, self._options
        )
        rejected = self._metrics.queue_full.labels(source.name, str(version))
        rows_per_run = self._options.limits.rows_per_run(model.vocab_size)
        model.start(self._executor, self._limits, rows_per_run, self._observer(model), rejected.inc)
        tied = str(model.tied).lower()
        self._metrics.models_loaded.labels(source.name, str(version), tied).set(1)
        return model

    def _reason(self, error: Exception) -> str:
        """A load failure for operators and clients: no absolute paths of this machine."""
        text = _reason(error)
        repository = self._settings.repository
        for prefix in {str(repository.resolve()), str(repository.absolute()), str(repository)}:
            text = text.replace(prefix + "/", "").replace(prefix, "<repository>")
        return text

    def _failed(
        self, name: str, previous: ModelRecord | None, reason: str, failed: dict[int, str]
    ) -> ModelRecord:
        """A load that published nothing: keep what was serving, and say why."""
        if previous is not None and previous.versions:
            self._metrics.loads.labels(name, "kept_previous").inc()
            return replace(previous, reason=reason, failed={**previous.failed, **failed})
        self._metrics.loads.labels(name, "failed").inc()
        return ModelRecord(name, ModelState.FAILED, reason, {}, failed)

    def _retire_later(self, version: LoadedVersion) -> None:
        task = asyncio.get_running_loop().create_task(self._retire(version))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _retire(self, version: LoadedVersion) -> None:
        drained = await version.retire(self._settings.drain_timeout_s)
        if not drained:
            logger.warning("%s released with requests still running", version.label)
        self._metrics.unloads.labels(version.name).inc()
        if not self._serves_like(version):  # else the series is its successor's
            self._metrics.model_released(
                version.name, str(version.version), str(version.tied).lower()
            )
        trim_heap()

    def _serves_like(self, retired: LoadedVersion) -> bool:
        """Whether another object serves the retired one's model, version and tie (its files
        changed on disk, and the version was loaded again under its number)."""
        record = self._records.get(retired.name)
        return record is not None and any(
            loaded is not retired
            and (loaded.version, loaded.tied) == (retired.version, retired.tied)
            for loaded in record.versions.values()
        )

    def _observer(self, model: LoadedVersion) -> Callable[[BatchStats], None]:
        """Per-batch metrics; the labelled children are looked up once per version."""
        labels = (model.name, str(model.version))
        metrics = self._metrics
        rows = metrics.batch_rows.labels(*labels)
        requests = metrics.batch_requests.labels(*labels)
        run = metrics.inference_duration.labels(*labels)
        queue = metrics.queue_duration.labels(*labels)
        failures = metrics.inference_failures.labels(*labels)

        def observe(stats: BatchStats) -> None:
            rows.observe(stats.rows)
            requests.observe(stats.requests)
            run.observe(stats.run_seconds)
            for seconds in stats.queue_seconds:
                queue.observe(seconds)
            if stats.failed:
                failures.inc()

        return observe


def _check_name(name: str) -> None:
    if not is_valid_name(name):
        raise InvalidModelName(
            f"invalid model name {name[:64]!r}: letters, digits, '.', '_', '-', "
            "starting with a letter or digit"
        )


def _changes(previous: ModelRecord | None, new: LoadedVersion) -> tuple[str, ...]:
    """What a swap changed that a client may care about (tie, d_model, vocab)."""
    old = previous.latest if previous else None
    if old is None or old is new:
        return ()
    notes = [f"serving version {new.version} (was {old.version})"]
    if old.tied != new.tied:
        notes.append(f"head is now {'tied' if new.tied else 'untied'}")
    if old.d_model != new.d_model:
        notes.append(f"d_model changed from {old.d_model} to {new.d_model}")
    if old.vocab_size != new.vocab_size:
        notes.append(f"vocab_size changed from {old.vocab_size} to {new.vocab_size}")
    return tuple(notes)


def _reason(error: Exception) -> str:
    plain = isinstance(error, RepositoryError | VersionLoadError)  # their messages say it all
    text = (str(error) if plain else f"{type(error).__name__}: {error}").replace("\n", " ")
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."
