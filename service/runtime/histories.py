"""Token lists per row (a decoding step's prompt and output histories, bad words) as one
array of values and offsets: what the processors read (``processors``, ``processed_at``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Ids = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Histories:
    """Token lists, one per row (or one per bad word), as one array of values and the offsets
    where each list starts: list i is ``values[offsets[i]:offsets[i + 1]]``. Values are the
    head's columns; a token a trimmed head lacks is ``-(1 + id)`` (``outside``): no column
    to penalize or ban, but still itself where a bad word's prefix is compared."""

    values: Ids
    offsets: Ids

    @classmethod
    def of(cls, lists: list[list[int]]) -> Histories:
        """From Python lists (tests, small inputs)."""
        lengths = np.array([len(tokens) for tokens in lists], np.int64)
        values = np.array([token for tokens in lists for token in tokens], np.int64)
        return cls(values, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))

    @property
    def lengths(self) -> Ids:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def part(self, start: int, stop: int) -> Histories:
        """Lists ``start`` to ``stop`` (a run's rows), offsets from 0."""
        offsets = self.offsets[start : stop + 1]
        return Histories(self.values[offsets[0] : offsets[-1]], offsets - offsets[0])

    def take(self, rows: Ids) -> Histories:
        """The lists of ``rows`` (any of them, in that order), offsets from 0."""
        lengths = self.lengths[rows]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        starts = np.repeat(self.offsets[:-1][rows] - offsets[:-1], lengths)
        return Histories(self.values[starts + np.arange(offsets[-1])], offsets)

    def row_of_each(self) -> Ids:
        """The list each value belongs to."""
        return np.repeat(np.arange(len(self), dtype=np.int64), self.lengths)


def outside(ids: Ids) -> Ids:
    """How a history names tokens a trimmed head lacks (``Histories``)."""
    return -1 - ids
