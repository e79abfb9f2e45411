"""What a codec reads again and again, read once: a decoding client sends the same query string
and the same few options (none, or a k) with every request.

* ``options_key``/``VALIDATED``: option values validated before, by their exact scalar values
  (``wire.options`` validates each new set with pydantic, ~10 us a request, and keeps the
  frozen result; anything but short scalars is validated every time);
* ``query_facts``: a query string's names given twice and its version (``wire.target``);
  ``QUERY_OPTIONS``: a binary body's options read from its query string (``native``).

Both bounded: a full table is emptied, not grown.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel
from starlette.datastructures import QueryParams

#: Validated options by ``options_key`` (frozen models: shared safely between requests).
VALIDATED: dict[tuple[Any, ...], Any] = {}
#: A binary body's options by (schema, id lists, query string), when it gives no id lists.
QUERY_OPTIONS: dict[tuple[Any, ...], Any] = {}
OPTIONS_CACHE_SIZE = 1024
#: Query strings up to this long are read once.
QUERY_CACHE_CHARS = 256
_SCALARS = (int, float, str, bool, type(None))


def options_key(
    model: type[BaseModel], strict: bool, values: Mapping[str, Any]
) -> tuple[Any, ...] | None:
    """A key telling these values apart exactly (type and value, a float by its bits: -0.0 is
    not 0.0, True is not 1), or None when one is no short scalar."""
    if len(values) > 8:
        return None
    items: list[Any] = [model, strict]
    for name, value in values.items():
        kind = type(value)
        if kind not in _SCALARS or (kind is str and len(value) > 64):
            return None
        items.append((name, kind, value.hex() if kind is float else value))
    return tuple(items)


def remember(
    key: tuple[Any, ...], validated: Any, table: dict[tuple[Any, ...], Any] = VALIDATED
) -> None:
    if len(table) >= OPTIONS_CACHE_SIZE:
        table.clear()
    table[key] = validated


def read_query(query: bytes) -> tuple[list[str], bool, str | None]:
    """A query string's names given twice, whether it names a version, and that version (the
    last given, as Starlette's ``query_params`` reads it)."""
    params = QueryParams(query)
    names = Counter(name for name, _ in params.multi_items())
    twice = sorted(name for name, count in names.items() if count > 1)
    return twice, "version" in names, params.get("version")


_read_once = functools.lru_cache(maxsize=1024)(read_query)


def query_facts(query: bytes) -> tuple[list[str], bool, str | None]:
    """``read_query``, remembered for short query strings (the list is not to be changed)."""
    return _read_once(query) if len(query) <= QUERY_CACHE_CHARS else read_query(query)
