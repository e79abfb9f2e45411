"""Reference math for language-model heads, in plain numpy.

Every number the service returns is checked against these functions in the tests, so they
favour clarity and exactness over speed. They are the tests' oracle only: the service computes
with ``service.runtime.logmath`` and never imports this module (a serving path that shared
the oracle's code would pass the tests whatever that code got wrong); ``service`` re-exports
the two projections as the documented reference API. The numerics contract lives here:

* projection: ``logits = hidden_states @ matrix.T`` with ``matrix`` shaped (vocab_size, d_model);
* top-k: values sorted descending, ties broken toward the lower token id, k clamped to the vocab;
* log-softmax: ``logits - logsumexp(logits)``, computed stably (max subtracted) in float64.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.floating]
IntArray = npt.NDArray[np.int64]


def output_projection_tied(
    hidden_states: npt.ArrayLike, embedding_table: npt.NDArray[np.floating]
) -> FloatArray:
    """Project hidden states onto the vocabulary through the input embedding table itself.

    A tied model has one matrix for both roles, so this reads ``embedding_table`` directly: no
    copy and no cached transpose (``.T`` is a view). A change made to the table in place, as a
    training step would make, shows in the very next call.
    """
    hidden = _check_operands(hidden_states, embedding_table, "embedding_table")
    return hidden @ embedding_table.T


def output_projection_untied(
    hidden_states: npt.ArrayLike, output_weight: npt.NDArray[np.floating]
) -> FloatArray:
    """Project hidden states through an output matrix of its own (``lm_head``).

    The weight is independent of any input embedding table: the caller owns two matrices and
    changing one has no effect on the other.
    """
    hidden = _check_operands(hidden_states, output_weight, "output_weight")
    return hidden @ output_weight.T


def _check_operands(
    hidden_states: npt.ArrayLike, matrix: npt.NDArray[np.floating], matrix_name: str
) -> FloatArray:
    """Validate shapes and dtypes and say exactly what is wrong when they do not fit."""
    if not isinstance(matrix, np.ndarray):
        raise ValueError(f"{matrix_name} must be a numpy array, got {type(matrix).__name__}")
    if matrix.ndim != 2:
        raise ValueError(
            f"{matrix_name} must be 2-D (vocab_size, d_model), got shape {matrix.shape}"
        )
    if matrix.size == 0:
        raise ValueError(f"{matrix_name} is empty: shape {matrix.shape}")
    if not np.issubdtype(matrix.dtype, np.floating):
        raise ValueError(f"{matrix_name} must have a floating dtype, got {matrix.dtype}")
    hidden = np.asarray(hidden_states)
    if not np.issubdtype(hidden.dtype, np.floating):
        raise ValueError(f"hidden_states must have a floating dtype, got {hidden.dtype}")
    if hidden.ndim == 0 or hidden.size == 0:
        raise ValueError(f"hidden_states is empty: shape {hidden.shape}, expected (..., d_model)")
    if hidden.shape[-1] != matrix.shape[1]:
        raise ValueError(
            f"d_model mismatch: hidden_states has last dimension {hidden.shape[-1]} but "
            f"{matrix_name} has d_model {matrix.shape[1]} (shape {matrix.shape})"
        )
    return hidden


def top_k(logits: npt.ArrayLike, k: int) -> tuple[FloatArray, IntArray]:
    """Return the k largest logits per row and their token ids, along the last axis.

    Values are sorted descending; equal values keep the lower token id first (a stable sort
    of the negated values); k is clamped to the vocabulary size.
    """
    scores = np.asarray(logits)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    k = min(k, scores.shape[-1])
    order = np.argsort(-scores, axis=-1, kind="stable")[..., :k].astype(np.int64)
    return np.take_along_axis(scores, order, axis=-1), order


def logsumexp(logits: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """Stable log-sum-exp over the last axis, in float64."""
    scores = np.asarray(logits, dtype=np.float64)
    peak = scores.max(axis=-1, keepdims=True)
    total: npt.NDArray[np.float64] = np.log(np.exp(scores - peak).sum(axis=-1)) + peak[..., 0]
    return total


def log_softmax(logits: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """Log-probabilities over the last axis: ``logits - logsumexp(logits)``, in float64."""
    scores = np.asarray(logits, dtype=np.float64)
    return scores - logsumexp(scores)[..., None]
