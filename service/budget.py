"""The memory budget of requests in flight: what each request holds, charged as it is held.

Why a module of its own: ``service.limits`` judges a request's shape before any math, once;
the budget follows a request from its first body byte to its answer's last, through the
codecs, the data plane and the connection, and is charged by whoever materialises memory for
it (``charge``, ``charge_json``, ``hold``, ``ran``). A front end opens one reservation per
request (``MemoryBudget.request``); every charge finds it through a context variable, so the
code that charges needs no handle on the request. ``worst_case_extra_bytes`` adds up what the
service may hold beyond its models (docs/safety.md's formula), the budget's capacity included.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from service.errors import PayloadTooLarge, ServerBusy
from service.limits import CHUNK_BYTES
from service.settings import Settings

#: A body's bytes are charged this many times as they are read (its decoded arrays, copies).
BODY_EXPANSION = 3
#: Peak bytes a JSON body takes to decode, per number: a Python float (24) in a list's slot
#: (8) and its place in the array numpy makes (<= 8); and per array: a list's header and slot.
#: ``0.5,`` decodes to ~10x its bytes, ``[0],`` to ~30x (measured +2.05 GB for 63 MiB).
JSON_NUMBER_BYTES = 40
JSON_ARRAY_BYTES = 80

#: What the statistics hold at most.
STATISTICS_BYTES = 10 * CHUNK_BYTES

#: Bytes charged since the budget was last empty after which, once it empties, freed memory is
#: handed back to the OS (``MemoryBudget.on_idle``).
IDLE_TRIM_BYTES = 64 * 2**20
#: Python, uvicorn and onnxruntime churn under load, beside the terms below (measured ~40 MB).
SERVICE_SLACK_BYTES = 64 * 2**20


def worst_case_extra_bytes(settings: Settings) -> int:
    """Memory beyond the loaded models the service may hold at its worst, by construction:

    requests in flight (``max_inflight_bytes``: bodies as decoded, full logits, answers), one
    run per inference thread and one pending replay per shadow slot (each within
    ``max_logits_bytes``), the statistics thread, and a fixed slack. README "Limits and
    safety" gives the same sum.
    """
    per_run = settings.max_logits_bytes
    runs = settings.inference_threads + settings.shadow_max_pending
    return settings.max_inflight_bytes + runs * per_run + STATISTICS_BYTES + SERVICE_SLACK_BYTES


_held: ContextVar[Reservation | None] = ContextVar("lmhead_reservation", default=None)


class MemoryBudget:
    """Bytes that requests in flight may hold at once: bodies as decoded, full logits, answers.

    A front end opens a reservation per request (``request``) and holds it until the answer is
    sent; the body is ``charge``d as it is read, and the data plane charges before it
    materialises a (rows x vocab) tensor. Past the capacity the request gets 503 with
    Retry-After, never a memory spike: RSS stays under models + capacity + the per-run terms
    that README "Limits and safety" adds up. One request is always admitted, whatever its size
    (the other limits bound it), except a JSON body whose decoding alone would pass the
    capacity (``charge_json``: 413).
    """

    def __init__(self, capacity: int, on_idle: Callable[[], None] | None = None) -> None:
        self.capacity = capacity
        self.used = 0
        #: Bytes charged since the budget was last empty, and what to call when it empties
        #: after ``IDLE_TRIM_BYTES`` of them: the allocator keeps what requests freed (a
        #: process held 1 GB more, idle, after a storm of 4096-row calls) until told. Small
        #: requests one after another never add up to it: each empties the budget.
        self.grown = 0
        self.on_idle = on_idle
        #: Charges come from the event loop and from decoding threads (``off_loop``).
        self.lock = threading.Lock()

    @contextmanager
    def request(self) -> Iterator[Reservation]:
        """Open the current request's reservation (``charge`` adds to it); release on exit."""
        reservation = Reservation(self)
        token = _held.set(reservation)
        try:
            yield reservation
        finally:
            _held.reset(token)
            reservation.release()


def charge_json(text: bytes) -> None:
    """Charge the peak of decoding JSON ``text`` beyond the ``BODY_EXPANSION`` its bytes were
    charged on arrival (a count of its commas and brackets, an upper bound); refused (413)
    when that alone is more than the whole in-flight budget."""
    reservation = _held.get()
    if reservation is None:
        return
    peak = JSON_NUMBER_BYTES * (text.count(b",") + 1) + JSON_ARRAY_BYTES * text.count(b"[")
    capacity = reservation.capacity
    if peak > capacity:
        raise PayloadTooLarge(
            f"decoding this JSON body would hold ~{peak // 2**20} MiB (its numbers as Python "
            f"objects); the limit is LMHEAD_MAX_INFLIGHT_BYTES={capacity}: send fewer rows, "
            "or send them as .npy or V2 binary data"
        )
    reservation.grow(max(0, peak - BODY_EXPANSION * len(text)))


def hold(nbytes: int) -> None:
    """Add ``nbytes`` the current request already holds (its encoded answer) to its
    reservation, past the capacity if need be: it is memory in use, not a request for more."""
    reservation = _held.get()
    if reservation is not None:
        reservation.grow(nbytes, check=False)


def charge(nbytes: int) -> None:
    """Charge the current request's reservation, or raise ``ServerBusy`` past the budget.

    Outside a request (in-process callers, tests) it charges nothing.
    """
    reservation = _held.get()
    if reservation is not None:
        reservation.grow(nbytes)


def ran(nbytes: int) -> None:
    """The current request runs a tensor of ``nbytes`` (its largest run's logits): never
    charged against the in-flight capacity (each inference thread's run is its own term of
    the worst case), but counted toward handing memory back once the service is idle, however
    small the request's own charge (a 16 KB lens body ran 1 GB of logits, and the process
    kept them idle)."""
    reservation = _held.get()
    if reservation is not None:
        reservation.note_run(nbytes)


class Reservation:
    """One request's share of the budget; released whole when the request is done."""

    def __init__(self, budget: MemoryBudget) -> None:
        self._budget = budget
        self.bytes = 0

    @property
    def capacity(self) -> int:
        return self._budget.capacity

    def grow(self, nbytes: int, check: bool = True) -> None:
        budget = self._budget
        with budget.lock:
            others = budget.used - self.bytes  # a request alone is always admitted
            if check and others > 0 and budget.used + nbytes > budget.capacity:
                raise ServerBusy(
                    f"requests in flight hold {budget.used} of {budget.capacity} bytes "
                    "(LMHEAD_MAX_INFLIGHT_BYTES); retry shortly",
                    headers={"Retry-After": "1"},
                )
            budget.used += nbytes
            budget.grown += nbytes
            self.bytes += nbytes

    def note_run(self, nbytes: int) -> None:
        budget = self._budget
        with budget.lock:
            budget.grown += nbytes

    def release(self) -> None:
        budget = self._budget
        with budget.lock:
            budget.used -= self.bytes
            self.bytes = 0
            emptied = budget.used == 0
            idle = emptied and budget.grown >= IDLE_TRIM_BYTES
            if emptied:  # what counts is what requests held together, between idle moments
                budget.grown = 0
        if idle and budget.on_idle is not None:
            budget.on_idle()
