"""The decoding step's logits processors, applied in place to a run's float32 logits.

What an engine's sampler does to a row before it draws (vLLM's ``SamplingParams``,
transformers' logits processors), on the logits of one run of the head (``rows x vocab``
float32, already divided by the temperature by the graph): histories of tokens per row
(``Histories``), the repetition, presence and frequency penalties over them, ``min_tokens``'
stop ids and bad words (banned: -inf), and a grammar's token bitmask. Everything is written
into the run's own array: no (rows x vocab) copy, and float32 throughout (a float64 copy of a
128256-token run of 64 rows would be 66 MB).

The order (``service.heads.reference`` holds it, and ``docs/decoding.md``): masks first (they
are -inf, which every later step keeps), then bias, then repetition, then frequency and
presence. The graph divided the logits by the temperature T already: repetition scales a
logit by a factor chosen by its sign, which T > 0 keeps, so it commutes with T; bias and the
additive penalties are divided by T (``Bias.at`` does the bias), so ``(z + b - f c) / T`` is
what the run holds, as if T came after them.

The sparse steps touch only the tokens of the histories (O(history) each, never O(vocab)); the
bitmask is the one dense step: its words are unpacked to bytes (``np.unpackbits``, least
significant bit first as xgrammar and llguidance write them) and the masked logits set in one
``copyto``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

Floats = npt.NDArray[np.float32]
Ids = npt.NDArray[np.int64]
Words = npt.NDArray[np.int32]
LogprobsMode = Literal["raw", "processed"]
Order = Literal["transformers", "vllm"]
LOGPROBS_MODES: dict[str, LogprobsMode] = {"raw": "raw", "processed": "processed"}
ORDERS: dict[str, Order] = {"transformers": "transformers", "vllm": "vllm"}
#: Tokens per bitmask word (int32).
BITS = 32


def mask_width(vocab: int) -> int:
    """Words of a bitmask row over ``vocab`` tokens: ceil(vocab / 32)."""
    return -(-vocab // BITS)


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

    def row_of_each(self) -> Ids:
        """The list each value belongs to."""
        return np.repeat(np.arange(len(self), dtype=np.int64), self.lengths)


@dataclass(frozen=True)
class Processors:
    """A decoding step's checked options, in the head's columns (``plane.decoding_options``
    builds them): histories, penalties, stop rules, the bitmask, and how log-probs and
    filters are read (``logprobs_mode``, ``order``). The neutral values change nothing."""

    prompt: Histories | None = None
    output: Histories | None = None
    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0
    min_tokens: int = 0
    stop_ids: Ids | None = None
    bad_words: Histories | None = None
    bitmask: Words | None = None
    """(1, width) for every row or (rows, width), over the head's columns."""
    logprobs_mode: LogprobsMode = "raw"
    order: Order = "transformers"

    def part(self, start: int, stop: int) -> Processors:
        """The options of rows ``start`` to ``stop`` (one run of a request's rows)."""
        bitmask = self.bitmask
        if bitmask is not None and len(bitmask) > 1:
            bitmask = bitmask[start:stop]
        return Processors(
            None if self.prompt is None else self.prompt.part(start, stop),
            None if self.output is None else self.output.part(start, stop),
            self.repetition,
            self.presence,
            self.frequency,
            self.min_tokens,
            self.stop_ids,
            self.bad_words,
            bitmask,
            self.logprobs_mode,
            self.order,
        )

    @property
    def penalizes(self) -> bool:
        return self.repetition != 1.0 or bool(self.presence) or bool(self.frequency)

    def penalized(self, vocab: int, distinct: bool = True) -> Penalized | None:
        """Where these options' penalties fall in a run of their rows (None: nowhere)."""
        if not self.penalizes:
            return None
        return Penalized.of(self.prompt, self.output, vocab, self.repetition != 1.0, distinct)

    def apply(
        self,
        logits: Floats,
        temperature: float,
        penalized: Penalized | None = None,
        *,
        mask: bool = True,
    ) -> None:
        """Every processor, in place, on a run's logits (already divided by ``temperature``),
        these options' rows being the run's; ``penalized`` where the penalties fall, when
        the caller has it already; the bitmask last, unless ``mask`` is False."""
        if self.bad_words is not None:
            output = self.output if self.output is not None else Histories.of([[]] * len(logits))
            ban_bad_words(logits, output, self.bad_words)
        if self.min_tokens and self.stop_ids is not None:
            ban_stop_ids(logits, self.output, self.min_tokens, self.stop_ids)
        at = penalized if penalized is not None else self.penalized(logits.shape[1])
        if at is not None:
            penalize_at(logits, at, self.repetition, self.presence, self.frequency, temperature)
        if mask and self.bitmask is not None:
            apply_bitmask(logits, self.bitmask)


def outside(ids: Ids) -> Ids:
    """How a history names tokens a trimmed head lacks (``Histories``)."""
    return -1 - ids


def _flat(histories: Histories, vocab: int) -> Ids:
    """Each history token's index in the run's flattened logits (tokens without a column
    left out)."""
    values = histories.values
    flat = histories.row_of_each() * vocab + values
    if values.size and values.min() < 0:  # tokens a trimmed head lacks
        flat = flat[values >= 0]
    return flat


def _counted(flat: Ids) -> tuple[Ids, Ids]:
    """The distinct indexes, ascending (the gathers then read the run's logits in order), and
    how often each occurs: one sort (``np.unique`` took ~7 ms for 32,768 indexes in numpy 2.4,
    its hash path; a sort and a comparison take ~0.15 ms)."""
    ordered = np.sort(flat)
    if not ordered.size:
        return ordered, np.zeros(0, np.int64)
    starts = np.flatnonzero(np.concatenate([[True], ordered[1:] != ordered[:-1]]))
    counts = np.diff(np.append(starts, len(ordered)))
    return ordered[starts], counts


@dataclass(frozen=True)
class Penalized:
    """Where a run's penalties fall, as indexes of its flattened logits: ``seen`` the
    distinct tokens of each row's prompt and output (repetition), ``outputs`` the distinct
    tokens of each row's output with their ``counts`` (frequency and presence). Built once
    per run; ``sparse_step`` also reads them as tokens the step changes."""

    seen: Ids | None
    outputs: Ids | None
    counts: Ids | None

    @classmethod
    def of(
        cls,
        prompt: Histories | None,
        output: Histories | None,
        vocab: int,
        repetition: bool,
        distinct: bool = True,
    ) -> Penalized:
        """``distinct=False`` leaves repeats in ``seen``: the repetition's gather and
        scatter write the same value for each (a sort spared)."""
        outputs = counts = None
        if output is not None:
            outputs, counts = _counted(_flat(output, vocab))
        seen = None
        if repetition:
            parts = ([] if prompt is None else [_flat(prompt, vocab)]) + (
                [] if outputs is None else [outputs]
            )
            if len(parts) > 1:
                joined = np.concatenate(parts)
                seen = _counted(joined)[0] if distinct else joined
            elif parts:  # the outputs are distinct already; a prompt alone may repeat
                seen = _counted(parts[0])[0] if distinct and prompt is not None else parts[0]
        return cls(seen, outputs, counts)


def penalize(
    logits: Floats,
    prompt: Histories | None,
    output: Histories | None,
    repetition: float,
    presence: float,
    frequency: float,
    temperature: float,
) -> None:
    """The penalties on the tokens a row has seen (the output's counted once, for both):
    repetition on each token of its prompt or output, once (a positive logit divided by it,
    a negative one multiplied: CTRL's, as vLLM applies it), then ``- (frequency * count +
    presence) / T`` on each token of its output, ``count`` its occurrences there (OpenAI's,
    vLLM's; the graph divided the logits by T already)."""
    if repetition == 1.0 and not presence and not frequency:
        return
    at = Penalized.of(prompt, output, logits.shape[1], repetition != 1.0)
    penalize_at(logits, at, repetition, presence, frequency, temperature)


def penalize_at(
    logits: Floats,
    at: Penalized,
    repetition: float,
    presence: float,
    frequency: float,
    temperature: float,
) -> None:
    """``penalize`` where ``at`` says the penalties fall."""
    flat = logits.reshape(-1)
    if repetition != 1.0 and at.seen is not None:
        values = flat[at.seen]
        factor = np.float32(repetition)
        flat[at.seen] = np.where(values > 0, values / factor, values * factor)
    if at.outputs is not None and at.counts is not None and (presence or frequency):
        flat[at.outputs] -= ((frequency * at.counts + presence) / temperature).astype(np.float32)


def ban_stop_ids(logits: Floats, output: Histories | None, min_tokens: int, stop: Ids) -> None:
    """The stop ids at -inf in each row whose output is shorter than ``min_tokens``."""
    lengths = np.zeros(len(logits), np.int64) if output is None else output.lengths
    short = np.flatnonzero(lengths < min_tokens)
    logits[np.ix_(short, stop)] = -np.inf


def ban_bad_words(logits: Floats, output: Histories, words: Histories) -> None:
    """Each word's last token at -inf in the rows whose output ends with its other tokens
    (a one-token word everywhere)."""
    for rows, last in bad_word_hits(output, words):
        logits[rows, last] = -np.inf


def bad_word_hits(output: Histories, words: Histories) -> Iterator[tuple[Ids, int]]:
    """(the rows, the column) each word bans: the rows whose output ends with the word's
    other tokens (every row for a one-token word); per word, every row's tail compared with
    its prefix at once. A word whose last token the head lacks bans nothing."""
    lengths, ends = output.lengths, output.offsets[1:]
    every = np.arange(len(output), dtype=np.int64)
    for word in range(len(words)):
        tokens = words.values[words.offsets[word] : words.offsets[word + 1]]
        last, prefix = int(tokens[-1]), tokens[:-1]
        if last < 0:  # a token this head cannot produce: nothing to ban
            continue
        if not len(prefix):
            yield every, last
            continue
        long_enough = np.flatnonzero(lengths >= len(prefix))
        at = ends[long_enough, None] - len(prefix) + np.arange(len(prefix))
        matches = (output.values[at] == prefix).all(axis=1)
        yield long_enough[matches], last


def allowed_bytes(bitmask: Words, vocab: int) -> npt.NDArray[np.uint8]:
    """(rows, vocab) bytes, 1 where the bitmask allows the token (its words' bytes in
    little-endian order: token j is bit j % 8 of byte j // 8)."""
    octets = np.ascontiguousarray(bitmask, dtype="<i4").view(np.uint8)
    return np.unpackbits(octets, axis=1, count=vocab, bitorder="little")


def apply_bitmask(logits: Floats, bitmask: Words) -> None:
    """-inf where the bitmask (one row for all, or one per row) does not allow the token: the
    words inverted, unpacked to one byte per token and read as booleans (no other pass)."""
    masked = allowed_bytes(np.invert(bitmask), logits.shape[1]).view(np.bool_)
    np.copyto(logits, np.float32(-np.inf), where=masked)


def pack(allowed: npt.NDArray[np.bool_]) -> Words:
    """The bitmask of (rows, vocab) booleans."""
    packed = np.packbits(allowed, axis=1, bitorder="little")
    padded = np.zeros((len(allowed), mask_width(allowed.shape[1]) * 4), np.uint8)
    padded[:, : packed.shape[1]] = packed
    return padded.view("<i4").astype(np.int32)
