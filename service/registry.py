"""Memory side of the repository: model name -> loaded versions, with state and reasons.

Loading is serialized (one loader thread: concurrent onnxruntime session creation has been
reported to race) and happens off the event loop. A model's record is replaced in one
assignment once every version has been tried, so readers see the old record or the new one,
never a mix. A version that fails to load is kept with its reason and does not stop the
others; the highest loaded version is served unless a request names one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from service.batching import BatchLimits, BatchStats
from service.errors import ModelNotFound, ModelNotReady, VersionNotFound
from service.metrics import Metrics
from service.model import LoadedVersion, LoadOptions, load_version
from service.repository import RepositoryError, model_names, read_source
from service.settings import Settings

logger = logging.getLogger("lmhead")
MAX_REASON_CHARS = 500


class ModelState(StrEnum):
    LOADING = "LOADING"
    READY = "READY"
    FAILED = "FAILED"


@dataclass(frozen=True)
class ModelRecord:
    """An immutable snapshot of one model; replaced whole, never edited."""

    name: str
    state: ModelState
    reason: str = ""
    versions: dict[int, LoadedVersion] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)

    @property
    def latest(self) -> LoadedVersion | None:
        return self.versions[max(self.versions)] if self.versions else None

    def describe(self) -> dict[str, Any]:
        latest = self.latest
        return {
            "name": self.name,
            "state": self.state.value,
            "reason": self.reason,
            "versions": sorted(self.versions),
            "served_version": latest.version if latest else None,
            "failed_versions": {str(v): reason for v, reason in sorted(self.failed.items())},
            **({k: v for k, v in latest.describe().items() if k != "version"} if latest else {}),
        }


class Registry:
    """Loads models from the repository and hands out loaded versions."""

    def __init__(self, settings: Settings, executor: Executor, metrics: Metrics) -> None:
        self._settings = settings
        self._executor = executor
        self._metrics = metrics
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="lmhead-load")
        self._records: dict[str, ModelRecord] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._options = LoadOptions(
            settings.memory_mode, settings.intra_op_threads, settings.default_k
        )
        self._limits = BatchLimits(
            merge=settings.batching,
            max_batch_rows=settings.max_batch_rows,
            max_wait_s=settings.max_wait_ms / 1000,
            max_queue_rows=settings.max_queue_rows,
        )
        self.ready = False

    def records(self) -> list[ModelRecord]:
        return [self._records[name] for name in sorted(self._records)]

    async def load_all(self) -> None:
        """Load every model in the repository, then report ready (failures included)."""
        for name in model_names(self._settings.repository):
            await self.load(name)
        self.ready = True
        states = {record.name: record.state.value for record in self.records()}
        logger.info("lmhead ready: %s", states or "no models in the repository")

    async def load(self, name: str) -> ModelRecord:
        """(Re)load every version of ``name`` from disk and publish the result at once."""
        async with self._locks.setdefault(name, asyncio.Lock()):
            previous = self._records.get(name)
            if previous is None:
                self._records[name] = ModelRecord(name, ModelState.LOADING)
            record = await self._load_record(name)
            self._records[name] = record
            if previous is not None:
                for version in previous.versions.values():
                    await version.close()
            return record

    async def _load_record(self, name: str) -> ModelRecord:
        loop = asyncio.get_running_loop()
        try:
            source = await loop.run_in_executor(
                self._loader, read_source, self._settings.repository, name
            )
        except RepositoryError as error:
            self._metrics.load_failures.labels(name).inc()
            return ModelRecord(name, ModelState.FAILED, str(error))
        loaded: dict[int, LoadedVersion] = {}
        failed: dict[int, str] = {}
        for version, directory in source.versions.items():
            try:
                model = await loop.run_in_executor(
                    self._loader,
                    load_version,
                    name,
                    version,
                    directory,
                    source.config,
                    self._options,
                )
            except Exception as error:  # any load failure is reported, never fatal
                failed[version] = _reason(error)
                self._metrics.load_failures.labels(name).inc()
                logger.warning("failed to load %s/%d: %s", name, version, failed[version])
                continue
            rejected = self._metrics.queue_full.labels(name, str(version))
            model.start(self._executor, self._limits, self._observer(model), rejected.inc)
            self._metrics.models_loaded.labels(name, str(version), str(model.tied).lower()).set(1)
            loaded[version] = model
        if loaded:
            return ModelRecord(name, ModelState.READY, "", loaded, failed)
        reason = "; ".join(f"version {v}: {r}" for v, r in failed.items()) or (
            f"no version directory with a model.onnx in {source.directory}"
        )
        return ModelRecord(name, ModelState.FAILED, reason, {}, failed)

    def get(self, name: str, version: int | None = None) -> LoadedVersion:
        """The version to serve; raises 404/503 errors that say what exists."""
        record = self._records.get(name)
        if record is None:
            known = ", ".join(sorted(self._records)) or "none"
            raise ModelNotFound(f"model {name!r} not found; models: {known}")
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

    def record(self, name: str) -> ModelRecord:
        if name not in self._records:
            raise ModelNotFound(f"model {name!r} not found")
        return self._records[name]

    async def close(self) -> None:
        for record in self._records.values():
            for version in record.versions.values():
                await version.close()
        self._loader.shutdown(wait=False, cancel_futures=True)

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


def _reason(error: Exception) -> str:
    text = f"{type(error).__name__}: {error}".replace("\n", " ")
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."
