"""The head's math against the float64 oracle (``service.heads.reference``) and against the
definitions themselves: log-sum-exp, log-softmax, KL, entropy, and ranks with their tie rule
(equal logits rank the lower id first, so a rank is the place in the top-k list)."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import pytest

from service.heads.reference import log_softmax as reference_log_softmax
from service.heads.reference import logsumexp as reference_logsumexp
from service.heads.reference import top_k
from service.runtime.logmath import (
    RANK_ROWS,
    entropy_and_kl_to_last,
    kl_divergence,
    log_softmax,
    logsumexp,
    target_ranks,
)


def _logits(shape: tuple[int, ...], seed: int, scale: float = 3.0) -> npt.NDArray[np.float32]:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(7,), (5, 300), (2, 3, 41)])
def test_logsumexp_is_the_oracles_in_the_terms_own_precision(
    dtype: type[np.floating], shape: tuple[int, ...]
) -> None:
    terms = _logits(shape, sum(shape)).astype(dtype)
    got = logsumexp(terms)
    assert got.dtype == dtype
    assert got.shape == shape[:-1]
    rtol = 1e-6 if dtype == np.float32 else 1e-14
    np.testing.assert_allclose(got, reference_logsumexp(terms), rtol=rtol, atol=rtol)


def test_logsumexp_takes_the_rows_maximum_out_first() -> None:
    """Logits past exp's range (e^89 overflows float32, e^710 float64), and far below it,
    give their exact log-sum-exp: max + log(sum(exp(x - max)))."""
    big = np.array([[1000.0, 1000.0, 1000.0 - math.log(2.0)], [-1e4, -1e4, -1e4]], np.float32)
    np.testing.assert_allclose(
        logsumexp(big), [1000.0 + math.log(2.5), -1e4 + math.log(3.0)], rtol=1e-7
    )
    huge = np.array([[5e3, 5e3 + 2.0, -np.inf]])
    np.testing.assert_allclose(logsumexp(huge), [5e3 + 2.0 + math.log1p(math.exp(-2.0))])


def test_a_row_of_minus_inf_has_a_log_sum_exp_of_minus_inf_and_warns_of_nothing() -> None:
    """Every token banned: nothing to draw, -inf (not NaN); -inf terms elsewhere weigh 0."""
    terms = np.array([[-np.inf, -np.inf, -np.inf], [-np.inf, 0.0, math.log(3.0)]], np.float32)
    with np.errstate(all="raise"):
        got = logsumexp(terms)
    assert got[0] == -np.inf
    np.testing.assert_allclose(got[1], math.log(4.0), rtol=1e-7)


def test_log_softmax_is_the_oracles_and_its_probabilities_sum_to_one() -> None:
    logits = _logits((6, 500), 1, scale=8.0)
    got = log_softmax(logits)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, reference_log_softmax(logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.exp(got.astype(np.float64)).sum(axis=-1), 1.0, rtol=1e-5)
    exact = log_softmax(logits.astype(np.float64))
    np.testing.assert_allclose(exact, reference_log_softmax(logits), rtol=1e-13, atol=1e-12)


def test_kl_is_the_definition_in_float64_and_zero_against_itself() -> None:
    p = np.log(np.array([[0.5, 0.5], [0.9, 0.1]], np.float32))
    q = np.log(np.array([[0.25, 0.75], [0.1, 0.9]], np.float32))
    want = [
        0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75),
        0.9 * math.log(0.9 / 0.1) + 0.1 * math.log(0.1 / 0.9),
    ]
    got = kl_divergence(p + np.float32(7.0), q - np.float32(3.0))  # shifts change nothing
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-6)
    reverse = kl_divergence(q, p)  # KL is not symmetric
    assert reverse[0] == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5), rel=1e-6)
    a, b = _logits((4, 900), 2), _logits((4, 900), 3)
    log_p, log_q = reference_log_softmax(a), reference_log_softmax(b)
    oracle = (np.exp(log_p) * (log_p - log_q)).sum(axis=-1)
    np.testing.assert_allclose(kl_divergence(a, b), oracle, rtol=1e-12)
    assert (kl_divergence(a, a) == 0.0).all()


def test_kl_is_taken_over_the_last_axis_whatever_the_leading_ones() -> None:
    a, b = _logits((2, 3, 50), 9), _logits((2, 3, 50), 10)
    got = kl_divergence(a, b)
    assert got.shape == (2, 3)
    flat = kl_divergence(a.reshape(6, 50), b.reshape(6, 50))
    np.testing.assert_allclose(got, flat.reshape(2, 3), rtol=1e-12)


def _reference_ranks(
    logits: npt.NDArray[np.float32], targets: npt.NDArray[np.int64]
) -> npt.NDArray[np.int64]:
    """Each target's place in the oracle's full top-k list (ties: the lower id first)."""
    _, order = top_k(logits, logits.shape[-1])
    places: npt.NDArray[np.int64] = np.argmax(order == targets[:, None], axis=1).astype(np.int64)
    return places


@pytest.mark.parametrize("rows", [1, RANK_ROWS, 3 * RANK_ROWS + 5])
def test_ranks_are_places_in_the_top_k_list_ties_to_the_lower_id(rows: int) -> None:
    """Small integers tie often: every rank, chunk after chunk, is the target's place in the
    oracle's list (strictly higher tokens first, then equal ones in id order)."""
    rng = np.random.default_rng(rows)
    logits = rng.integers(-4, 4, (rows, 200)).astype(np.float32)
    targets = rng.integers(0, 200, rows)
    target, rank = target_ranks(logits, targets)
    np.testing.assert_array_equal(target, logits[np.arange(rows), targets])
    np.testing.assert_array_equal(rank, _reference_ranks(logits, targets))
    assert rank.dtype == np.int64


def test_a_tie_exactly_at_the_kth_value_ranks_the_lower_id_inside_the_top_k() -> None:
    """Tokens 6 and 2 tie at the second-highest logit: the lower id takes place 1 and the
    other place 2, whichever comes first in the row; the lone token ranks after both."""
    logits = np.array([[0.0, 1.0, 4.0, 9.0, 1.0, -2.0, 4.0]] * 4, np.float32)
    _, rank = target_ranks(logits, np.array([2, 6, 3, 1]))
    assert rank.tolist() == [1, 2, 0, 3]
    _, order = top_k(logits[:1], 3)
    assert order.tolist() == [[3, 2, 6]]  # the top-3: place 2 holds 6, the tie's higher id


@pytest.mark.parametrize("per_row", [False, True])
def test_ranks_among_candidates_order_ties_by_their_ids_not_their_columns(per_row: bool) -> None:
    """Candidates (columns) named by ids in any order: a tie goes to the lower id, wherever
    its column is."""
    logits = np.array([[5.0, 7.0, 7.0, 7.0, 1.0]] * 3, np.float32)
    shared = np.array([40, 90, 10, 30, 20], np.int64)
    ids = np.tile(shared, (3, 1)) if per_row else shared
    columns = np.array([1, 2, 3])  # ids 90, 10, 30: all at 7.0
    target, rank = target_ranks(logits, columns, ids)
    assert target.tolist() == [7.0, 7.0, 7.0]
    assert rank.tolist() == [2, 0, 1]
    _, low = target_ranks(logits, np.array([0, 4, 0]), ids)
    assert low.tolist() == [3, 4, 3]


def test_ranks_among_candidates_match_the_reference_for_many_rows() -> None:
    rng = np.random.default_rng(5)
    rows, n = 2 * RANK_ROWS + 3, 60
    logits = rng.integers(-2, 2, (rows, n)).astype(np.float32)
    ids = np.stack([rng.permutation(1000)[:n] for _ in range(rows)]).astype(np.int64)
    columns = rng.integers(0, n, rows)
    _, rank = target_ranks(logits, columns, ids)
    order = np.lexsort((ids, -logits), axis=1)  # by logit descending, then id
    want = np.argmax(order == columns[:, None], axis=1)
    np.testing.assert_array_equal(rank, want)


def _entropy_and_kl_reference(
    logits: npt.NDArray[np.float32],
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    log_p = reference_log_softmax(logits)
    entropy = -(np.exp(log_p) * log_p).sum(axis=-1)
    last = log_p[-1:]
    kl = (np.exp(last) * (last - log_p)).sum(axis=-1)
    return entropy, kl


def test_the_lens_statistics_are_the_oracles_entropy_and_kl_to_the_last_layer() -> None:
    layers, tokens, vocab = 4, 3, 700
    logits = _logits((layers, tokens, vocab), 7, scale=4.0)
    logits[1] = logits[-1] + _logits((tokens, vocab), 8, scale=1e-3)  # a layer near the last
    logits[0, 0] = 0.0  # a flat distribution: entropy log(vocab)
    lse = reference_logsumexp(logits).astype(np.float32)
    entropy, kl = entropy_and_kl_to_last(logits, lse)
    want_entropy, want_kl = _entropy_and_kl_reference(logits)
    assert entropy.dtype == kl.dtype == np.float32
    np.testing.assert_allclose(entropy, want_entropy, rtol=1e-4, atol=1e-5)
    assert entropy[0, 0] == pytest.approx(math.log(vocab), rel=1e-5)
    np.testing.assert_allclose(kl, want_kl, rtol=1e-3, atol=1e-5)
    assert (kl[-1] == 0.0).all()  # the last layer against itself, exactly
    assert (kl >= 0.0).all()
    assert 0 < kl[1].max() < 1e-5 < kl[0].min()  # near the last: near 0, and not cancelled


def test_the_lens_statistics_read_each_position_against_its_own_last_row() -> None:
    """Two positions whose last layers differ: each layer's KL is to its own position's."""
    last = np.array([[3.0, 0.0, 0.0], [0.0, 0.0, 3.0]], np.float32)
    logits = np.stack([last[::-1], last])  # layer 0 holds the other position's row
    lse = reference_logsumexp(logits).astype(np.float32)
    _, kl = entropy_and_kl_to_last(logits, lse)
    _, want = _entropy_and_kl_reference(logits)
    np.testing.assert_allclose(kl, want, rtol=1e-5)
    assert kl[0, 0] > 1.0
