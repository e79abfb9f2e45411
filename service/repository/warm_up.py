"""A version's warm-up: its first real runs, under a deadline, and ended on demand.

Why: a warm-up runs the head's graph, and a graph may take as long as it likes. The operator
list (``service.heads.operators``) keeps out loops, but the operators a head uses are slow on
large enough shapes, and issue 43's ``Loop`` showed what a run that never ends did: the one
loading thread wedged, loads of other models hung, start-up never got ready, and a stopped
process spun until killed. So each warm-up runs on a thread of its own (never the loading
thread), and its runs are ended with onnxruntime's terminate flag (``HeadSession.terminate``:
set on the ``RunOptions`` every run of the session is given, from another thread;
onnxruntime checks it between nodes) when the first of these comes:

* ``LMHEAD_WARMUP_TIMEOUT_S`` passes (a timer's thread sets it);
* the model is unloaded (``WarmUps.cancel``): the unload needs not wait for the deadline;
* the service stops (``WarmUps.stop``): a process stops within its grace.

The version then fails with that reason, and the session, never published, is dropped.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from service.repository.open_version import VersionLoadError
from service.runtime.session import HeadSession

UNLOADED = "warm-up cancelled: the model was unloaded"
STOPPING = "warm-up cancelled: the service is stopping"
#: The name of a warm-up's deadline timer thread.
DEADLINE_THREAD = "lmhead-warm-up-deadline"


@dataclass(eq=False)
class _WarmUp:
    name: str
    session: HeadSession
    why: str | None = field(default=None)
    """Why its runs were ended (the first reason only); None while it may finish."""


class WarmUps:
    """The warm-ups running now, by model: each ends by itself, at its deadline, at an
    unload of its model, or when the service stops."""

    def __init__(self, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        self._lock = threading.Lock()
        self._running: set[_WarmUp] = set()
        self._unloading: set[str] = set()
        self._stopping = False

    def run(self, name: str, session: HeadSession) -> None:
        """Warm ``session`` of model ``name`` up in this thread; ``VersionLoadError`` saying
        why if its runs were ended (even where the last of them finished meanwhile)."""
        warm_up = _WarmUp(name, session)
        with self._lock:
            if self._stopping or name in self._unloading:
                raise VersionLoadError(STOPPING if self._stopping else UNLOADED)
            self._running.add(warm_up)
        timer = threading.Timer(self.deadline_s, self._end, [warm_up, self._late()])
        timer.name, timer.daemon = DEADLINE_THREAD, True
        timer.start()
        try:
            warm(session)
        except Exception:
            if warm_up.why is None:  # failed by itself: the head's own reason
                raise
        finally:
            timer.cancel()
            timer.join()  # a timer that fired has ended it: decided before the check below
            with self._lock:
                self._running.discard(warm_up)
        if warm_up.why is not None:
            raise VersionLoadError(warm_up.why)

    def cancel(self, name: str) -> None:
        """End the warm-ups of model ``name``, and refuse its next ones until ``resume``:
        it is being unloaded (a load queued before the unload fails too, at once)."""
        with self._lock:
            self._unloading.add(name)
            ending = [warm_up for warm_up in self._running if warm_up.name == name]
        for warm_up in ending:
            self._end(warm_up, UNLOADED)

    def resume(self, name: str) -> None:
        """``name`` is unloaded: loads asked for since may warm up."""
        with self._lock:
            self._unloading.discard(name)

    def stop(self) -> None:
        """End every warm-up, and refuse those that would start later."""
        with self._lock:
            self._stopping = True
            ending = list(self._running)
        for warm_up in ending:
            self._end(warm_up, STOPPING)

    def _end(self, warm_up: _WarmUp, why: str) -> None:
        with self._lock:
            if warm_up.why is not None:
                return
            warm_up.why = why
        warm_up.session.terminate()

    def _late(self) -> str:
        return (
            f"warm-up did not finish within {self.deadline_s:g} s (LMHEAD_WARMUP_TIMEOUT_S): "
            "its run was ended. A head's warm-up is one row: a graph this slow does more "
            "than a head's work (raise the limit only for a head that is slow to start here)"
        )


def warm(session: HeadSession) -> None:
    """One real run of each side; a head that cannot answer is not published."""
    k = min(5, session.vocab_size)
    result = session.project(np.zeros((1, session.d_model), np.float32), k, full_logits=True)
    if result.topk_token_ids.shape != (1, k) or result.logsumexp.shape != (1,):
        raise ValueError(f"warm-up returned shapes {result.topk_token_ids.shape}")
    assert result.logits is not None
    if not np.isfinite(result.logits).all():  # 0 x NaN (or Inf) is NaN: any such weight
        raise ValueError(
            "the head's logits for a zero hidden state are not all finite: its weights hold "
            "NaN/Inf, or its output bias masks tokens with -inf (lmhead takes finite biases, "
            "as its import does; drop padded rows with lmhead trim)"
        )
    if session.embed(np.zeros(1, np.int64)).shape != (1, session.d_model):
        raise ValueError("warm-up embedding has the wrong shape")
