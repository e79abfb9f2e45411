"""The engine: registry, batchers, sessions and the data plane over them, with start-up loading.

One process holds it: the single service process (``LMHEAD_WORKERS=1``, inside the app's
lifespan) or the engine process that every front feeds (``service.hosting.split.engine_server``).
Either way each head is loaded once. ``running_engine`` creates the inference executor, the
registry and the data plane, and starts loading the repository in the background (``loading``),
then the poller in poll mode; on exit it stops them and releases every session.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

from service.errors import ServiceError
from service.metrics import Metrics
from service.plane.dataplane import DataPlane
from service.repository.disk import RepositoryError, model_names
from service.repository.journal import ControlJournal
from service.repository.poller import RepositoryPoller
from service.repository.registry import Registry
from service.settings import Settings
from service.tools.demo import write_demo_models

logger = logging.getLogger("lmhead")


@dataclass(frozen=True)
class Engine:
    registry: Registry
    plane: DataPlane
    loading: asyncio.Task[None]
    """Start-up loading; awaitable by embedders and in-process tests."""


@asynccontextmanager
async def running_engine(
    settings: Settings, metrics: Metrics, journal: ControlJournal | None = None
) -> AsyncIterator[Engine]:
    """The engine, loading in the background; everything stopped and released on exit.
    ``journal``: where control calls are noted for an engine started after this one."""
    executor = ThreadPoolExecutor(settings.inference_threads, thread_name_prefix="lmhead-infer")
    registry = Registry(settings, executor, metrics, journal)
    plane = DataPlane(registry, settings, metrics)
    loading = asyncio.create_task(_start(settings, registry), name="lmhead-startup-load")
    background = [loading]
    if settings.control_mode == "poll":
        poller = RepositoryPoller(
            registry,
            settings.repository,
            settings.poll_interval_s,
            metrics,
            settings.model_name,
            lazy=not settings.load_at_start,
        )
        background.append(asyncio.create_task(_follow(loading, poller), name="lmhead-poll"))
    try:
        yield Engine(registry, plane, loading)
    finally:
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await plane.close()
        await registry.close()
        executor.shutdown(wait=True, cancel_futures=True)


async def _start(settings: Settings, registry: Registry) -> None:
    """Write the demo heads into an empty repository when asked, then load everything."""
    try:
        demo = (
            settings.create_demo_models and settings.model_name is None and settings.load_at_start
        )
        if demo and not model_names(settings.repository):
            written = await asyncio.to_thread(write_demo_models, settings.repository)
            logger.info("repository was empty: wrote the demo heads %s", written)
        await registry.load_all()
    except Exception as error:  # readiness must say why, not "still loading" forever
        if isinstance(error, ServiceError | RepositoryError):  # the message is the story
            logger.error("start-up failed: %s", error)
        else:
            logger.exception("start-up failed")
        registry.fail_startup(error)


async def _follow(loading: asyncio.Task[None], poller: RepositoryPoller) -> None:
    """Poll mode: once start-up loading is done, follow the repository until shutdown."""
    await loading
    await poller.prime()
    await poller.run()
