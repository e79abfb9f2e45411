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

import dataclasses
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from service.runtime.histories import Histories, outside
from service.runtime.processed_at import BiasLike, processed, touched

Floats = npt.NDArray[np.float32]
Ids = npt.NDArray[np.int64]
Words = npt.NDArray[np.int32]
__all__ = ["Histories", "outside"]  # their home is ``histories``; long imported from here
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
    bitmask_counts: Ids | None = None
    """The tokens each bitmask row allows, where the options' check counted them (a
    popcount of its words, ~20 us a request): the step's readings take them from here."""

    def part(self, start: int, stop: int) -> Processors:
        """The options of rows ``start`` to ``stop`` (one run of a request's rows)."""
        bitmask, counts = self.bitmask, self.bitmask_counts
        if bitmask is not None and len(bitmask) > 1:
            bitmask = bitmask[start:stop]
            counts = None if counts is None else counts[start:stop]
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
            counts,
        )

    def take(self, rows: Ids) -> Processors:
        """The options of a request's ``rows`` (any of them, in that order)."""
        bitmask, counts = self.bitmask, self.bitmask_counts
        if bitmask is not None and len(bitmask) > 1:
            bitmask = bitmask[rows]
            counts = None if counts is None else counts[rows]
        return dataclasses.replace(
            self,
            prompt=None if self.prompt is None else self.prompt.take(rows),
            output=None if self.output is None else self.output.take(rows),
            bitmask=bitmask,
            bitmask_counts=counts,
        )

    @property
    def penalizes(self) -> bool:
        return self.repetition != 1.0 or bool(self.presence) or bool(self.frequency)

    def apply(
        self, logits: Floats, temperature: float, bias: BiasLike | None = None, *, mask: bool = True
    ) -> None:
        """The bias and every processor, in place, on a run's logits (already divided by
        ``temperature``), these options' rows being the run's: the tokens they touch read
        and written once (``processed_at``), then the bitmask, unless ``mask`` is False."""
        touch = touched(self, bias, *logits.shape)
        if touch.at.size and logits.flags.c_contiguous:
            flat = logits.reshape(-1)  # a view
            flat[touch.at] = processed(self, touch, flat[touch.at], temperature)
        elif touch.at.size:
            rows, columns = np.divmod(touch.at, logits.shape[1])
            logits[rows, columns] = processed(self, touch, logits[rows, columns], temperature)
        if mask and self.bitmask is not None:
            apply_bitmask(logits, self.bitmask)


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
