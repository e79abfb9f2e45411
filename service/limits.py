"""Every numeric limit on inference input.

Front ends decode the wire into numpy arrays and plain values without judging them; what a
model can take (shape, dtype, finite values, ids in range), how much a request may ask for
(rows, k, bytes of full logits) and which temperatures are safe is decided here, with messages
that name the field, the expected and the actual value, and never echo data. A request's
options are checked through these, once, before any math (``service.plane.options``); the
memory a request holds meanwhile is the budget's (``service.budget``: the codecs and the math
only charge what they hold).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from service.errors import InvalidInput, PayloadTooLarge
from service.settings import Settings

#: Temperatures outside this range overflow or underflow float32 logits (1e-45 made them inf).
MIN_TEMPERATURE = 1e-4
MAX_TEMPERATURE = 1e4
#: |logit_bias| beyond this is a ban or a forced token in all but name (OpenAI's range).
MAX_BIAS = 100.0
#: Layers a /lens request may hold (the largest models have ~130).
MAX_LENS_LAYERS = 512
LOGIT_BYTES = 4  # float32
#: Logits the statistics of compare, score and shadow process at a time
#: (``service.plane.comparison``); a chunk's float64 and index temporaries are ~10x it.
CHUNK_BYTES = 4 * 2**20


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

    def run(self, nbytes: int, what: str) -> None:
        """Refuse (413) a request whose largest run would hold ``nbytes`` of logits (its
        declared cost, ``service.plane.costs``): every verb's runs stay within the setting."""
        if nbytes > self.max_logits_bytes:
            raise PayloadTooLarge(
                f"{what}: one run would hold {nbytes} bytes of logits; the limit is "
                f"LMHEAD_MAX_LOGITS_BYTES={self.max_logits_bytes} (send fewer rows or layers)"
            )

    def fits_logits(self, rows: int, vocab_size: int, copies: int = 1) -> bool:
        return rows * vocab_size * LOGIT_BYTES * copies <= self.max_logits_bytes

    def rows_per_run(self, vocab_size: int) -> int:
        """Rows of one onnxruntime run: its logits and log-softmax (2 x rows x vocab floats)
        stay within ``max_logits_bytes``; bigger requests run in chunks of this many rows."""
        return max(1, self.max_logits_bytes // (2 * vocab_size * LOGIT_BYTES))


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
