"""The statistics that compare two heads, on logits small enough to check by hand."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from service.cli.compare import format_comparison
from service.heads.reference import log_softmax, logsumexp, top_k
from service.plane.comparison import (
    Scores,
    agreement,
    kl_rows,
    perplexity,
    row_agreement,
    score,
    top_k_sets,
    wins,
)


def test_scores_are_the_references_log_probs_and_ranks_ties_to_the_lower_id() -> None:
    """Rows of small integers (ties everywhere): each target's log-prob over the row's
    log-sum-exp, its rank its place in the reference's top-k list; NLL their mean."""
    rng = np.random.default_rng(3)
    logits = rng.integers(-3, 3, (21, 300)).astype(np.float32)
    targets = rng.integers(0, 300, 21)
    scores = score(logits, logsumexp(logits).astype(np.float32), targets)
    log_p = log_softmax(logits)[np.arange(21), targets]
    np.testing.assert_allclose(scores.logprob, log_p, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(scores.logit, logits[np.arange(21), targets])
    _, order = top_k(logits, 300)
    np.testing.assert_array_equal(scores.rank, np.argmax(order == targets[:, None], axis=1))
    assert scores.nll == pytest.approx(-log_p.mean(), rel=1e-6)


def test_kl_both_ways_is_the_references_over_the_full_softmax() -> None:
    rng = np.random.default_rng(4)
    a = rng.standard_normal((9, 400)).astype(np.float32) * 3
    b = a + rng.standard_normal((9, 400)).astype(np.float32)
    log_a, log_b = log_softmax(a), log_softmax(b)
    want_ab = (np.exp(log_a) * (log_a - log_b)).sum(axis=1)
    np.testing.assert_allclose(kl_rows(a, b), want_ab, rtol=1e-10)
    report = agreement(a, b, 5)
    want_ba = (np.exp(log_b) * (log_b - log_a)).sum(axis=1)
    assert report["kl_ab"]["max"] == pytest.approx(want_ab.max(), rel=1e-10)
    assert report["kl_ba"]["mean"] == pytest.approx(want_ba.mean(), rel=1e-10)
    assert report["top1_agreement"] == float(np.mean(a.argmax(1) == b.argmax(1)))


def test_top_k_sets_take_tied_logits_in_id_order() -> None:
    logits = np.array([[1.0, 3.0, 3.0, 2.0, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0]], np.float32)
    assert [np.flatnonzero(row).tolist() for row in top_k_sets(logits, 2)] == [[1, 2], [0, 1]]
    assert np.flatnonzero(top_k_sets(logits, 4)[0]).tolist() == [1, 2, 3, 4]
    assert top_k_sets(logits, 5).all()


def test_heads_with_the_same_top_k_under_ties_overlap_fully() -> None:
    # the top-2 of both is {1, 2} (ties to the lower id); argpartition alone picked {1, 4}
    a = np.tile(np.array([0.0, 2.0, 2.0, 1.0, 2.0, 2.0], np.float32), (4, 1))
    b = np.tile(np.array([0.0, 3.0, 3.0, 1.0, 0.5, 3.0], np.float32), (4, 1))
    agree, overlap, _ = row_agreement(a, b, 2)
    assert agree.all()
    assert overlap.tolist() == [1.0] * 4
    _, overlap, _ = row_agreement(a, b, 3)  # {1, 2, 4} and {1, 2, 5}: Jaccard 2/4
    assert overlap.tolist() == [0.5] * 4


def test_wins_are_shares_in_the_heads_order_whatever_their_names() -> None:
    logit, rank = np.zeros(4, np.float32), np.zeros(4, np.int64)
    a = Scores(logit, np.array([-1.0, -2.0, -3.0, -4.0], np.float32), rank)
    b = Scores(logit, np.array([-2.0, -1.0, -3.0, -5.0], np.float32), rank)
    assert wins(a, b) == (0.5, 0.25, 0.25)
    assert wins(a, a) == (0.0, 0.0, 1.0)


def test_perplexity_past_float64_is_inf_and_the_table_says_so() -> None:
    assert perplexity(2.0) == math.exp(2.0)
    assert perplexity(800.0) == math.inf
    block = {
        "tied": True,
        "parameters": 10,
        "file_bytes": 40,
        "rows_per_s": 5.0,
        "nll": 800.0,
        "perplexity": None,  # as JSON carries Inf
        "wins": 0.5,
    }
    kl = {"mean": 0.0, "p50": 0.0, "p90": 0.0, "max": 0.0}
    report = {
        "models": [{"name": "a", **block}, {"name": "a", **block, "wins": 0.25}],
        "ties": 0.25,
        "rows": 4,
        "k": 5,
        "top1_agreement": 1.0,
        "topk_overlap": 1.0,
        "kl_ab": kl,
        "kl_ba": kl,
    }
    table = format_comparison(report)
    assert re.search(r"^perplexity +inf +inf *$", table, re.MULTILINE)
    assert re.search(r"^rows won +50.0% +25.0% *$", table, re.MULTILINE)
    assert re.search(r"^rows tied +25.0%", table, re.MULTILINE)
