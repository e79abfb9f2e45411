"""``sample_sorted`` against a reference written from the definitions, one token at a time in
float64 (Hugging Face's order: ``top_k``, then ``top_p`` on the renormalised remainder, then
``min_p`` relative to the most likely token; the draw inverts the kept tokens' CDF at u), and
its ``inside`` flag: whether the fetched prefix surely holds the kept set (else the caller
draws again from the whole row, with the same u)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import numpy.typing as npt
import pytest

from service.runtime.vocabulary import SampleSpec, sample_sorted

#: A sorted distribution; its cumulative sums (0.4, 0.7, 0.85, 0.95, 1.0) sit far from the
#: u values below, so float32 rounding cannot move a draw.
P = [0.4, 0.3, 0.15, 0.1, 0.05]
U = [0.02, 0.13, 0.31, 0.52, 0.66, 0.79, 0.88, 0.93, 0.985]


def _draw(probs: list[float], u: float, spec: SampleSpec) -> int:
    """The reference: the filters in order on the sorted distribution, then the CDF of what is
    kept inverted at u (u scaled to the kept mass when a filter is set)."""
    kept = list(range(len(probs)))
    if spec.top_k is not None:
        kept = kept[: spec.top_k]
    if spec.top_p is not None:
        total = sum(probs[i] for i in kept) if spec.top_k is not None else 1.0
        before, chosen = 0.0, []
        for i in kept:  # a token is kept while the mass before it is below top_p
            if before / total < spec.top_p:
                chosen.append(i)
            before += probs[i]
        kept = chosen
    if spec.min_p is not None:
        kept = [i for i in kept if probs[i] >= spec.min_p * probs[0]]
    filtered = spec.top_k is not None or spec.top_p is not None or spec.min_p is not None
    target = u * sum(probs[i] for i in kept) if filtered else u
    running = 0.0
    for i in kept:
        running += probs[i]
        if running > target:
            return i
    return kept[-1]


def _sampled(
    probs: list[float], spec: SampleSpec, u: list[float], vocab: int | None = None
) -> tuple[list[int], list[bool]]:
    rows = len(u)
    values = np.tile(np.log(np.array(probs, np.float64)).astype(np.float32), (rows, 1))
    lse = np.zeros(rows, np.float32)
    index, inside = sample_sorted(values, lse, spec, np.array(u), vocab or len(probs))
    assert index.dtype == np.intp
    assert inside.dtype == np.bool_
    return index.tolist(), inside.tolist()


SPECS = [
    SampleSpec(),
    *(SampleSpec(top_k=k) for k in (1, 2, 3, 5)),
    *(SampleSpec(top_p=p) for p in (0.3, 0.5, 0.65, 0.8, 0.9, 1.0)),
    *(SampleSpec(min_p=m) for m in (0.0, 0.3, 0.5, 0.8)),
    *(
        SampleSpec(top_k=k, top_p=p, min_p=m)
        for k, p, m in itertools.product((2, 3, 4), (0.45, 0.55, 0.75, 0.9), (None, 0.3, 0.6))
    ),
]


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_each_draw_is_the_references_for_every_filter(spec: SampleSpec) -> None:
    """Two rows per u (the filters' sums are per row, never across rows)."""
    index, inside = _sampled(P, spec, [u for u in U for _ in range(2)])
    assert index == [_draw(P, u, spec) for u in U for _ in range(2)]
    assert all(inside)  # the whole row was given


def test_the_reference_draws_what_the_definitions_say() -> None:
    """A few draws worked by hand, so the reference is checked too."""
    assert _draw(P, 0.5, SampleSpec()) == 1  # 0.4 <= 0.5 < 0.7
    assert _draw(P, 0.9, SampleSpec(top_k=2)) == 1  # 0.9 x 0.7 = 0.63 in [0.4, 0.7)
    assert _draw(P, 0.9, SampleSpec(top_p=0.5)) == 1  # keeps 0.4, 0.3 (0.4 < 0.5 before it)
    assert _draw(P, 0.9, SampleSpec(top_k=3, top_p=0.5)) == 1  # 0.4 / 0.85 = 0.47 before 0.3
    assert _draw(P, 0.9, SampleSpec(top_k=2, top_p=0.5)) == 0  # 0.4 / 0.7 = 0.57: 0.3 is out
    assert _draw(P, 0.99, SampleSpec(min_p=0.3)) == 2  # 0.15 >= 0.3 x 0.4, 0.1 is not


def test_min_p_of_one_keeps_exactly_the_tokens_as_likely_as_the_top() -> None:
    probs = [0.25, 0.25, 0.25, 0.125, 0.125]
    index, _ = _sampled(probs, SampleSpec(min_p=1.0), [0.1, 0.5, 0.9, 0.99])
    assert index == [0, 1, 2, 2]


def test_each_row_falls_back_to_its_own_last_kept_token() -> None:
    """Two rows keeping different sets (top_p 0.65 keeps two of P, three of Q): u = 1 draws
    each row's own last kept token."""
    q = [0.3, 0.3, 0.2, 0.1, 0.1]
    rows = np.log(np.array([P, q], np.float64)).astype(np.float32)
    lse = np.zeros(2, np.float32)
    spec = SampleSpec(top_p=0.65)
    index, _ = sample_sorted(rows, lse, spec, np.array([1.0, 1.0]), 5)
    assert index.tolist() == [1, 2]


def test_the_last_kept_token_takes_a_u_at_the_very_top() -> None:
    """u = 1 (what rounding can make of u x mass) lands past every kept token's CDF: the
    draw is the last kept token, never one a filter removed."""
    for spec, last in [
        (SampleSpec(top_k=2), 1),
        (SampleSpec(top_p=0.5), 1),
        (SampleSpec(min_p=0.3), 2),
        (SampleSpec(), 4),
    ]:
        index, _ = _sampled(P, spec, [1.0, 1.0])
        assert index == [last, last], spec


@pytest.mark.parametrize(
    ("spec", "width", "u", "inside"),
    [
        # no filter: inside when u lands within the prefix's mass (0.4, 0.7, 0.85)
        (SampleSpec(), 3, [0.1, 0.8, 0.9], [True, True, False]),
        # top_k: inside when the k fit in the prefix
        (SampleSpec(top_k=3), 3, [0.9], [True]),
        (SampleSpec(top_k=4), 3, [0.9], [False]),
        # top_p: inside when the prefix's mass reaches it (0.85 after three)
        (SampleSpec(top_p=0.8), 3, [0.9], [True]),
        (SampleSpec(top_p=0.9), 3, [0.9], [False]),
        # min_p: inside when the prefix's last token is already below the bar
        (SampleSpec(min_p=0.3), 4, [0.9], [True]),
        (SampleSpec(min_p=0.3), 3, [0.9], [False]),
    ],
)
def test_inside_says_whether_the_prefix_holds_the_kept_set(
    spec: SampleSpec, width: int, u: list[float], inside: list[bool]
) -> None:
    _, got = _sampled(P[:width], spec, u, vocab=len(P))
    assert got == inside


def test_a_prefix_of_equal_tokens_may_continue_past_min_p() -> None:
    """The prefix ends on a token exactly at the bar (min_p 1, all tied): the next one may
    be at the bar too, so the prefix is not known to hold the kept set."""
    _, inside = _sampled([0.2, 0.2, 0.2], SampleSpec(min_p=1.0), [0.5], vocab=5)
    assert inside == [False]


def test_inside_rows_draw_what_the_whole_row_draws() -> None:
    """For every spec, every row the prefix says it holds draws the whole row's token. The
    prefix holds ``top_k`` tokens at least, as the callers fetch it (``top_p`` after
    ``top_k`` is taken on the k's mass, which a shorter prefix does not know)."""
    for spec in SPECS:
        width = 4
        if spec.top_k is not None and spec.top_k > width:
            continue
        whole, _ = _sampled(P, spec, U)
        prefix, inside = _sampled(P[:width], spec, U, vocab=len(P))
        assert [w for w, i in zip(whole, inside, strict=True) if i] == [
            p for p, i in zip(prefix, inside, strict=True) if i
        ], spec


def test_greedy_takes_the_first_of_each_row_as_intp() -> None:
    index, inside = _sampled(P, SampleSpec(temperature=0.0), [0.9, 0.1])
    assert index == [0, 0]
    assert inside == [True, True]


def _probabilities(values: npt.NDArray[np.float32]) -> list[float]:
    return [math.exp(v) for v in values.astype(np.float64).tolist()]


def test_probabilities_are_taken_from_the_rows_own_log_sum_exp() -> None:
    """Values are logits and lse their row's log-sum-exp: a row shifted by c with its lse
    shifted by c draws the same."""
    values = np.log(np.array([P, P], np.float64)).astype(np.float32) + np.float32(40.0)
    lse = np.array([40.0, 40.0], np.float32)
    index, _ = sample_sorted(values, lse, SampleSpec(top_p=0.5), np.array([0.9, 0.2]), 5)
    assert index.tolist() == [
        _draw(_probabilities(values[0] - 40.0), 0.9, SampleSpec(top_p=0.5)),
        0,
    ]
