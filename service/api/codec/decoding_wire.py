"""The decoding step's options off the wire, the same from every front end: a JSON body's lists
of lists, a binary body's entries (``.npz``; V2's named input tensors), and the scalars beside
them, into one ``DecodingOptions`` (``service.api.decoding_fields`` names the fields).

A list of lists travels binary as two arrays: its values, flat, and ``<name>_lengths``, one
length per list (so 64 rows of 512 history ids are two arrays, never 64 lists to parse). The
codecs take the arrays out of what they read and hand them here; nothing is judged here but
the wire's own shapes (integers, lists of lists, a length beside each list): the data plane
checks the rest (``service.plane.decoding_options``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from service.api.codec.wire import int_array, json_type
from service.api.decoding_fields import ARRAYS, LENGTHS, LISTS
from service.errors import InvalidInput
from service.limits import kind_name
from service.messages import DecodingOptions, TokenLists

#: Every name a binary body (or V2's inputs) may hold for the step.
BINARY_NAMES = (*ARRAYS, *LISTS, *(name + LENGTHS for name in LISTS))
#: The scalars the options' models hold (``PenaltyFields``, ``StepFields``).
SCALARS = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "logprobs_mode",
    "processor_order",
)


def json_arrays(values: dict[str, Any], booleans: bool) -> dict[str, Any]:
    """The step's arrays taken out of a JSON body's ``values``: lists of lists as
    ``TokenLists``, flat ones as int64 arrays; one sent as null is not given."""
    return taken_from(values, LISTS, _json_lists, booleans) | taken_from(
        values, ARRAYS, int_array, booleans
    )


def taken_from(
    values: dict[str, Any],
    names: tuple[str, ...],
    read: Callable[[Any, str, bool], Any],
    booleans: bool,
) -> dict[str, Any]:
    """``names`` taken out of a JSON body's ``values``, each read as ``read(value, name,
    booleans)``; one absent or sent as null is not given."""
    taken: dict[str, Any] = {}
    for name in names:
        given = values.pop(name, None)
        if given is not None:
            taken[name] = read(given, name, booleans)
    return taken


def binary_arrays(arrays: dict[str, npt.NDArray[Any]]) -> dict[str, Any]:
    """The step's arrays taken out of a binary body's (``.npz`` entries, V2 inputs): each
    list of lists from its values and ``<name>_lengths``, which come together or not at all."""
    taken: dict[str, Any] = {}
    for name in LISTS:
        values, lengths = arrays.pop(name, None), arrays.pop(name + LENGTHS, None)
        if values is None and lengths is None:
            continue
        if values is None or lengths is None:
            missing = name if values is None else name + LENGTHS
            raise InvalidInput(
                f"{name} travels as two arrays, its values and {name}{LENGTHS} (one length per "
                f"list): {missing} is missing"
            )
        taken[name] = TokenLists(_integers(values, name), _integers(lengths, name + LENGTHS))
    for name in ARRAYS:
        if name in arrays:
            taken[name] = _integers(arrays.pop(name), name)
    return taken


def decoding(opts: Any, arrays: Mapping[str, Any]) -> DecodingOptions | None:
    """The step's options from a request's scalars (an options model, or V2's parameters as
    a mapping) and its arrays; None when it asks for none of them."""
    given_fields = getattr(opts, "model_fields_set", None)  # a model says what was sent
    if not arrays and given_fields is not None and given_fields.isdisjoint(SCALARS):
        return None  # the plain request's case, without a lookup per scalar
    scalars = {name: _scalar(opts, name) for name in SCALARS}
    given = {name: value for name, value in scalars.items() if value is not None}
    steps = {name: arrays[name] for name in (*LISTS, *ARRAYS) if arrays.get(name) is not None}
    if not given and not steps:
        return None
    return DecodingOptions(**steps, **given)


def _scalar(opts: Any, name: str) -> Any:
    if isinstance(opts, Mapping):
        return opts.get(name)
    return getattr(opts, name, None)


def _json_lists(value: Any, field: str, booleans: bool) -> TokenLists:
    if not isinstance(value, list) or not all(isinstance(row, list) for row in value):
        raise InvalidInput(
            f"{field} must be a list of lists of token ids (one per row), got {json_type(value)}"
        )
    rows = []
    for row in value:
        ids = int_array(row, field, booleans)
        if ids.ndim != 1:
            raise InvalidInput(f"{field} must be a list of flat lists of token ids")
        rows.append(ids)
    lengths = np.array([len(row) for row in rows], np.int64)
    values = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    return TokenLists(values, lengths)


def _integers(array: npt.NDArray[Any], field: str) -> npt.NDArray[Any]:
    if array.size and array.dtype.kind not in "iu":
        raise InvalidInput(f"{field} must hold integers, got {kind_name(array.dtype)}")
    return array
