"""Shadow traffic: replay a sampled fraction of a model's requests on a candidate head.

A model's ``config.json`` names its shadow: ``{"shadow": {"model": "B", "fraction": 0.1}}``.
The data plane asks ``wants`` for each projection; a sampled request also fetches the
primary's full logits (the graph computes them anyway: one output copy, not a second run) and
``submit`` queues the rows; the answer goes out at once, so the shadow never delays or fails
the primary. At most ``max_pending`` replays run; further samples are dropped and counted. A
replay gets the shadow's logits through the data plane (same lease, limits and temperature as
the request) and computes top-1 agreement, top-k overlap and KL(primary || shadow) per row on
the statistics thread, then exports them by primary/shadow pair.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor

import numpy as np
import numpy.typing as npt

from service.metrics import Metrics
from service.plane import comparison
from service.repository.loaded_version import LoadedVersion
from service.runtime.vocabulary import refuse_overflow

logger = logging.getLogger("lmhead")

#: (primary, shadow name, rows, temperature) -> the shadow's full logits for those rows.
Replay = Callable[
    [LoadedVersion, str, npt.NDArray[np.float32], float], Awaitable[npt.NDArray[np.float32]]
]


class ShadowTraffic:
    """Bounded, fire-and-forget shadow runs with agreement metrics."""

    def __init__(
        self, metrics: Metrics, max_pending: int, replay: Replay, statistics: Executor
    ) -> None:
        self._metrics = metrics
        self._max_pending = max_pending
        self._replay = replay
        self._statistics = statistics
        self._tasks: set[asyncio.Task[None]] = set()
        self._random = random.Random(0)

    def wants(self, primary: LoadedVersion, affordable: bool) -> bool:
        """Sample this request for the shadow? A sample that is not ``affordable`` (its logits
        would pass the byte limit) or finds the queue full is dropped and counted."""
        shadow = primary.config.shadow
        if shadow is None or self._random.random() >= shadow.fraction:
            return False
        dropped = "too_large" if not affordable else None
        if len(self._tasks) >= self._max_pending:
            dropped = "dropped"
        if dropped is not None:
            self._metrics.shadow_requests.labels(primary.name, shadow.model, dropped).inc()
            return False
        return True

    def submit(
        self,
        primary: LoadedVersion,
        hidden: npt.NDArray[np.float32],
        logits: npt.NDArray[np.float32],
        temperature: float,
    ) -> None:
        """Queue the replay of a sampled request (returns at once)."""
        shadow = primary.config.shadow
        if shadow is None:
            return
        # A copy: the caller's rows may be a view of a front's shared memory, reused once answered.
        rows = np.array(hidden.reshape(-1, primary.d_model))
        flat = logits.reshape(-1, primary.vocab_size)
        task = asyncio.get_running_loop().create_task(
            self._run(primary, shadow.model, rows, flat, temperature)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def settle(self, timeout_s: float | None = None) -> None:
        """Wait for the replays in flight (all of them, or until ``timeout_s``)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)

    async def close(self, timeout_s: float) -> None:
        """Let replays in flight finish for up to ``timeout_s``, then cancel the rest."""
        await self.settle(timeout_s)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _run(
        self,
        primary: LoadedVersion,
        name: str,
        rows: npt.NDArray[np.float32],
        ours: npt.NDArray[np.float32],
        temperature: float,
    ) -> None:
        outcome = self._metrics.shadow_requests.labels
        try:
            theirs = await self._replay(primary, name, rows, temperature)
            for logits in (ours, theirs):  # Inf logits would make the KL NaN
                refuse_overflow(logits, logits)
            loop = asyncio.get_running_loop()
            stats = await loop.run_in_executor(
                self._statistics, comparison.row_agreement, ours, theirs, primary.config.shadow_k
            )
        except Exception as error:  # a shadow must never hurt the primary: count and go on
            logger.warning("shadow %s for %s failed: %s", name, primary.name, error)
            outcome(primary.name, name, "failed").inc()
            return
        self._record(primary.name, name, *stats)
        outcome(primary.name, name, "ran").inc()

    def _record(
        self,
        primary: str,
        shadow: str,
        agree: npt.NDArray[np.bool_],
        overlap: npt.NDArray[np.float64],
        kl: npt.NDArray[np.float64],
    ) -> None:
        metrics = self._metrics
        metrics.shadow_rows.labels(primary, shadow, "true").inc(int(agree.sum()))
        metrics.shadow_rows.labels(primary, shadow, "false").inc(int((~agree).sum()))
        overlap_histogram = metrics.shadow_topk_overlap.labels(primary, shadow)
        kl_histogram = metrics.shadow_kl.labels(primary, shadow)
        for value in overlap.tolist():
            overlap_histogram.observe(value)
        for value in kl.tolist():
            kl_histogram.observe(value)
