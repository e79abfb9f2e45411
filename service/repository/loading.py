"""A model's next record, built from the repository: read its directory, load what its
version policy selects (reusing versions whose files are unchanged, falling back where a
load fails), and say why in the record's reason and notes. ``service.repository.registry``
publishes it.

A load holds the one loading thread only while it copies, inspects and opens its version
(time bounded by its files' sizes): its directory is read, and its warm-up runs, on other
threads, the warm-up under a deadline (``service.repository.warm_up``). So a slow load keeps
no other model's load waiting (issue 43: one warm-up that never ended held every load).
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from service.allocator import trim_heap
from service.limits import Limits
from service.metrics import Metrics
from service.repository.disk import ModelSource, RepositoryError, read_source
from service.repository.loaded_version import LoadedVersion
from service.repository.open_version import LoadOptions, VersionLoadError, open_version
from service.repository.records import ModelRecord, ModelState
from service.repository.warm_up import WarmUps
from service.runtime.batcher import BatchLimits
from service.runtime.pending import BatchStats
from service.runtime.providers import select_providers
from service.settings import Settings

logger = logging.getLogger("lmhead")
MAX_REASON_CHARS = 500
#: Warm-ups that run at once (one per model loading, each bounded by its deadline).
MAX_WARMING = 32


class RecordBuilder:
    """Builds records; one loader thread creates every onnxruntime session (concurrent
    creation has been reported to race), off the event loop; warm-ups run beside it."""

    def __init__(self, settings: Settings, executor: Executor, metrics: Metrics) -> None:
        self._settings = settings
        self._executor = executor
        self._metrics = metrics
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="lmhead-load")
        self._warming = ThreadPoolExecutor(MAX_WARMING, thread_name_prefix="lmhead-warm")
        self._warm_ups = WarmUps(settings.warmup_timeout_s)
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

    def stopping(self) -> None:
        """The service is stopping: warm-ups running end now (their loads fail, saying so),
        and none starts later."""
        self._warm_ups.stop()

    def close(self) -> None:
        self._warm_ups.stop()
        self._loader.shutdown(wait=False, cancel_futures=True)
        self._warming.shutdown(wait=False, cancel_futures=True)

    def cancel(self, name: str) -> None:
        """End ``name``'s warm-ups now, and those that would start until ``resume``: it is
        being unloaded, and its loads fail at once rather than at their deadline."""
        self._warm_ups.cancel(name)

    def resume(self, name: str) -> None:
        self._warm_ups.resume(name)

    async def build(
        self, name: str, previous: ModelRecord | None, pin: int | None, fallback: tuple[int, ...]
    ) -> ModelRecord:
        """``name``'s next record; ``previous`` serves on where nothing new loads."""
        # Served versions refused now (an operator's slip beside them) count as there: the
        # policy picks as before (no roll-back) and they serve on from their loaded copies.
        served = frozenset(previous.versions if previous else ())
        try:
            source = await asyncio.to_thread(read_source, self._settings.repository, name)
            selected = source.selected(pin, present=served)
            wanted = source.selected(pin, present=frozenset(source.refused))
        except RepositoryError as error:
            return self.failed(name, previous, str(error), {}, pin)
        failed: dict[int, str] = dict(source.refused)
        loaded, changed, kept = await self._load_selected(source, previous, selected, failed)
        # A version the policy wanted but refused (unreadable, held twice) is a failed load.
        kept += [f"version {v}: {failed[v]}" for v in wanted if v in failed and v not in served]
        if not loaded and previous is None and fallback:
            loaded, kept = await self._fall_back(source, fallback, failed)
        if not loaded:
            reason = "; ".join(f"version {v}: {r}" for v, r in failed.items()) or _none_chosen(
                source
            )
            return self.failed(name, previous, reason, failed, pin)
        self._metrics.loads.labels(name, "published").inc()
        notes = (
            *changed,
            *_changes(previous, loaded[pin] if pin in loaded else loaded[max(loaded)]),
        )
        for note in notes:
            logger.info("%s: %s", name, note)
        return ModelRecord(name, ModelState.READY, "; ".join(kept), loaded, failed, pin, notes)

    async def _load_selected(
        self,
        source: ModelSource,
        previous: ModelRecord | None,
        selected: list[int],
        failed: dict[int, str],
    ) -> tuple[dict[int, LoadedVersion], list[str], list[str]]:
        """The selected versions: unchanged ones reused, others loaded; and the notes of
        versions loaded again in place, and of served ones whose new files failed."""
        loaded: dict[int, LoadedVersion] = {}
        changed: list[str] = []
        kept: list[str] = []  # served versions whose new files failed: they serve on
        for version in selected:
            reused = previous.versions.get(version) if previous else None
            if reused is not None and version in source.refused:  # a slip beside it
                loaded[version] = reused
                kept.append(f"version {version}: {source.refused[version]}")
                continue
            if reused is not None and reused.signature == source.signature(version):
                loaded[version] = reused
                continue
            fresh = await self._try_load(source, version, failed, reused is not None)
            if fresh is not None:
                loaded[version] = fresh
                if reused is not None:
                    changed.append(f"version {version}'s files changed on disk: loaded again")
            elif reused is not None:  # its loaded copy serves on, as a lone version would
                loaded[version] = reused
                kept.append(f"version {version}: {failed[version]}")
        return loaded, changed, kept

    async def _fall_back(
        self, source: ModelSource, versions: tuple[int, ...], failed: dict[int, str]
    ) -> tuple[dict[int, LoadedVersion], list[str]]:
        """Nothing the policy chose loads and nothing serves here: the versions the engine
        before this one served (where it kept a version serving after the same failure)."""
        why = [f"version {v}: {r}" for v, r in failed.items()]
        loaded = {}
        for version in versions:
            if version in source.versions and version not in failed:
                fresh = await self._try_load(source, version, failed, in_place=False)
                if fresh is not None:
                    loaded[version] = fresh
        why.append(f"versions {sorted(loaded)} serve on, as before the engine restarted")
        return loaded, why

    async def _try_load(
        self, source: ModelSource, version: int, failed: dict[int, str], in_place: bool
    ) -> LoadedVersion | None:
        """Load one version, or note in ``failed`` why not (any failure is reported, never
        fatal); ``in_place``: a served number whose files changed (a new load, never a mix)."""
        if in_place:
            self._metrics.loads.labels(source.name, "changed_in_place").inc()
        try:
            return await self._load_version(source, version)
        except Exception as error:
            failed[version] = self.reason(error)
            self._metrics.load_failures.labels(source.name).inc()
            logger.warning("failed to load %s/%d: %s", source.name, version, failed[version])
            return None

    async def _load_version(self, source: ModelSource, version: int) -> LoadedVersion:
        loop = asyncio.get_running_loop()
        model = await loop.run_in_executor(
            self._loader, open_version, source, version, self._options
        )
        try:
            await loop.run_in_executor(
                self._warming, self._warm_ups.run, source.name, model.session
            )
        except BaseException as error:  # failed, or the load cancelled: no run of it goes on
            model.session.terminate()
            model.session.close()
            if not isinstance(error, Exception):  # a stopping service cancels what loads
                logger.warning("loading %s was cancelled: its warm-up was ended", model.label)
            raise
        trim_heap()  # the file's bytes passed through the heap on the way in
        rejected = self._metrics.queue_full.labels(source.name, str(version))
        rows_per_run = self._options.limits.rows_per_run(model.vocab_size)
        model.start(self._executor, self._limits, rows_per_run, self._observer(model), rejected.inc)
        tied = str(model.tied).lower()
        self._metrics.models_loaded.labels(source.name, str(version), tied).set(1)
        return model

    def reason(self, error: Exception) -> str:
        """A load failure for operators and clients: no absolute paths of this machine (the
        repository's, or the scratch directory's where versions are copied to load)."""
        text = _reason(error)
        repository = self._settings.repository
        for prefix in {str(repository.resolve()), str(repository.absolute()), str(repository)}:
            text = text.replace(prefix + "/", "").replace(prefix, "<repository>")
        try:
            scratch = self._settings.scratch_dir or Path(tempfile.gettempdir())
        except OSError:  # no usable temp directory (a read-only root): the reason says so
            return text
        for prefix in {str(scratch.resolve()), str(scratch.absolute()), str(scratch)}:
            text = text.replace(prefix, "<scratch>")
        return text

    def failed(
        self,
        name: str,
        previous: ModelRecord | None,
        reason: str,
        failed: dict[int, str],
        pin: int | None = None,
    ) -> ModelRecord:
        """A load that published nothing: keep what was serving, and say why (a pin that
        could not be served stays asked for, so the next load tries it again)."""
        if previous is not None and previous.versions:
            self._metrics.loads.labels(name, "kept_previous").inc()
            return replace(previous, reason=reason, failed={**previous.failed, **failed})
        self._metrics.loads.labels(name, "failed").inc()
        return ModelRecord(name, ModelState.FAILED, reason, {}, failed, pinned=pin)

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


def _none_chosen(source: ModelSource) -> str:
    """Why no version was loaded when none failed: none on disk, or none the policy names."""
    policy = source.config.versions
    if isinstance(policy, list) and source.versions:
        return (
            f"config.json versions {policy[:20]} match none on disk "
            f"({sorted(source.versions)[:20]})"
        )
    return "no version directory with a model.onnx"
