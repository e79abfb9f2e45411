"""Poll mode: follow the repository on disk, loading new versions and unloading removed models.

When is a version complete? Its files' names, sizes and mtimes must be unchanged across two
consecutive scans before it is considered, so a copy in progress (which keeps changing them)
is never loaded. A copy that stalls for longer than a scan interval could still be seen as
stable: such a load fails, the serving version stays, and the version is retried as soon as
its files change again. For an instant, exact hand-over, copy into a hidden directory
(``models/NAME/.incoming``) and rename it to its version number: directories whose names are
not numbers are ignored.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from service.metrics import Metrics
from service.registry import Registry
from service.repository import (
    CONFIG_FILE,
    Signature,
    model_names,
    signature,
    version_dirs,
)

logger = logging.getLogger("lmhead")
ModelSignature = tuple[tuple[int, Signature], ...]


def model_signature(repository: Path, name: str) -> ModelSignature:
    """Signatures of the model's config and of each version directory with a model file."""
    directory = repository / name
    entries: list[tuple[int, Signature]] = []
    config = directory / CONFIG_FILE
    if config.is_file():
        stat = config.stat()
        entries.append((-1, ((CONFIG_FILE, stat.st_size, stat.st_mtime_ns),)))
    for number, entry in version_dirs(directory).items():
        entries.append((number, signature(entry)))
    return tuple(entries)


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
        names = await asyncio.to_thread(model_names, self._repository, self._only)
        if self._lazy:  # models load when asked: follow only those held, not the unloaded
            names = [name for name in names if self._registry.holds(name)]
        for name in names:
            current = await asyncio.to_thread(model_signature, self._repository, name)
            stable = self._seen.get(name) == current
            self._seen[name] = current
            if stable and current != self._applied.get(name):
                self._applied[name] = current
                record = await self._registry.load(name)
                logger.info("poll: loaded %s -> %s %s", name, record.state, record.notes)
        for name in set(self._applied) - set(names):
            del self._applied[name]
            self._seen.pop(name, None)
            if self._registry.knows(name):
                await self._registry.unload(name)
                logger.info("poll: unloaded %s (removed from the repository)", name)
        self._metrics.repository_scans.inc()
