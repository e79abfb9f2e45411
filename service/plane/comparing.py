"""The compare verb: the same rows through two heads, side by side.

Both heads' full logits are held at once (their bytes checked by ``options.compare`` and
declared by ``costs.compare``); the statistics (agreement, KL both ways, NLL and wins with the
real next tokens) run on the data plane's statistics thread (``service.plane.comparison``),
never on the inference threads; speed, when asked, is measured on each head alone.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

import numpy as np
import numpy.typing as npt

from service.limits import Limits
from service.messages import CompareRequest, CompareResult
from service.plane import comparison, costs, lens_options, options
from service.plane.lens import final_states
from service.repository.loaded_version import LoadedVersion
from service.runtime.vocabulary import refuse_overflow

SPEED_ROWS = 64
SPEED_RUNS = 5
#: Runs ``function(*args)`` on the statistics thread.
Statistics = Callable[..., Awaitable[Any]]


async def compare_heads(
    request: CompareRequest,
    heads: tuple[LoadedVersion, LoadedVersion],
    limits: Limits,
    statistics: Statistics,
) -> CompareResult:
    """Agreement, KL both ways, NLL per head and speed, of two leased heads."""
    a, b = heads
    checked = options.compare(request, heads, limits)
    hidden, targets, k = checked.hidden, checked.targets, checked.k
    flags = [lens_options.residual(request.states, head) for head in heads]
    costs.admit(costs.compare(heads, math.prod(hidden.shape[:-1]), any(flags)), limits, "compare")
    states = [await final_states(h, hidden, f) for h, f in zip(heads, flags, strict=True)]
    full = [await _full(h, rows) for h, rows in zip(heads, states, strict=True)]
    (logits_a, _), (logits_b, _) = full
    agreement = await statistics(comparison.agreement, logits_a, logits_b, k)
    blocks = (_block(a), _block(b))
    ties = None
    if targets is not None:
        scores = [await statistics(comparison.score, *f, targets) for f in full]
        *wins, ties = comparison.wins(scores[0], scores[1])
        for block, result, won in zip(blocks, scores, wins, strict=True):
            block["nll"], block["perplexity"] = result.nll, result.perplexity
            block["wins"] = won
    if request.measure_speed:
        for head, block in zip(heads, blocks, strict=True):
            block["rows_per_s"] = await head.rows_per_second(hidden, SPEED_ROWS, SPEED_RUNS)
            block["speed_rows"] = SPEED_ROWS
    return CompareResult(agreement, blocks, ties)


async def _full(
    model: LoadedVersion, hidden: npt.NDArray[np.float32]
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """Full (rows, vocab) logits and log-sum-exp (``options.compare`` checked their bytes)."""
    rows = hidden.reshape(-1, model.d_model)
    projection = await model.project(rows, 1, full_logits=True)
    assert projection.logits is not None
    refuse_overflow(projection.logsumexp, projection.logits)
    return projection.logits, projection.logsumexp


def _block(head: LoadedVersion) -> dict[str, Any]:
    """A head's block in compare's answer: its name and details, filled in above."""
    return {"name": head.name, **asdict(head.details())}
