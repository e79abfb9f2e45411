"""The decoding step's reference math against examples worked by hand: each processor's
formula as vLLM and transformers write it, the bitmask's bit order, both filter orders, the
raw and processed log-probs, and the inverse-CDF draw."""

from __future__ import annotations

import math

import numpy as np
import pytest

from service.heads.reference import (
    bad_words_banned,
    bitmask_allows,
    bitmask_of,
    decoding_step,
    draw,
    filtered,
    min_tokens_banned,
    presence_frequency_penalized,
    repetition_penalized,
)

INF = np.inf


def test_repetition_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    logits = np.array([[2.0, -1.0, 0.5, 4.0], [2.0, -1.0, 0.5, 4.0]])
    out = repetition_penalized(logits, [[0, 1, 1], [3]], 2.0)
    np.testing.assert_array_equal(out, [[1.0, -2.0, 0.5, 4.0], [2.0, -1.0, 0.5, 2.0]])


def test_presence_and_frequency_count_output_tokens() -> None:
    logits = np.zeros((2, 4))
    out = presence_frequency_penalized(logits, [[1, 1, 1, 2], []], presence=0.5, frequency=0.25)
    np.testing.assert_allclose(out, [[0.0, -1.25, -0.75, 0.0], [0.0, 0.0, 0.0, 0.0]])
    negative = presence_frequency_penalized(logits, [[3]], presence=-2.0, frequency=-1.0)
    np.testing.assert_allclose(negative[:1], [[0.0, 0.0, 0.0, 3.0]])


def test_min_tokens_bans_stop_ids_while_the_output_is_shorter() -> None:
    logits = np.ones((3, 5))
    out = min_tokens_banned(logits, [[], [7, 7], [7, 7, 7]], 3, [0, 4])
    assert np.isneginf(out[:2, [0, 4]]).all()
    assert np.isfinite(out[:2, 1:4]).all()
    np.testing.assert_array_equal(out[2], np.ones(5))


def test_bad_words_ban_the_last_token_where_the_output_ends_with_the_rest() -> None:
    logits = np.zeros((3, 6))
    words = [[5], [1, 2, 3], [4, 2]]
    out = bad_words_banned(logits, [[0, 1, 2], [1, 2, 3], [4]], words)
    assert np.flatnonzero(np.isneginf(out[0])).tolist() == [3, 5]  # ends with 1, 2
    assert np.flatnonzero(np.isneginf(out[1])).tolist() == [5]  # ends with 2, 3: [5] alone
    assert np.flatnonzero(np.isneginf(out[2])).tolist() == [2, 5]  # ends with 4


def test_the_bitmask_is_least_significant_bit_first_one_allowed() -> None:
    # word 0 = 0b101 (tokens 0 and 2); word 1 = -2**31 (bit 31: token 63); 40 tokens: word 1
    # holds tokens 32-39, so bit 31 is past the vocabulary and allows nothing
    mask = np.array([[5, -(2**31)], [-1, 1]], np.int32)
    allows = bitmask_allows(mask, 40)
    assert np.flatnonzero(allows[0]).tolist() == [0, 2]
    assert np.flatnonzero(allows[1]).tolist() == list(range(33))
    assert np.flatnonzero(bitmask_allows(mask, 64)[0]).tolist() == [0, 2, 63]
    flags = np.random.default_rng(0).random((3, 70)) < 0.5
    packed = bitmask_of(flags)
    assert packed.shape == (3, 3)
    assert packed.dtype == np.int32
    np.testing.assert_array_equal(bitmask_allows(packed, 70), flags)


def test_the_filters_keep_a_prefix_in_either_order() -> None:
    """Probabilities 0.5, 0.2, 0.2, 0.1 (tokens 3, 0, 1, 2; 0 and 1 tie, 0 first):
    transformers: top_k 3 keeps 3, 0, 1 (mass 0.9); top_p 0.6 over that renormalized
    (0.556, 0.222, 0.222) keeps 3 and 0; min_p 0.45 (0.225 of the top's 0.5) keeps 3.
    vllm: min_p 0.3 first keeps 3, 0, 1 (0.2 >= 0.15); top_k 2 keeps 3, 0."""
    logits = np.log([[0.2, 0.2, 0.1, 0.5]])
    kept = filtered(logits, top_k=3, top_p=0.6, order="transformers")
    assert np.flatnonzero(np.isfinite(kept[0])).tolist() == [0, 3]
    assert np.flatnonzero(np.isfinite(filtered(logits, top_p=0.5)[0])).tolist() == [3]
    assert np.flatnonzero(np.isfinite(filtered(logits, top_p=0.51)[0])).tolist() == [0, 3]
    kept = filtered(logits, top_k=3, top_p=0.6, min_p=0.45)
    assert np.flatnonzero(np.isfinite(kept[0])).tolist() == [3]
    vllm = filtered(logits, top_k=2, min_p=0.3, order="vllm")
    assert np.flatnonzero(np.isfinite(vllm[0])).tolist() == [0, 3]
    np.testing.assert_array_equal(vllm[0, [0, 3]], logits[0, [0, 3]])


def test_the_orders_differ_when_min_p_narrows_what_top_p_renormalizes() -> None:
    """Probabilities 0.4, 0.3, 0.2, 0.1 with top_p 0.5 and min_p 0.6 (cut at 0.24):
    transformers keeps 0 and 1 by top_p (0.4 before token 1 < 0.5), then min_p keeps both
    (0.3 >= 0.24). vllm: min_p keeps 0, 1 (renormalized 0.571, 0.429), then top_p 0.5 keeps
    0 alone (0.571 before token 1)."""
    logits = np.log([[0.4, 0.3, 0.2, 0.1]])
    hf = filtered(logits, top_p=0.5, min_p=0.6, order="transformers")
    vllm = filtered(logits, top_p=0.5, min_p=0.6, order="vllm")
    assert np.flatnonzero(np.isfinite(hf[0])).tolist() == [0, 1]
    assert np.flatnonzero(np.isfinite(vllm[0])).tolist() == [0]


def test_the_step_applies_bias_before_penalties_and_divides_by_the_temperature() -> None:
    """Token 0: logit 1, bias -3 -> -2, repetition 2 (seen in the prompt) -> -4, then /2.
    Token 1: logit 1, seen twice in the output: repetition -> 0.5, frequency 0.5 x 2 and
    presence 0.25 -> -0.75, /2 -> -0.375. Token 2: untouched, 1 / 2. Token 3: banned by the
    mask. Raw log-probs over tokens 0-2; processed with top_k 2 over tokens 1 and 2."""
    logits = np.ones((1, 4))
    raw, processed = decoding_step(
        logits,
        temperature=2.0,
        bias={0: -3.0},
        prompts=[[0]],
        outputs=[[1, 1]],
        repetition=2.0,
        presence=0.25,
        frequency=0.5,
        bitmask=bitmask_of([[True, True, True, False]]),
        top_k=2,
    )
    shaped = np.array([-2.0, -0.375, 0.5])
    lse = math.log(np.exp(shaped).sum())
    np.testing.assert_allclose(raw[0, :3], shaped - lse)
    assert raw[0, 3] == -INF
    kept = math.log(np.exp(shaped[1:]).sum())
    np.testing.assert_allclose(processed[0, 1:3], shaped[1:] - kept)
    assert processed[0, 0] == processed[0, 3] == -INF


def test_the_step_masks_allowed_ids_bad_words_and_stop_ids() -> None:
    logits = np.zeros((2, 6))
    raw, processed = decoding_step(
        logits,
        allowed=[[0, 1, 2, 3], [1, 2, 3, 4]],
        outputs=[[4], []],
        min_tokens=1,
        stop_ids=[2],
        bad_words=[[4, 3]],
    )
    assert np.flatnonzero(np.isfinite(raw[0])).tolist() == [0, 1, 2]  # 3: bad word after 4
    assert np.flatnonzero(np.isfinite(raw[1])).tolist() == [1, 3, 4]  # 2: stop, output empty
    np.testing.assert_allclose(raw[np.isfinite(raw)], -math.log(3))
    np.testing.assert_array_equal(processed, raw)  # no filter: the same distribution


@pytest.mark.parametrize(
    ("u", "token"), [(0.0, 3), (0.49, 3), (0.5, 0), (0.69, 0), (0.7, 1), (0.95, 2), (1.0, 2)]
)
def test_a_draw_inverts_the_sorted_cdf(u: float, token: int) -> None:
    """Sorted: 3 (0.5), 0 (0.2), 1 (0.2; ties with 0, after it), 2 (0.1)."""
    assert draw(np.log([0.2, 0.2, 0.1, 0.5]), u) == token


def test_a_draw_never_lands_on_a_filtered_token() -> None:
    logprobs = np.log([0.6, 0.4, 1.0, 1.0]) - np.array([0.0, 0.0, INF, INF])
    assert draw(logprobs, 1.0) == 1
    assert draw(logprobs, 0.999999999) == 1
