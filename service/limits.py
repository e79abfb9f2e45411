"""Every numeric limit on inference input, and the memory budget of requests in flight.

Front ends decode the wire into numpy arrays and plain values without judging them; what a
model can take (shape, dtype, finite values, ids in range), how much a request may ask for
(rows, k, bytes of full logits) and which temperatures are safe is decided here, with messages
that name the field, the expected and the actual value, and never echo data. A request's
options are checked through these, once, before any math (``service.plane.options``); the
codecs and the math only charge the memory they hold (``charge``, ``hold``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from service.errors import InvalidInput, PayloadTooLarge, ServerBusy
from service.settings import Settings

#: Temperatures outside this range overflow or underflow float32 logits (1e-45 made them inf).
MIN_TEMPERATURE = 1e-4
MAX_TEMPERATURE = 1e4
#: |logit_bias| beyond this is a ban or a forced token in all but name (OpenAI's range).
MAX_BIAS = 100.0
#: Layers a /lens request may hold (the largest models have ~130).
MAX_LENS_LAYERS = 512
LOGIT_BYTES = 4  # float32
#: A body's bytes are charged this many times as they are read (its decoded arrays, copies).
BODY_EXPANSION = 3
#: Peak bytes a JSON body takes to decode, per number: a Python float (24) in a list's slot
#: (8) and its place in the array numpy makes (<= 8); and per array: a list's header and slot.
#: ``0.5,`` decodes to ~10x its bytes, ``[0],`` to ~30x (measured +2.05 GB for 63 MiB).
JSON_NUMBER_BYTES = 40
JSON_ARRAY_BYTES = 80
#: Logits the statistics of compare, score and shadow process at a time
#: (``service.plane.comparison``); a chunk's float64 and index temporaries are ~10x it.
CHUNK_BYTES = 4 * 2**20
#: What the statistics hold at most.
STATISTICS_BYTES = 10 * CHUNK_BYTES


@dataclass(frozen=True)
class Limits:
    """Request limits of one service instance (from ``LMHEAD_MAX_*``)."""

    max_rows: int
    max_k: int
    max_logits_bytes: int
    max_inflight_bytes: int

    @classmethod
    def from_settings(cls, settings: Settings) -> Limits:
        return cls(
            settings.max_rows,
            settings.max_k,
            settings.max_logits_bytes,
            settings.max_inflight_bytes,
        )

    def hidden_states(
        self, array: npt.NDArray[Any], d_model: int, field: str = "hidden_states"
    ) -> npt.NDArray[np.float32]:
        """(rows, d_model) or (batch, tokens, d_model), finite, within the row limit."""
        if array.dtype.kind != "f":
            raise InvalidInput(f"{field} must be float32 or float16, got {kind_name(array.dtype)}")
        if array.ndim not in (2, 3):
            raise InvalidInput(
                f"{field} must have shape (rows, {d_model}) or (batch, tokens, {d_model}), "
                f"got {array.ndim}-D shape {list(array.shape)[:8]}"
            )
        if array.shape[-1] != d_model:
            raise InvalidInput(
                f"{field} rows must have d_model={d_model} values, got {array.shape[-1]}"
            )
        rows = math.prod(array.shape[:-1])
        if rows == 0:
            raise InvalidInput(
                f"{field} is empty (shape {list(array.shape)}); send at least one row"
            )
        if rows > self.max_rows:
            raise PayloadTooLarge(
                f"{field} has {rows} rows; the limit is {self.max_rows} per request "
                "(LMHEAD_MAX_ROWS)"
            )
        return _finite(array, field)

    def lens_states(self, array: npt.NDArray[Any], d_model: int) -> npt.NDArray[np.float32]:
        """``/lens``: (layers, tokens, d_model), finite; tokens within the row limit (a prompt's
        positions, as ``/score`` takes them) and at most ``MAX_LENS_LAYERS`` layers."""
        field = "hidden_states"
        if array.dtype.kind != "f":
            raise InvalidInput(f"{field} must be float32 or float16, got {kind_name(array.dtype)}")
        if array.ndim != 3 or array.shape[-1] != d_model or 0 in array.shape:
            raise InvalidInput(
                f"{field} of /lens must have shape (layers, tokens, {d_model}): every layer's "
                f"states, as output_hidden_states stacks them; got shape {list(array.shape)[:8]}"
            )
        layers, tokens, _ = array.shape
        if tokens > self.max_rows or layers > MAX_LENS_LAYERS:
            raise PayloadTooLarge(
                f"{field} has {layers} layers of {tokens} tokens; the limits are "
                f"{MAX_LENS_LAYERS} layers and {self.max_rows} tokens (LMHEAD_MAX_ROWS)"
            )
        return _finite(array, field)

    def token_ids(
        self, ids: npt.NDArray[Any], vocab_size: int, field: str = "input_ids"
    ) -> npt.NDArray[np.int64]:
        """Integer ids in [0, vocab_size), at least one, at most ``max_rows``."""
        if ids.dtype.kind not in "iu":
            raise InvalidInput(f"{field} must hold integers, got {kind_name(ids.dtype)}")
        if ids.size == 0:
            raise InvalidInput(f"{field} is empty; send at least one token id")
        if ids.size > self.max_rows:
            raise PayloadTooLarge(
                f"{field} has {ids.size} ids; the limit is {self.max_rows} per request "
                "(LMHEAD_MAX_ROWS)"
            )
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab_size:
            raise InvalidInput(
                f"{field} must be in [0, {vocab_size}), got values in [{low}, {high}]"
            )
        return ids.astype(np.int64, copy=False)

    def k(self, requested: int | None, default: int, field: str = "k") -> int:
        """The request's k (or sample.top_k), or the model's default, within [1, max_k]."""
        k = default if requested is None else requested
        if not 1 <= k <= self.max_k:
            raise InvalidInput(
                f"{field} must be between 1 and {self.max_k} (LMHEAD_MAX_K), got {k}"
            )
        return k

    def logit_bias(self, entries: int) -> None:
        """Biased tokens widen the top-k run by as many: at most ``max_k`` of them."""
        if entries > self.max_k:
            raise InvalidInput(
                f"logit_bias has {entries} entries; at most {self.max_k} (LMHEAD_MAX_K)"
            )

    @staticmethod
    def bias(value: float) -> float:
        if not -MAX_BIAS <= value <= MAX_BIAS:  # NaN fails too
            raise InvalidInput(f"logit_bias values must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}]")
        return float(value)

    def check_default_k(self, default: int) -> None:
        """At load time: a model whose default k no request could use must not be served."""
        if default > self.max_k:
            raise ValueError(f"default_k {default} is above LMHEAD_MAX_K ({self.max_k})")

    @staticmethod
    def temperature(value: float, field: str = "temperature") -> float:
        if not MIN_TEMPERATURE <= value <= MAX_TEMPERATURE:  # NaN fails too
            raise InvalidInput(
                f"{field} must be a number in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], "
                f"got {value:g}"
            )
        return float(value)

    def logits(
        self, rows: int, vocab_size: int, copies: int = 1, what: str = "full logits"
    ) -> None:
        """Refuse (413) a request that would hold ``copies`` (rows, vocab) float32 tensors."""
        size = rows * vocab_size * LOGIT_BYTES * copies
        if size > self.max_logits_bytes:
            raise PayloadTooLarge(
                f"{what} would be {size} bytes ({rows} rows x {vocab_size} tokens"
                + (f" x {copies} heads" if copies > 1 else "")
                + f"); the limit is LMHEAD_MAX_LOGITS_BYTES={self.max_logits_bytes} "
                "(send fewer rows, or use top-k)"
            )

    def fits_logits(self, rows: int, vocab_size: int, copies: int = 1) -> bool:
        return rows * vocab_size * LOGIT_BYTES * copies <= self.max_logits_bytes

    def rows_per_run(self, vocab_size: int) -> int:
        """Rows of one onnxruntime run: its logits and log-softmax (2 x rows x vocab floats)
        stay within ``max_logits_bytes``; bigger requests run in chunks of this many rows."""
        return max(1, self.max_logits_bytes // (2 * vocab_size * LOGIT_BYTES))


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


def kind_name(dtype: np.dtype[Any]) -> str:
    """A dtype as a client would say it: ``strings`` rather than ``<U3``."""
    return {"b": "booleans", "U": "strings", "S": "bytes", "O": "objects", "c": "complex"}.get(
        dtype.kind, str(dtype)
    )


def _finite(array: npt.NDArray[Any], field: str) -> npt.NDArray[np.float32]:
    hidden = np.ascontiguousarray(array, dtype=np.float32)
    if not np.isfinite(hidden).all():
        raise InvalidInput(f"{field} contains NaN, Inf or null (or a value beyond float32's range)")
    return hidden
