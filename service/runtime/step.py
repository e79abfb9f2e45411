"""One run of a decoding step: a run's full logits processed in place, their top and
log-sum-exp, the filters and the draws (``service.plane.decoding`` runs it per run of rows,
in the inference executor).

The run's logits (rows x vocab float32, divided by the temperature by the graph) are the one
large array: the bias and every processor write into it (``Processors.apply``), ``selection``
reads it for the top ``width`` and the log-sum-exp, and a row whose filters or draws reach
past that prefix (``filters``) is sorted whole from it. Nothing here copies it, and nothing
turns it into float64: the float64 arrays are (rows x width) at most.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from service.runtime.filters import drawn, filtered_prefix
from service.runtime.processors import Processors
from service.runtime.selection import selector
from service.runtime.sparse_step import RawTop, Sparse, sparse_selection, whole_lse
from service.runtime.vocabulary import Bias, SampleSpec, refuse_overflow, top_sorted

Floats = npt.NDArray[np.float32]
Ids = npt.NDArray[np.int64]
#: Tokens of the wider prefix a row whose filters or draws reach past its first one is
#: ranked to (a partition of the row, then a sort of these: ~0.3 ms at 32000 tokens, where a
#: sort of the whole row takes ~1.5 ms); past it too, the whole row is sorted.
WIDER = 1024
#: Logits of a run selected by numpy rather than the selection graph (a compact step's
#: rows, tens of tokens each): the graph's run, its threads woken, took ~0.2 ms for 32 x 65
#: in the service, numpy's sort ~0.03 ms.
SMALL_SELECTION = 1 << 14


@functools.cache
def columns(vocab: int) -> Ids:
    """The ids of a row's columns (read-only, shared)."""
    ids = np.arange(vocab, dtype=np.int64)
    ids.setflags(write=False)
    return ids


@dataclass(frozen=True)
class StepRun:
    """A run's answer: the processed distribution's top ``width`` per row (``values`` and
    ``ids``, before the filters) and its log-sum-exp; which of them the filters keep and the
    kept set's log-sum-exp (``kept_lse``: the distribution draws come from); the draws
    (rows, n) and their values, when sampling."""

    values: Floats
    ids: Ids
    lse: Floats
    keep: npt.NDArray[np.bool_]
    kept_lse: Floats
    sampled: Ids | None = None
    sampled_values: Floats | None = None


def step_run(
    logits: Floats,
    temperature: float,
    processors: Processors,
    bias: Bias | None,
    sample: SampleSpec | None,
    width: int,
    u: npt.NDArray[np.float64] | None,
    raw: RawTop | None = None,
) -> StepRun:
    """The step over one run's ``logits`` (modified in place: afterwards they are the
    processed logits, before the filters, but for the masks ``Sparse.pending`` holds);
    ``u`` the run's rows' uniforms (rows, n); ``raw`` the run's own top and log-sum-exp,
    which let rows with few changed tokens skip a second pass (``sparse_step``)."""
    sparse: Sparse | None = None
    if raw is not None:
        sparse = sparse_selection(logits, temperature, processors, bias, width, raw)
        values, ids, lse = sparse.values, sparse.ids, sparse.lse
    else:
        processors.apply(logits, temperature, bias)  # the bias: divided by T (``Bias.at``)
        if logits.size <= SMALL_SELECTION:
            values, ids = top_sorted(logits, columns(logits.shape[1]), width)
            lse = whole_lse(logits)
        else:
            values, ids, lse = selector().top(logits, width)
    refuse_overflow(lse, lse, temperature=temperature)
    vocab = logits.shape[1]
    kept = filtered_prefix(values, lse, sample, processors.order, vocab)
    sampled = picked = None
    redo = ~kept.known if kept.filtered else np.zeros(len(values), np.bool_)
    if sample is not None and u is not None:
        index, inside = drawn(kept, sample, u)
        sampled = np.take_along_axis(ids, index, axis=1)
        picked = np.take_along_axis(values, index, axis=1)
        redo |= ~inside
    keep, mass = kept.keep, kept.mass
    for row in np.flatnonzero(redo).tolist():  # a wider prefix of the row, then all of it
        if sparse is not None:
            sparse.whole_row(logits, row)
        for wider in (min(vocab, max(WIDER, 16 * values.shape[1])), vocab):
            ranked, order = top_sorted(logits[row : row + 1], columns(vocab), wider)
            whole = filtered_prefix(ranked, lse[row : row + 1], sample, processors.order, vocab)
            index, inside = np.zeros((1, 1), np.intp), whole.known
            if sample is not None and u is not None:
                index, inside = drawn(whole, sample, u[row : row + 1])
            if inside[0] or wider == vocab:
                break
        keep[row], mass[row] = whole.keep[0, : values.shape[1]], whole.mass[0]
        if sampled is not None and picked is not None:
            sampled[row], picked[row] = order[0, index[0]], ranked[0, index[0]]
    with np.errstate(divide="ignore"):
        kept_lse = (lse + np.log(mass)).astype(np.float32)
    return StepRun(values, ids, lse, keep, kept_lse, sampled, picked)
