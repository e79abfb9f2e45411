"""The batcher merges concurrent requests into one run and splits the answers back exactly.

A gate (a threading.Event) holds the first run inside the executor while the test queues more
requests behind it, so what gets merged is decided by the test, not by timing.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from service.errors import InferenceFailed, ModelNotReady, PayloadTooLarge, QueueFull
from service.runtime.batcher import Batcher, BatchLimits
from service.runtime.pending import BatchStats, RunBatch
from service.runtime.session import HeadSession, Projection
from tests.conftest import D_MODEL

WAIT = 30.0


def _rows(count: int, seed: int) -> npt.NDArray[np.float32]:
    return np.random.default_rng(seed).standard_normal((count, D_MODEL)).astype(np.float32)


class GatedRun:
    """A real session run that signals it started, then waits for the gate to open."""

    def __init__(
        self, session: HeadSession, name: str = "", order: list[str] | None = None
    ) -> None:
        self.session = session
        self.started = threading.Event()
        self.gate = threading.Event()
        self.calls: list[int] = []
        self.temperatures: list[list[float]] = []
        self.name, self.order = name, order  # runs of several batchers, in the order they ran

    def __call__(
        self,
        rows: npt.NDArray[np.float32],
        k: int,
        full: bool,
        temperature: npt.NDArray[np.float32] | float = 1.0,
    ) -> Projection:
        self.started.set()
        self.gate.wait(timeout=WAIT)
        if self.order is not None:
            self.order.append(self.name)
        self.calls.append(len(rows))
        self.temperatures.append(np.broadcast_to(temperature, len(rows)).tolist())
        return self.session.project(rows, k, temperature=temperature, full_logits=full)

    async def wait_started(self) -> None:
        assert await asyncio.to_thread(self.started.wait, WAIT)


async def _turns_until(condition: Callable[[], bool], turns: int = 100) -> None:
    """Let the event loop take turns until ``condition`` holds: a bounded count of turns,
    never the clock (fails if it does not come)."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)  # one turn of the loop, not a wait
    raise AssertionError(f"not reached in {turns} turns of the event loop")


def _with_batcher(
    run: RunBatch,
    limits: BatchLimits,
    scenario: Callable[[Batcher], object],
    on_batch: Callable[[BatchStats], None] = lambda stats: None,
) -> object:
    async def main() -> object:
        with ThreadPoolExecutor(1) as executor:
            batcher = Batcher(run, executor, limits, label="t/1", on_batch=on_batch)
            batcher.start()
            result = await scenario(batcher)  # type: ignore[misc]
            await batcher.close()
            return result

    return asyncio.run(main())


def test_queued_requests_share_one_run_and_get_their_own_rows(tied_path: Path) -> None:
    session = HeadSession(tied_path, tied=True)
    run = GatedRun(session)
    stats: list[BatchStats] = []
    requests = [(_rows(1 + i % 3, seed=i), 2 + i % 4, i % 5 == 0) for i in range(12)]

    async def scenario(batcher: Batcher) -> list[Projection]:
        first = batcher.enqueue(_rows(1, seed=99), 1)
        await run.wait_started()
        queued = [batcher.enqueue(rows, k, full) for rows, k, full in requests]
        assert batcher.queued_rows == sum(len(rows) for rows, _, _ in requests)
        run.gate.set()
        await first
        return list(await asyncio.gather(*queued))

    results = _with_batcher(run, BatchLimits(max_wait_s=0.01), scenario, stats.append)
    assert isinstance(results, list)
    assert run.calls == [1, sum(len(rows) for rows, _, _ in requests)]
    assert [(s.rows, s.requests) for s in stats] == [(1, 1), (run.calls[1], 12)]
    for (rows, k, full), result in zip(requests, results, strict=True):
        alone = session.project(rows, k, full_logits=full)
        np.testing.assert_array_equal(result.topk_token_ids, alone.topk_token_ids)
        np.testing.assert_allclose(result.topk_logits, alone.topk_logits, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(result.logsumexp, alone.logsumexp, rtol=1e-5, atol=1e-5)
        assert (result.logits is None) == (not full)
        if full:
            assert result.logits is not None
            assert alone.logits is not None
            np.testing.assert_allclose(result.logits, alone.logits, rtol=1e-5, atol=1e-5)


def test_batches_never_exceed_max_rows_unless_one_request_is_larger(tied_path: Path) -> None:
    run = GatedRun(HeadSession(tied_path, tied=True))

    async def scenario(batcher: Batcher) -> None:
        first = batcher.enqueue(_rows(1, 0), 1)
        await run.wait_started()
        queued = [batcher.enqueue(_rows(n, n), 1) for n in (1, 3, 2, 2, 9, 1)]
        run.gate.set()
        await asyncio.gather(first, *queued)

    _with_batcher(run, BatchLimits(max_batch_rows=4, max_wait_s=0.01), scenario)
    assert run.calls == [1, 4, 4, 9, 1]


def test_a_batch_as_large_as_the_last_one_runs_without_waiting(tied_path: Path) -> None:
    """Closed-loop clients: once all of the last batch's callers are back, nobody waits."""
    run = GatedRun(HeadSession(tied_path, tied=True))
    run.gate.set()

    async def scenario(batcher: Batcher) -> None:
        await asyncio.gather(*(batcher.enqueue(_rows(1, i), 1) for i in range(3)))
        # With max_wait at ten minutes, this round only completes if the batcher stops
        # waiting when the third request is in; the guard turns a hang into a failure.
        again = asyncio.gather(*(batcher.enqueue(_rows(1, i), 1) for i in range(3, 6)))
        await asyncio.wait_for(again, timeout=WAIT)

    _with_batcher(run, BatchLimits(max_wait_s=600.0), scenario)
    assert run.calls == [3, 3]


def test_without_merging_each_request_runs_alone(tied_path: Path) -> None:
    run = GatedRun(HeadSession(tied_path, tied=True))

    async def scenario(batcher: Batcher) -> None:
        first = batcher.enqueue(_rows(2, 0), 1)
        await run.wait_started()
        queued = [batcher.enqueue(_rows(2, i), 1) for i in range(1, 5)]
        run.gate.set()
        await asyncio.gather(first, *queued)

    _with_batcher(run, BatchLimits(merge=False), scenario)
    assert run.calls == [2] * 5


def test_a_failing_run_fails_every_caller_and_the_next_batch_runs(tied_path: Path) -> None:
    session = HeadSession(tied_path, tied=True)
    gated = GatedRun(session)
    failures = iter([False, True, False])

    def flaky(
        rows: npt.NDArray[np.float32], k: int, full: bool, temperature: npt.NDArray[np.float32]
    ) -> Projection:
        result = gated(rows, k, full, temperature)
        if next(failures):
            raise RuntimeError("onnxruntime exploded")
        return result

    async def scenario(batcher: Batcher) -> tuple[list[object], Projection]:
        first = batcher.enqueue(_rows(1, 0), 1)
        await gated.wait_started()
        doomed = [batcher.enqueue(_rows(1, i), 1) for i in range(1, 4)]
        gated.gate.set()
        await first
        outcomes = await asyncio.gather(*doomed, return_exceptions=True)
        return list(outcomes), await batcher.submit(_rows(1, 7), 1)

    outcome = _with_batcher(flaky, BatchLimits(max_wait_s=0.01), scenario)
    assert isinstance(outcome, tuple)
    failed, after = outcome
    assert gated.calls == [1, 3, 1]
    assert all(isinstance(error, InferenceFailed) for error in failed)
    assert "onnxruntime exploded" not in str(failed[0])
    assert after.topk_token_ids.shape == (1, 1)


def test_a_request_larger_than_the_queue_is_413_not_a_503_to_retry(tied_path: Path) -> None:
    """Retrying cannot help a request that never fits: it is refused as too large, and the
    batcher goes on serving (settings keep ``max_rows`` <= ``max_queue_rows``; this guards
    embedders that build their own limits)."""
    run = GatedRun(HeadSession(tied_path, tied=True))
    run.gate.set()

    async def scenario(batcher: Batcher) -> tuple[PayloadTooLarge, Projection]:
        with pytest.raises(PayloadTooLarge) as refused:
            batcher.enqueue(_rows(5, 0), 1)
        return refused.value, await batcher.enqueue(_rows(4, 1), 1)

    outcome = _with_batcher(run, BatchLimits(max_queue_rows=4), scenario)
    assert isinstance(outcome, tuple)
    error, served = outcome
    assert "5 rows are more than" in error.message
    assert "(4 rows, LMHEAD_MAX_QUEUE_ROWS)" in error.message
    assert error.headers == {}
    assert served.topk_token_ids.shape == (4, 1)


def test_a_full_queue_refuses_at_once_with_retry_after(tied_path: Path) -> None:
    run = GatedRun(HeadSession(tied_path, tied=True))

    async def scenario(batcher: Batcher) -> QueueFull:
        running = batcher.enqueue(_rows(2, 0), 1)
        await run.wait_started()
        queued = [batcher.enqueue(_rows(2, i), 1) for i in (1, 2)]
        with pytest.raises(QueueFull) as refused:
            batcher.enqueue(_rows(1, 3), 1)
        run.gate.set()
        await asyncio.gather(running, *queued)
        return refused.value

    error = _with_batcher(run, BatchLimits(max_batch_rows=2, max_queue_rows=4), scenario)
    assert isinstance(error, QueueFull)
    assert error.headers == {"Retry-After": "1"}
    assert "4 rows queued" in error.message


def test_close_lets_the_running_batch_finish_and_fails_the_queued(tied_path: Path) -> None:
    run = GatedRun(HeadSession(tied_path, tied=True))

    async def main() -> tuple[list[object], Batcher]:
        with ThreadPoolExecutor(1) as executor:
            batcher = Batcher(run, executor, BatchLimits(max_batch_rows=1), label="t/1")
            batcher.start()
            futures = [batcher.enqueue(_rows(1, i), 1) for i in range(3)]
            await run.wait_started()
            closing = asyncio.ensure_future(batcher.close())
            await _turns_until(lambda: batcher.closing)  # the run ends after the close began
            run.gate.set()
            await closing
            return list(await asyncio.gather(*futures, return_exceptions=True)), batcher

    outcomes, batcher = asyncio.run(main())
    assert isinstance(outcomes[0], Projection)
    assert all(isinstance(outcome, ModelNotReady) for outcome in outcomes[1:])
    with pytest.raises(ModelNotReady):
        batcher.enqueue(_rows(1, 0), 1)


def test_requests_at_other_temperatures_share_a_run_and_keep_their_own(tied_path: Path) -> None:
    """The graph takes one temperature per row: merged rows keep their request's value."""
    session = HeadSession(tied_path, tied=True)
    run = GatedRun(session)
    asked = [(_rows(1, 1), 0.5), (_rows(2, 2), 0.5), (_rows(1, 3), 2.0)]

    async def scenario(batcher: Batcher) -> list[Projection]:
        first = batcher.enqueue(_rows(1, 0), 1)
        await run.wait_started()
        queued = [batcher.enqueue(rows, 4, temperature=t) for rows, t in asked]
        run.gate.set()
        await first
        return list(await asyncio.gather(*queued))

    results = _with_batcher(run, BatchLimits(max_wait_s=0.01), scenario)
    assert run.calls == [1, 4]
    assert run.temperatures[1] == [0.5, 0.5, 0.5, 2.0]
    assert isinstance(results, list)
    for (rows, temperature), result in zip(asked, results, strict=True):
        alone = session.project(rows, 4, temperature=temperature)
        np.testing.assert_array_equal(result.topk_token_ids, alone.topk_token_ids)
        np.testing.assert_allclose(result.topk_logits, alone.topk_logits, rtol=1e-5)
        np.testing.assert_allclose(result.logsumexp, alone.logsumexp, rtol=1e-5)


class CountingExecutor(ThreadPoolExecutor):
    """Counts the runs handed to it."""

    def __init__(self) -> None:
        super().__init__(1)
        self.submitted = 0

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        self.submitted += 1
        return super().submit(*args, **kwargs)


def test_the_next_run_starts_before_the_last_batch_is_answered(tied_path: Path) -> None:
    """Answering wakes the callers (fronts, clients): the queued batch's run goes first, so
    onnxruntime does not sit idle while they run."""
    run = GatedRun(HeadSession(tied_path, tied=True))

    async def main() -> tuple[int, list[int]]:
        with CountingExecutor() as executor:
            batcher = Batcher(run, executor, BatchLimits(max_batch_rows=1), label="t/1")
            batcher.start()
            first = batcher.enqueue(_rows(1, 0), 3)
            await run.wait_started()
            second = batcher.enqueue(_rows(1, 1), 3)
            run.gate.set()
            await first
            submitted_when_answered = executor.submitted
            await second
            await batcher.close()
            return submitted_when_answered, run.calls

    submitted_when_answered, calls = asyncio.run(main())
    assert submitted_when_answered == 2
    assert calls == [1, 1]


def test_concurrent_closes_finish_each_run_once(tied_path: Path) -> None:
    """Closing right as a run ends (its successor already started): each run is finished,
    answered and counted once, however many callers close the batcher."""
    run = GatedRun(HeadSession(tied_path, tied=True))
    run.gate.set()
    stats: list[BatchStats] = []

    async def main() -> list[object]:
        with ThreadPoolExecutor(1) as executor:
            batcher = Batcher(
                run, executor, BatchLimits(max_batch_rows=1), label="t/1", on_batch=stats.append
            )
            batcher.start()
            futures = [batcher.enqueue(_rows(1, i), 1) for i in range(2)]
            await futures[0]  # the second run started before this answer
            await asyncio.gather(batcher.close(), batcher.close())
            return list(await asyncio.gather(*futures, return_exceptions=True))

    outcomes = asyncio.run(main())
    assert all(isinstance(outcome, Projection) for outcome in outcomes)
    assert [(s.rows, s.requests) for s in stats] == [(1, 1), (1, 1)]


def _open_run(session: HeadSession, name: str = "", order: list[str] | None = None) -> GatedRun:
    """A run that never waits (its gate open), recording its name in ``order`` if given."""
    run = GatedRun(session, name, order)
    run.gate.set()
    return run


def test_runs_chained_from_the_inference_thread_answer_every_request(tied_path: Path) -> None:
    """Requests keep arriving while runs chain one into the next from the inference thread:
    every request is answered with its own rows, each run holds at most a batch, and the
    rows of all runs add up to the rows sent."""
    session = HeadSession(tied_path, tied=True)
    order: list[str] = []
    stats: list[BatchStats] = []
    sizes = [1 + (i * 7) % 5 for i in range(120)]

    async def scenario(batcher: Batcher) -> list[Projection]:
        async def client(index: int) -> Projection:
            if index >= 8:  # closed loop: sent once an earlier request was answered
                await calls[index - 8]
            return await batcher.enqueue(_rows(sizes[index], index), 3)

        calls = [asyncio.ensure_future(client(i)) for i in range(len(sizes))]
        return list(await asyncio.gather(*calls))

    limits = BatchLimits(max_batch_rows=8, max_wait_s=0.001)
    results = _with_batcher(_open_run(session, "a", order), limits, scenario, stats.append)
    assert isinstance(results, list)
    assert sum(s.rows for s in stats) == sum(sizes)
    assert sum(s.requests for s in stats) == len(sizes)
    assert all(s.rows <= 8 for s in stats)
    assert len(order) == len(stats)
    for index, result in enumerate(results):
        alone = session.project(_rows(sizes[index], index), 3)
        np.testing.assert_array_equal(result.topk_token_ids, alone.topk_token_ids)
        np.testing.assert_allclose(result.topk_logits, alone.topk_logits, rtol=1e-5, atol=1e-5)


def test_a_chain_of_runs_leaves_turns_to_another_version_in_the_same_executor(
    tied_path: Path,
) -> None:
    """Two versions share one inference thread (A/B): a version whose runs chain into each
    other queues each next run behind what is already waiting, so the other version's run
    goes between them rather than after the whole chain."""
    session = HeadSession(tied_path, tied=True)
    order: list[str] = []
    gate = GatedRun(session)

    async def main() -> None:
        with ThreadPoolExecutor(1) as executor:
            limits = BatchLimits(max_batch_rows=1)
            a = Batcher(_open_run(session, "a", order), executor, limits, label="a/1")
            b = Batcher(_open_run(session, "b", order), executor, limits, label="b/1")
            a.start()
            b.start()
            holder = asyncio.get_running_loop().run_in_executor(
                executor, gate, _rows(1, 0), 1, False
            )
            await gate.wait_started()  # the inference thread is busy: both queue behind it
            first_a = a.enqueue(_rows(1, 1), 2)
            more_a = [a.enqueue(_rows(1, 2 + i), 2) for i in range(3)]
            await _turns_until(lambda: a.queued_rows == 3)  # a's first run goes to the executor
            only_b = b.enqueue(_rows(1, 9), 2)
            await _turns_until(lambda: b.queued_rows == 0)  # and b's only one, behind a's
            gate.gate.set()
            await asyncio.gather(holder, first_a, only_b, *more_a)
            await asyncio.gather(a.close(), b.close())

    asyncio.run(main())
    assert order.index("b") < len(order) - 1, order  # b did not wait for all of a's runs
    assert order.count("a") == 4
    assert order.count("b") == 1


def test_the_next_run_starts_while_the_event_loop_is_busy(tied_path: Path) -> None:
    """A run that ends with requests queued starts theirs from the inference thread: the event
    loop (busy with HTTP in a server, blocked outright here) is not needed in between."""
    session = HeadSession(tied_path, tied=True)
    first = GatedRun(session)
    second_started = threading.Event()

    def run(
        rows: npt.NDArray[np.float32], k: int, full: bool, temperature: npt.NDArray[np.float32]
    ) -> Projection:
        if first.calls:
            second_started.set()
            return session.project(rows, k, temperature=temperature, full_logits=full)
        return first(rows, k, full, temperature)

    async def scenario(batcher: Batcher) -> list[Projection]:
        queued = [batcher.enqueue(_rows(1, 0), 2)]
        await first.wait_started()
        queued.append(batcher.enqueue(_rows(1, 1), 2))
        first.gate.set()
        assert second_started.wait(WAIT)  # blocks the event loop until the second run starts
        return list(await asyncio.gather(*queued))

    results = _with_batcher(run, BatchLimits(max_batch_rows=1), scenario)
    assert isinstance(results, list)
    assert len(results) == 2


class HoldingExecutor(ThreadPoolExecutor):
    """Two inference threads; one that queues a chained run is then held (as the OS or the GIL
    may hold it) until ``release`` is set, so the chained run finishes and is answered first."""

    def __init__(self) -> None:
        super().__init__(2)
        self.release = threading.Event()

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        work = super().submit(*args, **kwargs)
        if threading.current_thread() is not threading.main_thread():
            self.release.wait(WAIT)
        return work


def test_close_waits_for_every_answer_when_chained_runs_finish_out_of_order(
    tied_path: Path,
) -> None:
    run = _open_run(HeadSession(tied_path, tied=True))

    async def main() -> tuple[bool, list[object]]:
        with HoldingExecutor() as executor:
            batcher = Batcher(run, executor, BatchLimits(max_batch_rows=1), label="t/1")
            batcher.start()
            futures = [batcher.enqueue(_rows(1, i), 2) for i in range(2)]
            await futures[1]  # the chained run, answered while the first is held
            closing = asyncio.ensure_future(batcher.close())
            for _ in range(20):  # room for a close that would not wait for the first answer
                await asyncio.sleep(0)
            closed_early = closing.done()
            executor.release.set()
            await closing
            return closed_early, [future.result() for future in futures]

    closed_early, results = asyncio.run(main())
    assert not closed_early
    assert all(isinstance(result, Projection) for result in results)


def test_runs_the_executor_drops_fail_their_callers_and_close_ends(tied_path: Path) -> None:
    """An executor shut down with ``cancel_futures`` drops a queued run: its callers get an
    error and the batcher still closes (nothing waits for a run that will never come)."""
    run = GatedRun(HeadSession(tied_path, tied=True))

    async def main() -> list[object]:
        executor = ThreadPoolExecutor(1)
        batcher = Batcher(run, executor, BatchLimits(max_batch_rows=1), label="t/1")
        batcher.start()
        futures = [batcher.enqueue(_rows(1, i), 2) for i in range(2)]
        await run.wait_started()
        hold, blocking = threading.Event(), threading.Event()

        def block() -> bool:
            blocking.set()
            return hold.wait(WAIT)

        blocker = executor.submit(block)  # the chained run queues behind it
        run.gate.set()
        await futures[0]
        # The worker takes the blocker once the first run has queued the next (shutting down
        # before it did cancelled the blocker too: a race this test lost under load).
        assert await asyncio.to_thread(blocking.wait, WAIT)
        executor.shutdown(wait=False, cancel_futures=True)
        hold.set()
        await asyncio.wait_for(batcher.close(), WAIT)
        assert blocker.result() is True
        return list(await asyncio.gather(*futures, return_exceptions=True))

    outcomes = asyncio.run(main())
    assert isinstance(outcomes[0], Projection)
    assert isinstance(outcomes[1], InferenceFailed)


def test_a_lone_small_request_to_an_idle_batcher_runs_at_once(tied_path: Path) -> None:
    """``lone_rows``: a request alone at an idle batcher runs in its caller, counted as a run
    of one (a failed one too: the caller gets ``InferenceFailed``, the next runs); requests
    that come together still merge into one run."""
    session = HeadSession(tied_path, tied=True)
    calls: list[int] = []
    failures = iter([False, True, False, False])

    def run(
        rows: npt.NDArray[np.float32], k: int, full: bool, temperature: npt.NDArray[np.float32]
    ) -> Projection:
        calls.append(len(rows))
        if next(failures):
            raise RuntimeError("onnxruntime exploded")
        return session.project(rows, k, temperature=temperature, full_logits=full)

    stats: list[BatchStats] = []

    async def scenario(batcher: Batcher) -> tuple[Projection, object, list[Projection]]:
        alone = await batcher.submit(_rows(1, 0), 3, temperature=0.5)
        failed = await asyncio.gather(batcher.submit(_rows(2, 1), 3), return_exceptions=True)
        together = await asyncio.gather(*(batcher.submit(_rows(1, i), 3) for i in range(2, 5)))
        return alone, failed[0], together

    limits = BatchLimits(max_batch_rows=64, lone_rows=2)
    outcome = _with_batcher(run, limits, scenario, on_batch=stats.append)
    assert isinstance(outcome, tuple)
    alone, failed, together = outcome
    whole = session.project(_rows(1, 0), 3, temperature=0.5)
    np.testing.assert_array_equal(alone.topk_token_ids, whole.topk_token_ids)
    assert isinstance(failed, InferenceFailed)
    assert "onnxruntime exploded" not in str(failed)
    assert calls == [1, 2, 3]  # the three that came together: one run
    assert [(s.rows, s.requests, s.failed) for s in stats] == [
        (1, 1, False),
        (2, 1, True),
        (3, 3, False),
    ]
    for index, projection in zip(range(2, 5), together, strict=True):
        expected = session.project(_rows(1, index), 3).topk_token_ids
        np.testing.assert_array_equal(projection.topk_token_ids, expected)
