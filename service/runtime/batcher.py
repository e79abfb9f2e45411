"""Dynamic batching: merge concurrent requests for one model version into one onnxruntime run.

One asyncio task per model version takes the first waiting request, keeps taking requests
that are already queued, and waits at most ``max_wait`` for more while the batch has fewer
than ``max_batch_rows`` rows. It waits only when the previous batch merged several requests,
i.e. when clients are concurrent: a lone client never pays ``max_wait`` per request (measured
here: 2 ms on a 24 ms run of 64 rows). It also stops waiting once the batch holds as many
requests as the previous one: closed-loop clients (each waits for its answer before sending
again) are then all back, and waiting longer would only add ``max_wait`` to every cycle.
The merged run happens in the inference executor; only a batch of one request too small to
be worth the thread hops (``BatchLimits.lone_rows``) runs on the event loop. While a run
runs, new requests queue up, so under load the next batch fills without waiting at all. A run
that ends with requests queued starts theirs itself, from the inference thread, before its own
batch is answered (``Batcher._execute`` says why); the event loop collects only the first
batch of a busy spell, with the waiting above. The results are split back per request
(``service.runtime.pending``): k is the batch's largest k (top-k is sorted, so each keeps its
first k columns) and the graph takes one temperature per row: different options share a run.

The queue is bounded in rows: past ``max_queue_rows`` a request is refused at once (503 with
Retry-After) rather than left to time out. A run that raises fails every caller in its batch
with ``InferenceFailed``; the loop goes on with the next batch.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from service.errors import ModelNotReady, PayloadTooLarge, QueueFull
from service.runtime.pending import (
    Arrivals,
    BatchStats,
    Pending,
    RunBatch,
    Started,
    answered,
    fail,
    run_lone,
)
from service.runtime.session import Projection

logger = logging.getLogger("lmhead")


#: Runs of one version that may be finished or running while the event loop has not yet
#: answered them, before the inference thread stops starting runs itself.
MAX_UNANSWERED = 3


@dataclass(frozen=True)
class BatchLimits:
    merge: bool = True
    max_batch_rows: int = 128
    max_wait_s: float = 0.002
    max_queue_rows: int = 16384
    #: A batch of one request of at most this many rows (no full logits) runs on the event
    #: loop: nothing was there to merge with it, and the thread hops cost more than its run.
    lone_rows: int = 0


class Batcher:
    """Per-model-version queue and the task that turns it into runs.

    The queue is a deque under a lock: the event loop adds to it and collects the first batch
    of a busy spell; the inference thread takes every later batch itself (``_execute``)."""

    def __init__(
        self,
        run: RunBatch,
        executor: Executor,
        limits: BatchLimits,
        *,
        label: str,
        on_batch: Callable[[BatchStats], None] = lambda stats: None,
        on_reject: Callable[[], None] = lambda: None,
    ) -> None:
        self._run = run
        self._executor = executor
        self._limits = limits
        self._label = label
        self._on_batch = on_batch
        self._on_reject = on_reject
        self._lock = threading.Lock()
        self._queue: deque[Pending] = deque()
        self._arrived = asyncio.Event()
        self._collecting: list[Pending] = []
        self._last_batch_requests = 0
        self._queued_rows = 0
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._spell: asyncio.Future[None] | None = None
        self._unanswered = 0  # runs launched whose answers have not been given yet
        self._arrivals = Arrivals()
        self._closing = False
        self._closed: asyncio.Future[None] | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._serve(), name=self._label)

    @property
    def queued_rows(self) -> int:
        return self._queued_rows

    @property
    def closing(self) -> bool:
        """True once ``close`` has begun: no run starts after the one in progress."""
        return self._closing

    @property
    def room(self) -> int:
        """Rows one more entry (calls served as one) may hold: what the queue still takes (not
        ``QueueFull``), and half a batch. Entries of at most half a batch pack batches at
        least half full; a full-batch entry queued behind a half-batch one runs as two
        half-empty runs (measured: 64-row calls from 16 clients, 122 rows per run, not 128)."""
        if not self._limits.merge:  # batching off: every call runs alone
            return 0
        half = max(1, self._limits.max_batch_rows // 2)
        return min(self._limits.max_queue_rows - self._queued_rows, half)

    async def submit(
        self,
        rows: npt.NDArray[np.float32],
        k: int,
        full_logits: bool = False,
        temperature: float = 1.0,
    ) -> Projection:
        """Queue (rows, d_model) float32 rows; return their projection once their batch ran.

        A request the batcher would run alone on the event loop (``lone_rows``) while it is
        idle runs here instead, once one turn of the loop has shown that no other request
        came with it (those that did take the queue together, and merge): the queue's round
        trip (a future, the batcher task woken, the answer) cost more than such a run."""
        idle = self._idle_for(rows, full_logits)
        if idle and await self._arrivals.alone() and self._idle_for(rows, full_logits):
            self._last_batch_requests = 1
            return run_lone(self._run, self._label, self._on_batch, rows, k, temperature)
        return await self.enqueue(rows, k, full_logits, temperature)

    def _idle_for(self, rows: npt.NDArray[np.float32], full_logits: bool) -> bool:
        """Whether ``rows`` would be a batch of their own, run on the event loop."""
        return (
            not full_logits
            and len(rows) <= self._limits.lone_rows
            and not self._queue
            and not self._collecting
            and self._unanswered == 0
            and not self._closing
            and self._task is not None
            and not self._task.done()
        )

    def enqueue(
        self,
        rows: npt.NDArray[np.float32],
        k: int,
        full_logits: bool = False,
        temperature: float = 1.0,
    ) -> asyncio.Future[Projection]:
        """Queue rows now (or raise QueueFull/ModelNotReady); the future resolves after the run."""
        if self._task is None or self._task.done():
            raise ModelNotReady(f"{self._label} is not accepting requests")
        count = len(rows)
        if count > self._limits.max_queue_rows:  # would never fit: retrying cannot help
            raise PayloadTooLarge(
                f"{count} rows are more than {self._label}'s queue holds "
                f"({self._limits.max_queue_rows} rows, LMHEAD_MAX_QUEUE_ROWS); send at most "
                "that many per request"
            )
        if self._queued_rows + count > self._limits.max_queue_rows:
            self._on_reject()
            raise QueueFull(
                f"{self._label} has {self._queued_rows} rows queued (limit "
                f"{self._limits.max_queue_rows}); retry shortly",
                headers={"Retry-After": "1"},
            )
        future: asyncio.Future[Projection] = asyncio.get_running_loop().create_future()
        pending = Pending(rows, k, full_logits, future, temperature)
        with self._lock:
            self._queued_rows += count
            self._queue.append(pending)
        future.add_done_callback(lambda _: self._drop_if_gone(pending))
        self._arrived.set()
        return future

    def _drop_if_gone(self, pending: Pending) -> None:
        """A caller that went away (its future cancelled: a client hung up, a gRPC call was
        cancelled or ran out of time) leaves the queue at once: its rows are not computed for
        nobody, and its place is free for the callers still waiting. Rows in a run already
        started are computed (and dropped when answered)."""
        if not pending.future.cancelled():
            return
        with self._lock:
            try:
                self._queue.remove(pending)
            except ValueError:  # taken into a batch already
                return
            self._queued_rows -= len(pending.rows)

    async def close(self) -> None:
        """Stop taking batches; started runs finish and deliver, requests still queued fail.
        Concurrent calls share one closing (shielded: a cancelled caller does not stop it)."""
        if self._closed is None:
            self._closed = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closed)

    async def _close(self) -> None:
        self._closing = True  # a run ending now starts no other
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._spell is not None:  # the runs already started finish and are answered
            await asyncio.gather(self._spell, return_exceptions=True)
        with self._lock:
            pending = self._collecting + list(self._queue)
            self._collecting = []
            self._queue.clear()
        for item in pending:
            if not item.future.done():
                item.future.set_exception(ModelNotReady(f"{self._label} was unloaded"))

    async def _serve(self) -> None:
        """Collect the first batch of each busy spell and wait for the spell to end."""
        while True:
            batch = await self._collect()
            if self._closing:  # ``close`` fails what was collected
                return
            self._collecting = []
            if self._ran_here(batch):
                continue
            assert self._loop is not None
            self._spell = self._loop.create_future()
            if not self._launch(batch):  # every caller of it went away meanwhile
                self._spell.set_result(None)
            # Shielded: closing the batcher stops this task but lets started runs deliver.
            await asyncio.shield(self._spell)

    async def _collect(self) -> list[Pending]:
        """Gather the next batch; ``_collecting`` holds it so ``close`` can fail it."""
        batch = self._collecting
        while (first := self._take_fitting(0, first=True)) is None:
            self._arrived.clear()
            await self._arrived.wait()
        batch.append(first)
        rows = len(first.rows)
        if not self._limits.merge:
            return batch
        expected = self._last_batch_requests  # clients active in the last batch
        deadline = time.monotonic() + (self._limits.max_wait_s if expected > 1 else 0.0)
        while rows < self._limits.max_batch_rows:
            if len(batch) >= expected and not self._queue:
                break  # everyone from the last batch is back: nobody else to wait for
            item = await self._next_before(deadline, self._limits.max_batch_rows - rows)
            if item is None:
                break
            batch.append(item)
            rows += len(item.rows)
        return batch

    async def _next_before(self, deadline: float, room: int) -> Pending | None:
        """The next queued request if it fits in ``room`` rows, waiting until ``deadline``
        for one to arrive; None when time is up or the next does not fit (it stays first)."""
        while not self._queue:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self._arrived.clear()
            try:  # not ``wait_for``: on 3.11 it drops a cancel that comes as the wait ends
                async with asyncio.timeout(remaining):
                    await self._arrived.wait()
            except TimeoutError:
                return None
        return self._take_fitting(room)

    def _take_fitting(self, room: int, *, first: bool = False) -> Pending | None:
        """Pop the first queued request if it fits in ``room`` rows (``first``: whatever its
        size: a request larger than a batch runs alone)."""
        with self._lock:
            if self._queue and (first or len(self._queue[0].rows) <= room):
                return self._queue.popleft()
            return None

    def _queued_now(self) -> list[Pending]:
        """The next batch from what is queued already, without waiting (empty if nothing is)."""
        batch: list[Pending] = []
        rows = 0
        with self._lock:
            while self._queue:
                if batch and rows + len(self._queue[0].rows) > self._limits.max_batch_rows:
                    break
                item = self._queue.popleft()
                batch.append(item)
                rows += len(item.rows)
                if not self._limits.merge:
                    break
        return batch

    def _launch(self, batch: list[Pending]) -> bool:
        """Merge a batch's rows and hand them to the inference executor (from any thread);
        False when none of its callers is still waiting (nothing runs)."""
        with self._lock:
            self._queued_rows -= sum(len(item.rows) for item in batch)
            batch = [item for item in batch if not item.future.cancelled()]
            if not batch:
                return False
            self._last_batch_requests = len(batch)
            self._unanswered += 1
        try:
            started = Started.merge(batch)
            work = self._executor.submit(self._execute, started)
        except Exception:  # the executor was shut down, or the rows would not merge
            logger.exception("could not start a run for %s", self._label)
            self._answer_soon(batch, time.monotonic(), None, 0.0)
            return True
        # A run the executor drops unstarted (``shutdown(cancel_futures=True)``) fails its
        # callers, and the spell still ends.
        work.add_done_callback(
            lambda work: (
                self._answer_soon(batch, started.at, None, 0.0) if work.cancelled() else None
            )
        )
        return True

    def _ran_here(self, batch: list[Pending]) -> bool:
        """Run a batch of one small request (``lone_rows``) here, on the event loop: the batch
        could merge nothing, and nothing runs while the loop collects (each spell's first batch
        is collected here). Its answer and metrics are a run's like any other."""
        lone = batch[0]
        if len(batch) > 1 or lone.full_logits or len(lone.rows) > self._limits.lone_rows:
            return False
        with self._lock:
            self._queued_rows -= len(lone.rows)
            if lone.future.cancelled():  # its caller went away meanwhile: nothing runs
                return True
            self._last_batch_requests = 1
            self._unanswered += 1  # ``_answer`` counts it out
        started = Started.merge(batch)
        result: Projection | None = None
        try:
            result = self._run(started.rows, started.k, False, started.temperature)
        except Exception:
            logger.exception("inference failed for %s on a run of one request", self._label)
        seconds = time.monotonic() - started.at
        started.log(self._label, seconds)
        self._answer(batch, started.at, result, seconds)
        return True

    def _execute(self, started: Started) -> None:
        """In the inference thread: run a batch, then start the next queued one before the
        finished batch is answered.

        Answering wakes the event loop (and through it the fronts and clients); from then on
        this thread competes with it for the GIL, and any step that lets the GIL go (numpy
        lets it go to copy rows) waits until the loop lets it back (~1 ms between runs of 30 ms
        here). So the next batch is merged and queued first, and answering comes last (through
        the event loop, runs were in flight 94.5% of the time for 64-row requests from 16
        clients; 99% this way)."""
        result: Projection | None = None
        started.at = time.monotonic()  # queued until now, in the executor too
        try:
            result = self._run(started.rows, started.k, started.full_logits, started.temperature)
        except Exception:
            logger.exception(
                "inference failed for %s on a batch of %d rows", self._label, len(started.rows)
            )
        finally:
            seconds = time.monotonic() - started.at
            started.log(self._label, seconds)
            following = self._queued_now() if self._may_chain() else []
            if following:
                self._launch(following)
            self._answer_soon(started.batch, started.at, result, seconds)

    def _may_chain(self) -> bool:
        """Whether the inference thread may start the next run itself: not while closing or
        once the event loop is gone, and not while ``MAX_UNANSWERED`` runs wait for the loop
        to answer them (a stalled loop would otherwise pile up results, each up to rows x
        vocab; the loop then starts the next spell once it has caught up)."""
        assert self._loop is not None
        return (
            not self._closing and not self._loop.is_closed() and self._unanswered < MAX_UNANSWERED
        )

    def _answer_soon(
        self, batch: list[Pending], at: float, result: Projection | None, seconds: float
    ) -> None:
        """Have the event loop answer a batch whose run began ``at`` and took ``seconds``."""
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._answer, batch, at, result, seconds)
        except RuntimeError:  # the event loop is closed: nobody waits for these answers
            logger.debug("%s: a batch finished after the event loop closed", self._label)

    def _answer(
        self, batch: list[Pending], at: float, result: Projection | None, seconds: float
    ) -> None:
        """On the event loop: answer a finished batch; the spell ends with its last answer
        (counted, not flagged: with several inference threads answers may come in any order)."""
        try:
            self._on_batch(answered(batch, at, result, seconds, self._label))
        except Exception:
            logger.exception("answering a batch of %s failed", self._label)
            fail(batch, self._label)
        finally:
            with self._lock:
                self._unanswered -= 1
                spell_over = self._unanswered == 0
            if spell_over and self._spell is not None and not self._spell.done():
                self._spell.set_result(None)
