"""The decoding step's options, checked once, before any math.

``service.plane.options`` hands the decoding options of a top-k (or logits) request here,
with its rows, the head's token space and what it checked already (allowed columns, banned
columns, the sampling spec), and gets ``Processors`` back: histories as columns, penalties in
range, stop rules, the grammar's bitmask over the head's columns (the allowed ids folded into
it), and how log-probs and filters are read. Every refusal is a 422 naming the field, what
was expected and what came (never the data): penalties out of range, history ids outside the
vocabulary, lengths that do not add up, a bitmask of the wrong width (naming
ceil(vocab / 32)), a row of it that allows nothing, a row that nothing is left in once every
mask and ban is counted (naming the row), ``sample.n`` past ``MAX_DRAWS``.

The bitmask is counted, not unpacked: a row's allowed tokens are its words' bits (a byte
table), less the banned tokens its bits allow (looked up one bit each), so a 64-row mask over
128,256 tokens is checked in well under a millisecond on the event loop.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from service.errors import InvalidInput, PayloadTooLarge
from service.limits import Limits, kind_name
from service.messages import DecodingOptions, TokenLists, VocabularyOptions
from service.runtime.processed_at import bad_word_hits
from service.runtime.processors import (
    BITS,
    LOGPROBS_MODES,
    ORDERS,
    Histories,
    Ids,
    Processors,
    Words,
    allowed_bytes,
    mask_width,
    outside,
    pack,
)
from service.runtime.sparse_masks import allowed_counts
from service.runtime.vocabulary import TokenSpace

#: Draws per row (``sample.n``): each is a stream of the seed and an entry of the answer.
MAX_DRAWS = 64
#: Ids each history field may hold in all (``prompt_token_ids``, ``output_token_ids``,
#: ``bad_words_ids``; 8 bytes each as decoded, declared in ``costs.decoding``).
MAX_HISTORY_TOKENS = 2**22
#: Words of ``bad_words_ids`` (each is compared with every row's output).
MAX_BAD_WORDS = 1024
#: |presence_penalty| and |frequency_penalty| (OpenAI's and vLLM's range).
MAX_PENALTY = 2.0
#: Set bits of each byte value (numpy before 2.0 has no ``bitwise_count``).
#: Rows of a trimmed head's bitmask unpacked at a time (rows x vocab bytes each).
_UNPACK_ROWS = 64


def of_vocabulary(
    options: VocabularyOptions,
    rows: int,
    space: TokenSpace,
    limits: Limits,
    allowed: Ids | None,
    banned: Ids | None,
) -> Processors | None:
    """A top-k request's processors (``processors``), when it asks for the decoding step:
    any decoding option, or ``sample.n``. Allowed ids then mask the other tokens, and
    log-probs are over what is left (``logprobs_over='vocabulary'`` is refused)."""
    sample = options.sample
    if options.decoding is None and (sample is None or sample.n is None):
        return None
    if allowed is not None and options.logprobs_over == "vocabulary":
        raise InvalidInput(
            "logprobs_over='vocabulary' does not apply with the decoding options: "
            "allowed_token_ids mask the other tokens, and log-probs are over what is left"
        )
    return processors(options.decoding, rows, space, limits, allowed, banned)


def processors(
    options: DecodingOptions | None,
    rows: int,
    space: TokenSpace,
    limits: Limits,
    allowed: Ids | None = None,
    banned: Ids | None = None,
) -> Processors:
    """The checked processors of ``rows`` rows; ``allowed`` and ``banned``: the columns the
    request's ``allowed_token_ids`` and ``banned_token_ids`` name (checked already)."""
    options = options or DecodingOptions()
    vocab = space.size if space.kept is None else len(space.kept)
    prompt = histories(options.prompt_token_ids, rows, space, "prompt_token_ids")
    output = histories(options.output_token_ids, rows, space, "output_token_ids")
    min_tokens = options.min_tokens or 0
    if isinstance(min_tokens, bool) or not 0 <= min_tokens < 2**31:
        raise InvalidInput(f"min_tokens must be an integer in [0, 2**31), got {min_tokens}")
    stop = None
    if options.stop_token_ids is not None:
        raw = np.asarray(options.stop_token_ids).reshape(-1)
        stop = _columns_kept(limits.token_ids(raw, space.size, "stop_token_ids"), space)
    if min_tokens and stop is None:
        raise InvalidInput(
            "min_tokens bans the stop ids until a row's output is that long: give "
            "stop_token_ids (the end-of-sequence id among them)"
        )
    words = _bad_words(options.bad_words_ids, space)
    bitmask = token_bitmask(options.token_bitmask, rows, space)
    if allowed is not None:
        listed = allowed_mask(allowed, vocab)
        bitmask = listed if bitmask is None else np.bitwise_and(bitmask, listed)
    checked = Processors(
        prompt,
        output,
        _repetition(options.repetition_penalty),
        _penalty(options.presence_penalty, "presence_penalty"),
        _penalty(options.frequency_penalty, "frequency_penalty"),
        min_tokens,
        stop,
        words,
        bitmask,
        _choice(options.logprobs_mode, LOGPROBS_MODES, "logprobs_mode", "raw"),
        _choice(options.processor_order, ORDERS, "processor_order", "transformers"),
        None if bitmask is None else allowed_counts(bitmask, vocab),
    )
    refuse_empty_rows(checked, rows, vocab, banned)
    return checked


def draws(n: int | None) -> int | None:
    """``sample.n``: draws per row, in [1, ``MAX_DRAWS``] (None: one, no axis of draws)."""
    if n is None:
        return None
    if isinstance(n, bool) or not 1 <= n <= MAX_DRAWS:
        raise InvalidInput(f"sample.n must be an integer in [1, {MAX_DRAWS}], got {n}")
    return n


def histories(raw: TokenLists | None, rows: int, space: TokenSpace, field: str) -> Histories | None:
    """One list per row: lengths that add up to the values, ids in the vocabulary, as
    columns (a token a trimmed head lacks as ``outside``)."""
    if raw is None:
        return None
    values, lengths = _lists(raw, field)
    if len(lengths) != rows:
        raise InvalidInput(
            f"{field} must hold one list per row: got {len(lengths)} lists for {rows} rows"
        )
    _in_vocabulary(values, space, field)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return Histories(_columns_or_outside(values, space), offsets)


def token_bitmask(raw: npt.NDArray[Any] | None, rows: int, space: TokenSpace) -> Words | None:
    """int32 words (or unsigned ones, as JSON writes them), (width,) or (1 or rows, width),
    width ceil(vocab / 32); as a (1 or rows, ceil(columns / 32)) mask over the head's columns
    (the same words unless the head is trimmed; bits past the vocabulary cleared). A row that
    allows no token of the head is refused."""
    if raw is None:
        return None
    field, width = "token_bitmask", mask_width(space.size)
    array = np.asarray(raw)
    if array.dtype.kind not in "iu":
        raise InvalidInput(f"{field} must hold int32 words, got {kind_name(array.dtype)}")
    if array.ndim == 1:
        array = array[None, :]
    if array.ndim != 2 or array.shape[1] != width:
        raise InvalidInput(
            f"{field} must have ceil(vocab / 32) = {width} words per row (vocab {space.size}), "
            f"got shape {list(np.asarray(raw).shape)[:4]}"
        )
    if array.shape[0] not in (1, rows):
        raise InvalidInput(
            f"{field} must have one row for every row, or one per row ({rows}), "
            f"got {array.shape[0]} rows"
        )
    if array.dtype.itemsize == 4:  # int32 as the libraries write it, or uint32: the bits
        words = np.ascontiguousarray(array).view(np.int32)
    else:  # wider integers (JSON's): each a 32-bit word, signed or not
        if array.size and (int(array.min()) < -(2**31) or int(array.max()) >= 2**32):
            raise InvalidInput(f"{field} words must be 32-bit integers (int32 or uint32)")
        words = array.astype(np.int64).astype(np.uint32).view(np.int32)
    mask = _over_columns(words, space)
    empty = ~mask.any(axis=1)
    if empty.any():
        row = int(np.argmax(empty))
        raise InvalidInput(f"{field} row {row} allows no token of the vocabulary; allow one")
    return mask


def allowed_mask(allowed: Ids, vocab: int) -> Words:
    """The bitmask of allowed columns ((n,) for every row or (rows, n))."""
    lists = np.atleast_2d(allowed)
    words = np.zeros((len(lists), mask_width(vocab)), np.uint32)
    rows = np.repeat(np.arange(len(lists)), lists.shape[1])
    columns = lists.reshape(-1)
    bits = np.left_shift(np.uint32(1), (columns % BITS).astype(np.uint32))
    np.bitwise_or.at(words, (rows, columns // BITS), bits)
    return words.view(np.int32)


def refuse_empty_rows(checked: Processors, rows: int, vocab: int, banned: Ids | None) -> None:
    """422 naming the first row in which no token is left once the bitmask (the allowed ids
    in it), the banned ids, the stop ids of a row shorter than ``min_tokens`` and the bad
    words it ends with are all counted: such a row has nothing to draw or rank."""
    bitmask, output = checked.bitmask, checked.output
    everywhere = [] if banned is None else [banned]
    short = np.zeros(rows, np.bool_)
    stop = checked.stop_ids
    if checked.min_tokens and stop is not None:
        lengths = np.zeros(rows, np.int64) if output is None else output.lengths
        short = lengths < checked.min_tokens
        if short.all():
            everywhere.append(stop)
    pairs: list[tuple[Ids, Ids]] = []
    if checked.bad_words is not None:
        lists = output if output is not None else Histories.of([[]] * rows)
        for hit_rows, last in bad_word_hits(lists, checked.bad_words):
            if len(hit_rows) == rows:
                everywhere.append(np.array([last], np.int64))
            else:
                pairs.append((hit_rows, np.full(len(hit_rows), last, np.int64)))
    if stop is not None and short.any() and not short.all():
        hit = np.flatnonzero(short)
        pairs.append((np.repeat(hit, len(stop)), np.tile(stop, len(hit))))
    common = np.unique(np.concatenate(everywhere)) if everywhere else np.zeros(0, np.int64)
    left = np.full(rows, vocab, np.int64)
    each = bitmask is not None and len(bitmask) > 1  # else every row is the first one
    if bitmask is not None:
        counts = checked.bitmask_counts
        left[:] = allowed_counts(bitmask, vocab) if counts is None else counts
    left -= _allowed_among(bitmask, np.arange(rows if each else 1), common).sum(axis=1)
    if pairs:
        at_rows = np.concatenate([r for r, _ in pairs])
        at_columns = np.concatenate([c for _, c in pairs])
        fresh = ~np.isin(at_columns, common)
        flat = np.unique(at_rows[fresh] * vocab + at_columns[fresh])
        at_rows, at_columns = flat // vocab, flat % vocab
        hits = _allowed_among(bitmask, at_rows, at_columns[:, None])[:, 0]
        np.subtract.at(left, at_rows, hits.astype(np.int64))
    if (left <= 0).any():
        row = int(np.argmax(left <= 0))
        raise InvalidInput(
            f"row {row} has no token left: token_bitmask, allowed_token_ids, banned_token_ids, "
            "bad_words_ids and stop_token_ids (while the output is shorter than min_tokens) "
            "exclude every one; leave at least one"
        )


def _allowed_among(
    bitmask: Words | None, rows: Ids, columns: npt.NDArray[np.int64]
) -> npt.NDArray[np.bool_]:
    """Whether each row's bitmask allows ``columns`` ((n,) for every row, or (rows, 1))."""
    columns = np.atleast_1d(columns)
    if bitmask is None:
        return np.ones((len(rows), columns.shape[-1]), np.bool_)
    words = bitmask.view(np.uint32)
    at = rows if len(words) > 1 else np.zeros(len(rows), np.int64)
    word = words[at[:, None], columns // BITS]
    return ((word >> (columns % BITS).astype(np.uint32)) & 1).astype(np.bool_)


def _over_columns(words: Words, space: TokenSpace) -> Words:
    """A bitmask over original ids as one over the head's columns, bits past it cleared."""
    if space.kept is None:
        tail = space.size % BITS
        if tail:  # 1 to 31 bits of the last word name tokens
            words = words.copy()
            words[:, -1] &= np.int32((1 << tail) - 1)
        return np.ascontiguousarray(words)
    parts = []
    for start in range(0, len(words), _UNPACK_ROWS):
        tokens = allowed_bytes(words[start : start + _UNPACK_ROWS], space.size)
        parts.append(pack(tokens[:, space.kept].view(np.bool_)))
    return np.concatenate(parts)


def _lists(raw: TokenLists, field: str) -> tuple[Ids, Ids]:
    """Values and lengths as int64, lengths non-negative and adding up to the values."""
    values, lengths = np.asarray(raw.values), np.asarray(raw.lengths)
    for name, array in (("", values), (" lengths", lengths)):
        if array.dtype.kind not in "iu" and array.size:
            raise InvalidInput(f"{field}{name} must hold integers, got {kind_name(array.dtype)}")
    values = values.reshape(-1).astype(np.int64, copy=False)
    lengths = lengths.reshape(-1).astype(np.int64, copy=False)
    if len(values) > MAX_HISTORY_TOKENS:
        raise PayloadTooLarge(
            f"{field} holds {len(values)} ids; the limit is {MAX_HISTORY_TOKENS} per request"
        )
    if lengths.size and int(lengths.min()) < 0:
        raise InvalidInput(f"{field} lengths must be >= 0")
    if int(lengths.sum()) != len(values):
        raise InvalidInput(
            f"{field}: the lists' lengths add up to {int(lengths.sum())}, but "
            f"{len(values)} ids came"
        )
    return values, lengths


def _in_vocabulary(values: Ids, space: TokenSpace, field: str) -> None:
    if values.size and (int(values.min()) < 0 or int(values.max()) >= space.size):
        raise InvalidInput(
            f"{field} must be token ids in [0, {space.size}), got values in "
            f"[{int(values.min())}, {int(values.max())}]"
        )


def _columns_or_outside(ids: Ids, space: TokenSpace) -> Ids:
    """Columns of original ids; ``outside(id)`` for an id a trimmed head lacks."""
    if space.kept is None:
        return ids
    position = np.minimum(np.searchsorted(space.kept, ids), len(space.kept) - 1)
    found = space.kept[position] == ids
    return np.where(found, position, outside(ids)).astype(np.int64)


def _columns_kept(ids: Ids, space: TokenSpace) -> Ids:
    """Columns of the ids a head has (an id it lacks can be neither drawn nor banned)."""
    columns = _columns_or_outside(ids, space)
    return np.unique(columns[columns >= 0])


def _bad_words(raw: TokenLists | None, space: TokenSpace) -> Histories | None:
    field = "bad_words_ids"
    if raw is None:
        return None
    values, lengths = _lists(raw, field)
    if len(lengths) > MAX_BAD_WORDS:
        raise InvalidInput(f"{field} has {len(lengths)} words; at most {MAX_BAD_WORDS}")
    if lengths.size and int(lengths.min()) < 1:
        raise InvalidInput(f"{field}: every word must hold at least one token id")
    _in_vocabulary(values, space, field)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return Histories(_columns_or_outside(values, space), offsets)


def _repetition(value: float | None) -> float:
    if value is None:
        return 1.0
    if isinstance(value, bool) or not (math.isfinite(value) and value > 0):
        raise InvalidInput(f"repetition_penalty must be a number > 0 (1: none), got {value:g}")
    return float(value)


def _penalty(value: float | None, field: str) -> float:
    if value is None:
        return 0.0
    if isinstance(value, bool) or not -MAX_PENALTY <= value <= MAX_PENALTY:  # NaN fails too
        raise InvalidInput(
            f"{field} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0: none), "
            f"got {value:g}"
        )
    return float(value)


def _choice(value: str | None, choices: dict[str, Any], field: str, default: str) -> Any:
    if value is None:
        return choices[default]
    if value not in choices:
        named = " or ".join(repr(choice) for choice in choices)
        raise InvalidInput(f"{field} must be {named}, got {str(value)[:24]!r}")
    return choices[value]
