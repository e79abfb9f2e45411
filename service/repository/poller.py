"""Poll mode: follow the repository on disk, loading new versions and unloading removed models.

When is a version complete? Its files' stat signatures (``disk.signature``) must be
unchanged across two consecutive scans before it is considered, so a copy in progress (which
keeps changing them) is never loaded. A copy that stalls for longer than a scan interval
could still be seen as stable: such a load fails, the serving version stays, and the version
is retried as soon as its files change again. For an instant, exact hand-over, copy into a
hidden directory (``models/NAME/.incoming``) and rename it to its version number:
directories whose names are not numbers are ignored.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from service.metrics import Metrics
from service.repository.disk import (
    CONFIG_FILE,
    Signature,
    cannot_read,
    file_signature,
    model_names,
    signature,
    version_entries,
)
from service.repository.registry import Registry

logger = logging.getLogger("lmhead")
ModelSignature = tuple[tuple[int, Signature], ...]


def model_signature(repository: Path, name: str) -> ModelSignature:
    """Signatures of the model's config and of each version directory with a model file;
    what cannot be read is part of it by its reason, so a fix (a chmod) is a change."""
    directory = repository / name
    entries: list[tuple[int, Signature]] = []
    try:
        config = directory / CONFIG_FILE
        if config.is_file():
            entries.append((-1, file_signature(config)))
        versions, refused = version_entries(directory, repository.resolve())
    except OSError as error:
        return ((-2, (("unreadable", cannot_read(error)),)),)
    for number, entry in versions.items():
        try:
            entries.append((number, signature(entry)))
        except OSError as error:
            entries.append((number, (("unreadable", cannot_read(error)),)))
    entries += [(number, (("refused", reason),)) for number, reason in refused.items()]
    return tuple(sorted(entries))


class RepositoryPoller:
    """Scans every ``interval_s`` and applies changes that were stable for two scans."""

    def __init__(
        self,
        registry: Registry,
        repository: Path,
        interval_s: float,
        metrics: Metrics,
        only: str | None = None,
        lazy: bool = False,
    ) -> None:
        self._registry = registry
        self._repository = repository
        self._only = only
        self._lazy = lazy
        self._interval_s = interval_s
        self._metrics = metrics
        self._seen: dict[str, ModelSignature] = {}
        self._applied: dict[str, ModelSignature] = {}

    async def prime(self) -> None:
        """Take what start-up loaded as applied, so the first scans change nothing."""
        for name in await asyncio.to_thread(model_names, self._repository, self._only):
            current = await asyncio.to_thread(model_signature, self._repository, name)
            self._seen[name] = self._applied[name] = current

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.scan()
            except Exception:  # a scan must never stop polling; the next one retries
                logger.exception("repository scan failed")

    async def scan(self) -> None:
        if not await asyncio.to_thread(self._repository.is_dir):  # moved or re-linked: wait
            logger.warning("poll: the repository %s is not a directory now", self._repository)
            return  # taking its absence as every model removed would unload them all
        on_disk = await asyncio.to_thread(model_names, self._repository, self._only)
        names = on_disk
        if self._lazy:  # models load when asked: follow only those held, not the unloaded
            names = [name for name in on_disk if self._registry.holds(name)]
        for name in names:
            try:  # one model's trouble must not stop the others being followed
                await self._follow(name)
            except Exception:
                logger.exception("poll: following %s failed", name)
        for name in set(self._applied) - set(names):
            del self._applied[name]
            self._seen.pop(name, None)
            if name not in on_disk and self._registry.knows(name):  # not merely unheld
                await self._registry.unload(name, removed=True)  # an unload by call too
                logger.info("poll: unloaded %s (removed from the repository)", name)
        self._metrics.repository_scans.inc()

    async def _follow(self, name: str) -> None:
        current = await asyncio.to_thread(model_signature, self._repository, name)
        stable = self._seen.get(name) == current
        self._seen[name] = current
        if stable and current != self._applied.get(name):
            self._applied[name] = current
            record = await self._registry.reload(name)  # pins and unloads by call stand
            logger.info("poll: loaded %s -> %s %s", name, record.state, record.notes)
