"""The shaped distribution through the data plane, against the float64 reference: every top-k
path breaks a tie exactly at the k-th value toward the lower id, and every biased, restricted
or sampled path divides the logits (bias included) by the temperature.

Ties: a head of small integers, whose logits are exact in any summation order, so equal
logits are equal on every kernel. The row ``e_0`` reads column 0 of the table, written so
that tokens 300 and 700 tie at the third value: the top-3 is [500, 20, 300], and exactly one
equal token is left out (the case a partition alone gets wrong half of the time).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from service.heads.files import HeadWeights, save_head
from service.heads.reference import log_softmax, logsumexp, top_k
from service.messages import SampleOptions, Target, TopKRequest, TopKResult, VocabularyOptions
from service.metrics import Metrics
from service.plane.dataplane import DataPlane
from service.repository.registry import Registry
from service.runtime.vocabulary import SampleSpec
from service.settings import Settings
from tests.conftest import D_MODEL, VOCAB, reference_logits

INTEGERS, FLOATS = Target("integers"), Target("floats")
#: Column 0 of the integer head: the top four tokens of the row e_0, two of them tied.
TOP = {500: 9.0, 20: 8.0, 700: 7.0, 300: 7.0}
RTOL = ATOL = 1e-4
Floats = npt.NDArray[np.floating]
Ids = npt.NDArray[np.int64]


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(44)
    integers = rng.integers(-3, 4, (VOCAB, D_MODEL)).astype(np.float32)
    integers[:, 0] = rng.integers(-6, 6, VOCAB)
    integers[list(TOP), 0] = list(TOP.values())
    root = tmp_path_factory.mktemp("distribution")
    save_head(HeadWeights.from_arrays(integers), root / INTEGERS.model / "1")
    floats = rng.standard_normal((VOCAB, D_MODEL), dtype=np.float32)
    save_head(HeadWeights.from_arrays(floats), root / FLOATS.model / "1")
    return root


def _answers(repository: Path, requests: list[TopKRequest]) -> list[TopKResult]:
    """Each request's answer from one data plane over the repository, in order."""

    @asynccontextmanager
    async def plane() -> AsyncIterator[DataPlane]:
        settings = Settings(repository=repository, max_rows=1024, max_k=50)
        metrics = Metrics()
        with ThreadPoolExecutor(1) as executor:
            registry = Registry(settings, executor, metrics)
            serving = DataPlane(registry, settings, metrics)
            await registry.load_all()
            try:
                yield serving
            finally:
                await serving.close()
                await registry.close()

    async def main() -> list[TopKResult]:
        async with plane() as serving:
            return [await serving.topk(request) for request in requests]

    return asyncio.run(main())


def _integer_rows() -> npt.NDArray[np.float32]:
    """Four rows e_0 (the designed tie), four of small integers (ties everywhere)."""
    rows = np.zeros((8, D_MODEL), np.float32)
    rows[:4, 0] = 1.0
    rows[4:] = np.random.default_rng(7).integers(-1, 2, (4, D_MODEL))
    return rows


def _ranked(logits: Floats, ids: Ids, k: int) -> tuple[Floats, Ids]:
    """The reference top-k of (rows, n) logits whose columns are ``ids`` ((n,) or (rows, n)):
    values descending, equal ones in id order."""
    every = np.broadcast_to(ids, logits.shape)
    order = np.lexsort((every, -logits), axis=1)[:, :k]
    return np.take_along_axis(logits, order, 1), np.take_along_axis(every, order, 1)


def _biased(logits: Floats, bias: dict[int, float], temperature: float = 1.0) -> Floats:
    """(z + b) / T: the bias is added before the temperature divides (transformers, vLLM)."""
    shaped = logits.copy()
    for token, value in bias.items():
        shaped[:, token] += value
    return shaped / temperature


def _check_top(result: TopKResult, values: Floats, ids: Ids) -> None:
    np.testing.assert_array_equal(result.token_ids, ids)
    np.testing.assert_allclose(result.logits, values, rtol=RTOL, atol=ATOL)


def test_the_designed_row_ties_exactly_at_the_third_value(repository: Path) -> None:
    logits = reference_logits(repository / INTEGERS.model / "1", _integer_rows()[:1])
    assert np.flatnonzero(logits[0] >= 7.0).tolist() == [20, 300, 500, 700]
    assert top_k(logits, 3)[1].tolist() == [[500, 20, 300]]


def test_a_tie_at_the_kth_value_goes_to_the_lower_id_over_the_whole_vocabulary(
    repository: Path,
) -> None:
    """The graph's TopK, the biased top-k (``biased_topk``) and the exact fallback of sampled
    rows (a whole row sorted): at temperature 16 these rows put most of their mass past the
    fetched prefix, and their fifth value ties with many tokens. A power of two: the graph
    divides the hidden state by it, exactly, so equal logits stay equal."""
    rows = _integer_rows()
    logits = reference_logits(repository / INTEGERS.model / "1", rows)
    bias = {5: -2.0, 11: 1.0}
    sample = VocabularyOptions(sample=SampleOptions(seed=3))
    plain, biased, sampled = _answers(
        repository,
        [
            TopKRequest(INTEGERS, rows, k=3),
            TopKRequest(INTEGERS, rows, k=3, vocabulary=VocabularyOptions(logit_bias=bias)),
            TopKRequest(INTEGERS, rows, k=5, temperature=16.0, vocabulary=sample),
        ],
    )
    vocabulary = np.arange(VOCAB)
    _check_top(plain, *_ranked(logits, vocabulary, 3))
    assert plain.token_ids[:4].tolist() == [[500, 20, 300]] * 4
    _check_top(biased, *_ranked(_biased(logits, bias), vocabulary, 3))
    _check_top(sampled, *_ranked(logits / 16.0, vocabulary, 5))
    assert sampled.token_ids[0, :4].tolist() == [500, 20, 300, 700]


@pytest.mark.parametrize("bias", [None, {3: -1.0}], ids=["plain", "biased"])
def test_a_tie_at_the_kth_value_goes_to_the_lower_id_among_allowed_tokens(
    repository: Path, bias: dict[int, float] | None
) -> None:
    """Allowed lists name tokens in any order, 700 before 300: the order of the list must not
    decide the tie. Plain: the top of the candidates' product (TopK in the columns' order,
    which must be the ids'); biased: the candidates' logits, their k taken by partition."""
    rows = _integer_rows()
    logits = reference_logits(repository / INTEGERS.model / "1", rows)
    rng = np.random.default_rng(8)
    others = rng.choice(np.setdiff1d(np.arange(VOCAB), [*TOP, 3]), 35, replace=False)
    lists = []
    for _ in rows:  # each row its own order (a partition's pick depends on it)
        listed = np.concatenate([[700, 3, 20], others, [300, 500]])
        lists.append(np.concatenate([listed[:1], rng.permutation(listed[1:])]))
    allowed = np.array(lists, np.int64)
    options = VocabularyOptions(allowed_token_ids=allowed, logit_bias=bias)
    shared = VocabularyOptions(allowed_token_ids=allowed[0], logit_bias=bias)
    per_row, one_list = _answers(
        repository,
        [TopKRequest(INTEGERS, rows, k=3, vocabulary=o) for o in (options, shared)],
    )
    shaped = _biased(logits, bias or {})
    restricted = np.take_along_axis(shaped, allowed, axis=1)
    _check_top(per_row, *_ranked(restricted, allowed, 3))
    _check_top(one_list, *_ranked(shaped[:, allowed[0]], allowed[0], 3))
    assert one_list.token_ids[:4].tolist() == [[500, 20, 300]] * 4


def test_the_temperature_divides_the_biased_distribution(repository: Path) -> None:
    """Values, ids, log-sum-exp and log-probs of (z + b) / T, bans included, over the whole
    vocabulary and over allowed tokens (log-probs over either)."""
    rows = np.random.default_rng(1).standard_normal((6, D_MODEL), dtype=np.float32)
    logits = reference_logits(repository / FLOATS.model / "1", rows)
    top = top_k(logits, 2)[1]
    bias = {int(top[0, 1]): 4.0, int(top[1, 0]): -3.0, 17: 25.0}
    banned = np.array([int(top[2, 0])])
    allowed = np.unique(np.concatenate([top[:, :2].reshape(-1), [17, 40, 41, 42]]))
    over_allowed = VocabularyOptions(allowed_token_ids=allowed, logit_bias=bias)
    over_vocabulary = VocabularyOptions(
        allowed_token_ids=allowed, logit_bias=bias, logprobs_over="vocabulary"
    )
    temperature = 0.5
    requests = [
        TopKRequest(FLOATS, rows, 5, temperature, True, vocabulary=options)
        for options in (
            VocabularyOptions(logit_bias=bias, banned_token_ids=banned),
            over_allowed,
            over_vocabulary,
        )
    ]
    whole, within, within_vocabulary = _answers(repository, requests)
    shaped = _biased(logits, {**bias, int(banned[0]): -np.inf}, temperature)
    values, ids = top_k(shaped, 5)
    _check_top(whole, values, ids)
    assert int(banned[0]) not in whole.token_ids[2]
    np.testing.assert_allclose(whole.logsumexp, logsumexp(shaped), rtol=RTOL, atol=ATOL)
    assert whole.logprobs is not None
    want = np.take_along_axis(log_softmax(shaped), ids, axis=1)
    np.testing.assert_allclose(whole.logprobs, want, rtol=RTOL, atol=ATOL)
    shaped = _biased(logits, bias, temperature)
    restricted = shaped[:, allowed]
    values, ids = _ranked(restricted, allowed, 5)  # the candidates' own order
    for answer, lse in ((within, logsumexp(restricted)), (within_vocabulary, logsumexp(shaped))):
        _check_top(answer, values, ids)
        np.testing.assert_allclose(answer.logsumexp, lse, rtol=RTOL, atol=ATOL)
        assert answer.logprobs is not None
        np.testing.assert_allclose(answer.logprobs, values - lse[:, None], rtol=RTOL, atol=ATOL)


def _drawn(logits: Floats, ids: npt.NDArray[np.int64], u: Floats) -> npt.NDArray[np.int64]:
    """The reference draw without filters: the CDF of the sorted distribution (descending,
    ties in id order) inverted at each row's u."""
    every = np.broadcast_to(ids, logits.shape)
    order = np.lexsort((every, -logits), axis=1)
    cumulative = np.cumsum(np.exp(np.take_along_axis(log_softmax(logits), order, 1)), axis=1)
    index = np.minimum((cumulative <= u[:, None]).sum(axis=1), logits.shape[1] - 1)
    drawn: npt.NDArray[np.int64] = np.take_along_axis(every, order, 1)[np.arange(len(u)), index]
    return drawn


@pytest.mark.parametrize("where", ["sample", "request"])
def test_the_temperature_shapes_what_is_sampled(repository: Path, where: str) -> None:
    """The token each row draws (its u from the seed) and its log-prob are those of the
    distribution at the sampling temperature, with the bias divided by it too; over the whole
    vocabulary (the fetched prefix, or a row's exact fallback) and among allowed tokens.
    Given as ``sample.temperature`` or as the request's temperature."""
    rows = np.random.default_rng(2).standard_normal((16, D_MODEL), dtype=np.float32) * 0.3
    logits = reference_logits(repository / FLOATS.model / "1", rows)
    temperature, seed = 0.4, 9
    bias = {int(top_k(logits, 1)[1][0, 0]): 1.5, 12: 2.0}
    allowed = np.arange(0, VOCAB, 7, dtype=np.int64)
    sample = SampleOptions(temperature=temperature if where == "sample" else None, seed=seed)
    at = 1.0 if where == "sample" else temperature
    requests = [
        TopKRequest(FLOATS, rows, 3, at, vocabulary=VocabularyOptions(sample=sample)),
        TopKRequest(
            FLOATS, rows, 3, at, vocabulary=VocabularyOptions(logit_bias=bias, sample=sample)
        ),
        TopKRequest(
            FLOATS,
            rows,
            3,
            at,
            vocabulary=VocabularyOptions(allowed_token_ids=allowed, logit_bias=bias, sample=sample),
        ),
    ]
    plain, biased, within = _answers(repository, requests)
    u = SampleSpec(seed=seed).uniforms(len(rows))
    vocabulary = np.arange(VOCAB)
    for answer, shaped, ids, over in (
        (plain, logits / temperature, vocabulary, None),
        (biased, _biased(logits, bias, temperature), vocabulary, None),
        (within, _biased(logits, bias, temperature)[:, allowed], allowed, "candidates"),
    ):
        assert answer.sampled is not None
        np.testing.assert_array_equal(answer.sampled.token_ids, _drawn(shaped, ids, u))
        assert over is None or answer.logprobs_over == over
        log_p = log_softmax(shaped)
        column = np.searchsorted(ids, answer.sampled.token_ids)
        want = log_p[np.arange(len(rows)), column]
        np.testing.assert_allclose(answer.sampled.logprobs, want, rtol=RTOL, atol=ATOL)
