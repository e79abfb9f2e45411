"""A head's next-token distribution, shaped as a request asks: allowed tokens, bias, sampling.

The options arrive checked, as a ``Shape`` (``service.plane.options`` checks them, before any
of this runs); ``service.runtime.vocabulary`` holds the numpy, this module decides what to
fetch from the head.

Costs, by construction:

* allowed tokens: their rows of W (n x d_model) and a small matmul; a full run only when the
  log-probs must be over the whole vocabulary (its log-sum-exp); a quantized head's logits
  always come from a full run (its graph's numbers; ``layout.candidate_logits`` says why);
* bias or banned tokens: one run for the top-(k + |B|) and |B| rows of W;
* sampling: the same run with a wider top (``SAMPLE_PREFIX``); only a row whose kept set may
  reach past it is run again with full logits (a flat distribution, no filter).

Scoring long prompts is ``service.plane.scoring``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from service.messages import Sampled, TopKResult
from service.repository.loaded_version import LoadedVersion
from service.runtime.logmath import logsumexp
from service.runtime.vocabulary import (
    Bias,
    CandidateLogits,
    Floats,
    Ids,
    Shape,
    apply_bias,
    biased_topk,
    refuse_overflow,
    sample_sorted,
    swap_lse,
    top_sorted,
)

#: Tokens fetched per row for sampling: the kept set of a peaked distribution fits in it.
SAMPLE_PREFIX = 64


@dataclass(frozen=True)
class Shaped:
    """Top-k of the shaped distribution (rows x k), its log-sum-exp, and the draws."""

    values: Floats
    ids: Ids
    lse: Floats
    sampled: Ids | None = None
    sampled_logprobs: Floats | None = None


async def candidate_logits(
    model: LoadedVersion, rows: Floats, ids: Ids, temperature: float
) -> Floats:
    """(rows, n) logits of ``ids`` from their rows of W (full logits when the head's layout
    has no row source)."""
    per_row = np.full(len(rows), temperature, np.float32)
    candidates = model.session.candidates
    if candidates is not None:
        found = await model.run_alone(len(rows), candidates, rows, ids, per_row)
        refuse_overflow(found, found, temperature=temperature)
        return found
    every = np.broadcast_to(ids, (len(rows), ids.shape[-1])) if ids.ndim == 1 else ids
    step = model.rows_per_run  # one run's full logits at a time, never (rows x vocab)
    parts = []
    for start in range(0, len(rows), step):
        part = slice(start, start + step)
        logits = await model.project(rows[part], 1, temperature=temperature, full_logits=True)
        assert logits.logits is not None
        parts.append(np.take_along_axis(logits.logits, every[part], axis=1))
    found = np.concatenate(parts) if parts else np.zeros(every.shape, np.float32)
    refuse_overflow(found, found, temperature=temperature)
    return found


async def full_logits(model: LoadedVersion, rows: Floats, temperature: float) -> Floats:
    """Full logits of a few rows (the exact fallback; ``costs.topk`` declared them)."""
    projection = await model.project(rows, 1, temperature=temperature, full_logits=True)
    assert projection.logits is not None
    refuse_overflow(projection.logsumexp, projection.logits, temperature=temperature)
    return projection.logits


async def shaped_topk(
    model: LoadedVersion, rows: Floats, k: int, temperature: float, shape: Shape
) -> Shaped:
    if shape.allowed is not None:
        return await _restricted(model, rows, k, temperature, shape, shape.allowed)
    return await _whole(model, rows, k, temperature, shape)


async def _restricted(
    model: LoadedVersion, rows: Floats, k: int, temperature: float, shape: Shape, allowed: Ids
) -> Shaped:
    candidates = model.session.candidates
    if candidates is not None and shape.bias is None and shape.sample is None:
        # the plain case: logits, their top-k and log-sum-exp in one hop to the executor
        per_row = np.full(len(rows), temperature, np.float32)
        args = (candidates, rows, allowed, per_row, k, temperature)
        values, ids, lse = await model.run_alone(len(rows), _top_of_candidates, *args)
        if shape.over == "vocabulary":
            lse = await _vocabulary_lse(model, rows, temperature, None)
        return Shaped(values, ids, lse)
    logits = await candidate_logits(model, rows, allowed, temperature)
    if shape.bias is not None:
        logits = apply_bias(logits, allowed, shape.bias)
    if shape.bias is not None:  # banned tokens are never listed
        k = min(k, int((~np.isneginf(logits)).sum(axis=1).min()))
    # Sampling draws from the whole sorted row; top-k needs its k only (``top_sorted``).
    width = logits.shape[1] if shape.sample is not None else k
    ordered, order_ids = top_sorted(logits, allowed, width)
    lse = logsumexp(logits)
    sampled = drawn = None
    if shape.sample is not None:
        draws = shape.sample.uniforms(len(rows))
        index, _ = sample_sorted(ordered, lse, shape.sample, draws, 0)
        sampled = order_ids[np.arange(len(rows)), index]
        drawn = ordered[np.arange(len(rows)), index]
    if shape.over == "vocabulary":
        lse = await _vocabulary_lse(model, rows, temperature, shape.bias)
    logprobs = None if drawn is None else drawn - lse
    return Shaped(ordered[:, :k], order_ids[:, :k], lse, sampled, logprobs)


def _top_of_candidates(
    candidates: CandidateLogits,
    rows: Floats,
    allowed: Ids,
    per_row: Floats,
    k: int,
    temperature: float,
) -> tuple[Floats, Ids, Floats]:
    """The top-k of the allowed tokens' logits and their log-sum-exp (in the executor); for a
    head with no transform after its product and one list for every row, taken in the
    product's own run (``CandidateLogits.top``)."""
    if candidates.plain and allowed.ndim == 1:
        values, ids, lse = candidates.top(rows, np.sort(allowed), per_row, k)
        refuse_overflow(lse, values, temperature=temperature)
        return values, ids, lse
    logits = candidates(rows, allowed, per_row)
    refuse_overflow(logits, logits, temperature=temperature)
    values, ids = top_sorted(logits, allowed, k)
    return values, ids, logsumexp(logits)


async def _vocabulary_lse(
    model: LoadedVersion, rows: Floats, temperature: float, bias: Bias | None
) -> Floats:
    """The whole vocabulary's log-sum-exp, biased when asked (one run, k=1)."""
    lse = (await model.project(rows, 1, temperature=temperature)).logsumexp
    if bias is None:
        return lse
    raw = await candidate_logits(model, rows, bias.ids, temperature)
    swapped, trusted = swap_lse(lse, raw, bias)
    async for part, _, part_lse in _exact_rows(model, rows, ~trusted, temperature, bias):
        swapped[part] = part_lse
    return swapped


async def _whole(
    model: LoadedVersion, rows: Floats, k: int, temperature: float, shape: Shape
) -> Shaped:
    vocab, bias, spec = model.vocab_size, shape.bias, shape.sample
    if bias is not None:
        k = min(k, vocab - bias.banned)  # banned tokens are never listed
    width = max(k, SAMPLE_PREFIX, spec.top_k or 0) if spec is not None else k
    extra = 0 if bias is None else len(bias.ids)
    projection = await model.project(rows, min(vocab, width + extra), temperature=temperature)
    values, ids, lse = projection.topk_logits, projection.topk_token_ids, projection.logsumexp
    redo = np.zeros(len(rows), np.bool_)
    if bias is not None:
        raw = await candidate_logits(model, rows, bias.ids, temperature)
        values, ids = biased_topk(values, ids, raw, bias, width)
        lse, trusted = swap_lse(lse, raw, bias)
        redo |= ~trusted
    sampled = drawn = None
    if spec is not None:
        index, inside = sample_sorted(values, lse, spec, spec.uniforms(len(rows)), vocab)
        picked = np.arange(len(rows)), index
        sampled, drawn = ids[picked], values[picked]
        redo |= ~inside
    values, ids = values[:, :k].copy(), ids[:, :k].copy()
    draws = None if spec is None else spec.uniforms(len(rows))  # row i's u, as in the batch

    def redo_rows(part: npt.NDArray[np.intp], logits: Floats, part_lse: Floats) -> None:
        for offset, row in enumerate(part.tolist()):
            lse[row] = part_lse[offset]
            row_logits = logits[offset : offset + 1]
            order = np.argsort(-row_logits[0], kind="stable")  # the whole row, descending
            values[row], ids[row] = row_logits[0, order[:k]], order[:k]
            if spec is not None and draws is not None and sampled is not None and drawn is not None:
                u, row_lse = draws[row : row + 1], part_lse[offset : offset + 1]
                (chosen,), _ = sample_sorted(row_logits[:, order], row_lse, spec, u, vocab)
                sampled[row], drawn[row] = order[chosen], row_logits[0, order[chosen]]

    async for part, logits, part_lse in _exact_rows(model, rows, redo, temperature, bias):
        # A sort of the whole vocabulary per row (~3-4 ms at 32k tokens): 1,048 such rows held
        # the event loop, health checks included, for 4.6 s. A thread does it.
        await asyncio.to_thread(redo_rows, part, logits, part_lse)
    logprobs = None if drawn is None else drawn - lse
    return Shaped(values, ids, lse, sampled, logprobs)


async def _exact_rows(
    model: LoadedVersion,
    rows: Floats,
    chosen: npt.NDArray[np.bool_],
    temperature: float,
    bias: Bias | None,
) -> AsyncIterator[tuple[npt.NDArray[np.intp], Floats, Floats]]:
    """(positions, their biased full logits (n, vocab), their log-sum-exp) of the chosen rows:
    the exact fallback, one run per ``rows_per_run`` of them (not one per row: each run reads
    W); the bias and log-sum-exp of a chunk are computed off the event loop."""
    positions = np.flatnonzero(chosen)
    step = model.rows_per_run
    for start in range(0, len(positions), step):
        part = positions[start : start + step]
        logits = await full_logits(model, rows[part], temperature)
        logits, lse = await asyncio.to_thread(_biased_lse, logits, bias)
        yield part, logits, lse


def _biased_lse(logits: Floats, bias: Bias | None) -> tuple[Floats, Floats]:
    if bias is not None:
        logits = apply_bias(logits, None, bias)
    return logits, logsumexp(logits)


def topk_result(
    model: LoadedVersion, leading: tuple[int, ...], shaped: Shaped, shape: Shape, tokens: bool
) -> TopKResult:
    """The answer, leading dims as sent (with log-probs; the data plane drops them unless asked)."""
    values, ids = shaped.values.reshape(*leading, -1), shaped.ids.reshape(*leading, -1)
    lse = shaped.lse.reshape(leading)
    sampled = None
    space = model.space
    if shape.sample is not None and shaped.sampled is not None:
        assert shaped.sampled_logprobs is not None
        labels = model.tokens(shaped.sampled[:, None]) if tokens else None
        sampled = Sampled(
            space.original(shaped.sampled).reshape(leading),
            shaped.sampled_logprobs.reshape(leading),
            shape.sample.seed,
            None if labels is None else [row[0] for row in labels],
        )
    return TopKResult(
        model.info,
        space.original(ids),
        values,
        lse,
        values - lse[..., None],
        model.tokens(ids) if tokens else None,
        shape.over,
        sampled,
    )
