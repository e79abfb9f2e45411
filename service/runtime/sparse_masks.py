"""How the decoding step's sparse reading (``sparse_step``) reads each row of a run under a
grammar's token bitmask: from the mask's words alone, never unpacked to a byte per token.

A JSON grammar's masks are of two kinds: at a structural point they allow a few tokens (tens),
inside a string they forbid a few (quotes, controls). Each row is counted (a popcount of its
words) and read as one of: **allowing** few (at most ``vocab / SPARSE`` and at least the
prefix's width: the row is its allowed tokens), **forbidding** few (the row is the raw row
with those tokens at -inf), or **whole** (the mask written densely and the row selected as
every row once was). Only words holding a set bit are unpacked, so a row costs what it allows
or forbids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

Ids = npt.NDArray[np.int64]
Words = npt.NDArray[np.int32]
#: A row is read sparsely while its mask allows (or forbids) at most vocab / SPARSE tokens.
SPARSE = 16
_BYTE_BITS = np.array([bin(value).count("1") for value in range(256)], np.uint8)


@dataclass(frozen=True)
class Allowed:
    """Rows' allowed tokens, each row's ascending, padded to the longest row with that row's
    first token (``tokens``: a valid id to compute with, never answered); ``real`` marks each
    row's own."""

    tokens: Ids
    real: npt.NDArray[np.bool_]

    @classmethod
    def of_mask(cls, bitmask: Words, rows: Ids, vocab: int) -> Allowed:
        """The tokens ``rows`` of a request allow under ``bitmask`` (one mask for every row,
        or one per row); each of them allows at least one."""
        if len(bitmask) == 1:  # one mask: its tokens once, repeated for each row
            tokens = set_bits(bitmask, vocab)[1]
            return cls.of(
                np.repeat(np.arange(len(rows)), len(tokens)), np.tile(tokens, len(rows)), len(rows)
            )
        row, tokens = set_bits(bitmask[rows], vocab)
        return cls.of(row, tokens, len(rows))

    @classmethod
    def of(cls, row: Ids, tokens: Ids, rows: int) -> Allowed:
        """From (row, token) pairs in row then token order (``set_bits``); every one of the
        ``rows`` allows at least one token."""
        counts = np.bincount(row, minlength=rows)
        column = np.arange(len(tokens)) - (np.cumsum(counts) - counts)[row]
        real = np.zeros((rows, int(counts.max())), np.bool_)
        real[row, column] = True
        padded = np.repeat(tokens[np.cumsum(counts) - counts][:, None], real.shape[1], axis=1)
        padded[row, column] = tokens
        return cls(padded, real)


@dataclass(frozen=True)
class MaskPlan:
    """Each row's reading: ``allowing`` the rows that allow few and ``allowed`` their tokens;
    ``forbidden`` the flat indexes (row * vocab + token) the rows forbidding few forbid,
    ascending; and ``whole`` the rows read whole."""

    allowing: Ids
    allowed: Allowed | None
    forbidden: Ids
    whole: npt.NDArray[np.bool_]

    @classmethod
    def unmasked(cls, rows: int) -> MaskPlan:
        empty = np.zeros(0, np.int64)
        return cls(empty, None, empty, np.zeros(rows, np.bool_))


def plan(
    bitmask: Words | None, rows: int, vocab: int, width: int, counts: Ids | None = None
) -> MaskPlan:
    """The reading of each of a run's ``rows`` under ``bitmask`` (one row for all, or one
    per row), for a prefix of ``width`` tokens; ``counts``: its rows' allowed tokens, when
    known (``Processors.bitmask_counts``)."""
    if bitmask is None:
        return MaskPlan.unmasked(rows)
    counts = allowed_counts(bitmask, vocab) if counts is None else counts
    counts = np.broadcast_to(counts, (rows,)) if len(bitmask) == 1 else counts
    few = vocab // SPARSE
    allowing = np.flatnonzero((counts <= few) & (counts >= width))
    forbidding = np.flatnonzero(vocab - counts <= few)
    whole = np.ones(rows, np.bool_)
    whole[allowing] = whole[forbidding] = False
    allowed = Allowed.of_mask(bitmask, allowing, vocab) if allowing.size else None
    if len(bitmask) == 1:  # one mask: the tokens it forbids, for each forbidding row
        gone = set_bits(np.invert(bitmask), vocab)[1]
        forbidden = (forbidding[:, None] * vocab + gone).reshape(-1)
        return MaskPlan(allowing, allowed, forbidden, whole)
    at, gone = set_bits(np.invert(bitmask[forbidding]), vocab)
    return MaskPlan(allowing, allowed, forbidding[at] * vocab + gone, whole)


def allowed_counts(words: Words, vocab: int) -> Ids:
    """Tokens each mask row allows: its words' set bits below ``vocab`` (a popcount of the
    words, ~0.04 ms for 64 rows of 1,000; unpacking them to bytes to count took ~0.7 ms)."""
    unsigned = np.ascontiguousarray(words).view(np.uint32)
    tail = vocab % 32
    if tail:  # a writer may leave bits set past the vocabulary in the last word
        unsigned = unsigned.copy()
        unsigned[:, -1] &= np.uint32((1 << tail) - 1)
    if unsigned.shape[-1] % 2 == 0 and hasattr(np, "bitwise_count"):  # two words at a time
        unsigned = unsigned.view(np.uint64)  # (~20 us for 64 rows of 1,000, not ~37)
    counts: Ids = _popcount(unsigned).sum(axis=1, dtype=np.int64)
    return counts


def set_bits(words: Words, vocab: int) -> tuple[Ids, Ids]:
    """(row, token) of each set bit below ``vocab`` of (rows, width) mask words, in row then
    token order: only the bytes holding a set bit are unpacked (a sparse row's words mostly
    hold one bit: unpacking their four bytes each took ~2x longer, for 6,400 words)."""
    width = words.shape[1]
    # flat (~2x faster than np.nonzero's pairs), of booleans (numpy's nonzero of ints
    # branches on each: ~2.6 ns a word where 1 in 5 is set, against ~0.2 for booleans)
    found = np.flatnonzero(words.reshape(-1) != 0)
    octets = np.ascontiguousarray(words.reshape(-1)[found], dtype="<i4").view(np.uint8)
    live = np.flatnonzero(octets != 0)
    bit_of = np.unpackbits(octets[live][:, None], axis=1, bitorder="little")
    flat_bits = np.flatnonzero(bit_of.view(np.bool_))  # as booleans: ~15x faster than uint8
    byte_at = live[flat_bits >> 3]
    word_at = found[byte_at >> 2]
    tokens = (word_at % width) * 32 + (byte_at & 3) * 8 + (flat_bits & 7)
    inside = tokens < vocab
    return (word_at // width)[inside], tokens[inside]


def _popcount(words: npt.NDArray[np.unsignedinteger[Any]]) -> npt.NDArray[np.uint8]:
    if hasattr(np, "bitwise_count"):  # numpy >= 2.0
        counted: npt.NDArray[np.uint8] = np.bitwise_count(words)
        return counted
    octets = _BYTE_BITS[words.view(np.uint8)].reshape(*words.shape, 4)
    summed: npt.NDArray[np.uint8] = octets.sum(axis=-1, dtype=np.uint8)
    return summed
