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
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from service.messages import LogitsResult, Sampled, TopKResult
from service.plane import distribution
from service.plane.decoding_compact import compact_job, compact_rows, compact_run
from service.plane.distribution import SAMPLE_PREFIX
from service.plane.options import CheckedTopK
from service.repository.loaded_version import LoadedVersion
from service.runtime.filters import streams
from service.runtime.processors import Processors
from service.runtime.session import HeadSession
from service.runtime.sparse_step import RawTop
from service.runtime.step import StepRun, step_run
from service.runtime.vocabulary import Bias, Floats, Ids, SampleSpec, Shape, refuse_overflow

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
    """The step over (rows, d_model) final states: the rows whose mask allows few tokens
    through those tokens alone (``decoding_compact``), the others run by run; the compact
    rows' step goes in the same hop to the executor as the first run's."""
    processors = shape.processors or Processors()
    spec = shape.sample
    u = None if spec is None else streams(spec, len(rows))
    compact = compact_rows(model, processors, len(rows))
    if compact is None:
        runs, _ = await _whole_runs(model, rows, k, temperature, shape, processors, u)
        return _joined(runs, k)
    taken = compact.rows
    drawn = None if u is None else u[taken]
    args = (temperature, processors, shape.bias, spec, drawn)
    job = compact_job(model, rows[taken], compact, *args)
    if len(taken) == len(rows):
        return _joined([(taken, await compact_run(model, job, len(taken)))], k)
    whole_rows = np.ones(len(rows), np.bool_)
    whole_rows[taken] = False
    rest = np.flatnonzero(whole_rows)
    runs, beside = await _whole_runs(model, rows, k, temperature, shape, processors, u, rest, job)
    assert beside is not None
    return _joined([(taken, beside), *runs], k)


async def _whole_runs(
    model: LoadedVersion,
    rows: Floats,
    k: int,
    temperature: float,
    shape: Shape,
    processors: Processors,
    u: npt.NDArray[np.float64] | None,
    whole: Ids | None = None,
    beside: Callable[[], StepRun] | None = None,
) -> tuple[list[tuple[Ids, StepRun]], StepRun | None]:
    """The step of the request's ``whole`` rows (None: every row) projected whole, run by
    run: each run's rows and its step; and ``beside``'s, done in the first run's job (the
    run's options are taken in the job too, off the event loop).

    A run and its step are one job of the inference thread (``run_alone``: in the run
    metrics, its step's time in the run's): through the batcher, the run's answer went to
    the event loop and its step back to the thread, two thread hops (~0.5 ms of a demo-head
    step of 10 ms) where the logits have nothing to wait for."""
    width = width_of(k, shape, model.vocab_size)
    raw_width = min(model.vocab_size, width + RAW_SLACK)
    every = np.arange(len(rows), dtype=np.int64) if whole is None else whole
    runs = []
    done = None
    for start in range(0, len(every), model.rows_per_run):
        at = every[start : start + model.rows_per_run]
        own = (
            functools.partial(processors.part, start, start + len(at))
            if whole is None
            else functools.partial(processors.take, at)
        )
        job = functools.partial(
            _run_and_step,
            model.session,
            rows[at],
            raw_width,
            (temperature, own, shape.bias, shape.sample, width),
            None if u is None else u[at],
            None if start else beside,
        )
        run, side = await model.run_alone(len(at), job)
        done = done or side
        runs.append((at, run))
    return runs, done


def _run_and_step(
    session: HeadSession,
    rows: Floats,
    raw_width: int,
    options: tuple[float, Callable[[], Processors], Bias | None, SampleSpec | None, int],
    u: npt.NDArray[np.float64] | None,
    beside: Callable[[], StepRun] | None,
) -> tuple[StepRun, StepRun | None]:
    """A run's full logits, with the raw top and log-sum-exp its graph took of them
    (``sparse_step`` reads most rows from these, not from a second pass), the run's step,
    and ``beside`` after it."""
    temperature, own, bias, sample, width = options
    processors = own()
    projection = session.project(rows, raw_width, temperature=temperature, full_logits=True)
    refuse_overflow(projection.logsumexp, projection.topk_logits, temperature=temperature)
    assert projection.logits is not None
    raw = RawTop(projection.topk_logits, projection.topk_token_ids, projection.logsumexp)
    args = (projection.logits, temperature, processors, bias, sample, width, u, raw)
    run = step_run(*args)
    return run, None if beside is None else beside()


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


def _joined(parts: list[tuple[Ids, StepRun]], k: int) -> Decoded:
    """Every part's rows in the request's order, each prefix cut (or padded, with tokens of
    no mass) to k; tokens with no mass (masked, banned) are never listed: k is then cut to
    the fewest any row has left."""
    rows = sum(len(at) for at, _ in parts)
    values = np.full((rows, k), -np.inf, np.float32)
    ids = np.zeros((rows, k), np.int64)
    keep = np.zeros((rows, k), np.bool_)
    lse = np.empty(rows, np.float32)
    kept_lse = np.empty(rows, np.float32)
    first = parts[0][1]
    sampled = None if first.sampled is None else np.empty((rows, first.sampled.shape[1]), np.int64)
    picked = None if sampled is None else np.empty(sampled.shape, np.float32)
    for at, run in parts:
        width = min(k, run.values.shape[1])
        values[at, :width], ids[at, :width] = run.values[:, :width], run.ids[:, :width]
        keep[at, :width] = run.keep[:, :width]
        lse[at], kept_lse[at] = run.lse, run.kept_lse
        if sampled is not None and picked is not None and run.sampled is not None:
            sampled[at], picked[at] = run.sampled, run.sampled_values
    k = max(1, min(k, int(np.isfinite(values).sum(axis=1).min())))
    return Decoded(
        np.ascontiguousarray(values[:, :k]),
        np.ascontiguousarray(ids[:, :k]),
        lse,
        np.ascontiguousarray(keep[:, :k]),
        kept_lse,
        sampled,
        picked,
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
