"""The decoding step's top and log-sum-exp from what the head's run already took, where the
processors change few tokens of a row: no second pass over the run's (rows x vocab) logits.

The head's graph hands the run's full logits with their raw top-``k'`` and log-sum-exp. A
step's processors change few tokens of most rows: the penalties touch a row's history, the
bias and bans their ids, and a grammar's bitmask either allows a few tokens (a structural
point of a JSON grammar: tens) or forbids a few (inside a string: the quotes and controls).
So each row is read one of three ways, and only the rows that fit none are processed whole:

- **allowed few** (the mask allows at most ``vocab / 16`` tokens, at least the prefix's
  width): the row's distribution is its allowed tokens' processed logits, gathered; its top
  and log-sum-exp are taken over them alone.
- **changed few** (no mask, or one forbidding at most ``vocab / 16``): the row is the raw row
  but on its changed tokens C (history, bias, bans, forbidden). Its top is the raw top outside
  C merged with C's new values (exact while the raw top-``k'`` holds ``width`` tokens outside
  C), and its log-sum-exp the raw one corrected: ``L + log(1 - sum_C e^(raw - L) +
  sum_C e^(new - L))`` in float64, kept only while C held at most half the raw mass (no
  cancellation worth a float32 ulp; past it, as where the model's favourite token is
  penalized, the processed row is summed, one pass over that row).
- **whole**: the mask applied densely and the row selected by ``selection`` (the graph's
  kernels), as every row was before.

The processors write into the run's array as ``Processors.apply`` does (bias, bans, stop ids
and penalties: sparse already); only the dense mask is deferred for the allowed-few rows,
whose whole rows nothing reads unless their draws reach past the prefix
(``Sparse.whole_row``). The answer is the dense path's: same values, same ids and tie order
(equal values in id order), log-sum-exp within float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from service.runtime import sparse_masks
from service.runtime.processed_at import processed, touched
from service.runtime.processors import Processors, apply_bitmask
from service.runtime.selection import selector
from service.runtime.sparse_masks import MaskPlan
from service.runtime.vocabulary import Bias, top_sorted

Floats = npt.NDArray[np.float32]
Ids = npt.NDArray[np.int64]
Rows = npt.NDArray[np.bool_]
#: The changed tokens' raw mass past which a row's log-sum-exp is taken whole.
MAX_REMOVED = 0.5
#: Runs of adjacent rows selected whole one at a time, past which all rows go at once.
MAX_BLOCKS = 8


@dataclass(frozen=True)
class RawTop:
    """What the head's run gave beside the full logits: the raw top ``k'`` (descending,
    equal values in id order) and log-sum-exp, per row."""

    values: Floats
    ids: Ids
    lse: Floats


@dataclass
class Sparse:
    """A run's selection (``values``, ``ids``, ``lse``: as ``selection`` gives them) and
    the rows whose mask is still to be written into the run's array (``whole_row``)."""

    values: Floats
    ids: Ids
    lse: Floats
    pending: dict[int, npt.NDArray[np.int32]]

    def whole_row(self, logits: Floats, row: int) -> None:
        """The row's mask written into the run's array (once), before its whole row is read."""
        words = self.pending.pop(row, None)
        if words is not None:
            apply_bitmask(logits[row : row + 1], words[None, :])


@dataclass(frozen=True)
class Changes:
    """The tokens a run's processors, bias and forbidding masks change: their flat indexes
    (ascending, once each), their raw and new values, and where each row's start."""

    at: Ids
    before: Floats
    after: Floats
    bounds: Ids

    def row_of(self) -> Ids:
        return np.repeat(np.arange(len(self.bounds) - 1, dtype=np.int64), np.diff(self.bounds))


def sparse_selection(
    logits: Floats,
    temperature: float,
    processors: Processors,
    bias: Bias | None,
    width: int,
    raw: RawTop,
) -> Sparse:
    """The processors applied to ``logits`` in place and each row's top ``width`` and
    log-sum-exp, reading each row the cheapest exact way (module docstring)."""
    rows, vocab = logits.shape
    width = min(width, vocab)
    counts = processors.bitmask_counts
    masks = sparse_masks.plan(processors.bitmask, rows, vocab, width, counts)
    changes = _changed(logits, temperature, processors, bias, masks)
    values = np.empty((rows, width), np.float32)
    ids = np.empty(values.shape, np.int64)
    lse = np.empty(rows, np.float32)
    done = np.zeros(rows, np.bool_)
    if masks.allowing.size:
        _read_allowed(logits, masks, values, ids, lse)
        done[masks.allowing] = True
    reading = ~done & ~masks.whole
    if reading.any():
        done |= _read_changed(logits, raw, changes, vocab, reading, values, ids, lse)
    bitmask = processors.bitmask
    pending = {}
    if bitmask is not None:
        pending = {row: bitmask[row if len(bitmask) > 1 else 0] for row in masks.allowing.tolist()}
    rest = np.flatnonzero(~done)
    if rest.size:
        if bitmask is not None:
            _mask_whole_rows(logits, bitmask, masks.whole)
        _select_whole(logits, rest, width, values, ids, lse)
    return Sparse(values, ids, lse, pending)


def _changed(
    logits: Floats,
    temperature: float,
    processors: Processors,
    bias: Bias | None,
    masks: MaskPlan,
) -> Changes:
    """The bias, the processors and the forbidding masks applied in place (each touched
    token read and written once), and the tokens they changed with their values before and
    after."""
    rows, vocab = logits.shape
    flat = logits.reshape(-1)
    touch = touched(processors, bias, rows, vocab, forbidden=masks.forbidden)
    at = touch.at
    before = flat[at]
    after = processed(processors, touch, before, temperature)
    flat[at] = after
    bounds = np.searchsorted(at, np.arange(rows + 1, dtype=np.int64) * vocab)
    return Changes(at, before, after, bounds)


def _read_allowed(logits: Floats, masks: MaskPlan, values: Floats, ids: Ids, lse: Floats) -> None:
    """The allowing rows' top and log-sum-exp over their allowed tokens alone, padded to the
    longest (-inf, and an id past the vocabulary so padding sorts last)."""
    allowing, allowed = masks.allowing, masks.allowed
    assert allowed is not None  # a plan with allowing rows has their tokens
    gathered = np.where(allowed.real, logits[allowing[:, None], allowed.tokens], -np.inf)
    gathered = gathered.astype(np.float32, copy=False)
    columns = np.where(allowed.real, allowed.tokens, logits.shape[1])
    values[allowing], ids[allowing] = top_sorted(gathered, columns, values.shape[1])
    # a row with nothing left (every allowed token banned) never gets here: the options
    # refuse it before any run (``plane.decoding_options.refuse_empty_rows``)
    peak = gathered.max(axis=1, keepdims=True).astype(np.float64)
    lse[allowing] = (peak[:, 0] + np.log(np.exp(gathered - peak).sum(axis=1))).astype(np.float32)


def _read_changed(
    logits: Floats,
    raw: RawTop,
    changes: Changes,
    vocab: int,
    reading: Rows,
    values: Floats,
    ids: Ids,
    lse: Floats,
) -> Rows:
    """The rows ``reading`` whose raw top holds ``width`` tokens outside their changes: the
    raw top outside the changes merged with the changed tokens' new values; the raw
    log-sum-exp corrected where the changes held at most half the mass, else the processed
    row summed (one pass over that row, not a selection). Returns those rows."""
    rows, width = values.shape
    row_of = changes.row_of()
    reference = raw.lse.astype(np.float64)
    shift = reference[row_of]
    with np.errstate(under="ignore"):
        removed = _row_sums(_exp(changes.before - shift), changes.bounds)
        added = _row_sums(_exp(changes.after - shift), changes.bounds)
    raw_at = np.arange(rows, dtype=np.int64)[:, None] * vocab + raw.ids
    outside = np.ones(raw_at.shape, np.bool_)
    if changes.at.size:
        position = np.minimum(np.searchsorted(changes.at, raw_at), changes.at.size - 1)
        outside = changes.at[position] != raw_at
    rank = np.cumsum(outside, axis=1)
    ok: Rows = reading & (rank[:, -1] >= width)
    if not ok.any():
        return ok
    # the width-th raw value outside the changes: a changed token below it cannot enter
    threshold = raw.values[np.arange(rows), np.argmax(rank >= width, axis=1)]
    entering = ok[row_of] & (changes.after >= threshold[row_of])
    keep_raw = outside & (rank <= width) & ok[:, None]
    cand_row = np.concatenate([np.nonzero(keep_raw)[0], row_of[entering]])
    cand_value = np.concatenate([raw.values[keep_raw], changes.after[entering]])
    cand_id = np.concatenate([raw.ids[keep_raw], changes.at[entering] - row_of[entering] * vocab])
    order = np.lexsort((cand_id, -cand_value, cand_row))
    chosen = np.flatnonzero(ok)
    picked = order[np.searchsorted(cand_row[order], chosen)[:, None] + np.arange(width)]
    values[chosen], ids[chosen] = cand_value[picked], cand_id[picked]
    corrected = ok & (removed <= MAX_REMOVED)
    at = np.flatnonzero(corrected)
    lse[at] = (reference[at] + np.log1p(added[at] - removed[at])).astype(np.float32)
    summed = np.flatnonzero(ok & ~corrected)
    if summed.size:  # the changes held most of the mass: the processed rows summed whole
        lse[summed] = whole_lse(logits[summed])
    return ok


def whole_lse(rows: Floats) -> Floats:
    """Log-sum-exp of whole processed rows (float32 terms, float64 sums)."""
    peak = rows.max(axis=1, keepdims=True)
    with np.errstate(under="ignore"):
        total = np.exp(rows - peak).sum(axis=1, dtype=np.float64)
    sums: Floats = (peak[:, 0] + np.log(total)).astype(np.float32)
    return sums


def _exp(exponents: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """e^x, with x below -700 taken as -700 (e^-700 ~ 1e-304, nothing beside a sum near 1):
    exp's slow path for underflow and -inf (masked tokens) took a tenth of the reading."""
    return np.exp(np.maximum(exponents, -700.0))


def _row_sums(terms: npt.NDArray[np.float64], bounds: Ids) -> npt.NDArray[np.float64]:
    """Each row's sum of its segment of ``terms`` (``bounds``: where each row starts), by
    ``reduceat`` over the rows that have a segment (an empty one would read its neighbour)."""
    sums = np.zeros(len(bounds) - 1)
    starts = bounds[:-1]
    holding = np.diff(bounds) > 0
    if holding.any():
        sums[holding] = np.add.reduceat(terms, starts[holding])
    return sums


def _mask_whole_rows(logits: Floats, bitmask: npt.NDArray[np.int32], whole: Rows) -> None:
    """The mask written into the rows read whole (all at once when every row is)."""
    if whole.all():
        apply_bitmask(logits, bitmask)
        return
    for row in np.flatnonzero(whole).tolist():
        apply_bitmask(logits[row : row + 1], bitmask[row if len(bitmask) > 1 else 0][None])


def _select_whole(
    logits: Floats, rest: Ids, width: int, values: Floats, ids: Ids, lse: Floats
) -> None:
    """The ``rest`` rows selected by ``selection`` over their whole rows, a run of adjacent
    rows at a time (a slice is a view: no copy of the logits beside the selection's own
    log-softmax, as the dense path holds); past a few such runs, every row at once."""
    breaks = np.flatnonzero(np.diff(rest) != 1) + 1
    blocks = np.split(rest, breaks)
    if len(blocks) > MAX_BLOCKS:
        blocks = [np.arange(len(logits))]
    for block in blocks:
        start, stop = int(block[0]), int(block[-1]) + 1
        top, picked, sums = selector().top(logits[start:stop], width)
        keep = np.isin(np.arange(start, stop), rest)
        values[start:stop][keep], ids[start:stop][keep] = top[keep], picked[keep]
        lse[start:stop][keep] = sums[keep]
