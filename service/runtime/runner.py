"""A served head's runs: its batcher, the inference executor and the size of one run.

The repository decides which versions serve (``service.repository.loaded_version``); how a
served head's rows reach onnxruntime is decided here: projections go through the head's
dynamic batcher in runs of at most ``rows_per_run`` rows (larger requests in runs one after
another, so other requests come in between), and the runs that cannot be merged (scoring,
embedding rows, candidates' rows of W, the lens) go to the same executor beside it, counted
in the same run metrics.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from service.runtime.batcher import Batcher, BatchLimits
from service.runtime.pending import BatchStats
from service.runtime.session import HeadSession, Projection
from service.runtime.vocabulary import refuse_overflow

T = TypeVar("T")
#: Multiply-adds (rows x vocab x d_model) of a run small enough to take on the event loop when
#: the batcher could merge nothing with it: ~20-30 us on one core here, less than the two
#: thread hops it replaces (executor, then ``call_soon_threadsafe``).
INLINE_MACS = 1 << 18


@dataclass
class Runner:
    """One head's runs, from ``start`` (serving) to ``close``; ``label`` names its metrics."""

    session: HeadSession
    label: str
    rows_per_run: int = 1 << 30
    """The most rows one run takes (set by ``start``); requests with more run in parts."""
    inline_rows: int = 0
    """The most rows of a batch of one request run on the event loop (``INLINE_MACS``,
    ``BatchLimits.lone_rows``; set by ``start``): 0 for any head whose one row costs more."""
    batcher: Batcher | None = field(default=None, repr=False)
    executor: Executor | None = field(default=None, repr=False)
    on_run: Callable[[BatchStats], None] | None = field(default=None, repr=False)

    def start(
        self,
        executor: Executor,
        limits: BatchLimits,
        rows_per_run: int,
        on_batch: Callable[[BatchStats], None],
        on_reject: Callable[[], None],
    ) -> None:
        """Serve: runs of at most ``rows_per_run`` rows and the batch caps from now on. A
        request with more rows is cut into runs of that size, queued one after another, so the
        runs of other requests and other models come in between: a one-row request waits for
        one such run at most, not for a whole 4096-row request (measured on the demo head: a
        1048-row run at k=1000 took 392 ms; 128 rows, 50 ms)."""
        self.rows_per_run = min(limits.max_batch_rows, rows_per_run)
        per_row = self.session.vocab_size * self.session.d_model
        self.inline_rows = min(self.rows_per_run, INLINE_MACS // max(1, per_row))
        limits = BatchLimits(
            limits.merge,
            self.rows_per_run,
            limits.max_wait_s,
            limits.max_queue_rows,
            lone_rows=self.inline_rows,
        )
        self.executor = executor
        self.on_run = on_batch
        self.batcher = Batcher(
            self._run, executor, limits, label=self.label, on_batch=on_batch, on_reject=on_reject
        )
        self.batcher.start()

    async def close(self) -> None:
        if self.batcher is not None:
            await self.batcher.close()

    def group_room(self) -> int:
        """Rows calls served as one may hold (``DataPlane.topk_group``): what the queue takes
        now, and half a batch (``Batcher.room``)."""
        assert self.batcher is not None, "start() the version before serving it"
        return self.batcher.room

    async def project(
        self,
        hidden: npt.NDArray[np.float32],
        k: int,
        *,
        temperature: float = 1.0,
        full_logits: bool = False,
    ) -> Projection:
        """Project (..., d_model) float32 hidden states through the batcher.

        More rows than one run may take go in chunks, one after another: each run's logits
        stay within the byte limit, and other requests (other models too) run in between.
        """
        assert self.batcher is not None, "start() the version before serving it"
        leading = hidden.shape[:-1]
        rows = hidden.reshape(-1, self.session.d_model)
        step = self.rows_per_run
        if len(rows) <= step:
            flat = await self.batcher.submit(rows, k, full_logits, temperature)
        else:
            flat = await self._in_runs(rows, step, k, full_logits, temperature)
        refuse_overflow(flat.logsumexp, flat.topk_logits, temperature=temperature)
        return Projection(
            flat.topk_logits.reshape(*leading, -1),
            flat.topk_token_ids.reshape(*leading, -1),
            flat.logsumexp.reshape(leading),
            None if flat.logits is None else flat.logits.reshape(*leading, -1),
        )

    async def _in_runs(
        self,
        rows: npt.NDArray[np.float32],
        step: int,
        k: int,
        full_logits: bool,
        temperature: float,
    ) -> Projection:
        """Runs of ``step`` rows, one after another, each copied into the whole answer as it
        comes (one concatenation of 4096 rows at k=1000 held the event loop for ~30 ms), by a
        worker thread when the run carries full logits (copying a run's logits on the event
        loop held it 30-80 ms a run of a 2,048-row /logits; numpy copies without the GIL)."""
        assert self.batcher is not None
        whole: Projection | None = None
        for start in range(0, len(rows), step):
            part = await self.batcher.submit(
                rows[start : start + step], k, full_logits, temperature
            )
            if whole is None:
                whole = _allocated(part, len(rows))
            if full_logits:
                await asyncio.to_thread(_place, whole, part, start)
            else:
                _place(whole, part, start)
        assert whole is not None
        return whole

    async def embed(self, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.float32]:
        """Rows of the input embedding (the Gather side), in the inference executor."""
        return await self.run_alone(ids.size, self.session.embed, ids)

    async def run_alone(self, rows: int, function: Callable[..., T], *args: Any) -> T:
        """A run outside the batcher (scoring, embedding rows, candidates' rows of W) in the
        inference executor, in the run metrics as a batch of one request."""

        def timed() -> tuple[T, float]:
            started = perf_counter()
            try:
                return function(*args), perf_counter() - started
            except Exception:
                self._observe(BatchStats(rows, 1, [], perf_counter() - started, failed=True))
                raise

        result, seconds = await asyncio.get_running_loop().run_in_executor(self.executor, timed)
        self._observe(BatchStats(rows, 1, [], seconds, failed=False))
        return result

    def _observe(self, stats: BatchStats) -> None:
        if self.on_run is not None:
            self.on_run(stats)

    async def rows_per_second(self, hidden: npt.NDArray[np.float32], rows: int, runs: int) -> float:
        """Rows/s of the bare session on a fixed batch tiled from ``hidden`` (no batcher)."""
        d_model = self.session.d_model
        batch = np.resize(hidden.reshape(-1, d_model), (rows, d_model))

        def measure() -> float:
            self.session.project(batch, 10)
            start = perf_counter()
            for _ in range(runs):
                self.session.project(batch, 10)
            return rows * runs / (perf_counter() - start)

        return await asyncio.get_running_loop().run_in_executor(self.executor, measure)

    def _run(
        self,
        rows: npt.NDArray[np.float32],
        k: int,
        full_logits: bool,
        temperature: npt.NDArray[np.float32],
    ) -> Projection:
        return self.session.project(rows, k, temperature=temperature, full_logits=full_logits)


def _allocated(first: Projection, rows: int) -> Projection:
    """Empty arrays for ``rows`` rows shaped as ``first``'s."""

    def like(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
        return np.empty((rows, *array.shape[1:]), array.dtype)

    logits = None if first.logits is None else like(first.logits)
    return Projection(
        like(first.topk_logits), like(first.topk_token_ids), like(first.logsumexp), logits
    )


def _place(whole: Projection, part: Projection, start: int) -> None:
    stop = start + len(part.logsumexp)
    whole.topk_logits[start:stop] = part.topk_logits
    whole.topk_token_ids[start:stop] = part.topk_token_ids
    whole.logsumexp[start:stop] = part.logsumexp
    if whole.logits is not None and part.logits is not None:
        whole.logits[start:stop] = part.logits
