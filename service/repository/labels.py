"""Token strings of returned ids, looked up where they are encoded, not where they are found.

A head's labels are a table by column (``LabelTable``); an answer holds its column ids and a
reference to the table (``TokenStrings``) and turns them into strings only when a codec first
reads them. In one process that changes nothing (the same lookup, a moment later). Across
the split (``service.hosting.split``), the engine, the one process every front waits on, sends
ids alone: each front receives a table once per connection (``LabelShipment``) and does the
lookup itself. Measured on a 64-row top-10 answer (``service.hosting.split.channel``, one core): the
engine's share went from 130 us (the lookup, then pickling 640 strings) to 59 us, the front's
from 98 to 78 us; the frame from 7.4 kB to 0.5 kB. That is the engine's time a GPU waits on
(a 64-row run of a Llama-sized head takes 0.35-0.62 ms there); vLLM detokenizes in its
API-server processes for the same reason.

A token string is bounded in bytes as a JSON answer encodes it (``MAX_LABEL_BYTES``, quotes
and escapes included), and a table knows its longest (``LabelTable.encoded_bytes``): an
answer repeats its tokens' strings, so what a request may ask for is counted with it.
"""

from __future__ import annotations

import itertools
import math
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, overload

import numpy as np
import numpy.typing as npt
import orjson

#: Tables a front holds per engine connection (~8 MB each for a 128k vocabulary).
TABLES_PER_PEER = 8
#: The most bytes one token string may take in a JSON answer, quotes and escapes included (as
#: the service's encoder, orjson, writes it: UTF-8, a control character as six bytes,
#: ``\u0001``). Real vocabularies stay well below: the demo heads' and checkpoints' longest
#: take 15 bytes, a byte-level BPE token (GPT-2's longest are 128 characters, each at most 2
#: bytes) at most 258.
#: 32,000 labels of 1,024 control characters (6,146 bytes each, within the old bound of 1,024
#: characters) made a 64-row k=1000 answer 394 MB; within this bound it is at most 33 MB, and
#: counted in the answer's declared size (``LoadedVersion.label_bytes``).
MAX_LABEL_BYTES = 512
#: What a column without a token string takes in a JSON answer: ``null``.
NULL_BYTES = 4
_keys = itertools.count(1)

Row = list[str | None]


def encoded_bytes(label: str | None) -> int:
    """The bytes ``label`` takes in a JSON answer, quotes and escapes included (``null`` for
    None): what the service's encoder writes (Python's ``json.dumps(label, ensure_ascii=False)``
    writes the same; the service never writes ``ensure_ascii`` JSON)."""
    return len(orjson.dumps(label))


def first_over_bound(labels: Sequence[str]) -> tuple[int, int] | None:
    """The first label past ``MAX_LABEL_BYTES`` as (its index, its encoded bytes), or None.
    A character takes at most 6 bytes, so only labels longer than a sixth of the bound are
    encoded to be measured: a real vocabulary has none, and costs a pass over lengths."""
    shortest_over = (MAX_LABEL_BYTES - 2) // 6 + 1  # quotes, then 6 bytes per character
    for index, label in enumerate(labels):
        if len(label) >= shortest_over and (size := encoded_bytes(label)) > MAX_LABEL_BYTES:
            return index, size
    return None


class LabelTable:
    """One head's token strings by column (None past its labels file, e.g. padded vocabularies).

    ``key`` names it on a connection: unique in the process that made it. ``encoded_bytes``:
    the most bytes one of its columns takes in a JSON answer (``null`` included, for a column
    without a string), computed once, in one pass, when a loaded version makes the table
    (``of``); a table a front receives measures itself only if asked."""

    __slots__ = ("__weakref__", "_encoded_bytes", "key", "strings")

    def __init__(
        self,
        strings: npt.NDArray[np.object_],
        key: int | None = None,
        encoded_bytes: int | None = None,
    ) -> None:
        self.strings = strings
        self.key = next(_keys) if key is None else key
        self._encoded_bytes = encoded_bytes

    @classmethod
    def of(cls, labels: Sequence[str], vocab_size: int) -> LabelTable:
        padding = [None] * (vocab_size - len(labels))
        largest = max(map(len, map(orjson.dumps, labels)), default=0)  # ~20 ms for 128k
        if padding:
            largest = max(largest, NULL_BYTES)
        return cls(np.array([*labels, *padding], dtype=object), encoded_bytes=largest)

    @property
    def encoded_bytes(self) -> int:
        """The most bytes one of its strings (or ``null``) takes in a JSON answer."""
        if self._encoded_bytes is None:
            self._encoded_bytes = max(map(encoded_bytes, self.strings.tolist()), default=0)
        return self._encoded_bytes


class TokenStrings(Sequence[Row]):
    """The strings of (..., k) column ids, one list per (flattened) row, looked up on first
    read. ``ids`` may be the very array the answer's ids are (untrimmed heads): a frame then
    carries it once.

    Reads like the list of lists it stands for (index, iterate, compare). Pickled outside the
    split's frames (Ray, a deep copy) it becomes that list of lists."""

    __slots__ = ("_rows", "ids", "table")

    def __init__(self, table: LabelTable, ids: npt.NDArray[np.int64]) -> None:
        self.table = table
        self.ids = ids
        self._rows: list[Row] | None = None

    def rows(self) -> list[Row]:
        """One lookup in an object array and one ``tolist`` (a Python loop over the ids cost
        5x more on 64 x 10 ids)."""
        if self._rows is None:
            flat = self.ids.reshape(-1, self.ids.shape[-1])
            self._rows = self.table.strings[flat].tolist()
        return self._rows

    @overload
    def __getitem__(self, index: int) -> Row: ...

    @overload
    def __getitem__(self, index: slice) -> list[Row]: ...

    def __getitem__(self, index: int | slice) -> Row | list[Row]:
        """A row or a slice of rows, looked up alone until every row was: a codec reads an
        answer a piece at a time, and one lookup of 4,096 x 1,000 strings held the event loop
        for 120-175 ms (``TokenStrings.rows``)."""
        if self._rows is not None:
            return self._rows[index]
        picked: Row | list[Row] = self.table.strings[
            self.ids.reshape(-1, self.ids.shape[-1])[index]
        ].tolist()
        return picked

    def __len__(self) -> int:
        return math.prod(self.ids.shape[:-1])

    def __iter__(self) -> Iterator[Row]:
        return iter(self.rows())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence):
            return self.rows() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # a list is not hashable either

    def __repr__(self) -> str:
        return f"TokenStrings({self.rows()!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return list, (self.rows(),)

    def __deepcopy__(self, memo: dict[int, Any]) -> TokenStrings:
        """A copy that outlives the memory ``ids`` may view (the table is never written)."""
        return TokenStrings(self.table, self.ids.copy())


class LabelShipment:
    """The sender's record of which tables its peer holds (one per connection).

    ``reduce`` is how a frame carries a ``TokenStrings``: the table's key and the ids once the
    peer holds the table; the table too the first time, while the peer holds fewer than
    ``limit``; and otherwise the answer's strings themselves, as before tables existed (a
    table is never sent twice: with more labelled heads than the limit, a table per answer
    cost a 128k-token head 10 ms of the engine's time, measured by a probe). A table the
    engine has let go (its version unloaded) is dropped on both sides, which frees its place.
    Frames are read in the order they are written, so the peer's tables match this record."""

    def __init__(self, limit: int = TABLES_PER_PEER) -> None:
        self._held: dict[int, weakref.ref[LabelTable]] = {}
        self._limit = limit

    def reduce(self, tokens: TokenStrings) -> tuple[Any, ...]:
        table = tokens.table
        if table.key in self._held:
            return received, (table.key, tokens.ids, None, [])
        dropped = [key for key, alive in self._held.items() if alive() is None]
        for key in dropped:
            del self._held[key]
        if len(self._held) >= self._limit:
            return _strings, (tokens.rows(), dropped)
        self._held[table.key] = weakref.ref(table)
        return received, (table.key, tokens.ids, table.strings.tolist(), dropped)


_receiving = threading.local()


@contextmanager
def receiving(tables: dict[int, LabelTable]) -> Iterator[None]:
    """Unpickle inside this: ``TokenStrings`` in a frame find (and store) their tables here."""
    _receiving.tables = tables
    try:
        yield
    finally:
        _receiving.tables = None


def received(
    key: int, ids: npt.NDArray[np.int64], strings: list[str | None] | None, dropped: list[int]
) -> TokenStrings:
    """A ``TokenStrings`` rebuilt by the receiver (``LabelShipment.reduce``'s counterpart)."""
    tables: dict[int, LabelTable] = _receiving.tables
    for old in dropped:
        tables.pop(old, None)
    if strings is not None:
        tables[key] = LabelTable(np.array(strings, dtype=object), key)
    return TokenStrings(tables[key], ids)


def _strings(rows: list[Row], dropped: list[int]) -> list[Row]:
    """Strings sent as they are (the peer holds its limit of tables), and tables to drop."""
    tables: dict[int, LabelTable] = _receiving.tables
    for old in dropped:
        tables.pop(old, None)
    return rows
