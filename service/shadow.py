"""Shadow traffic: replay a sampled fraction of a model's requests on a candidate head.

A model's ``config.json`` names its shadow: ``{"shadow": {"model": "B", "fraction": 0.1}}``.
A sampled request also fetches the primary's full logits (the graph computes them anyway, so
this costs one output copy, not a second run); after the answer is computed the rows are
queued for the shadow and the answer goes out at once: the shadow never delays or fails the
primary answer. At most ``max_pending`` shadow jobs run; further samples are dropped and
counted. A job projects the rows through the shadow (its own batcher) and computes top-1
agreement, top-k overlap (argpartition, not a full sort) and KL(primary || shadow) per row in
a thread of its own, so the statistics never hold up inference, and exports them by
primary/shadow pair. The shadow runs at the request's temperature, so both sides compare alike.
"""

from __future__ import annotations

import asyncio
import logging
import random
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import numpy.typing as npt

from service import contrast
from service.metrics import Metrics
from service.model import LoadedVersion
from service.registry import Registry

logger = logging.getLogger("lmhead")


class ShadowTraffic:
    """Bounded, fire-and-forget shadow runs with agreement metrics."""

    def __init__(self, registry: Registry, metrics: Metrics, max_pending: int) -> None:
        self._registry = registry
        self._metrics = metrics
        self._max_pending = max_pending
        self._tasks: set[asyncio.Task[None]] = set()
        self._random = random.Random(0)
        self._stats = ThreadPoolExecutor(1, thread_name_prefix="lmhead-shadow")

    def wants(self, primary: LoadedVersion) -> bool:
        """Sample this request for the shadow? (A full queue drops it and counts that.)"""
        shadow = primary.config.shadow
        if shadow is None or self._random.random() >= shadow.fraction:
            return False
        if len(self._tasks) >= self._max_pending:
            self._metrics.shadow_requests.labels(primary.name, shadow.model, "dropped").inc()
            return False
        return True

    def submit(
        self,
        primary: LoadedVersion,
        hidden: npt.NDArray[np.float32],
        logits: npt.NDArray[np.float32] | None,
        temperature: float = 1.0,
    ) -> None:
        """Queue the shadow run of a sampled request (returns at once)."""
        shadow = primary.config.shadow
        if shadow is None or logits is None:
            return
        rows = hidden.reshape(-1, primary.d_model)
        flat = logits.reshape(-1, primary.vocab_size)
        task = asyncio.get_running_loop().create_task(
            self._run(primary, shadow.model, rows, flat, temperature)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._stats.shutdown(wait=False, cancel_futures=True)

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
            shadow = self._registry.get(name)
            if (shadow.d_model, shadow.vocab_size) != (primary.d_model, primary.vocab_size):
                raise ValueError(f"{name} does not match {primary.name}'s d_model and vocab")
            with shadow.lease():
                theirs = await shadow.project(rows, 1, temperature=temperature, full_logits=True)
            if theirs.logits is None:
                raise RuntimeError("full logits were asked for but not returned")
            loop = asyncio.get_running_loop()
            stats = await loop.run_in_executor(
                self._stats, contrast.row_agreement, ours, theirs.logits, primary.config.shadow_k
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
