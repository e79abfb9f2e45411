"""The decoding step of rows whose grammar mask allows few tokens, from those tokens' logits
alone: no projection of the whole vocabulary for them.

At a structural point of a JSON grammar a mask allows tens of tokens; the row's distribution
is over those alone (every other token is -inf, no mass). Their logits come from their rows
of W (``CandidateLogits``, what the graph computes for those columns), one product for the
union of the rows' tokens, and the step runs over a (rows, m) array: each row's allowed
tokens in id order, padded to the longest with -inf. The bias and the processors are
``processed_at``'s on exactly those tokens; the top, log-sum-exp, filters and draws are
``step_run``'s over the short rows, whose prefix is the whole distribution (nothing reaches
past it). Answers name tokens, not columns.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import numpy.typing as npt

from service.runtime.processed_at import processed, touched
from service.runtime.processors import Processors
from service.runtime.sparse_masks import Allowed
from service.runtime.step import StepRun, step_run
from service.runtime.vocabulary import Bias, SampleSpec

Floats = npt.NDArray[np.float32]
Flags = npt.NDArray[np.bool_]


def compact_step(
    logits: Floats,
    allowed: Allowed,
    temperature: float,
    processors: Processors,
    bias: Bias | None,
    sample: SampleSpec | None,
    u: npt.NDArray[np.float64] | None,
    vocab: int,
) -> StepRun:
    """The step over ``logits`` (rows, m): the logits of ``allowed.tokens`` (processed in
    place), ``processors`` the rows' options; ids in the answer are tokens."""
    rows = len(logits)
    keys = (np.arange(rows, dtype=np.int64)[:, None] * vocab + allowed.tokens)[allowed.real]
    own = touched(processors, bias, rows, vocab, listed=keys)  # exactly ``keys``, in order
    logits[allowed.real] = processed(processors, own, logits[allowed.real], temperature)
    logits[~allowed.real] = -np.inf
    neutral = Processors(logprobs_mode=processors.logprobs_mode, order=processors.order)
    run = step_run(logits, temperature, neutral, None, sample, logits.shape[1], u)
    sampled = run.sampled
    if sampled is not None:
        sampled = np.take_along_axis(allowed.tokens, sampled, axis=1)
    ids = np.take_along_axis(allowed.tokens, run.ids, axis=1)
    return dataclasses.replace(run, ids=ids, sampled=sampled)
