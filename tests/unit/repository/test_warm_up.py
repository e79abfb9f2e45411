"""A warm-up ends at its deadline, at an unload of its model, or when the service stops: its
run is ended by onnxruntime's terminate flag, not left running in a thread. The slow head is
real (a chain of MatMuls, operators a head uses: ``tests.hostile_heads``), its session real."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from service.repository.open_version import VersionLoadError
from service.repository.warm_up import DEADLINE_THREAD, STOPPING, UNLOADED, WarmUps
from service.runtime.layout import Placement, open_head
from service.runtime.session import HeadSession
from tests.hostile_heads import slow_head

#: A run ends at its next node: one MatMul of the slow head (~0.3 s here), on a busy machine.
ENDS_WITHIN_S = 5.0


def _slow(tmp_path: Path, table: npt.NDArray[np.float32]) -> HeadSession:
    return open_head(slow_head(tmp_path, table), Placement(intra_op_threads=1))


def _ended(
    warm_ups: WarmUps, session: HeadSession, end: Callable[[], None]
) -> tuple[Exception | None, float]:
    """Run the warm-up in a thread, calling ``end`` until it returns (``end`` before the
    warm-up has begun ends nothing): what it raised, and how long it ran."""
    outcome: list[Exception | None] = []

    def run() -> None:
        try:
            warm_ups.run("slow", session)
            outcome.append(None)
        except Exception as error:
            outcome.append(error)

    started = time.monotonic()
    thread = threading.Thread(target=run)
    thread.start()
    while thread.is_alive() and time.monotonic() - started < ENDS_WITHIN_S * 2:
        end()
        thread.join(timeout=0.05)
    assert not thread.is_alive(), "the warm-up was not ended"
    return outcome[0], time.monotonic() - started


def test_a_warm_up_past_its_deadline_is_ended(
    tmp_path: Path, table: npt.NDArray[np.float32]
) -> None:
    session = _slow(tmp_path, table)
    started = time.monotonic()
    with pytest.raises(VersionLoadError, match=r"did not finish within 0.5 s \(LMHEAD_WARMUP"):
        WarmUps(0.5).run("slow", session)
    assert time.monotonic() - started < 0.5 + ENDS_WITHIN_S
    with pytest.raises(Exception, match="terminate"):  # its session is done for: never served
        session.project(np.zeros((1, session.d_model), np.float32), 1)


def test_an_unload_ends_the_warm_ups_of_its_model_only(
    tmp_path: Path, table: npt.NDArray[np.float32]
) -> None:
    warm_ups = WarmUps(600)
    session = _slow(tmp_path, table)
    warm_ups.cancel("other")  # another model's unload ends nothing here
    error, took = _ended(warm_ups, session, lambda: warm_ups.cancel("slow"))
    assert isinstance(error, VersionLoadError)
    assert str(error) == UNLOADED
    assert took < ENDS_WITHIN_S


def test_a_stop_ends_every_warm_up_and_refuses_later_ones(
    tmp_path: Path, table: npt.NDArray[np.float32], tied_path: Path
) -> None:
    warm_ups = WarmUps(600)
    error, took = _ended(warm_ups, _slow(tmp_path, table), warm_ups.stop)
    assert isinstance(error, VersionLoadError)
    assert str(error) == STOPPING
    assert took < ENDS_WITHIN_S
    with pytest.raises(VersionLoadError, match=STOPPING):
        warm_ups.run("head", open_head(tied_path))


def test_a_head_warms_up_and_serves_on(tied_path: Path) -> None:
    """The deadline's timer is gone once the warm-up ends (none could end the session's runs
    later), and the session serves."""
    session = open_head(tied_path)
    WarmUps(0.1).run("head", session)
    assert DEADLINE_THREAD not in {thread.name for thread in threading.enumerate()}
    result = session.project(np.zeros((2, session.d_model), np.float32), 3)
    assert result.topk_token_ids.shape == (2, 3)


def test_a_load_queued_before_an_unload_fails_at_once_and_later_ones_warm_up(
    tied_path: Path,
) -> None:
    """Between ``cancel`` (the unload is asked for) and ``resume`` (it is done), a warm-up of
    that model fails at once: it was asked for before the unload, which wins."""
    warm_ups = WarmUps(600)
    warm_ups.cancel("head")
    with pytest.raises(VersionLoadError, match=UNLOADED):
        warm_ups.run("head", open_head(tied_path))
    warm_ups.run("other", open_head(tied_path))  # other models warm up meanwhile
    warm_ups.resume("head")
    warm_ups.run("head", open_head(tied_path))
