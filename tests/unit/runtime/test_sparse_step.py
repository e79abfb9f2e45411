"""The decoding step's sparse reading (``service.runtime.sparse_step``) against the dense path
(every processor applied, the mask written, the selection graph over the whole run): the same
top values, the same ids in the same tie order, the same log-sum-exp, for each way a row is
read (allowed few, changed few, whole) and for each reason a row falls back to whole (too few
raw tokens outside its changes, over half its mass changed, too few allowed tokens)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from service.runtime import sparse_step
from service.runtime.processors import Histories, Processors, apply_bitmask, pack
from service.runtime.selection import selector
from service.runtime.sparse_masks import SPARSE
from service.runtime.sparse_step import RawTop, sparse_selection
from service.runtime.step import step_run
from service.runtime.vocabulary import Bias, SampleSpec

VOCAB = 1000
ROWS = 8
Floats = npt.NDArray[np.float32]


def _raw(logits: Floats, k: int) -> RawTop:
    """What the head's graph hands beside its logits (the selection graph is its kernels)."""
    values, ids, lse = selector().top(logits.copy(), k)
    return RawTop(values, ids, lse)


def _dense(
    logits: Floats, processors: Processors, bias: Bias | None, width: int, temperature: float
) -> tuple[Floats, npt.NDArray[np.int64], Floats, Floats]:
    processed = logits.copy()
    if bias is not None:
        processed[:, bias.ids] += bias.values
    processors.apply(processed, temperature)
    values, ids, lse = selector().top(processed, width)
    return values, ids, lse, processed


def _masks(rng: np.random.Generator) -> npt.NDArray[np.int32]:
    """Rows allowing few, forbidding few, about half, and few fewer than the width."""
    allowed = np.zeros((ROWS, VOCAB), np.bool_)
    few = VOCAB // SPARSE
    for row in range(ROWS):
        kind = row % 4
        if kind == 0:  # a structural point: few allowed
            allowed[row, rng.choice(VOCAB, few - 3, replace=False)] = True
        elif kind == 1:  # inside a string: few forbidden
            allowed[row] = True
            allowed[row, rng.choice(VOCAB, few - 5, replace=False)] = False
        elif kind == 2:  # neither: read whole
            allowed[row] = rng.random(VOCAB) < 0.5
        else:  # fewer allowed than the prefix's width: read whole
            allowed[row, rng.choice(VOCAB, 5, replace=False)] = True
    return pack(allowed)


def _histories(rng: np.random.Generator, longest: int) -> Histories:
    return Histories.of([rng.integers(0, VOCAB, longest).tolist() for _ in range(ROWS)])


def _check(
    logits: Floats,
    processors: Processors,
    bias: Bias | None = None,
    width: int = 10,
    temperature: float = 1.0,
    raw_k: int = 42,
) -> None:
    values, ids, lse, processed = _dense(logits, processors, bias, width, temperature)
    into = logits.copy()
    sparse = sparse_selection(into, temperature, processors, bias, width, _raw(logits, raw_k))
    np.testing.assert_array_equal(sparse.values, values)
    np.testing.assert_array_equal(sparse.ids, ids)
    np.testing.assert_allclose(sparse.lse, lse, rtol=0, atol=2e-6 * max(1.0, float(abs(lse).max())))
    for row in list(sparse.pending):
        sparse.whole_row(into, row)
    np.testing.assert_array_equal(into, processed)  # the run's array ends as the dense path's


@pytest.mark.parametrize("seed", range(6))
def test_each_reading_of_a_row_gives_the_dense_paths_top_and_lse(seed: int) -> None:
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((ROWS, VOCAB)) * 2).astype(np.float32)
    processors = Processors(
        prompt=_histories(rng, 30),
        output=_histories(rng, 30),
        repetition=1.3,
        presence=0.5,
        frequency=-0.4,
        min_tokens=40,
        stop_ids=np.array([3, 7], np.int64),
        bad_words=Histories.of([[int(rng.integers(VOCAB))], [11, 12]]),
        bitmask=_masks(rng),
    )
    bias = Bias.of({5: 2.5, 900: -1.0}, np.array([17], np.int64))
    _check(logits, processors, bias)
    _check(logits, processors, bias, width=64, temperature=0.7)


def test_one_mask_for_all_rows_and_no_mask_read_sparsely() -> None:
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal((ROWS, VOCAB)) * 2).astype(np.float32)
    history = _histories(rng, 50)
    for bitmask in (_masks(rng)[:1], _masks(rng)[1:2], None):
        _check(logits, Processors(output=history, presence=1.0, bitmask=bitmask))


def test_rows_whose_changes_hold_the_top_or_most_mass_are_read_whole() -> None:
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((ROWS, VOCAB)) * 0.5).astype(np.float32)
    tops = np.argsort(-logits, axis=1, kind="stable")[:, :40]
    logits[np.arange(ROWS)[:, None], tops[:, :1]] += 12.0  # the top token holds ~all the mass
    output = Histories.of([row.tolist() for row in tops])  # the raw top is the history
    processors = Processors(output=output, repetition=2.0, frequency=1.5)
    _check(logits, processors, raw_k=42)


def test_equal_logits_keep_the_lower_id_first_across_raw_and_changed_tokens() -> None:
    logits = np.zeros((ROWS, VOCAB), np.float32)  # every token ties
    output = Histories.of([[4, 9, 9, 600]] * ROWS)
    _check(logits, Processors(output=output, presence=-0.0, frequency=0.0, repetition=1.5))
    bias = Bias.of({2: 0.0, 700: 0.0}, None)
    _check(logits, Processors(output=output, presence=0.0), bias)


def test_draws_past_the_prefix_read_the_masked_whole_row() -> None:
    """A row whose filter reaches past the prefix is ranked from its whole row: its pending
    mask is written first, so the draw never takes a forbidden token."""
    rng = np.random.default_rng(11)
    logits = np.zeros((ROWS, VOCAB), np.float32)  # flat: top_p 0.99 reaches past any prefix
    allowed = np.zeros((ROWS, VOCAB), np.bool_)
    for row in range(ROWS):
        allowed[row, rng.choice(VOCAB, 50, replace=False)] = True
    processors = Processors(bitmask=pack(allowed))
    spec = SampleSpec(seed=5, top_p=0.99)
    u = np.random.default_rng(2).random((ROWS, 1))
    sparse = step_run(logits.copy(), 1.0, processors, None, spec, 20, u, _raw(logits, 52))
    dense = step_run(logits.copy(), 1.0, processors, None, spec, 20, u)
    assert sparse.sampled is not None
    assert dense.sampled is not None
    np.testing.assert_array_equal(sparse.sampled, dense.sampled)
    assert allowed[np.arange(ROWS), sparse.sampled[:, 0]].all()
    masked = logits.copy()
    apply_bitmask(masked, processors.bitmask)  # type: ignore[arg-type]
    np.testing.assert_allclose(sparse.kept_lse, dense.kept_lse, atol=1e-5)


def test_rows_read_whole_in_many_runs_are_selected_all_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past ``MAX_BLOCKS`` runs of adjacent rows read whole, one selection over every row
    answers them; the rows read sparsely keep their own answer."""
    monkeypatch.setattr(sparse_step, "MAX_BLOCKS", 1)
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((ROWS, VOCAB)) * 2).astype(np.float32)
    _check(logits, Processors(output=_histories(rng, 20), presence=0.7, bitmask=_masks(rng)))


def test_a_row_whose_changed_token_held_most_of_its_mass_takes_its_lse_whole() -> None:
    """The top token alone is in the history and holds ~all the mass: the raw top still
    holds the prefix outside it, but the corrected log-sum-exp would cancel (1 - removed
    with removed ~ 1 in float32's rounding), so the row's is taken whole."""
    rng = np.random.default_rng(9)
    logits = (rng.standard_normal((ROWS, VOCAB)) * 0.5).astype(np.float32)
    top = np.argmax(logits, axis=1)
    logits[np.arange(ROWS), top] += 20.0  # e^20 against ~1,000 tokens near 1: removed ~ 1
    processors = Processors(output=Histories.of([[int(token)] for token in top]), frequency=2.0)
    _check(logits, processors, temperature=0.05)
