"""The numpy reference: tied/untied semantics, errors, top-k contract, log-softmax."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from service import output_projection_tied, output_projection_untied
from service.heads.reference import log_softmax, logsumexp, top_k


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


@pytest.mark.parametrize("leading", [(), (3,), (2, 4), (2, 3, 2)])
def test_projection_matches_explicit_dot_products(
    rng: np.random.Generator, leading: tuple[int, ...]
) -> None:
    table = rng.standard_normal((11, 5))
    hidden = rng.standard_normal((*leading, 5))
    logits = output_projection_tied(hidden, table)
    assert logits.shape == (*leading, 11)
    expected = np.einsum("...d,vd->...v", hidden, table)
    np.testing.assert_allclose(logits, expected, rtol=1e-12)
    np.testing.assert_allclose(output_projection_untied(hidden, table), expected, rtol=1e-12)


def test_tied_projection_sees_in_place_updates_of_the_table(rng: np.random.Generator) -> None:
    table = rng.standard_normal((7, 4)).astype(np.float32)
    hidden = rng.standard_normal((2, 4)).astype(np.float32)
    before = output_projection_tied(hidden, table)
    table[3] += 1.0  # a training step updates the shared matrix in place
    after = output_projection_tied(hidden, table)
    changed = np.flatnonzero(~np.isclose(before, after).all(axis=0))
    assert changed.tolist() == [3]
    np.testing.assert_allclose(after[:, 3], before[:, 3] + hidden.sum(axis=1), rtol=1e-5)
    table *= 2.0
    np.testing.assert_allclose(output_projection_tied(hidden, table), 2 * after, rtol=1e-6)


def test_tied_projection_reads_the_table_without_copying(rng: np.random.Generator) -> None:
    table = rng.standard_normal((6, 3))
    table.setflags(write=False)  # works on a read-only view: nothing is written or cached
    hidden = rng.standard_normal(3)
    np.testing.assert_allclose(output_projection_tied(hidden, table), table @ hidden)


def test_untied_weight_is_independent_of_the_embedding_table(rng: np.random.Generator) -> None:
    table = rng.standard_normal((7, 4))
    output_weight = table.copy()
    hidden = rng.standard_normal((3, 4))
    before = output_projection_untied(hidden, output_weight)
    table[:] = 0.0  # changing the embedding table leaves the untied head alone
    np.testing.assert_array_equal(output_projection_untied(hidden, output_weight), before)
    output_weight[0] = 0.0
    assert np.all(output_projection_untied(hidden, output_weight)[:, 0] == 0.0)


@pytest.mark.parametrize("project", [output_projection_tied, output_projection_untied])
def test_errors_say_what_is_wrong(project: Callable[..., object]) -> None:
    table = np.ones((10, 4), np.float32)
    with pytest.raises(ValueError, match=r"d_model mismatch.*5.*4"):
        project(np.ones((2, 5), np.float32), table)
    with pytest.raises(ValueError, match=r"must be 2-D.*\(10, 4, 1\)"):
        project(np.ones((2, 4), np.float32), table[..., None])
    with pytest.raises(ValueError, match="floating dtype, got int64"):
        project(np.ones((2, 4), np.float32), table.astype(np.int64))
    with pytest.raises(ValueError, match="hidden_states must have a floating dtype"):
        project(np.ones((2, 4), np.int32), table)
    with pytest.raises(ValueError, match="hidden_states is empty"):
        project(np.ones((0, 4), np.float32), table)
    with pytest.raises(ValueError, match="is empty"):
        project(np.ones((2, 4), np.float32), np.ones((0, 4), np.float32))


def test_top_k_sorts_descending_and_breaks_ties_toward_lower_ids() -> None:
    logits = np.array([[0.5, 2.0, 2.0, -1.0, 2.0, 0.5], [3.0, 1.0, 1.0, 1.0, 0.0, 3.0]])
    values, ids = top_k(logits, 4)
    assert ids.tolist() == [[1, 2, 4, 0], [0, 5, 1, 2]]
    assert values.tolist() == [[2.0, 2.0, 2.0, 0.5], [3.0, 3.0, 1.0, 1.0]]
    assert ids.dtype == np.int64


def test_top_k_clamps_k_to_the_vocabulary_and_rejects_k_below_one() -> None:
    values, ids = top_k(np.array([1.0, 3.0, 2.0]), 10)
    assert ids.tolist() == [1, 2, 0]
    assert values.tolist() == [3.0, 2.0, 1.0]
    with pytest.raises(ValueError, match="k must be >= 1"):
        top_k(np.array([1.0]), 0)


def test_log_softmax_is_normalized_and_stable(rng: np.random.Generator) -> None:
    logits = rng.standard_normal((4, 50)) * 3
    logprobs = log_softmax(logits)
    np.testing.assert_allclose(np.exp(logprobs).sum(axis=-1), 1.0, rtol=1e-12)
    naive = np.log(np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True))
    np.testing.assert_allclose(logprobs, naive, rtol=1e-10)
    huge = np.array([1e4, 1e4 - 1.0, -1e4])  # exp overflows without the max shift
    expected_lse = 1e4 + np.log1p(np.exp(-1.0))
    np.testing.assert_allclose(logsumexp(huge), expected_lse, rtol=1e-12)
    assert np.all(np.isfinite(log_softmax(huge)))
