"""What one dynamic batch is: the callers' pending requests, their rows merged into one run's
inputs, and the run's result split back to each caller (``service.runtime.batcher`` decides which
requests make a batch, and when and where it runs)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from service.errors import InferenceFailed
from service.runtime.session import Projection

logger = logging.getLogger("lmhead")


@dataclass(frozen=True)
class BatchStats:
    """What one run did, for metrics."""

    rows: int
    requests: int
    queue_seconds: list[float]
    run_seconds: float
    failed: bool


@dataclass(eq=False)  # one caller's entry: found in the queue by identity
class Pending:
    """One caller's rows and options, waiting for a run."""

    rows: npt.NDArray[np.float32]
    k: int
    full_logits: bool
    future: asyncio.Future[Projection]
    temperature: float = 1.0
    enqueued: float = field(default_factory=time.monotonic)


@dataclass
class Started:
    """A batch handed to the inference executor, its rows merged into one run's inputs."""

    batch: list[Pending]
    rows: npt.NDArray[np.float32]
    temperature: npt.NDArray[np.float32]
    k: int
    full_logits: bool
    at: float = field(default_factory=time.monotonic)

    @classmethod
    def merge(cls, batch: list[Pending]) -> Started:
        rows = batch[0].rows if len(batch) == 1 else np.concatenate([p.rows for p in batch])
        temperature = np.repeat(
            np.array([item.temperature for item in batch], np.float32),
            [len(item.rows) for item in batch],
        )
        k = max(item.k for item in batch)
        return cls(batch, rows, temperature, k, any(item.full_logits for item in batch))

    def log(self, label: str, seconds: float) -> None:
        """LMHEAD_LOG_LEVEL=debug: one line per run, in the executor or on the event loop."""
        log_run(label, len(self.rows), len(self.batch), seconds)


def log_run(label: str, rows: int, requests: int, seconds: float) -> None:
    """LMHEAD_LOG_LEVEL=debug: one line per run, however it ran."""
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "%s: ran %d rows of %d requests in %.2f ms", label, rows, requests, seconds * 1e3
        )


def fail(batch: list[Pending], label: str) -> None:
    """Every caller still waiting gets ``InferenceFailed``."""
    for item in batch:
        if not item.future.done():
            item.future.set_exception(
                InferenceFailed(f"inference failed for {label}; see the server log")
            )


def deliver(batch: list[Pending], result: Projection) -> None:
    """Each caller gets its own rows of the run, and its own first k columns."""
    offset = 0
    for item in batch:
        end = offset + len(item.rows)
        if not item.future.done():  # a caller that went away has a cancelled future
            logits = result.logits
            item.future.set_result(
                Projection(
                    topk_logits=result.topk_logits[offset:end, : item.k],
                    topk_token_ids=result.topk_token_ids[offset:end, : item.k],
                    logsumexp=result.logsumexp[offset:end],
                    logits=logits[offset:end] if item.full_logits and logits is not None else None,
                )
            )
        offset = end


#: (rows, k, full_logits, one temperature per row) -> the projection of those rows.
RunBatch = Callable[[npt.NDArray[np.float32], int, bool, npt.NDArray[np.float32]], Projection]


def run_lone(
    run: RunBatch,
    label: str,
    on_batch: Callable[[BatchStats], None],
    rows: npt.NDArray[np.float32],
    k: int,
    temperature: float,
) -> Projection:
    """One request's rows run at once (``Batcher.submit``), in the run metrics as a batch of
    one; ``InferenceFailed`` when the run raises."""
    started = time.monotonic()
    try:
        result = run(rows, k, False, np.full(len(rows), temperature, np.float32))
    except Exception:
        logger.exception("inference failed for %s on a run of one request", label)
        on_batch(BatchStats(len(rows), 1, [0.0], time.monotonic() - started, True))
        raise InferenceFailed(f"inference failed for {label}; see the server log") from None
    seconds = time.monotonic() - started
    log_run(label, len(rows), 1, seconds)
    on_batch(BatchStats(len(rows), 1, [0.0], seconds, False))
    return result


def answered(
    batch: list[Pending], at: float, result: Projection | None, seconds: float, label: str
) -> BatchStats:
    """A finished batch's callers answered (their rows, or ``InferenceFailed`` when the run
    failed), and what the run did."""
    if result is None:
        fail(batch, label)
    else:
        deliver(batch, result)
    return BatchStats(
        rows=sum(len(item.rows) for item in batch),
        requests=len(batch),
        queue_seconds=[at - item.enqueued for item in batch],
        run_seconds=seconds,
        failed=result is None,
    )


class Arrivals:
    """Lone requests at an idle batcher, each looking, for one turn of the event loop,
    whether others came with it (``Batcher.submit``): those that did queue together."""

    def __init__(self) -> None:
        self._looking = 0

    async def alone(self) -> bool:
        """After one turn of the loop: whether no other request looked meanwhile."""
        self._looking += 1
        try:
            await asyncio.sleep(0)  # one turn: requests that came with this one say so
        finally:
            self._looking -= 1
        return not self._looking
