"""The decoding step's runtime (processors in place, the selection graph, the filters over a
sorted prefix, the draws) against the float64 reference (``service.heads.reference``): raw
and processed log-probs, both filter orders, the fallback of rows whose kept set reaches past
the prefix, ties to the lower id, and draws that depend on (seed, row, j) alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

import numpy as np
import numpy.typing as npt
import pytest

from service.heads import reference
from service.runtime.filters import drawn, filtered_prefix, streams
from service.runtime.processors import (
    Histories,
    Order,
    Processors,
    apply_bitmask,
    mask_width,
    outside,
    pack,
)
from service.runtime.selection import selector
from service.runtime.step import StepRun, step_run
from service.runtime.vocabulary import Bias, SampleSpec

VOCAB = 203  # not a multiple of 32: the last word is partly past the vocabulary
ROWS = 6
RTOL = ATOL = 2e-5
Floats = npt.NDArray[np.float32]


def _logits(seed: int, scale: float = 3.0) -> Floats:
    return (np.random.default_rng(seed).standard_normal((ROWS, VOCAB)) * scale).astype(np.float32)


def _lists(rng: np.random.Generator, longest: int) -> list[list[int]]:
    return [rng.integers(0, VOCAB, int(rng.integers(0, longest))).tolist() for _ in range(ROWS)]


class Filters(TypedDict, total=False):
    top_k: int
    top_p: float
    min_p: float


@dataclass(frozen=True)
class Case:
    """Histories, penalties, stop rules, bad words and a bitmask, for both sides."""

    prompts: list[list[int]]
    outputs: list[list[int]]
    bitmask: npt.NDArray[np.int32]
    repetition: float = 1.7
    presence: float = 0.4
    frequency: float = -0.3
    min_tokens: int = 3
    stop_ids: tuple[int, ...] = (0, 1)
    bad_words: tuple[tuple[int, ...], ...] = ((5, 6, 7), (9,), (3, 4))

    def processors(self, order: Order = "transformers") -> Processors:
        return Processors(
            Histories.of(self.prompts),
            Histories.of(self.outputs),
            self.repetition,
            self.presence,
            self.frequency,
            self.min_tokens,
            np.array(self.stop_ids, np.int64),
            Histories.of([list(word) for word in self.bad_words]),
            self.bitmask,
            order=order,
        )

    def reference(
        self,
        logits: Floats,
        temperature: float,
        bias: dict[int, float] | None = None,
        filters: Filters | None = None,
        order: str = "transformers",
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """The reference's raw and processed log-probs of this case."""
        chosen = filters or {}
        return reference.decoding_step(
            logits,
            temperature=temperature,
            bias=bias,
            prompts=self.prompts,
            outputs=self.outputs,
            repetition=self.repetition,
            presence=self.presence,
            frequency=self.frequency,
            min_tokens=self.min_tokens,
            stop_ids=list(self.stop_ids),
            bad_words=[list(word) for word in self.bad_words],
            bitmask=self.bitmask,
            top_k=chosen.get("top_k"),
            top_p=chosen.get("top_p"),
            min_p=chosen.get("min_p"),
            order=order,
        )


def _case(seed: int) -> Case:
    """A case drawn at random; the output of row 0 ends with the prefix of a bad word, row
    1's is empty (min_tokens bans)."""
    rng = np.random.default_rng(seed)
    outputs = _lists(rng, 12)
    outputs[0] = [*outputs[0], 5, 6]
    outputs[1] = []
    allows = rng.random((ROWS, VOCAB)) < 0.7
    allows[:, :3] = True
    return Case(_lists(rng, 30), outputs, reference.bitmask_of(allows))


def _run(
    logits: Floats,
    temperature: float,
    processors: Processors,
    bias: dict[int, float] | None = None,
    sample: SampleSpec | None = None,
    width: int = 8,
) -> tuple[StepRun, Floats]:
    """The step as the data plane runs it: the graph's logits are divided by T already."""
    run = (logits / np.float32(temperature)).astype(np.float32)
    shaped = None if bias is None else Bias.of(bias, None)
    at = None if shaped is None else shaped.at(temperature)
    u = None if sample is None else streams(sample, len(logits))
    return step_run(run, temperature, processors, at, sample, width, u), run


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.5])
def test_processors_in_place_are_the_references_raw_distribution(temperature: float) -> None:
    logits = _logits(1)
    case = _case(2)
    bias = {4: 2.5, 8: -1.0, 11: -np.inf}
    result, processed = _run(logits, temperature, case.processors(), bias, width=12)
    raw, _ = case.reference(logits, temperature, bias)
    assert processed.dtype == np.float32
    masked = np.isneginf(raw)
    np.testing.assert_array_equal(np.isneginf(processed), masked)
    got = processed - result.lse[:, None]
    np.testing.assert_allclose(got[~masked], raw[~masked], rtol=RTOL, atol=ATOL)
    want_values, want_ids = reference.top_k(raw, 12)
    np.testing.assert_array_equal(result.ids, want_ids)
    np.testing.assert_allclose(
        result.values - result.lse[:, None], want_values, rtol=RTOL, atol=ATOL
    )
    np.testing.assert_allclose(result.kept_lse, result.lse)  # no filter: nothing renormalized


def test_the_stop_ids_and_bad_words_are_banned_where_the_rules_say() -> None:
    case = _case(3)
    result, processed = _run(_logits(4), 1.0, case.processors(), width=4)
    assert np.isneginf(processed[0, 7])  # row 0's output ends with 5, 6
    assert np.isneginf(processed[:, 9]).all()  # a one-token word
    assert np.isneginf(processed[1, [0, 1]]).all()  # row 1's output is empty: min_tokens
    short = [len(tokens) < 3 for tokens in case.outputs]
    np.testing.assert_array_equal(np.isneginf(processed[:, 0]), short)


def test_a_history_token_a_trimmed_head_lacks_is_matched_but_not_penalized() -> None:
    """Histories name such tokens ``outside(id)``: a bad word's prefix may still match it."""
    logits = _logits(5)
    lacking = int(outside(np.array([500]))[0])
    output = Histories.of([[lacking, 2]] + [[2]] * (ROWS - 1))
    words = Histories.of([[lacking, 2, 3]])
    processors = Processors(output=output, repetition=2.0, bad_words=words)
    _, processed = _run(logits, 1.0, processors)
    assert np.isneginf(processed[0, 3])
    assert np.isfinite(processed[1:, 3]).all()
    positive = logits[:, 2] > 0
    want = np.where(positive, logits[:, 2] / 2, logits[:, 2] * 2)
    np.testing.assert_allclose(processed[:, 2], want, rtol=1e-6)


def test_the_bitmask_masks_one_row_for_all_or_one_per_row() -> None:
    rng = np.random.default_rng(6)
    allows = rng.random((ROWS, VOCAB)) < 0.3
    allows[:, 0] = True
    per_row = reference.bitmask_of(allows)
    assert per_row.shape == (ROWS, mask_width(VOCAB))
    np.testing.assert_array_equal(pack(allows), per_row)
    logits = _logits(7)
    apply_bitmask(logits, per_row)
    np.testing.assert_array_equal(np.isfinite(logits), allows)
    shared = _logits(8)
    apply_bitmask(shared, per_row[:1])
    np.testing.assert_array_equal(np.isfinite(shared), np.broadcast_to(allows[0], shared.shape))


def test_the_selection_breaks_ties_toward_the_lower_id_and_takes_the_exact_lse() -> None:
    logits = np.zeros((3, VOCAB), np.float32)
    logits[:, [150, 40, 90]] = 2.0  # three equal values, ids in any order
    logits[1, 7] = -np.inf
    logits[2] = np.where(np.arange(VOCAB) % 2 == 0, -np.inf, logits[2]).astype(np.float32)
    logits[2, 90] = 2.0
    values, ids, lse = selector().top(logits, 4)
    assert ids[0].tolist() == [40, 90, 150, 0]
    assert ids[2].tolist() == [90, 1, 3, 5]  # even ids masked, 90 put back above the rest
    np.testing.assert_allclose(lse, reference.logsumexp(logits), rtol=1e-6)
    np.testing.assert_array_equal(values[:, 0], [2.0, 2.0, 2.0])


@pytest.mark.parametrize("order", ["transformers", "vllm"])
@pytest.mark.parametrize(
    "filters",
    [
        {"top_k": 5},
        {"top_p": 0.8},
        {"min_p": 0.05},
        {"top_k": 40, "top_p": 0.9, "min_p": 0.02},
        {"top_p": 0.95, "min_p": 0.001},
    ],
    ids=["top_k", "top_p", "min_p", "all", "wide"],
)
def test_processed_log_probs_are_the_references_in_either_order(
    order: Order, filters: Filters
) -> None:
    """Rows at temperature 3 put most of their mass far past an 8-token prefix: the filters'
    kept sets reach past it and those rows are sorted whole (the fallback)."""
    logits = _logits(9, scale=2.0)
    case = _case(10)
    sample = SampleSpec(1.0, seed=11, n=3, **filters)
    for temperature in (0.5, 3.0):
        result, _ = _run(logits, temperature, case.processors(order), sample=sample)
        raw, processed = case.reference(logits, temperature, None, filters, order)
        kept = np.isfinite(processed)
        listed = np.take_along_axis(kept, result.ids, axis=1)
        np.testing.assert_array_equal(result.keep, listed)
        lse_kept = raw.max(axis=1) - processed.max(axis=1)  # the kept set's share, in log
        got = result.kept_lse - result.lse
        np.testing.assert_allclose(got, lse_kept, rtol=RTOL, atol=ATOL)
        u = streams(sample, ROWS)
        assert result.sampled is not None
        for row in range(ROWS):
            for j in range(3):
                assert result.sampled[row, j] == reference.draw(processed[row], u[row, j])


def test_draws_without_filters_are_the_references_from_a_prefix_or_the_whole_row() -> None:
    """At temperature 4 a draw often lands past the 8-token prefix: such rows are sorted
    whole, with the same u."""
    logits = _logits(12)
    sample = SampleSpec(1.0, seed=13, n=4)
    processors = Processors(
        bitmask=reference.bitmask_of(np.random.default_rng(1).random((ROWS, VOCAB)) < 0.5)
    )
    for temperature in (0.3, 4.0):
        result, _ = _run(logits, temperature, processors, sample=sample)
        raw, processed = reference.decoding_step(
            logits, temperature=temperature, bitmask=processors.bitmask
        )
        np.testing.assert_array_equal(processed, raw)
        u = streams(sample, ROWS)
        assert result.sampled is not None
        assert result.sampled_values is not None
        for row in range(ROWS):
            for j in range(4):
                assert result.sampled[row, j] == reference.draw(raw[row], u[row, j])
        picked = np.take_along_axis(raw, result.sampled, axis=1)
        np.testing.assert_allclose(
            result.sampled_values - result.lse[:, None], picked, rtol=RTOL, atol=ATOL
        )


def test_a_draw_depends_on_the_seed_the_row_and_its_stream_alone() -> None:
    spec = SampleSpec(seed=21, n=3)
    u = streams(spec, 10)
    np.testing.assert_array_equal(u[:4], streams(spec, 4))  # the rows after it change nothing
    np.testing.assert_array_equal(streams(SampleSpec(seed=21, n=1), 10)[:, 0], u[:, 0])
    np.testing.assert_array_equal(SampleSpec(seed=21).uniforms(10), u[:, 0])  # stream 0
    assert len({tuple(column) for column in u.T.tolist()}) == 3


def test_greedy_draws_the_top_token_whatever_u() -> None:
    logits = _logits(14)
    sample = SampleSpec(0.0, seed=1, n=2, top_p=0.5)
    result, _ = _run(logits, 1.0, Processors(), sample=sample)
    assert result.sampled is not None
    np.testing.assert_array_equal(result.sampled, np.repeat(result.ids[:, :1], 2, axis=1))


def test_a_filter_keeps_a_prefix_that_stops_inside_it_or_says_it_may_not() -> None:
    """Probabilities 0.5, 0.25, 0.125, ...: the first two hold 0.75; a prefix of 3 of 10."""
    probs = 0.5 ** np.arange(1, 11)
    values = np.log(probs)[None, :3].astype(np.float32)
    lse = np.log([probs.sum()]).astype(np.float32)
    inside = filtered_prefix(values, lse, SampleSpec(top_p=0.7), "transformers", 10)
    assert inside.keep.tolist() == [[True, True, False]]
    assert inside.known.tolist() == [True]
    past = filtered_prefix(values, lse, SampleSpec(top_p=0.95), "transformers", 10)
    assert past.known.tolist() == [False]
    after_min_p = filtered_prefix(values, lse, SampleSpec(top_p=0.95, min_p=0.001), "vllm", 10)
    assert after_min_p.known.tolist() == [False]  # min_p's set passes the prefix: unknown mass
    index, sure = drawn(inside, SampleSpec(top_p=0.7), np.array([[0.0, 0.7, 0.99]]))
    assert index.tolist() == [[0, 1, 1]]
    assert sure.tolist() == [True]


def test_the_cases_above_reach_past_the_prefix() -> None:
    """The processed cases at temperature 3 and the unfiltered draws at 4 do take the
    fallback (a row sorted whole), so the tests above check it."""
    case = _case(10)
    sample = SampleSpec(1.0, seed=11, n=3, top_p=0.95, min_p=0.001)
    result, _ = _run(_logits(9, scale=2.0), 3.0, case.processors(), sample=sample)
    prefix = filtered_prefix(result.values, result.lse, sample, "transformers", VOCAB)
    assert (~prefix.known).sum() >= 2
    plain = SampleSpec(1.0, seed=13, n=4)
    result, _ = _run(_logits(12), 4.0, Processors(), sample=plain)
    unfiltered = filtered_prefix(result.values, result.lse, plain, "transformers", VOCAB)
    _, inside = drawn(unfiltered, plain, streams(plain, ROWS))
    assert (~inside).sum() >= 2


def test_empty_histories_change_nothing() -> None:
    """A first step: every row's output empty (the penalties have nothing to count)."""
    logits = _logits(15)
    empty = Histories.of([[]] * ROWS)
    processors = Processors(empty, empty, 1.5, 0.5, 0.5)
    _, processed = _run(logits, 1.0, processors)
    np.testing.assert_array_equal(processed, logits)


@pytest.mark.parametrize("temperature", [1.5, 40.0])
def test_a_row_past_its_prefix_is_ranked_wider_then_whole(temperature: float) -> None:
    """5,000 tokens: at temperature 1.5 a top_p 0.9 set or a draw passes the 8-token prefix
    but fits the 1,024 of the wider one; at 40 (nearly flat) it passes that too and the row
    is sorted whole. Either way the reference's draw and kept set."""
    vocab = 5000
    logits = (np.random.default_rng(16).standard_normal((4, vocab)) * 4).astype(np.float32)
    for spec in (SampleSpec(seed=3, n=4, top_p=0.9), SampleSpec(seed=4, n=4)):
        run = (logits / np.float32(temperature)).astype(np.float32)
        u = streams(spec, 4)
        result = step_run(run, temperature, Processors(), None, spec, 8, u)
        filters: Filters = {} if spec.top_p is None else {"top_p": spec.top_p}
        raw, processed = reference.decoding_step(logits, temperature=temperature, **filters)
        assert result.sampled is not None
        for row in range(4):
            for j in range(4):
                assert result.sampled[row, j] == reference.draw(processed[row], u[row, j])
        lse_kept = raw.max(axis=1) - processed.max(axis=1)
        np.testing.assert_allclose(result.kept_lse - result.lse, lse_kept, rtol=RTOL, atol=ATOL)
