"""Scoring's answers against the float64 reference: target log-probs, ranks, NLL and
perplexity, top-k alternatives and candidates, all over the row's whole log-sum-exp; and
scoring within candidates (log-probs over them alone, ties ranked by id)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from service.heads.reference import log_softmax, logsumexp, top_k
from service.messages import CandidateScores, HeadInfo
from service.plane.scoring import score_result, score_within
from service.runtime.layout import open_head
from service.runtime.vocabulary import TokenSpace
from tests.conftest import D_MODEL, VOCAB, reference_logits

HEAD = HeadInfo("m", 1, False, VOCAB, D_MODEL, "float32")
ROWS = 12


@pytest.mark.parametrize("head", ["tied_path", "untied_path"])
def test_scores_are_the_references_log_probs_ranks_and_nll(
    head: str, request: pytest.FixtureRequest
) -> None:
    path: Path = request.getfixturevalue(head)
    rng = np.random.default_rng(6)
    hidden = rng.standard_normal((ROWS, D_MODEL), dtype=np.float32)
    targets = rng.integers(0, VOCAB, ROWS)
    scored = open_head(path).score(hidden, targets, 5)
    log_p = log_softmax(reference_logits(path, hidden))
    ids = np.array([3, 50, 700], np.int64)
    every = np.ascontiguousarray(np.broadcast_to(ids, (ROWS, 3)))
    chosen = reference_logits(path, hidden)[:, ids].astype(np.float32)
    result = score_result(
        HEAD, scored, CandidateScores(every, chosen, chosen), 3, TokenSpace(VOCAB)
    )
    want = log_p[np.arange(ROWS), targets]
    np.testing.assert_allclose(result.logprob, want, rtol=1e-4, atol=1e-4)
    _, order = top_k(log_p, VOCAB)
    np.testing.assert_array_equal(result.rank, np.argmax(order == targets[:, None], axis=1))
    assert result.nll == pytest.approx(-want.mean(), rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(-want.mean()), rel=1e-5)
    assert result.alternatives is not None
    assert result.candidates is not None
    np.testing.assert_array_equal(result.alternatives.ids, order[:, :3])
    top = np.take_along_axis(log_p, order[:, :3], axis=1)
    np.testing.assert_allclose(result.alternatives.logprobs, top, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(result.candidates.logprobs, log_p[:, ids], rtol=1e-4, atol=1e-4)


def test_scores_within_candidates_are_over_them_alone_ties_ranked_by_id() -> None:
    """Per-row candidate lists in any order; tokens 40 and 9 tie with the target 20 in row 0."""
    ids = np.array([[40, 20, 7, 9], [5, 6, 7, 8], [8, 7, 6, 5]], np.int64)
    logits = np.array([[2.0, 2.0, -1.0, 2.0], [0.0, 1.0, 2.0, 3.0], [1.0, 1.0, 1.0, 1.0]])
    logits = logits.astype(np.float32)
    targets = np.array([20, 6, 7])
    result = score_within(HEAD, CandidateScores(ids, logits, logits), targets, TokenSpace(VOCAB))
    log_p = log_softmax(logits)
    assert result.rank.tolist() == [1, 2, 2]
    np.testing.assert_allclose(result.logprob, log_p[[0, 1, 2], [1, 1, 1]], rtol=1e-6)
    assert result.candidates is not None
    np.testing.assert_allclose(result.candidates.logprobs, log_p, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(
        result.logprob, logits[[0, 1, 2], [1, 1, 1]] - logsumexp(logits), rtol=1e-6
    )
    assert result.logprobs_over == "candidates"
