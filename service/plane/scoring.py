"""Scoring: each position's target log-prob and rank, top-k alternatives, NLL and perplexity,
for prompts of any length within the row limit, in memory bounded by one small run.

A run of ``score_rows`` rows holds its logits (and, unless the session can take its
log-sum-exp in row chunks, as on a CPU, onnxruntime's log-softmax of them:
``service.heads.lse_graph``), within ``SCORE_BYTES``; the target logit and the rank are read from
the logits before the next run, so no (rows x vocab) tensor exists for the whole request.
With ``logprobs_over='candidates'`` nothing runs over the vocabulary at all: the target is
scored among the row's candidates, from their rows of W.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from service.limits import LOGIT_BYTES
from service.messages import CandidateScores, HeadInfo, ScoreResult
from service.plane.comparison import perplexity
from service.repository.loaded_version import LoadedVersion
from service.runtime.logmath import logsumexp, target_ranks
from service.runtime.session import Scored
from service.runtime.vocabulary import Floats, Ids, TokenSpace, refuse_overflow

#: The rows x vocab float32 tensors of one scoring run.
SCORE_BYTES = 48 * 2**20


def score_rows(vocab_size: int, rows_per_run: int, logit_copies: int) -> int:
    """Rows per scoring run: its ``logit_copies`` rows x vocab tensors stay small."""
    return max(1, min(rows_per_run, SCORE_BYTES // (logit_copies * vocab_size * LOGIT_BYTES)))


async def score_chunks(model: LoadedVersion, rows: Floats, targets: Ids, k: int) -> Scored:
    """Target logits, ranks, top-k alternatives and log-sum-exp of any number of rows, in
    runs of ``score_rows``: peak memory is one run's, whatever the prompt's length (and the
    run's logits buffer is the inference thread's, not the request's: ``HeadSession.score``)."""
    step = score_rows(model.vocab_size, model.rows_per_run, model.session.score_copies)
    parts = [
        await model.run_alone(
            len(rows[i : i + step]),
            model.session.score,
            rows[i : i + step],
            targets[i : i + step],
            k,
        )
        for i in range(0, len(rows), step)
    ]
    scored = Scored(*(np.concatenate(arrays) for arrays in zip(*_fields(parts), strict=True)))
    refuse_overflow(scored.logsumexp, scored.topk_logits, scored.target_logit)
    return scored


def _fields(parts: list[Scored]) -> list[tuple[npt.NDArray[np.generic], ...]]:
    return [(p.topk_logits, p.topk_token_ids, p.logsumexp, p.target_logit, p.rank) for p in parts]


def score_within(
    head: HeadInfo, candidates: CandidateScores, targets: Ids, space: TokenSpace
) -> ScoreResult:
    """Score each row's target among its candidates only (classification with an LM); each
    target is one of its row's candidates (``service.plane.options.score`` checked it)."""
    columns = (candidates.ids == targets[:, None]).argmax(axis=1)
    logits = candidates.logits
    lse = logsumexp(logits)
    target, rank = target_ranks(logits, columns, candidates.ids)  # equal logits: ids in order
    logprob = target - lse
    within = CandidateScores(space.original(candidates.ids), logits, logits - lse[:, None])
    return ScoreResult(
        head, target, logprob, rank, *_nll_perplexity(logprob), within, logprobs_over="candidates"
    )


def score_result(
    head: HeadInfo, scored: Scored, candidates: CandidateScores | None, k: int, space: TokenSpace
) -> ScoreResult:
    """The answer, ids as requests name them (``space``: a trimmed head's original ids)."""
    lse = scored.logsumexp
    logprob = scored.target_logit - lse
    if candidates is not None:
        logprobs = candidates.logits - lse[:, None]
        candidates = CandidateScores(space.original(candidates.ids), candidates.logits, logprobs)
    alternatives = None
    if k:
        values = scored.topk_logits[:, :k]
        ids = space.original(scored.topk_token_ids[:, :k])
        alternatives = CandidateScores(ids, values, values - lse[:, None])
    return ScoreResult(
        head,
        scored.target_logit,
        logprob,
        scored.rank,
        *_nll_perplexity(logprob),
        candidates,
        alternatives,
    )


def _nll_perplexity(logprob: Floats) -> tuple[float, float]:
    """Mean negative log-likelihood (float64) and its exp (inf past float's range)."""
    nll = float(-logprob.astype(np.float64).mean())
    return nll, perplexity(nll)
