"""Restricted vocabularies, bias and sampling against the float64 reference of the same file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from service.heads.files import HeadWeights, save_head
from service.heads.graph import HeadTransforms
from service.runtime import vocabulary
from service.runtime.layout import Placement, open_head
from service.runtime.logmath import logsumexp
from service.runtime.session import HeadSession
from service.runtime.vocabulary import (
    Bias,
    SampleSpec,
    apply_bias,
    biased_topk,
    sample_sorted,
    swap_lse,
    top_sorted,
)
from tests.conftest import D_MODEL, VOCAB, reference_logits

RTOL, ATOL = 1e-4, 1e-4


def _hidden(rows: int, seed: int = 3) -> npt.NDArray[np.float32]:
    return np.random.default_rng(seed).standard_normal((rows, D_MODEL), dtype=np.float32)


def _session(path: Path, mode: str = "shared") -> HeadSession:
    session = open_head(path, Placement(memory_mode=mode))  # type: ignore[arg-type]
    assert session.candidates is not None
    return session


@pytest.fixture(scope="module")
def transformed_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untied head with a bias, a logit scale and a soft-cap (every transform)."""
    rng = np.random.default_rng(9)
    table = rng.standard_normal((VOCAB, D_MODEL), dtype=np.float32)
    output = rng.standard_normal((VOCAB, D_MODEL), dtype=np.float32)
    weights = HeadWeights.from_arrays(
        table,
        output,
        bias=rng.standard_normal(VOCAB, dtype=np.float32),
        transforms=HeadTransforms(input_scale=0.5, logit_scale=0.7, softcap=30.0),
    )
    directory = tmp_path_factory.mktemp("transformed")
    save_head(weights, directory)
    return directory / "model.onnx"


@pytest.mark.parametrize("mode", ["shared", "fast"])
@pytest.mark.parametrize("chunk_rows", [None, 2])
@pytest.mark.parametrize("kind", ["tied", "untied", "transformed"])
def test_candidate_logits_equal_the_full_head_restricted(
    kind: str,
    mode: str,
    chunk_rows: int | None,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Shared ids, ids per row (rows' own products, and one product with their union when
    they share many; the union given by the caller, as the decoding step gives it, or
    found); ``chunk_rows``: W's rows copied two at a time."""
    if chunk_rows is not None:  # a row's own products, or two of W's rows for the union's
        monkeypatch.setattr(vocabulary, "CHUNK_BYTES", chunk_rows * D_MODEL * 4)
    path = request.getfixturevalue(f"{kind}_path")
    session = _session(path, mode)
    assert session.candidates is not None
    hidden = _hidden(5)
    full = session.project(hidden, 1, temperature=0.5, full_logits=True).logits
    assert full is not None  # the graph's own logits, transforms and all
    if kind != "transformed":
        np.testing.assert_allclose(full, reference_logits(path, hidden) / 0.5, rtol=RTOL, atol=ATOL)
    shared = np.array([3, 990, 7, 3], np.int64)  # repeats allowed, any order
    per_row = np.random.default_rng(1).integers(0, VOCAB, (5, 6))
    sharing = np.random.default_rng(2).integers(0, 8, (5, 6))  # the union's product
    temperature = np.full(5, 0.5, np.float32)
    for ids in (shared, per_row, sharing):
        every = np.broadcast_to(ids, (5, ids.shape[-1]))
        want = np.take_along_axis(full, every, axis=1)
        for union in (None, len(np.unique(ids))):
            got = session.candidates(hidden, ids, temperature, union)
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("mode", ["shared", "fast"])
def test_the_top_of_candidates_in_one_run_equals_the_full_head_restricted(
    tmp_path: Path, mode: str, chunked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``CandidateLogits.top``: the top-k of the allowed tokens and their log-sum-exp, taken
    in the product's run; tied rows (equal logits) listed in id order. ``chunked``: W's rows
    read five at a time (as a long list is, to stay below the mmap threshold), the chunks'
    tops merged, ties across chunks still in id order, every chunk's mass in the lse."""
    if chunked:  # W's rows two at a time: a chunk of k = 5 ids, then the last 3
        monkeypatch.setattr(vocabulary, "CHUNK_BYTES", 2 * D_MODEL * 4)
    table = np.random.default_rng(4).standard_normal((VOCAB, D_MODEL), dtype=np.float32)
    table[[40, 400, 900]] = table[700]  # four tokens with one row: their logits tie
    path = save_head(HeadWeights.from_arrays(table), tmp_path)
    session = _session(path, mode)
    assert session.candidates is not None
    assert session.candidates.plain
    hidden = np.repeat(table[700:701] * np.float32(3.0), 4, axis=0)  # the tied rows on top
    hidden[2] = _hidden(1)[0]
    hidden[3] = 0.0  # every logit 0: each allowed token a share of 1/8, all tied
    temperature = np.array([1.0, 0.5, 2.0, 1.0], np.float32)
    allowed = np.sort(np.array([900, 5, 40, 700, 123, 400, 31, 64], np.int64))
    values, ids, lse = session.candidates.top(hidden, allowed, temperature, 5)
    full = session.project(hidden, 1, temperature=temperature, full_logits=True).logits
    assert full is not None
    restricted = full[:, allowed]
    order = np.lexsort((np.broadcast_to(allowed, restricted.shape), -restricted), axis=1)[:, :5]
    np.testing.assert_array_equal(ids[:2], np.broadcast_to(allowed, (4, 8))[:2, order[0]])
    np.testing.assert_array_equal(ids[:2, :4], [[40, 400, 700, 900]] * 2)  # ties: id order
    np.testing.assert_array_equal(ids[3], allowed[:5])  # all tied: the lowest ids, in order
    np.testing.assert_allclose(values, np.take_along_axis(restricted, order, 1), RTOL, ATOL)
    np.testing.assert_allclose(lse, logsumexp(restricted), rtol=RTOL, atol=ATOL)


def test_biased_topk_and_lse_equal_the_full_biased_distribution(tied_path: Path) -> None:
    hidden = _hidden(6)
    logits = reference_logits(tied_path, hidden).astype(np.float32)
    top_ids = np.argsort(-logits, axis=1)
    banned = top_ids[:, 0][:2]  # the best token of two rows
    bias = Bias.of({int(top_ids[3, 40]): 50.0, 11: -3.0}, banned)
    assert bias is not None
    assert bias.banned == 2
    k, width = 5, 5 + len(bias.ids)
    values, ids = top_sorted(logits, np.arange(VOCAB), width)
    raw = logits[:, bias.ids]
    got_values, got_ids = biased_topk(values, ids, raw, bias, k)
    lse, trusted = swap_lse(logsumexp(logits), raw, bias)
    biased = apply_bias(logits, None, bias)
    want_values, want_ids = top_sorted(biased, np.arange(VOCAB), k)
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_allclose(got_values, want_values, rtol=1e-6)
    assert trusted.all()
    np.testing.assert_allclose(lse, logsumexp(biased), rtol=1e-5)
    assert int(top_ids[3, 40]) == got_ids[3, 0]  # +50 made it the top


def test_swap_lse_flags_rows_whose_mass_was_all_in_the_bias() -> None:
    logits = np.array([[100.0, 0.0, 0.0]], np.float32)  # token 0 holds ~all the mass
    bias = Bias.of(None, np.array([0]))
    assert bias is not None
    _, trusted = swap_lse(logsumexp(logits), logits[:, :1], bias)
    assert not trusted[0]
    # as on CUDA: B's logit from its row of W a hair off the graph's, at a large scale
    large = np.array([[1778.0, 0.0, 0.0]], np.float32)
    _, trusted = swap_lse(logsumexp(large), large[:, :1] * np.float32(1 - 1e-6), bias)
    assert not trusted[0]


def test_swap_lse_sums_a_large_bias_at_a_low_temperature_in_log_space() -> None:
    # logit_bias +100 at temperature 0.1: B's term is e^1000 of the rest (past float64's exp)
    logits = np.random.default_rng(3).standard_normal((2, 50)).astype(np.float32) / 0.1
    bias = Bias.of({6: 100.0, 20: -100.0}, None)
    assert bias is not None
    at = bias.at(0.1)
    lse, trusted = swap_lse(logsumexp(logits), logits[:, at.ids], at)
    assert trusted.all()
    np.testing.assert_allclose(lse, logsumexp(apply_bias(logits, None, at)), rtol=1e-6)
    assert np.isfinite(lse).all()


def _sorted_row(logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    return -np.sort(-logits, axis=1)


@pytest.mark.parametrize(
    "spec",
    [
        SampleSpec(seed=1),
        SampleSpec(top_k=3, seed=2),
        SampleSpec(top_p=0.5, seed=3),
        SampleSpec(min_p=0.2, seed=4),
        SampleSpec(top_k=10, top_p=0.8, min_p=0.05, seed=5),
    ],
)
def test_a_prefix_draws_what_the_whole_row_draws(spec: SampleSpec) -> None:
    """Same u, a peaked distribution: the first 64 sorted logits give the whole row's token."""
    rng = np.random.default_rng(spec.seed)
    logits = (rng.standard_normal((200, 5000)) * 4).astype(np.float32)
    ordered = _sorted_row(logits)
    lse = logsumexp(logits)
    u = spec.uniforms(200)
    whole, inside_whole = sample_sorted(ordered, lse, spec, u, 5000)
    prefix, inside = sample_sorted(ordered[:, :64], lse, spec, u, 5000)
    assert inside_whole.all()
    assert inside.any()
    np.testing.assert_array_equal(prefix[inside], whole[inside])


def test_draws_follow_the_filtered_distribution() -> None:
    """20k draws of one row: frequencies within 4 sigma of the kept, renormalised probs."""
    logits = np.log(np.array([[0.4, 0.3, 0.15, 0.1, 0.05]], np.float32))
    spec = SampleSpec(top_p=0.8, seed=7)  # keeps 0.4, 0.3, 0.15 (0.85 >= 0.8)
    count = 20000
    u = spec.uniforms(count)
    rows = np.repeat(logits, count, axis=0)
    index, inside = sample_sorted(rows, logsumexp(rows), spec, u, 5)
    assert inside.all()
    frequency = np.bincount(index, minlength=5) / count
    expected = np.array([0.4, 0.3, 0.15, 0, 0]) / 0.85
    sigma = np.sqrt(expected * (1 - expected) / count)
    assert (np.abs(frequency - expected) <= 4 * sigma + 1e-12).all(), frequency


def test_a_seed_gives_each_position_the_same_draw() -> None:
    spec = SampleSpec(seed=123)
    np.testing.assert_array_equal(spec.uniforms(3), spec.uniforms(10)[:3])
    assert not np.array_equal(spec.uniforms(3), SampleSpec(seed=124).uniforms(3))


def test_greedy_is_the_top_token() -> None:
    logits = _sorted_row(np.random.default_rng(0).standard_normal((4, 50)).astype(np.float32))
    index, inside = sample_sorted(logits, logsumexp(logits), SampleSpec(0.0), np.zeros(4), 50)
    assert (index == 0).all()
    assert inside.all()


def test_score_counts_ranks_and_targets_like_the_reference(untied_path: Path) -> None:
    session = _session(untied_path)
    hidden = _hidden(20)
    targets = np.random.default_rng(2).integers(0, VOCAB, 20)
    scored = session.score(hidden, targets, 4)
    logits = reference_logits(untied_path, hidden)
    target = logits[np.arange(20), targets]
    np.testing.assert_allclose(scored.target_logit, target, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(scored.rank, (logits > target[:, None]).sum(axis=1))
    np.testing.assert_array_equal(scored.topk_token_ids, np.argsort(-logits, axis=1)[:, :4])


def test_top_sorted_breaks_ties_toward_the_lower_id_whatever_the_column_order() -> None:
    """Equal logits come out in id order, as the graph's TopK gives them: a biased token, or
    an allowed list's order, must not decide a tie."""
    logits = np.array([[1.0, 2.0, 2.0, 1.0, 2.0], [3.0, 3.0, 0.0, 3.0, 1.0]], np.float32)
    shared = np.array([9, 7, 3, 1, 5], np.int64)
    values, ids = top_sorted(logits, shared, 4)
    assert ids.tolist() == [[3, 5, 7, 1], [1, 7, 9, 5]]
    assert values.tolist() == [[2.0, 2.0, 2.0, 1.0], [3.0, 3.0, 3.0, 1.0]]
    per_row = np.array([[4, 2, 8, 0, 6], [5, 3, 1, 0, 2]], np.int64)
    _, ids = top_sorted(logits, per_row, 5)
    assert ids.tolist() == [[2, 6, 8, 0, 4], [0, 3, 5, 2, 1]]


@pytest.mark.parametrize("k", [1, 7, 50, 250])
def test_top_sorted_by_partition_matches_a_whole_sort_ties_included(k: int) -> None:
    """Few of many (the partition path): the same values and ids as sorting every column,
    with ties at the k-th value going to the lower ids (small integers tie often)."""
    rng = np.random.default_rng(k)
    logits = rng.integers(-5, 5, (64, 1000)).astype(np.float32)
    ids = rng.permutation(32000)[:1000].astype(np.int64)
    every = np.broadcast_to(ids, logits.shape)
    order = np.lexsort((every, -logits), axis=1)[:, :k]
    values, got = top_sorted(logits, ids, k)
    np.testing.assert_array_equal(got, np.take_along_axis(every, order, axis=1))
    np.testing.assert_array_equal(values, np.take_along_axis(logits, order, axis=1))


def test_top_sorted_takes_the_lower_id_when_exactly_one_equal_token_is_left_out() -> None:
    """The (k+1)-th value equals the k-th and every other value is distinct: of the two, the
    lower id is in, in every row, whichever the partition picked (k * 4 <= n)."""
    rng = np.random.default_rng(11)
    rows, n, k = 32, 40, 5
    logits = np.stack([rng.permutation(n) for _ in range(rows)]).astype(np.float32)
    order = np.argsort(-logits, axis=1)
    kth = logits[np.arange(rows), order[:, k - 1]]
    logits[np.arange(rows), order[:, k]] = kth  # one token past the k ties the k-th
    ids = rng.permutation(1000)[:n].astype(np.int64)
    values, got = top_sorted(logits, ids, k)
    every = np.broadcast_to(ids, logits.shape)
    want = np.lexsort((every, -logits), axis=1)[:, :k]
    np.testing.assert_array_equal(got, np.take_along_axis(every, want, axis=1))
    np.testing.assert_array_equal(values, np.take_along_axis(logits, want, axis=1))
    assert (values[:, -1] == kth).all()
