"""The small rules of ``service.runtime.vocabulary``: a trimmed head's token space, biases and
their dtypes, the overflow refusal naming its row, the trust bound of a swapped
log-sum-exp, and candidate logits through every transform at any temperature."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.errors import InvalidInput, LogitsOverflow
from service.heads.files import HeadWeights, save_head
from service.heads.graph import HeadTransforms
from service.runtime.layout import open_head
from service.runtime.logmath import logsumexp
from service.runtime.vocabulary import (
    Bias,
    TokenSpace,
    apply_bias,
    biased_topk,
    refuse_overflow,
    swap_lse,
)
from tests.conftest import D_MODEL, VOCAB

TRIMMED = TokenSpace(50, np.array([3, 10, 20, 41], np.int64))


def test_a_trimmed_space_maps_ids_to_columns_and_back() -> None:
    columns = TRIMMED.local(np.array([[20, 3], [41, 10]]), "ids")
    assert columns.dtype == np.int64
    assert columns.tolist() == [[2, 0], [3, 1]]
    assert TRIMMED.original(columns).tolist() == [[20, 3], [41, 10]]
    whole = TokenSpace(50)
    ids = np.array([7, 49])
    assert whole.local(ids, "ids") is ids
    assert whole.original(ids) is ids


@pytest.mark.parametrize(("ids", "missing"), [([3, 11, 12], 11), ([[41, 20], [45, 2]], 45)])
def test_a_trimmed_id_is_refused_naming_the_first_one(ids: list[int], missing: int) -> None:
    """Past the last kept id too (its search position is past the end)."""
    with pytest.raises(InvalidInput) as refused:
        TRIMMED.local(np.array(ids), "allowed_token_ids")
    assert str(refused.value) == (
        f"allowed_token_ids: token {missing} is not in this trimmed head's vocabulary "
        "(4 of 50 tokens kept)"
    )


def test_two_spaces_name_the_same_tokens_only_column_for_column() -> None:
    kept = np.array([3, 10, 20, 41], np.int64)
    assert TokenSpace(50).same_tokens(TokenSpace(50))
    assert not TokenSpace(50).same_tokens(TokenSpace(51))
    assert not TokenSpace(50).same_tokens(TRIMMED)
    assert not TRIMMED.same_tokens(TokenSpace(50))
    assert TRIMMED.same_tokens(TokenSpace(50, kept.copy()))
    assert not TRIMMED.same_tokens(TokenSpace(60, kept.copy()))
    assert not TRIMMED.same_tokens(TokenSpace(50, np.array([3, 10, 21, 41], np.int64)))


def test_a_bias_holds_sorted_ids_float32_values_and_bans_at_minus_inf() -> None:
    bias = Bias.of({9: 1.5, 2: -0.5}, np.array([[7], [4]]))
    assert bias is not None
    assert bias.ids.tolist() == [2, 4, 7, 9]
    assert bias.values.dtype == np.float32
    assert bias.values.tolist() == [-0.5, -np.inf, -np.inf, 1.5]
    assert bias.banned == 2
    hot = bias.at(0.5)
    assert hot.values.dtype == np.float32
    assert hot.values.tolist() == [-1.0, -np.inf, -np.inf, 3.0]
    assert Bias.of(None, None) is None
    assert Bias.of({}, np.zeros(0, np.int64)) is None


def test_the_biased_top_k_is_float32() -> None:
    values = np.array([[3.0, 2.0, 1.0]], np.float32)
    ids = np.array([[5, 6, 7]])
    bias = Bias.of({6: 2.5}, None)
    assert bias is not None
    got, got_ids = biased_topk(values, ids, values[:, 1:2], bias, 3)
    assert got.dtype == np.float32
    assert got_ids.tolist() == [[6, 5, 7]]
    assert got.tolist() == [[4.5, 3.0, 1.0]]
    # every column asked (a small vocabulary's prefix): B's unbiased copy comes last, at -inf
    got, got_ids = biased_topk(values, ids, values[:, 1:2], bias, 4)
    assert got_ids.tolist() == [[6, 5, 7, 6]]
    assert got.tolist() == [[4.5, 3.0, 1.0, -np.inf]]


@pytest.mark.parametrize(
    ("temperature", "at"), [(1.0, ""), (0.5, " at temperature 0.5"), (2.0, " at temperature 2")]
)
def test_an_overflow_is_refused_naming_the_first_row_and_the_temperature(
    temperature: float, at: str
) -> None:
    ceiling = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, np.inf]], np.float32)
    floor = np.zeros(3, np.float32)
    keywords = {} if temperature == 1.0 else {"temperature": temperature}  # 1 by default
    with pytest.raises(LogitsOverflow) as refused:
        refuse_overflow(ceiling, floor, **keywords)
    assert str(refused.value) == (
        f"hidden_states row 2 makes logits overflow{at} (|logit| past float32's 3.4e38, or "
        "float16's 65504 for a half-precision head on a GPU); send final, post-norm hidden states"
    )


def test_an_overflow_in_a_floor_is_found_in_its_own_row() -> None:
    ceiling = np.ones((4, 3), np.float32)
    values = np.ones((4, 3), np.float32)
    values[3, 2] = -np.inf
    lse = np.ones(4, np.float32)
    lse[1] = np.nan
    with pytest.raises(LogitsOverflow, match="^hidden_states row 1 makes"):
        refuse_overflow(ceiling, values, lse)
    refuse_overflow(ceiling, values[:3], lse[[0, 2]])  # every row finite: nothing to say
    with pytest.raises(LogitsOverflow, match="^hidden_states row 0 makes"):
        refuse_overflow(np.array([np.inf, 1.0], np.float32), np.ones(2, np.float32))


def test_a_bias_on_a_tenth_of_the_mass_is_swapped_and_trusted() -> None:
    """The bound on the swapped value is B's share times the logits' relative error (1e-5)
    and the row's scale (|lse| past 1): a tenth of the mass banned is trusted."""
    logits = np.log(np.array([[0.1, 0.5, 0.4], [0.1, 0.3, 0.6]], np.float32))
    lse = logsumexp(logits)
    bias = Bias.of(None, np.array([0]))
    assert bias is not None
    swapped, trusted = swap_lse(lse, logits[:, :1], bias)
    assert swapped.dtype == np.float32
    assert trusted.tolist() == [True, True]
    np.testing.assert_allclose(swapped, np.log([0.9, 0.9]), rtol=1e-6)


def test_a_swap_is_trusted_within_the_bound_at_a_row_scale_below_one() -> None:
    """Nine tenths banned: the rest is a tenth, the bound 0.9 x 1e-5 x 1 / 0.1 = 9e-5,
    within the 1e-4 tolerance at |lse| <= 1 (the scale counts from 1)."""
    logits = np.log(np.array([[0.9, 0.1]], np.float32))
    bias = Bias.of(None, np.array([0]))
    assert bias is not None
    _, trusted = swap_lse(logsumexp(logits), logits[:, :1], bias)
    assert trusted.tolist() == [True]


@pytest.fixture(scope="module")
def scaled_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A head with a logit scale of 2 and an input scale of 0.5 (no soft-cap, no bias)."""
    rng = np.random.default_rng(12)
    table = rng.standard_normal((VOCAB, D_MODEL), dtype=np.float32)
    weights = HeadWeights.from_arrays(
        table, transforms=HeadTransforms(input_scale=0.5, logit_scale=2.0)
    )
    return save_head(weights, tmp_path_factory.mktemp("scaled"))


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.25])
def test_candidate_logits_follow_every_scale_at_any_temperature(
    scaled_path: Path, temperature: float
) -> None:
    session = open_head(scaled_path)
    assert session.candidates is not None
    hidden = np.random.default_rng(13).standard_normal((3, D_MODEL), dtype=np.float32)
    full = session.project(hidden, 1, temperature=temperature, full_logits=True).logits
    assert full is not None
    ids = np.array([[5, 5, 900], [1, 2, 3], [900, 7, 7]], np.int64)  # repeats within a row
    per_row = np.full(3, temperature, np.float32)
    got = session.candidates(hidden, ids, per_row)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, np.take_along_axis(full, ids, 1), rtol=1e-4, atol=1e-4)
    if session.candidates.plain:
        values, top_ids, _ = session.candidates.top(hidden, np.arange(VOCAB), per_row, 4)
        order = np.argsort(-full, axis=1, kind="stable")[:, :4]
        np.testing.assert_array_equal(top_ids, order)
        np.testing.assert_allclose(values, np.take_along_axis(full, order, 1), rtol=1e-4)


def test_bias_on_candidates_is_added_where_their_ids_are_biased() -> None:
    logits = np.zeros((2, 3), np.float32)
    bias = Bias.of({7: 1.0, 9: -2.0}, None)
    assert bias is not None
    got = apply_bias(logits, np.array([[9, 8, 7], [1, 7, 2]]), bias)
    assert got.tolist() == [[-2.0, 0.0, 1.0], [0.0, 1.0, 0.0]]


def test_the_top_of_candidates_scales_the_hidden_state_first(tmp_path: Path) -> None:
    """A head with an input scale alone is plain: its candidates' top-k comes out of the
    product's own run, the hidden state multiplied by the scale."""
    table = np.random.default_rng(14).standard_normal((VOCAB, D_MODEL), dtype=np.float32)
    weights = HeadWeights.from_arrays(table, transforms=HeadTransforms(input_scale=0.25))
    session = open_head(save_head(weights, tmp_path))
    assert session.candidates is not None
    assert session.candidates.plain
    hidden = np.random.default_rng(15).standard_normal((2, D_MODEL), dtype=np.float32)
    full = session.project(hidden, 1, full_logits=True).logits
    assert full is not None
    allowed = np.arange(0, VOCAB, 3, dtype=np.int64)
    ones = np.ones(2, np.float32)
    values, ids, lse = session.candidates.top(hidden, allowed, ones, 3)
    restricted = full[:, allowed]
    order = np.argsort(-restricted, axis=1, kind="stable")[:, :3]
    np.testing.assert_array_equal(ids, allowed[order])
    np.testing.assert_allclose(values, np.take_along_axis(restricted, order, 1), rtol=1e-4)
    np.testing.assert_allclose(lse, logsumexp(restricted), rtol=1e-5)
