"""The decoding step's sparse processors (bias, bans, penalties) on the few tokens they touch:
one implementation for every path, dense or not.

A run's processors change few tokens of each row: the bias its ids, the bad words and stop
ids their bans, the penalties each row's history. ``touched`` lists them as indexes of the
run's flattened logits (row * vocab + token: ascending, once each), and ``processed`` gives
their values after the bias and every processor from their raw values, in the documented
order (``docs/decoding.md``: bias, bans, repetition, then frequency and presence; the graph
divided the logits by T, so the bias and the additive penalties are divided by T too).

Callers read and write the run's array once each: ``Processors.apply`` (a run's full
logits), ``sparse_step`` (the same, and the changed tokens' values before and after) and
``compact_step`` (rows whose logits were taken for their allowed tokens only: there ``at``
names just those). The values are float32 throughout, the same operations in the same order
whichever path: the paths agree bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from service.runtime.histories import Histories

Floats = npt.NDArray[np.float32]
Ids = npt.NDArray[np.int64]
Flags = npt.NDArray[np.bool_]


class Processors(Protocol):
    """What the sparse processors read of a step's options (``processors.Processors``)."""

    @property
    def prompt(self) -> Histories | None: ...
    @property
    def output(self) -> Histories | None: ...
    @property
    def repetition(self) -> float: ...
    @property
    def presence(self) -> float: ...
    @property
    def frequency(self) -> float: ...
    @property
    def min_tokens(self) -> int: ...
    @property
    def stop_ids(self) -> Ids | None: ...
    @property
    def bad_words(self) -> Histories | None: ...
    @property
    def penalizes(self) -> bool: ...


class BiasLike(Protocol):
    """An additive bias per token (``vocabulary.Bias``): sorted ids, their values."""

    @property
    def ids(self) -> Ids: ...
    @property
    def values(self) -> Floats: ...


#: What put an index among a run's touched tokens (its low bits in the one sort).
LISTED, BIAS, BANNED, PROMPT, OUTPUT, FORBIDDEN = range(6)
TAG_BITS = 3


@dataclass(frozen=True)
class Touched:
    """The tokens of a run the bias, the processors and a forbidding mask touch: flat
    indexes ``at`` (ascending, once each) and, for each, what falls on it: its ``bias``
    (0 where none), whether it is ``banned``, ``seen`` (repetition), its ``count`` in the
    row's output (frequency and presence), whether a mask ``forbids`` it, and whether the
    caller ``listed`` it (the tokens it holds values for)."""

    at: Ids
    bias: Floats
    banned: Flags
    seen: Flags
    count: Ids
    forbids: Flags
    listed: Flags

    def where(self, chosen: Flags) -> Touched:
        """These tokens' entries alone (taken by index: boolean indexing of each of seven
        arrays took ~0.2 ms for 34,000 tokens)."""
        at = np.flatnonzero(chosen)
        return Touched(*(getattr(self, name)[at] for name in _FIELDS))


_FIELDS = ("at", "bias", "banned", "seen", "count", "forbids", "listed")


def touched(
    processors: Processors,
    bias: BiasLike | None,
    rows: int,
    vocab: int,
    *,
    forbidden: Ids | None = None,
    listed: Ids | None = None,
) -> Touched:
    """Every token of a run of ``rows`` the bias, a processor or ``forbidden`` (flat
    indexes a mask forbids) touches: one sort of them all, each tagged by what put it there
    (no lookup of one set in another). With ``listed`` (ascending flat indexes): those
    tokens alone, touched or not (the histories' other tokens are dropped before the sort:
    a row's few allowed tokens against its hundreds of history tokens)."""
    every = np.arange(rows, dtype=np.int64)
    parts: list[tuple[Ids, int]] = [(np.zeros(0, np.int64), LISTED)]
    wanted = None
    if listed is not None:
        parts.append((listed, LISTED))
        wanted = np.zeros(vocab, np.bool_)
        wanted[listed % vocab] = True
    if bias is not None:
        parts.append(((every[:, None] * vocab + bias.ids).reshape(-1), BIAS))
    parts.append((banned(processors, rows, vocab), BANNED))
    if processors.repetition != 1.0 and processors.prompt is not None:
        parts.append((flat_indexes(processors.prompt, vocab, wanted), PROMPT))
    if processors.penalizes and processors.output is not None:
        parts.append((flat_indexes(processors.output, vocab, wanted), OUTPUT))
    if forbidden is not None:
        parts.append((forbidden, FORBIDDEN))
    keys = np.sort(np.concatenate([(part << TAG_BITS) | tag for part, tag in parts]))
    flat = keys >> TAG_BITS
    first = np.empty(len(keys), np.bool_)
    first[:1] = True
    np.not_equal(flat[1:], flat[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    at = flat[starts]
    # each index's tags as bits of a byte (one OR per index), its output count (one sum)
    tag_bits = np.left_shift(np.uint8(1), (keys & ((1 << TAG_BITS) - 1)).astype(np.uint8))
    bits = np.bitwise_or.reduceat(tag_bits, starts) if len(keys) else tag_bits
    output_tag = tag_bits == np.uint8(1 << OUTPUT)
    outputs = np.add.reduceat(output_tag, starts, dtype=np.int64) if len(keys) else flat

    def has(tag: int) -> Flags:
        flags: Flags = (bits & np.uint8(1 << tag)) != 0
        return flags

    values = np.zeros(len(at), np.float32)
    if bias is not None:
        biased = np.flatnonzero(has(BIAS))
        values[biased] = bias.values[np.searchsorted(bias.ids, at[biased] % vocab)]
    seen = (has(PROMPT) | (outputs > 0)) & (processors.repetition != 1.0)
    touch = Touched(at, values, has(BANNED), seen, outputs, has(FORBIDDEN), has(LISTED))
    return touch if listed is None else touch.where(touch.listed)


def processed(processors: Processors, touch: Touched, values: Floats, temperature: float) -> Floats:
    """The values the bias, ``processors`` and the forbidding mask leave on ``touch``'s
    tokens, from their raw ``values``, in the documented order."""
    out = np.array(values, np.float32)
    out += touch.bias  # divided by the temperature already (``Bias.at``); 0 elsewhere
    # no np.where on a sign (a branch per token, mispredicted half the time: ~6 ns each),
    # no boolean indexing (~0.5 ns a token, each time): index lists, min and max
    out[np.flatnonzero(touch.banned)] = -np.inf
    if processors.repetition != 1.0:
        seen = np.flatnonzero(touch.seen)
        chosen = out[seen]
        factor = np.float32(processors.repetition)
        # a positive logit divided by the factor, a negative one multiplied: for a factor
        # above 1 the smaller of the two, below 1 the larger (the same float32 values)
        pick = np.minimum if factor > 1 else np.maximum
        out[seen] = pick(chosen / factor, chosen * factor)
    if processors.presence or processors.frequency:
        found = np.flatnonzero(touch.count > 0)  # of booleans: ints branch on each
        penalty = (processors.frequency * touch.count[found] + processors.presence) / temperature
        out[found] -= penalty.astype(np.float32)
    out[np.flatnonzero(touch.forbids)] = -np.inf
    return out


def banned(processors: Processors, rows: int, vocab: int) -> Ids:
    """The flat indexes the bad words and ``min_tokens``' stop ids ban (-inf): ascending,
    once each."""
    parts: list[Ids] = [np.zeros(0, np.int64)]
    output = processors.output
    if processors.bad_words is not None:
        history = output if output is not None else Histories.of([[]] * rows)
        parts += [hit * vocab + last for hit, last in bad_word_hits(history, processors.bad_words)]
    if processors.min_tokens and processors.stop_ids is not None:
        lengths = np.zeros(rows, np.int64) if output is None else output.lengths
        short = np.flatnonzero(lengths < processors.min_tokens)
        parts.append((short[:, None] * vocab + processors.stop_ids).reshape(-1))
    return distinct(np.concatenate(parts))


def bad_word_hits(output: Histories, words: Histories) -> list[tuple[Ids, int]]:
    """(the rows, the column) each word bans: the rows whose output ends with the word's
    other tokens (every row for a one-token word); per word, every row's tail compared with
    its prefix at once. A word whose last token the head lacks bans nothing."""
    lengths, ends = output.lengths, output.offsets[1:]
    every = np.arange(len(output), dtype=np.int64)
    hits = []
    for word in range(len(words)):
        tokens = words.values[words.offsets[word] : words.offsets[word + 1]]
        last, prefix = int(tokens[-1]), tokens[:-1]
        if last < 0:  # a token this head cannot produce: nothing to ban
            continue
        if not len(prefix):
            hits.append((every, last))
            continue
        long_enough = np.flatnonzero(lengths >= len(prefix))
        at = ends[long_enough, None] - len(prefix) + np.arange(len(prefix))
        matches = (output.values[at] == prefix).all(axis=1)
        hits.append((long_enough[matches], last))
    return hits


def flat_indexes(histories: Histories, vocab: int, wanted: Flags | None = None) -> Ids:
    """Each history token's index in the run's flattened logits (tokens a trimmed head lacks,
    negative, left out; with ``wanted``, a flag per column, only those columns)."""
    values, rows = histories.values, histories.row_of_each()
    if values.size and values.min() < 0:
        inside = np.flatnonzero(values >= 0)
        values, rows = values[inside], rows[inside]
    if wanted is not None:
        hit = np.flatnonzero(wanted[values])
        values, rows = values[hit], rows[hit]
    flat: Ids = rows * vocab + values
    return flat


def counted(flat: Ids) -> tuple[Ids, Ids]:
    """The distinct indexes, ascending, and how often each occurs: one sort (``np.unique``
    took ~7 ms for 32,768 indexes in numpy 2.4, its hash path; a sort and a comparison
    ~0.15 ms)."""
    ordered = np.sort(flat)
    if not ordered.size:
        return ordered, np.zeros(0, np.int64)
    starts = np.flatnonzero(np.concatenate([[True], ordered[1:] != ordered[:-1]]))
    return ordered[starts], np.diff(np.append(starts, len(ordered)))


def distinct(indexes: Ids) -> Ids:
    """Sorted distinct values, by one sort."""
    return counted(indexes.astype(np.int64, copy=False))[0]
