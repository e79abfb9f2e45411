"""Which rows of a decoding step are read through their allowed tokens alone
(``service.runtime.compact_step``), and their run.

A row whose grammar mask allows at most ``vocab / SPARSE`` tokens needs those tokens' logits
only: one product of its hidden state with their rows of W, where a projection of the whole
vocabulary costs ``vocab / allowed`` times more. The rows read so are those of a head whose
layout can compute chosen columns (``CandidateLogits``: not a quantized head, whose numbers
only its graph gives), while the union of their tokens' rows of W stays within
``MAX_UNION_BYTES`` (it is gathered once for all of them); every other row is projected
whole (``service.plane.decoding``). ``costs.decoding`` declares what this holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from service.repository.loaded_version import LoadedVersion
from service.runtime.compact_step import compact_step
from service.runtime.processors import Processors
from service.runtime.sparse_masks import SPARSE, Allowed, allowed_counts
from service.runtime.step import StepRun
from service.runtime.vocabulary import Bias, SampleSpec, refuse_overflow

Floats = npt.NDArray[np.float32]
Ids = npt.NDArray[np.int64]
#: The rows of W the compact rows' tokens gather, at most (their union, float32).
MAX_UNION_BYTES = 64 * 2**20


@dataclass(frozen=True)
class CompactRows:
    """A request's rows read compact (``rows``, ascending) and how many distinct tokens they
    allow together (``union``); which tokens, their step reads from the mask itself (in the
    executor, not on the event loop)."""

    rows: Ids
    union: int


def compact_rows(model: LoadedVersion, processors: Processors, rows: int) -> CompactRows | None:
    """The rows of a request of ``rows`` rows read compact, or None (no mask allows few
    tokens, the head cannot compute chosen columns, or their union is too large)."""
    extent = compact_extent(model, processors, rows)
    if extent is None:
        return None
    few, _, union = extent
    return CompactRows(few, union)


def compact_extent(
    model: LoadedVersion, processors: Processors, rows: int
) -> tuple[Ids, int, int] | None:
    """Which rows are read compact, the most tokens one of them allows and how many they
    allow together, from the mask's popcounts alone (``costs.decoding`` declares them)."""
    bitmask = processors.bitmask
    if bitmask is None or model.session.candidates is None:
        return None
    vocab = model.vocab_size
    counts = processors.bitmask_counts
    counts = allowed_counts(bitmask, vocab) if counts is None else counts
    counts = np.broadcast_to(counts, (rows,)) if len(bitmask) == 1 else counts
    few = np.flatnonzero((counts >= 1) & (counts <= vocab // SPARSE))
    if not few.size:
        return None
    words = bitmask if len(bitmask) == 1 else bitmask[few]
    union = int(allowed_counts(np.bitwise_or.reduce(words, axis=0)[None], vocab)[0])
    if union * model.d_model * 4 > MAX_UNION_BYTES:
        return None
    return few, int(counts[few].max()), union


def compact_job(
    model: LoadedVersion,
    hidden: Floats,
    compact: CompactRows,
    temperature: float,
    processors: Processors,
    bias: Bias | None,
    sample: SampleSpec | None,
    u: npt.NDArray[np.float64] | None,
) -> Callable[[], StepRun]:
    """The step of the compact rows (``hidden`` their states, ``u`` theirs; ``processors``
    the request's), for the inference executor: their allowed tokens, those tokens' logits
    from W's rows and ``compact_step``. ``plane.decoding`` runs it in the same hop as the
    other rows' first step, or alone (``compact_run``) when every row is compact."""
    candidates = model.session.candidates
    assert candidates is not None  # ``compact_rows`` reads no rows of a head without
    assert processors.bitmask is not None  # compact rows are rows of a mask
    bitmask, vocab = processors.bitmask, model.vocab_size
    per_row = np.full(len(hidden), temperature, np.float32)

    def job() -> StepRun:
        allowed = Allowed.of_mask(bitmask, compact.rows, vocab)
        logits = candidates(hidden, allowed.tokens, per_row, compact.union)
        refuse_overflow(logits, logits, temperature=temperature)
        own = processors.take(compact.rows)
        return compact_step(logits, allowed, temperature, own, bias, sample, u, vocab)

    return job


async def compact_run(model: LoadedVersion, job: Callable[[], StepRun], rows: int) -> StepRun:
    """A request whose every row is compact: its ``compact_job`` as a run of the head (in the
    run metrics, as the candidates' rows of W are)."""
    return await model.run_alone(rows, job)
