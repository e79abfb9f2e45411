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
  cancellation worth a float32 ulp; past it the row is processed whole).
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

from service.runtime.processors import (
    Histories,
    Penalized,
    Processors,
    apply_bitmask,
    bad_word_hits,
)
from service.runtime.selection import selector
from service.runtime.vocabulary import Bias, top_sorted

Floats = npt.NDArray[np.float32]
Ids = npt.NDArray[np.int64]
#: A row is read sparsely while its mask allows (or forbids) at most vocab / SPARSE tokens.
SPARSE = 16
#: Runs of adjacent rows selected whole one at a time, past which all rows go at once.
MAX_BLOCKS = 8
#: The changed tokens' raw mass past which a row's log-sum-exp is taken whole.
MAX_REMOVED = 0.5


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
    flat = logits.reshape(-1)
    allowed_few, forbidden, whole = _mask_rows(processors.bitmask, rows, vocab, width)
    penalized = processors.penalized(vocab)
    changed = _touched(processors, penalized, bias, forbidden, rows, vocab)
    before = flat[changed]
    if bias is not None:  # the bias is divided by the temperature already (``Bias.at``)
        logits[:, bias.ids] += bias.values
    processors.apply(logits, temperature, penalized, mask=False)
    if forbidden is not None:
        flat[forbidden] = -np.inf
    after = flat[changed]
    values = np.empty((rows, min(width, vocab)), np.float32)
    ids = np.empty(values.shape, np.int64)
    lse = np.empty(rows, np.float32)
    done = np.zeros(rows, np.bool_)
    if allowed_few:
        done |= _read_allowed(logits, allowed_few, width, values, ids, lse)
    delta = ~done & ~whole
    if delta.any():
        done |= _read_changed(raw, changed, before, after, vocab, delta, values, ids, lse)
    pending = {} if processors.bitmask is None else _pending(processors.bitmask, allowed_few)
    rest = np.flatnonzero(~done)
    if rest.size:
        if processors.bitmask is not None:
            _mask_whole_rows(logits, processors.bitmask, whole)
        _select_whole(logits, rest, width, values, ids, lse)
    return Sparse(values, ids, lse, pending)


def _mask_whole_rows(
    logits: Floats, bitmask: npt.NDArray[np.int32], whole: npt.NDArray[np.bool_]
) -> None:
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


def _mask_rows(
    bitmask: npt.NDArray[np.int32] | None, rows: int, vocab: int, width: int
) -> tuple[dict[int, Ids], Ids | None, npt.NDArray[np.bool_]]:
    """Each row's reading: its allowed ids where it allows few (at least ``width``), the
    forbidden tokens' flat indexes of the rows that forbid few, and the rows read whole."""
    whole = np.zeros(rows, np.bool_)
    if bitmask is None:
        return {}, None, whole
    counts = _allowed_counts(bitmask, vocab)
    counts = np.broadcast_to(counts, (rows,)) if len(bitmask) == 1 else counts
    few = vocab // SPARSE
    allowing = np.flatnonzero((counts <= few) & (counts >= width))
    forbidding = np.flatnonzero(vocab - counts <= few)
    whole[:] = True
    whole[allowing] = whole[forbidding] = False
    if len(bitmask) == 1:
        tokens = _set_bits(bitmask, vocab)[1]
        allowed_few = dict.fromkeys(allowing.tolist(), tokens)
        gone = _set_bits(np.invert(bitmask), vocab)[1]
        forbidden = (forbidding[:, None] * vocab + gone).reshape(-1)
        return allowed_few, forbidden, whole
    at, tokens = _set_bits(bitmask[allowing], vocab)
    bounds = np.searchsorted(at, np.arange(len(allowing) + 1))
    allowed_few = {
        row: tokens[bounds[index] : bounds[index + 1]]
        for index, row in enumerate(allowing.tolist())
    }
    at, gone = _set_bits(np.invert(bitmask[forbidding]), vocab)
    return allowed_few, forbidding[at] * vocab + gone, whole


def _allowed_counts(words: npt.NDArray[np.int32], vocab: int) -> Ids:
    """Tokens each mask row allows: its words' set bits below ``vocab`` (a popcount of the
    words, ~0.04 ms for 64 rows of 1,000; unpacking them to bytes to count took ~0.7 ms)."""
    unsigned = np.ascontiguousarray(words).view(np.uint32)
    tail = vocab % 32
    if tail:  # a writer may leave bits set past the vocabulary in the last word
        unsigned = unsigned.copy()
        unsigned[:, -1] &= np.uint32((1 << tail) - 1)
    counts: Ids = _popcount(unsigned).sum(axis=1, dtype=np.int64)
    return counts


def _popcount(words: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint8]:
    if hasattr(np, "bitwise_count"):  # numpy >= 2.0
        counted: npt.NDArray[np.uint8] = np.bitwise_count(words)
        return counted
    octets = _BYTE_BITS[words.view(np.uint8)].reshape(*words.shape, 4)
    summed: npt.NDArray[np.uint8] = octets.sum(axis=-1, dtype=np.uint8)
    return summed


_BYTE_BITS = np.array([bin(value).count("1") for value in range(256)], np.uint8)


def _set_bits(words: npt.NDArray[np.int32], vocab: int) -> tuple[Ids, Ids]:
    """(row, token) of each set bit below ``vocab`` of (rows, width) mask words, in row then
    token order: only the words holding a set bit are unpacked (a row that allows or
    forbids few has few)."""
    width = words.shape[1]
    found = np.flatnonzero(words)  # flat: ~2x faster than np.nonzero's pairs
    octets = np.ascontiguousarray(words.reshape(-1)[found], dtype="<i4").view(np.uint8)
    bit_of = np.unpackbits(octets.reshape(-1, 4), axis=1, bitorder="little")
    flat_bits = np.flatnonzero(bit_of.view(np.bool_))  # as booleans: ~15x faster than uint8
    word_at = found[flat_bits >> 5]
    tokens = (word_at % width) * 32 + (flat_bits & 31)
    inside = tokens < vocab
    return (word_at // width)[inside], tokens[inside]


def _touched(
    processors: Processors,
    penalized: Penalized | None,
    bias: Bias | None,
    forbidden: Ids | None,
    rows: int,
    vocab: int,
) -> Ids:
    """The flat indexes of every token the bias, a processor or the mask may change (sorted,
    once): the penalties' own sorted indexes as they are when nothing else changes."""
    every = np.arange(rows, dtype=np.int64)
    own: list[Ids] = []  # the penalties' indexes: sorted and distinct already
    if penalized is not None:
        own = [part for part in (penalized.seen, penalized.outputs) if part is not None][:1]
    parts: list[Ids] = []
    if bias is not None:
        parts.append((every[:, None] * vocab + bias.ids).reshape(-1))
    output = processors.output
    if processors.bad_words is not None:
        history = output if output is not None else Histories.of([[]] * rows)
        parts += [hit * vocab + last for hit, last in bad_word_hits(history, processors.bad_words)]
    if processors.min_tokens and processors.stop_ids is not None:
        lengths = np.zeros(rows, np.int64) if output is None else output.lengths
        short = np.flatnonzero(lengths < processors.min_tokens)
        parts.append((short[:, None] * vocab + processors.stop_ids).reshape(-1))
    if forbidden is not None:
        parts.append(forbidden)
    if not parts:
        return own[0] if own else np.zeros(0, np.int64)
    return _distinct(np.concatenate(own + parts))


def _distinct(indexes: Ids) -> Ids:
    """Sorted distinct values by one sort (``np.unique``'s hash path took ~2.8 ms for the
    bench's 45,000 indexes in numpy 2.4; a sort and a comparison ~0.3 ms)."""
    ordered = np.sort(indexes.astype(np.int64, copy=False))
    if ordered.size < 2:
        return ordered
    distinct: Ids = ordered[np.concatenate([[True], ordered[1:] != ordered[:-1]])]
    return distinct


def _read_allowed(
    logits: Floats,
    allowed_few: dict[int, Ids],
    width: int,
    values: Floats,
    ids: Ids,
    lse: Floats,
) -> npt.NDArray[np.bool_]:
    """The allowed-few rows' top and log-sum-exp over their allowed tokens alone."""
    done = np.zeros(len(logits), np.bool_)
    longest = max(len(tokens) for tokens in allowed_few.values())
    order = list(allowed_few)
    gathered = np.full((len(order), longest), -np.inf, np.float32)
    columns = np.full((len(order), longest), len(logits[0]), np.int64)  # padding sorts last
    for at, row in enumerate(order):
        tokens = allowed_few[row]
        gathered[at, : len(tokens)] = logits[row, tokens]
        columns[at, : len(tokens)] = tokens
    top, picked = top_sorted(gathered, columns, width)
    # a row with nothing left (every allowed token banned) never gets here: the options
    # refuse it before any run (``plane.decoding_options.refuse_empty_rows``)
    peak = gathered.max(axis=1, keepdims=True).astype(np.float64)
    total = np.exp(gathered - peak).sum(axis=1)
    chosen = np.array(order, np.int64)
    values[chosen], ids[chosen] = top, picked
    lse[chosen] = (peak[:, 0] + np.log(total)).astype(np.float32)
    done[chosen] = True
    return done


def _read_changed(
    raw: RawTop,
    changed: Ids,
    before: Floats,
    after: Floats,
    vocab: int,
    rows: npt.NDArray[np.bool_],
    values: Floats,
    ids: Ids,
    lse: Floats,
) -> npt.NDArray[np.bool_]:
    """The changed-few rows (``rows``): the raw top outside C merged with C's new values,
    the raw log-sum-exp corrected; a row whose raw top holds too few tokens outside C, or
    whose C held over half its mass, is left to be read whole."""
    width = values.shape[1]
    count = len(rows)
    changed_row = changed // vocab
    taken = rows[changed_row]
    changed, changed_row = changed[taken], changed_row[taken]
    before, after = before[taken], after[taken]
    raw_flat = np.arange(count, dtype=np.int64)[:, None] * vocab + raw.ids
    position = np.minimum(np.searchsorted(changed, raw_flat), max(len(changed) - 1, 0))
    in_changed = changed[position] == raw_flat if len(changed) else np.zeros_like(raw_flat, bool)
    outside = ~in_changed
    enough = outside.sum(axis=1) >= width
    # the width-th raw value outside C: a changed token below it cannot enter the top
    rank = np.cumsum(outside, axis=1)
    at_width = np.argmax(rank >= width, axis=1)
    threshold = np.take_along_axis(raw.values, at_width[:, None], axis=1)[:, 0]
    reference = raw.lse.astype(np.float64)
    shift = reference[changed_row]
    removed = np.bincount(changed_row, np.exp(before - shift), minlength=count)
    with np.errstate(under="ignore"):
        added = np.bincount(changed_row, np.exp(after.astype(np.float64) - shift), minlength=count)
    ok: npt.NDArray[np.bool_] = rows & enough & (removed <= MAX_REMOVED)
    entering = ok[changed_row] & (after >= threshold[changed_row])
    keep_raw = outside & (rank <= width) & ok[:, None]
    cand_row = np.concatenate([np.nonzero(keep_raw)[0], changed_row[entering]])
    cand_value = np.concatenate([raw.values[keep_raw], after[entering]])
    cand_id = np.concatenate([raw.ids[keep_raw], changed[entering] - changed_row[entering] * vocab])
    order = np.lexsort((cand_id, -cand_value, cand_row))
    starts = np.searchsorted(cand_row[order], np.flatnonzero(ok))
    picked = order[starts[:, None] + np.arange(width)]
    chosen = np.flatnonzero(ok)
    values[chosen], ids[chosen] = cand_value[picked], cand_id[picked]
    lse[chosen] = (reference[chosen] + np.log1p(added[chosen] - removed[chosen])).astype(np.float32)
    return ok


def _pending(
    bitmask: npt.NDArray[np.int32], allowed_few: dict[int, Ids]
) -> dict[int, npt.NDArray[np.int32]]:
    return {row: bitmask[row if len(bitmask) > 1 else 0] for row in allowed_few}
