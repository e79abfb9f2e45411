"""The step of rows read through their allowed tokens alone (``service.runtime.compact_step``)
against the dense path over the same logits (every processor, the mask written, the whole
rows selected): the same top values and ids in the same tie order, the same log-sum-exp and
processed log-sum-exp, the same draws; answers name tokens, never the padding."""

from __future__ import annotations

import dataclasses

import numpy as np
import numpy.typing as npt
import pytest

from service.runtime.compact_step import compact_step
from service.runtime.processors import Histories, Processors, pack
from service.runtime.sparse_masks import Allowed, set_bits
from service.runtime.step import StepRun, step_run
from service.runtime.vocabulary import Bias, SampleSpec

VOCAB = 500
ROWS = 6


def _allowed(rng: np.random.Generator) -> npt.NDArray[np.bool_]:
    """Rows allowing 1 to 40 tokens."""
    allowed = np.zeros((ROWS, VOCAB), np.bool_)
    for row in range(ROWS):
        allowed[row, rng.choice(VOCAB, int(rng.integers(1, 40)), replace=False)] = True
    return allowed


def _both(
    logits: npt.NDArray[np.float32],
    allowed: npt.NDArray[np.bool_],
    processors: Processors,
    bias: Bias | None,
    sample: SampleSpec | None,
    width: int,
) -> tuple[StepRun, StepRun]:
    bitmask = pack(allowed)
    u = None if sample is None else np.random.default_rng(4).random((ROWS, sample.draws))
    masked = dataclasses.replace(processors, bitmask=bitmask)
    dense = step_run(logits.copy(), 0.8, masked, bias, sample, width, u)
    row, tokens = set_bits(bitmask, VOCAB)
    chosen = Allowed.of(row, tokens, ROWS)
    compact = compact_step(
        logits[np.arange(ROWS)[:, None], chosen.tokens].copy(),
        chosen,
        0.8,
        processors,
        bias,
        sample,
        u,
        VOCAB,
    )
    return dense, compact


@pytest.mark.parametrize("seed", range(4))
def test_the_compact_rows_answer_as_the_dense_path(seed: int) -> None:
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((ROWS, VOCAB)) * 2).astype(np.float32)
    allowed = _allowed(rng)
    history = Histories.of([rng.choice(np.flatnonzero(row), 10).tolist() for row in allowed])
    processors = Processors(
        prompt=history,
        output=history,
        repetition=1.4,
        presence=0.3,
        frequency=0.2,
        min_tokens=20,
        stop_ids=np.flatnonzero(allowed[0])[:1],
        logprobs_mode="processed",
    )
    bias = Bias.of({int(np.flatnonzero(allowed[1])[0]): 3.0}, None)
    for sample, width in ((None, 1), (SampleSpec(seed=3, top_p=0.8, n=2), 64)):
        dense, compact = _both(logits, allowed, processors, bias, sample, width)
        # past a row's tokens with mass, both list -inf ones (which, the answer never says)
        k = min(width, int(np.isfinite(dense.values).sum(axis=1).min()))
        np.testing.assert_array_equal(compact.values[:, :k], dense.values[:, :k])
        np.testing.assert_array_equal(compact.ids[:, :k], dense.ids[:, :k])
        np.testing.assert_allclose(compact.lse, dense.lse, rtol=1e-6)
        np.testing.assert_allclose(compact.kept_lse, dense.kept_lse, rtol=1e-6)
        if sample is not None:
            assert compact.sampled is not None
            np.testing.assert_array_equal(compact.sampled, dense.sampled)
            assert allowed[np.arange(ROWS)[:, None], compact.sampled].all()


def test_padding_is_never_an_answer() -> None:
    """Rows of 1 and 3 tokens: the short row's padding is -inf, listed after its own token."""
    allowed = np.zeros((2, VOCAB), np.bool_)
    allowed[0, 7] = True
    allowed[1, [3, 9, 400]] = True
    row, tokens = set_bits(pack(allowed), VOCAB)
    chosen = Allowed.of(row, tokens, 2)
    np.testing.assert_array_equal(chosen.tokens, [[7, 7, 7], [3, 9, 400]])
    np.testing.assert_array_equal(chosen.real, [[True, False, False], [True, True, True]])
    logits = np.array([[5.0, 9.0, 9.0], [1.0, 2.0, 0.5]], np.float32)
    run = compact_step(logits, chosen, 1.0, Processors(), None, None, None, VOCAB)
    assert run.ids[0, 0] == 7
    assert run.values[0, 0] == 5.0
    assert np.isneginf(run.values[0, 1:]).all()
    np.testing.assert_array_equal(run.ids[1], [9, 3, 400])
    np.testing.assert_allclose(run.lse[0], 5.0, rtol=1e-6)
