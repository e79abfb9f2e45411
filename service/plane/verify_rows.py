"""What ``/verify``'s rule reads of a head's rows: each position's processed distribution at
a few tokens (the drafts) and whole at one row per sequence (where it stops), without every
row's probabilities.

A request's rows run through the head with their full logits, run by run, a run holding
whole sequences (``per`` rows each), and the graph's own raw top and log-sum-exp beside them.
A plain distribution (a temperature, nothing else) is read from those as they are: its
log-sum-exp is the graph's, no second pass. Any other option goes through the decoding
step's run (``step_run`` with ``raw``: bias, bans, every processor, the filters of
``sample``; rows with few changed tokens read from the graph's top, ``sparse_step``), which
processes the run's logits in place: the distribution at token x is then ``exp(logit(x) -
kept_lse)`` where the filters keep x, else 0. Nothing of (rows x vocab) is made beyond the
logits the runs return; a whole row is made only where ``whole`` is asked.

A mask the step left pending (rows whose mask allows few tokens are read sparsely and never
written whole) is read from its words at the tokens asked, and written into a row before the
row is read whole. The kept set of a filtered row lies in its sorted prefix unless the
prefix's last token is kept; such a row is sorted whole, as the step's draws do.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from service.plane.decoding import RAW_SLACK
from service.repository.loaded_version import LoadedVersion
from service.runtime.filters import filtered_prefix
from service.runtime.processors import Processors, Words, apply_bitmask
from service.runtime.sparse_step import RawTop
from service.runtime.step import columns, step_run
from service.runtime.vocabulary import Floats, Ids, Shape, top_sorted

#: The prefix each row's processed distribution is ranked to (the filters' first look).
WIDTH = 64
Flags = npt.NDArray[np.bool_]


@dataclass
class Run:
    """One run's rows: ``logits`` (processed in place when stepped), the distribution's
    log-sum-exp before the filters (``lse``) and after (``kept_lse``), its top token and
    value; ``mask`` the rows' bitmask words (one row for all, or one per row) when any;
    ``ids``/``keep`` each row's ranked prefix and what the filters keep of it, when they ran;
    ``kept_rows`` the kept set of the rows whose set reaches past the prefix."""

    logits: Floats
    lse: Floats
    kept_lse: Floats
    top: Ids
    top_value: Floats
    mask: Words | None = None
    ids: Ids | None = None
    keep: Flags | None = None
    kept_rows: dict[int, Flags] = field(default_factory=dict)

    def allowed(self, rows: Ids, tokens: Ids) -> Flags:
        """Whether the mask allows each (row, token); every one where none."""
        if self.mask is None:
            return np.ones(len(rows), np.bool_)
        words = self.mask[rows if len(self.mask) > 1 else np.zeros_like(rows), tokens >> 5]
        bits: Flags = ((words >> (tokens & 31)) & 1).astype(np.bool_)
        return bits

    def kept(self, rows: Ids, tokens: Ids) -> Flags:
        """Whether the filters keep each (row, token) (the mask's allowance included)."""
        kept = self.allowed(rows, tokens) & np.isfinite(self.logits[rows, tokens])
        if self.ids is None or self.keep is None:
            return kept
        in_prefix = (self.ids[rows] == tokens[:, None]) & self.keep[rows]
        beyond = np.array([row in self.kept_rows for row in rows.tolist()], np.bool_)
        kept &= in_prefix.any(axis=1) | beyond
        for at, row in enumerate(rows.tolist()):
            whole = self.kept_rows.get(row)
            if whole is not None:  # the set reaches past the prefix: the row's own
                kept[at] &= whole[tokens[at]]
        return kept

    def whole(self, row: int) -> Floats:
        """The row's processed logits (float32, vocab), -inf where the mask or the filters
        leave no mass."""
        values: Floats = self.logits[row].copy()
        if self.mask is not None:
            apply_bitmask(values[None, :], self.mask[row if len(self.mask) > 1 else 0][None, :])
        if self.ids is not None and self.keep is not None:
            kept = self.kept_rows.get(row)
            if kept is None:
                kept = np.zeros(len(values), np.bool_)
                kept[self.ids[row][self.keep[row]]] = True
            values[~kept] = -np.inf
        return values


def raw_width(shape: Shape, vocab: int) -> tuple[int, int]:
    """The prefix each row is ranked to, and the raw top the graph is asked for beside it
    (one token where the distribution is the head's own)."""
    spec = shape.sample
    width = min(vocab, max(WIDTH, spec.top_k or 0) if spec is not None else WIDTH)
    plain = shape.processors is None and shape.bias is None and not filters(shape)
    return width, 1 if plain else min(vocab, width + RAW_SLACK)


def filters(shape: Shape) -> bool:
    spec = shape.sample
    return spec is not None and (spec.top_k, spec.top_p, spec.min_p) != (None,) * 3


async def read(
    model: LoadedVersion, rows: Floats, per: int, temperature: float, shape: Shape
) -> tuple[list[Run], int]:
    """Every row's distribution (``rows``: final states (n, d_model), ``per`` a sequence's
    rows), run by run; the runs and the rows each holds (the last may hold fewer)."""
    step = max(1, model.rows_per_run // per) * per
    width, k = raw_width(shape, model.vocab_size)
    processors = shape.processors
    plain = processors is None and shape.bias is None and not filters(shape)
    loop = asyncio.get_running_loop()
    runs = []
    for start in range(0, len(rows), step):
        stop = min(start + step, len(rows))
        projection = await model.project(
            rows[start:stop], k, temperature=temperature, full_logits=True
        )
        assert projection.logits is not None
        raw = RawTop(projection.topk_logits, projection.topk_token_ids, projection.logsumexp)
        part = None if processors is None else processors.part(start, stop)
        args = (projection.logits, raw, temperature, part, shape, width)
        if plain:  # the head's own distribution: read as it is, no hop to the executor
            runs.append(_run(*args))
        else:
            runs.append(await loop.run_in_executor(model.runner.executor, _run, *args))
    return runs, step


def _run(
    logits: Floats,
    raw: RawTop,
    temperature: float,
    processors: Processors | None,
    shape: Shape,
    width: int,
) -> Run:
    """One run's distribution (in the inference executor)."""
    if processors is None and shape.bias is None and not filters(shape):
        return Run(logits, raw.lse, raw.lse, raw.ids[:, 0], raw.values[:, 0])
    given = processors or Processors()
    spec = shape.sample
    step = step_run(logits, temperature, given, shape.bias, spec, width, None, raw)
    run = Run(logits, step.lse, step.kept_lse, step.ids[:, 0], step.values[:, 0], given.bitmask)
    if not filters(shape):
        return run
    assert spec is not None
    vocab = logits.shape[1]
    run.ids, run.keep = step.ids, step.keep
    for row in np.flatnonzero(step.keep[:, -1] & (width < vocab)).tolist():
        values = logits[row : row + 1].copy()
        if run.mask is not None:
            apply_bitmask(values, run.mask[row if len(run.mask) > 1 else 0][None, :])
        ranked, order = top_sorted(values, columns(vocab), vocab)
        lse = step.lse[row : row + 1]
        whole = filtered_prefix(ranked, lse, spec, given.order, vocab)
        kept = np.zeros(vocab, np.bool_)
        kept[order[0, whole.keep[0]]] = True
        run.kept_rows[row] = kept
    return run


class Rows:
    """A head's runs read as one array of rows (``step`` rows a run)."""

    def __init__(self, runs: list[Run], step: int) -> None:
        self.runs, self.step = runs, step
        self.lse = np.concatenate([run.lse for run in runs])
        self.kept_lse = np.concatenate([run.kept_lse for run in runs])
        self.top = np.concatenate([run.top for run in runs])
        self.top_value = np.concatenate([run.top_value for run in runs])

    def values(self, rows: Ids, tokens: Ids) -> Floats:
        """The processed logits at (row, token) pairs (before the pending masks)."""
        found = np.empty(len(rows), np.float32)
        for run, at, local in self._parts(rows):
            found[at] = run.logits[local, tokens[at]]
        return found

    def kept(self, rows: Ids, tokens: Ids) -> Flags:
        """Whether each (row, token) has mass in the processed distribution."""
        found = np.empty(len(rows), np.bool_)
        for run, at, local in self._parts(rows):
            found[at] = run.kept(local, tokens[at])
        return found

    def probs(self, rows: Ids, tokens: Ids) -> npt.NDArray[np.float64]:
        """The processed distribution at (row, token) pairs, in float64."""
        values = self.values(rows, tokens).astype(np.float64) - self.kept_lse[rows]
        return np.where(self.kept(rows, tokens), np.exp(values), 0.0)

    @property
    def vocab(self) -> int:
        return self.runs[0].logits.shape[1] if self.runs else 0

    def whole(self, rows: Ids, into: Floats | None = None) -> Floats:
        """The processed distribution of ``rows``, whole (float32, (rows, vocab)); written
        into ``into``'s first rows when given (a buffer reused chunk by chunk)."""
        shape = (len(rows), self.vocab)
        found = np.empty(shape, np.float32) if into is None else into[: len(rows)]
        for at, row in enumerate(rows.tolist()):
            run = self.runs[row // self.step]
            local = row % self.step
            plain = run.mask is None and run.ids is None  # nothing to remove: read in place
            source = run.logits[local] if plain else run.whole(local)
            np.subtract(source, self.kept_lse[row], out=found[at])
        with np.errstate(under="ignore"):
            np.exp(found, out=found)
        return found

    def _parts(self, rows: Ids) -> list[tuple[Run, Ids, Ids]]:
        """Each run's share of ``rows``: the run, where they sit in ``rows``, its own rows."""
        which = rows // self.step
        parts = []
        for index in np.unique(which).tolist():
            at = np.flatnonzero(which == index)
            parts.append((self.runs[index], at, rows[at] - index * self.step))
        return parts
