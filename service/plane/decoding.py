"""The decoding step in the data plane: a request's rows run by runs of the version's size, each
run's full logits processed where they lie (``service.runtime.step``), and the answer made.

Why full logits: penalties, stop rules, bad words and a grammar's bitmask change tokens
anywhere in a row, so the prefix tricks of ``service.plane.distribution`` (a top-(k + |B|) run
and B's rows of W) cannot hold them. A run's logits are fetched as every run's are
(``LoadedVersion.project`` through the batcher, ``full_logits``), at most
``rows_per_run`` rows at a time, and the processing of one run happens in the inference
executor while the next can be queued; nothing holds more than one run's (rows x vocab)
float32 beside the selection's log-softmax (``costs.decoding`` declares them).

The answer (``TopKResult``): the top-k of the distribution every processor and the
temperature make, ``raw`` (today's meaning: no sampling filter) or ``processed`` (after the
filters: a filtered token's logit and log-prob are -inf; ``logsumexp`` is the kept set's).
Tokens no processor leaves any mass (a mask, a ban) are never listed: k is cut to the fewest
such tokens any row has left. Draws: ``sample.n`` per row, their log-probs in the same mode.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from service.messages import LogitsResult, Sampled, TopKResult
from service.plane import distribution
from service.plane.distribution import SAMPLE_PREFIX
from service.plane.options import CheckedTopK
from service.repository.loaded_version import LoadedVersion
from service.runtime.filters import streams
from service.runtime.processors import Processors
from service.runtime.sparse_step import RawTop
from service.runtime.step import StepRun, step_run
from service.runtime.vocabulary import Floats, Ids, Shape

#: Raw tokens the graph's top holds past the prefix's width: a row's top is read from them
#: while at least ``width`` of them are outside the row's changed tokens (``sparse_step``).
RAW_SLACK = 32


@dataclass(frozen=True)
class Decoded:
    """Every row's step (``StepRun``'s arrays, rows in order), the top cut to ``k``."""

    values: Floats
    ids: Ids
    lse: Floats
    keep: npt.NDArray[np.bool_]
    kept_lse: Floats
    sampled: Ids | None
    sampled_values: Floats | None


def width_of(k: int, shape: Shape, vocab: int) -> int:
    """Tokens of each row's sorted prefix: k, and enough for the draws' filters."""
    spec = shape.sample
    wanted = k if spec is None else max(k, SAMPLE_PREFIX, spec.top_k or 0)
    return min(vocab, wanted)


async def decoding_topk(
    model: LoadedVersion, rows: Floats, k: int, temperature: float, shape: Shape
) -> Decoded:
    """The step over (rows, d_model) final states, run by run."""
    processors = shape.processors or Processors()
    spec = shape.sample
    width = width_of(k, shape, model.vocab_size)
    u = None if spec is None else streams(spec, len(rows))
    runs: list[StepRun] = []
    step = model.rows_per_run
    loop = asyncio.get_running_loop()
    raw_width = min(model.vocab_size, width + RAW_SLACK)
    for start in range(0, len(rows), step):
        stop = min(start + step, len(rows))
        logits, raw = await _full_logits(model, rows[start:stop], temperature, raw_width)
        part = processors.part(start, stop)
        drawn = None if u is None else u[start:stop]
        args = (logits, temperature, part, shape.bias, spec, width, drawn, raw)
        runs.append(await loop.run_in_executor(model.runner.executor, step_run, *args))
        del logits
    return _joined(runs, k)


async def processed_logits(
    model: LoadedVersion, rows: Floats, temperature: float, processors: Processors
) -> Floats:
    """``/logits`` with decoding options: (rows, vocab) logits after every processor (masked
    and banned tokens at -inf), run by run, processed in place in the inference executor."""
    projection = await model.project(rows, 1, temperature=temperature, full_logits=True)
    assert projection.logits is not None
    logits = projection.logits.reshape(len(rows), -1)
    loop = asyncio.get_running_loop()
    step = model.rows_per_run
    for start in range(0, len(rows), step):
        stop = min(start + step, len(rows))
        part = processors.part(start, stop)
        await loop.run_in_executor(
            model.runner.executor, part.apply, logits[start:stop], temperature
        )
    return logits


async def _full_logits(
    model: LoadedVersion, rows: Floats, temperature: float, k: int
) -> tuple[Floats, RawTop]:
    """A run's full logits, with the raw top ``k`` and log-sum-exp its graph took of them
    (``sparse_step`` reads most rows from these, not from a second pass)."""
    projection = await model.project(rows, k, temperature=temperature, full_logits=True)
    assert projection.logits is not None
    raw = RawTop(projection.topk_logits, projection.topk_token_ids, projection.logsumexp)
    return projection.logits, raw


A = TypeVar("A", bound=npt.NDArray[Any])


def _cat(arrays: list[A]) -> A:
    """Runs' arrays in row order (one run's as it is)."""
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)  # type: ignore[return-value]


def _joined(runs: list[StepRun], k: int) -> Decoded:
    cat = _cat

    values = cat([run.values for run in runs])
    # tokens with no mass (masked, banned) are never listed: k is the fewest any row has left
    k = max(1, min(k, int(np.isfinite(values[:, :k]).sum(axis=1).min())))
    sampled = [run.sampled for run in runs if run.sampled is not None]
    picked = [run.sampled_values for run in runs if run.sampled_values is not None]
    return Decoded(
        np.ascontiguousarray(values[:, :k]),
        np.ascontiguousarray(cat([run.ids for run in runs])[:, :k]),
        cat([run.lse for run in runs]),
        np.ascontiguousarray(cat([run.keep for run in runs])[:, :k]),
        cat([run.kept_lse for run in runs]),
        cat(sampled) if sampled else None,
        cat(picked) if picked else None,
    )


def decoding_result(
    model: LoadedVersion,
    leading: tuple[int, ...],
    decoded: Decoded,
    shape: Shape,
    tokens: bool,
) -> TopKResult:
    """The answer, leading dims as sent, in the processors' log-probs mode."""
    processors = shape.processors or Processors()
    processed = processors.logprobs_mode == "processed"
    lse = decoded.kept_lse if processed else decoded.lse
    values = decoded.values
    if processed:
        values = np.where(decoded.keep, values, np.float32(-np.inf)).astype(np.float32)
    with np.errstate(invalid="ignore"):  # -inf - finite is -inf; no NaN can come
        logprobs = values - lse[:, None]
    space = model.space
    ids = decoded.ids
    sampled = None
    spec = shape.sample
    if spec is not None and decoded.sampled is not None and decoded.sampled_values is not None:
        drawn = decoded.sampled
        drawn_logprobs = decoded.sampled_values - lse[:, None]
        labels = model.tokens(drawn) if tokens else None
        shaped: tuple[int, ...] = (*leading, spec.n) if spec.n is not None else leading
        strings: list[Any] | None = None
        if labels is not None:
            strings = [list(row) if spec.n is not None else row[0] for row in labels]
        sampled = Sampled(
            space.original(drawn).reshape(shaped),
            drawn_logprobs.reshape(shaped).astype(np.float32),
            spec.seed,
            strings,
            spec.n,
        )
    return TopKResult(
        model.info,
        space.original(ids).reshape(*leading, -1),
        values.reshape(*leading, -1),
        lse.reshape(leading),
        logprobs.reshape(*leading, -1).astype(np.float32),
        model.tokens(ids) if tokens else None,
        shape.over,
        sampled,
        processors.logprobs_mode,
    )


def logits_result(
    model: LoadedVersion, leading: tuple[int, ...], logits: Floats, columns: Ids | None
) -> LogitsResult:
    """Processed logits as ``/logits`` answers them: every column, or the allowed ones."""
    if columns is None:
        return LogitsResult(model.info, logits.reshape(*leading, -1), model.space.kept)
    every = np.broadcast_to(columns, (len(logits), columns.shape[-1]))
    chosen = np.take_along_axis(logits, every, axis=1)
    return LogitsResult(
        model.info,
        chosen.reshape(*leading, -1),
        model.space.original(np.ascontiguousarray(every)).reshape(*leading, -1),
    )


async def shaped_topk(
    model: LoadedVersion, checked: CheckedTopK, shape: Shape, tokens: bool
) -> TopKResult:
    """Top-k of the distribution the options shape (never shadowed: not the head's own): the
    decoding step when its processors are asked (every row whole), else the shaped
    distribution's cheaper paths (``service.plane.distribution``)."""
    hidden = checked.hidden
    rows = hidden.reshape(-1, model.d_model)
    if shape.processors is not None:
        step = await decoding_topk(model, rows, checked.k, checked.temperature, shape)
        return decoding_result(model, hidden.shape[:-1], step, shape, tokens)
    shaped = await distribution.shaped_topk(model, rows, checked.k, checked.temperature, shape)
    return distribution.topk_result(model, hidden.shape[:-1], shaped, shape, tokens)
