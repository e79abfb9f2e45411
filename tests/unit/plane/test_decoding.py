"""The decoding step through the data plane, in process, against the float64 reference
(``service.heads.reference.decoding_step``): the top-k of the processed distribution over the
whole vocabulary (k past what any row has left: every token with mass is listed), raw and
processed log-probs in both orders, n draws per row, per-row options split across the runs
of a request (20 rows, 8 per run), /logits after the processors, and what it declares."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import pytest

from service.heads.files import HeadWeights, save_head
from service.heads.reference import bitmask_of, decoding_step, draw
from service.limits import Limits
from service.messages import (
    DecodingOptions,
    LogitsRequest,
    SampleOptions,
    Target,
    TokenLists,
    TopKRequest,
    TopKResult,
    VocabularyOptions,
)
from service.metrics import Metrics
from service.plane import costs, options
from service.plane.dataplane import DataPlane
from service.repository.registry import Registry
from service.runtime.filters import streams
from service.runtime.vocabulary import SampleSpec
from service.settings import Settings
from tests.conftest import D_MODEL, VOCAB, reference_logits

HEAD = Target("head")
ROWS = 20
RUN_ROWS = 8
RTOL = ATOL = 1e-4
T = TypeVar("T")


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("decoding")
    table = np.random.default_rng(45).standard_normal((VOCAB, D_MODEL), dtype=np.float32)
    save_head(HeadWeights.from_arrays(table * 0.5), root / HEAD.model / "1")
    return root


def _served(
    repository: Path, call: Callable[[DataPlane], Awaitable[T]], run_rows: int = RUN_ROWS
) -> T:
    """``call`` on a data plane over the repository (runs of ``run_rows`` rows; full logits
    of at most that many rows)."""

    @asynccontextmanager
    async def plane() -> AsyncIterator[DataPlane]:
        settings = Settings(
            repository=repository,
            max_rows=1024,
            max_k=VOCAB,
            max_logits_bytes=run_rows * 2 * VOCAB * 4,
        )
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

    async def main() -> T:
        async with plane() as serving:
            return await call(serving)

    return asyncio.run(main())


class Case:
    """Rows and options drawn at random: histories, penalties, stop rules, bad words and a
    grammar mask per row; row 0's output ends with a bad word's prefix, row 1's is empty."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.hidden = rng.standard_normal((ROWS, D_MODEL), dtype=np.float32)
        self.prompts = [rng.integers(0, VOCAB, rng.integers(0, 40)).tolist() for _ in range(ROWS)]
        self.outputs = [rng.integers(0, VOCAB, rng.integers(0, 9)).tolist() for _ in range(ROWS)]
        self.outputs[0] = [*self.outputs[0], 11, 12]
        self.outputs[1] = []
        allows = rng.random((ROWS, VOCAB)) < 0.6
        allows[:, :20] = True
        self.bitmask = bitmask_of(allows)
        self.bias = {15: 3.0, 16: -2.0}
        self.words = [[11, 12, 13], [14]]

    def options(self, **more: Any) -> DecodingOptions:
        return DecodingOptions(
            prompt_token_ids=TokenLists.of(self.prompts),
            output_token_ids=TokenLists.of(self.outputs),
            repetition_penalty=1.4,
            presence_penalty=0.5,
            frequency_penalty=0.7,
            min_tokens=4,
            stop_token_ids=np.array([2, 3]),
            bad_words_ids=TokenLists.of(self.words),
            token_bitmask=self.bitmask,
            **more,
        )

    def reference(
        self, logits: npt.NDArray[np.float64], temperature: float, **filters: Any
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        return decoding_step(
            logits,
            temperature=temperature,
            bias=self.bias,
            prompts=self.prompts,
            outputs=self.outputs,
            repetition=1.4,
            presence=0.5,
            frequency=0.7,
            min_tokens=4,
            stop_ids=[2, 3],
            bad_words=self.words,
            bitmask=self.bitmask,
            **filters,
        )


def _check_listed(result: TopKResult, want: npt.NDArray[np.float64]) -> None:
    """Every token with mass is listed, in order (values descending, ties to the lower id),
    with the reference's log-prob; nothing else is."""
    assert result.logprobs is not None
    has_mass = np.isfinite(want).sum(axis=1)
    listed = result.token_ids.shape[1]
    assert listed == has_mass.min()
    for row in range(ROWS):
        order = np.lexsort((np.arange(VOCAB), -want[row]))[:listed]
        np.testing.assert_array_equal(result.token_ids[row], order)
        np.testing.assert_allclose(result.logprobs[row], want[row, order], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("order", ["transformers", "vllm"])
@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_the_top_k_over_the_whole_vocabulary_is_the_references(
    repository: Path, mode: str, order: str
) -> None:
    case = Case(1)
    temperature = 0.8
    filters: dict[str, Any] = {"top_k": 300, "top_p": 0.9, "min_p": 0.01}
    sample = SampleOptions(seed=5, n=3, **filters)
    decoding = case.options(logprobs_mode=mode, processor_order=order)
    request = TopKRequest(
        HEAD,
        case.hidden,
        k=VOCAB,
        temperature=temperature,
        logprobs=True,
        vocabulary=VocabularyOptions(logit_bias=case.bias, sample=sample, decoding=decoding),
    )
    result = _served(repository, lambda plane: plane.topk(request))
    logits = reference_logits(repository / HEAD.model / "1", case.hidden)
    raw, processed = case.reference(logits, temperature, order=order, **filters)
    assert result.logprobs_mode == mode
    if mode == "raw":
        _check_listed(result, raw)
    else:  # the same tokens as raw, the filtered ones at -inf
        _check_listed_processed(result, raw, processed)
    assert result.sampled is not None
    assert result.sampled.token_ids.shape == (ROWS, 3)
    u = streams(SampleSpec(seed=5, n=3), ROWS)
    for row in range(ROWS):
        for j in range(3):
            assert result.sampled.token_ids[row, j] == draw(processed[row], u[row, j])
    chosen = np.take_along_axis(raw if mode == "raw" else processed, result.sampled.token_ids, 1)
    np.testing.assert_allclose(result.sampled.logprobs, chosen, rtol=RTOL, atol=ATOL)


def _check_listed_processed(
    result: TopKResult, raw: npt.NDArray[np.float64], processed: npt.NDArray[np.float64]
) -> None:
    assert result.logprobs is not None
    listed = result.token_ids.shape[1]
    assert listed == np.isfinite(raw).sum(axis=1).min()
    for row in range(ROWS):
        order = np.lexsort((np.arange(VOCAB), -raw[row]))[:listed]
        np.testing.assert_array_equal(result.token_ids[row], order)
        want = processed[row, order]
        kept = np.isfinite(want)
        assert kept.any()
        np.testing.assert_array_equal(np.isfinite(result.logprobs[row]), kept)
        np.testing.assert_allclose(result.logprobs[row, kept], want[kept], rtol=RTOL, atol=ATOL)
        assert np.isneginf(result.logits[row, ~kept]).all()


def test_rows_of_one_request_keep_their_own_options_across_runs(repository: Path) -> None:
    """20 rows in runs of 8: a row's history, mask and draws are its own in any run (each
    row checked alone against the reference of that row)."""
    case = Case(2)
    request = TopKRequest(
        HEAD,
        case.hidden,
        k=5,
        logprobs=True,
        vocabulary=VocabularyOptions(decoding=case.options(), logit_bias=case.bias),
    )
    whole = _served(repository, lambda plane: plane.topk(request))
    logits = reference_logits(repository / HEAD.model / "1", case.hidden)
    raw, _ = case.reference(logits, 1.0)
    assert whole.logprobs is not None
    for row in (0, 7, 8, 15, 16, 19):  # each side of the runs' edges
        order = np.lexsort((np.arange(VOCAB), -raw[row]))[:5]
        np.testing.assert_array_equal(whole.token_ids[row], order)
        np.testing.assert_allclose(whole.logprobs[row], raw[row, order], rtol=RTOL, atol=ATOL)


def test_logits_after_the_processors_are_the_references(repository: Path) -> None:
    case = Case(3)
    request = LogitsRequest(HEAD, case.hidden, temperature=2.0, decoding=case.options())
    result = _served(repository, lambda plane: plane.logits(request), ROWS)
    logits = reference_logits(repository / HEAD.model / "1", case.hidden)
    unbiased = Case(3)
    unbiased.bias = {}
    raw, _ = unbiased.reference(logits, 2.0)
    masked = np.isneginf(raw)
    np.testing.assert_array_equal(np.isneginf(result.logits), masked)
    shift = result.logits[:, 0] - raw[:, 0]  # logits, not log-probs: a row's constant apart
    np.testing.assert_allclose(result.logits[~masked], (raw + shift[:, None])[~masked], atol=ATOL)
    allowed = np.array([0, 5, 9])
    request = LogitsRequest(
        HEAD, case.hidden, 2.0, allowed_token_ids=allowed, decoding=case.options()
    )
    chosen = _served(repository, lambda plane: plane.logits(request), ROWS)
    assert chosen.token_ids is not None
    np.testing.assert_array_equal(chosen.logits, result.logits[:, allowed])


def test_bad_options_are_refused_and_the_plane_serves_on(repository: Path) -> None:
    case = Case(4)
    bad = TopKRequest(
        HEAD,
        case.hidden,
        vocabulary=VocabularyOptions(decoding=DecodingOptions(token_bitmask=case.bitmask[:, 1:])),
    )
    good = TopKRequest(HEAD, case.hidden, k=3)

    async def both(plane: DataPlane) -> tuple[str, TopKResult]:
        try:
            await plane.topk(bad)
        except Exception as error:  # noqa: BLE001 - the refusal itself is what is checked
            refused = str(error)
        else:
            refused = ""
        return refused, await plane.topk(good)

    refused, answer = _served(repository, both)
    assert f"ceil(vocab / 32) = {-(-VOCAB // 32)} words per row" in refused
    assert answer.token_ids.shape == (ROWS, 3)


def test_the_step_declares_its_runs_histories_mask_and_draws(repository: Path) -> None:
    """Beside the answer: a run's logits and log-softmax, its bitmask as bytes, the
    histories (ids, offsets, flat indexes, sorted), the mask, and n draws per row."""
    case = Case(5)
    settings = Settings(repository=repository, max_logits_bytes=RUN_ROWS * 2 * VOCAB * 4)
    limits = Limits.from_settings(settings)
    loop = asyncio.new_event_loop()
    with ThreadPoolExecutor(1) as executor:
        registry = Registry(settings, executor, Metrics())
        loop.run_until_complete(registry.load_all())
        model = registry.get(HEAD.model)
        plain = options.topk(TopKRequest(HEAD, case.hidden, k=5), model, limits)
        vocabulary = VocabularyOptions(sample=SampleOptions(seed=1, n=8), decoding=case.options())
        step = options.topk(
            TopKRequest(HEAD, case.hidden, k=5, vocabulary=vocabulary), model, limits
        )
        flags = {"logprobs": True, "tokens": False, "residual": False}
        before = costs.topk(model, plain, **flags).held
        extra = costs.topk(model, step, **flags).held - before
        loop.run_until_complete(registry.close())
    loop.close()
    run = RUN_ROWS * VOCAB
    histories = sum(map(len, case.prompts)) + sum(map(len, case.outputs))
    assert extra >= 2 * run * 4 + run + 4 * histories * 8 + 2 * case.bitmask.nbytes
    assert extra >= ROWS * 8 * (8 + 8 + 4)
