"""A served head's runs (``Runner``): a request larger than one run is answered in runs, equal
to one run of all its rows; the run size never passes the batch cap; runs beside the batcher
are counted in the run metrics, failed ones too."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.runtime.batcher import BatchLimits
from service.runtime.pending import BatchStats
from service.runtime.runner import Runner
from service.runtime.session import HeadSession
from tests.conftest import D_MODEL


def _runner(
    path: Path, executor: ThreadPoolExecutor, rows_per_run: int
) -> tuple[Runner, list[BatchStats]]:
    runs: list[BatchStats] = []
    runner = Runner(HeadSession(path, tied=True), "tied/1")
    runner.start(executor, BatchLimits(max_batch_rows=64), rows_per_run, runs.append, lambda: None)
    return runner, runs


@pytest.mark.parametrize("full_logits", [False, True])
def test_a_request_past_one_run_is_answered_in_runs_equal_to_one_run(
    tied_path: Path, full_logits: bool
) -> None:
    hidden = np.random.default_rng(3).standard_normal((2, 11, D_MODEL)).astype(np.float32)

    async def main() -> None:
        with ThreadPoolExecutor(1) as executor:
            runner, runs = _runner(tied_path, executor, rows_per_run=4)
            try:
                got = await runner.project(hidden, 5, temperature=0.5, full_logits=full_logits)
            finally:
                await runner.close()
        assert runner.rows_per_run == 4
        assert [stats.rows for stats in runs] == [4, 4, 4, 4, 4, 2]
        whole = runner.session.project(
            hidden.reshape(-1, D_MODEL), 5, temperature=0.5, full_logits=full_logits
        )
        assert got.topk_token_ids.shape == (2, 11, 5)
        assert got.logsumexp.shape == (2, 11)
        np.testing.assert_array_equal(got.topk_token_ids.reshape(-1, 5), whole.topk_token_ids)
        np.testing.assert_allclose(got.topk_logits.reshape(-1, 5), whole.topk_logits, rtol=1e-6)
        np.testing.assert_allclose(got.logsumexp.reshape(-1), whole.logsumexp, rtol=1e-6)
        if full_logits:
            assert got.logits is not None
            assert whole.logits is not None
            np.testing.assert_allclose(got.logits.reshape(22, -1), whole.logits, rtol=1e-6)
        else:
            assert got.logits is None

    asyncio.run(main())


def test_a_run_never_passes_the_batch_cap(tied_path: Path) -> None:
    async def main() -> int:
        with ThreadPoolExecutor(1) as executor:
            runner, _ = _runner(tied_path, executor, rows_per_run=1000)
            await runner.close()
        return runner.rows_per_run

    assert asyncio.run(main()) == 64


def test_runs_beside_the_batcher_are_counted_failed_or_not(tied_path: Path) -> None:
    def fails() -> None:
        raise ValueError("a run that fails")

    async def main() -> list[BatchStats]:
        with ThreadPoolExecutor(1) as executor:
            runner, runs = _runner(tied_path, executor, rows_per_run=8)
            try:
                embedded = await runner.embed(np.array([[1, 2, 3]], np.int64))
                assert embedded.shape == (1, 3, D_MODEL)
                with pytest.raises(ValueError, match="a run that fails"):
                    await runner.run_alone(7, fails)
            finally:
                await runner.close()
        return runs

    runs = asyncio.run(main())
    assert [(stats.rows, stats.requests, stats.failed) for stats in runs] == [
        (3, 1, False),
        (7, 1, True),
    ]


class _CountingExecutor(ThreadPoolExecutor):
    """A real executor that counts the runs handed to it."""

    submitted = 0

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        self.submitted += 1
        return super().submit(*args, **kwargs)


@pytest.mark.parametrize(
    ("rows", "full_logits", "hops"), [(1, False, 0), (1, True, 1), (40, False, 1)]
)
def test_a_lone_tiny_run_takes_no_thread_hop_and_answers_the_same(
    tied_path: Path, rows: int, full_logits: bool, hops: int
) -> None:
    """A batch of one request this small runs on the event loop (no executor); full logits
    or more rows than ``inline_rows`` go to the executor. Either way the answer is the
    session's, and the run is counted."""
    hidden = np.random.default_rng(5).standard_normal((rows, D_MODEL)).astype(np.float32)

    async def main() -> tuple[Any, int, list[BatchStats], int]:
        with _CountingExecutor(1) as executor:
            runs: list[BatchStats] = []
            runner = Runner(HeadSession(tied_path, tied=True), "tied/1")
            runner.start(executor, BatchLimits(max_batch_rows=64), 64, runs.append, lambda: None)
            try:
                got = await runner.project(hidden, 5, temperature=0.5, full_logits=full_logits)
            finally:
                await runner.close()
            return got, executor.submitted, runs, runner.inline_rows

    got, submitted, runs, inline_rows = asyncio.run(main())
    assert 1 <= inline_rows < 40
    assert submitted == hops
    assert [(stats.rows, stats.requests, stats.failed) for stats in runs] == [(rows, 1, False)]
    whole = HeadSession(tied_path, tied=True).project(hidden, 5, temperature=0.5)
    np.testing.assert_array_equal(got.topk_token_ids, whole.topk_token_ids)
    np.testing.assert_allclose(got.topk_logits, whole.topk_logits, rtol=1e-6)


def test_concurrent_tiny_requests_still_merge_into_one_run(tied_path: Path) -> None:
    """Requests queued together are one batch, run in the executor as before: only a batch
    that could merge nothing runs on the event loop."""
    rng = np.random.default_rng(6)
    hiddens = [rng.standard_normal((1, D_MODEL)).astype(np.float32) for _ in range(4)]

    async def main() -> tuple[list[Any], int, list[BatchStats]]:
        with _CountingExecutor(1) as executor:
            runs: list[BatchStats] = []
            runner = Runner(HeadSession(tied_path, tied=True), "tied/1")
            runner.start(executor, BatchLimits(max_batch_rows=64), 64, runs.append, lambda: None)
            try:
                got = await asyncio.gather(*(runner.project(h, 5) for h in hiddens))
            finally:
                await runner.close()
            return got, executor.submitted, runs

    got, submitted, runs = asyncio.run(main())
    assert submitted == 1
    assert [(stats.rows, stats.requests) for stats in runs] == [(4, 4)]
    session = HeadSession(tied_path, tied=True)
    for hidden, projection in zip(hiddens, got, strict=True):
        np.testing.assert_array_equal(
            projection.topk_token_ids, session.project(hidden, 5).topk_token_ids
        )
