"""The decoding step's options, checked before any math: processors in the head's columns,
and a 422 naming the field, what was expected and what came for everything that cannot be
served (penalties out of range, ids outside the vocabulary, lengths that do not add up, a
bitmask of the wrong width or with a row that allows nothing, a row nothing is left in, more
draws than the limit)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from service.errors import InvalidInput, PayloadTooLarge
from service.heads.reference import bitmask_allows, bitmask_of
from service.limits import Limits
from service.messages import DecodingOptions, SampleOptions, TokenLists, VocabularyOptions
from service.plane import decoding_options
from service.plane.decoding_options import MAX_DRAWS, MAX_HISTORY_TOKENS
from service.plane.options import vocabulary_shape
from service.runtime.processors import Processors, outside
from service.runtime.vocabulary import TokenSpace

LIMITS = Limits(max_rows=128, max_k=50, max_logits_bytes=2**20, max_inflight_bytes=2**24)
WHOLE = TokenSpace(100)  # ceil(100 / 32) = 4 words a row
TRIMMED = TokenSpace(100, np.array([3, 10, 20, 40, 99], np.int64))
ROWS = 3


def _check(space: TokenSpace = WHOLE, **options: Any) -> Processors:
    return decoding_options.processors(DecodingOptions(**options), ROWS, space, LIMITS)


def _mask(*allowed: list[int], vocab: int = 100) -> np.ndarray[Any, np.dtype[np.int32]]:
    flags = np.zeros((len(allowed), vocab), np.bool_)
    for row, tokens in enumerate(allowed):
        flags[row, tokens] = True
    return bitmask_of(flags)


def test_the_options_come_out_as_columns_and_numbers_in_range() -> None:
    checked = _check(
        prompt_token_ids=TokenLists.of([[1, 2], [], [5, 5, 5]]),
        output_token_ids=TokenLists(np.array([7, 8, 9]), np.array([1, 2, 0])),
        repetition_penalty=1.3,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        min_tokens=2,
        stop_token_ids=np.array([0, 0, 99]),
        bad_words_ids=TokenLists.of([[4], [7, 8]]),
        token_bitmask=_mask([1, 2, 3]),
        logprobs_mode="processed",
        processor_order="vllm",
    )
    assert checked.prompt is not None
    assert checked.output is not None
    assert checked.prompt.offsets.tolist() == [0, 2, 2, 5]
    assert checked.output.values.tolist() == [7, 8, 9]
    assert checked.output.lengths.tolist() == [1, 2, 0]
    assert (checked.repetition, checked.presence, checked.frequency) == (1.3, -2.0, 2.0)
    assert checked.stop_ids is not None
    assert checked.stop_ids.tolist() == [0, 99]
    assert checked.bitmask is not None
    assert checked.bitmask.shape == (1, 4)
    assert (checked.logprobs_mode, checked.order) == ("processed", "vllm")
    neutral = _check()
    assert (neutral.repetition, neutral.presence, neutral.logprobs_mode) == (1.0, 0.0, "raw")
    assert neutral.order == "transformers"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be a number > 0 \(1: none\)"),
        ({"repetition_penalty": -1.0}, "repetition_penalty must be a number > 0"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty must be a number > 0"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be a number in \[-2, 2\].*got 2.5"),
        ({"frequency_penalty": -2.01}, r"frequency_penalty must be a number in \[-2, 2\]"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty must be a number in"),
        ({"min_tokens": 3}, "min_tokens bans the stop ids.*give stop_token_ids"),
        ({"min_tokens": -1, "stop_token_ids": np.array([1])}, r"min_tokens must be .* got -1"),
        ({"stop_token_ids": np.array([100])}, r"stop_token_ids must be in \[0, 100\)"),
        ({"logprobs_mode": "logits"}, "logprobs_mode must be 'raw' or 'processed', got 'logits'"),
        ({"processor_order": "hf"}, "processor_order must be 'transformers' or 'vllm'"),
    ],
)
def test_out_of_range_options_are_refused_naming_the_field(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidInput, match=message):
        _check(**options)


@pytest.mark.parametrize(
    ("lists", "message"),
    [
        (TokenLists.of([[1], [2]]), "must hold one list per row: got 2 lists for 3 rows"),
        (
            TokenLists(np.array([1, 2, 3]), np.array([1, 1, 2])),
            "lengths add up to 4, but 3 ids came",
        ),
        (TokenLists(np.array([1, 2]), np.array([3, -1, 0])), "lengths must be >= 0"),
        (TokenLists.of([[1], [100], [2]]), r"token ids in \[0, 100\), got values in \[1, 100\]"),
        (TokenLists.of([[-1], [], []]), r"got values in \[-1, -1\]"),
        (TokenLists(np.array([0.5]), np.array([1, 0, 0])), "must hold integers, got float64"),
    ],
)
@pytest.mark.parametrize("field", ["prompt_token_ids", "output_token_ids"])
def test_histories_must_add_up_and_name_tokens_of_the_vocabulary(
    field: str, lists: TokenLists, message: str
) -> None:
    with pytest.raises(InvalidInput, match=f"{field}.*{message}"):
        _check(WHOLE, **{field: lists})


def test_a_history_past_the_limit_is_too_large() -> None:
    values = np.zeros(MAX_HISTORY_TOKENS + 1, np.int64)
    lengths = np.array([len(values), 0, 0])
    with pytest.raises(PayloadTooLarge, match=f"the limit is {MAX_HISTORY_TOKENS} per request"):
        _check(output_token_ids=TokenLists(values, lengths))


def test_bad_words_must_hold_a_token_each() -> None:
    with pytest.raises(InvalidInput, match="bad_words_ids: every word must hold at least one"):
        _check(bad_words_ids=TokenLists.of([[1], []]))
    with pytest.raises(InvalidInput, match=r"bad_words_ids must be token ids in \[0, 100\)"):
        _check(bad_words_ids=TokenLists.of([[1, 100]]))


@pytest.mark.parametrize(
    ("mask", "message"),
    [
        (np.zeros((1, 3), np.int32), r"ceil\(vocab / 32\) = 4 words per row \(vocab 100\)"),
        (np.zeros((1, 5), np.int32), r"ceil\(vocab / 32\) = 4 words .* got shape \[1, 5\]"),
        (np.full((2, 4), -1, np.int32), "one row for every row, or one per row .3., got 2 rows"),
        (np.full((1, 4), 0.5), "must hold int32 words, got float64"),
        (np.full((1, 4), 2**32), r"32-bit integers \(int32 or uint32\)"),
    ],
)
def test_a_bitmask_of_the_wrong_shape_is_refused_naming_its_width(
    mask: np.ndarray[Any, Any], message: str
) -> None:
    with pytest.raises(InvalidInput, match=f"token_bitmask.*{message}"):
        _check(token_bitmask=mask)


def test_a_bitmask_row_that_allows_nothing_is_refused_naming_the_row() -> None:
    mask = _mask([1], [2], [])
    with pytest.raises(InvalidInput, match="token_bitmask row 2 allows no token"):
        _check(token_bitmask=mask)
    past = np.zeros((1, 4), np.int32)
    past[0, 3] = np.int32(1 << 4)  # token 100: past the vocabulary, so nothing
    with pytest.raises(InvalidInput, match="token_bitmask row 0 allows no token"):
        _check(token_bitmask=past)


def test_a_bitmask_is_taken_as_json_writes_it_unsigned_and_one_dimensional() -> None:
    words = _mask([0, 31, 63, 99])[0]
    unsigned = words.astype(np.int64) & 0xFFFFFFFF
    checked = _check(token_bitmask=unsigned)
    assert checked.bitmask is not None
    np.testing.assert_array_equal(checked.bitmask, words[None, :])


def test_a_trimmed_head_reads_the_bitmask_and_histories_over_its_columns() -> None:
    """Kept ids 3, 10, 20, 40, 99 are columns 0-4; the mask is over the original 100 ids."""
    checked = _check(
        TRIMMED,
        token_bitmask=_mask([10, 40, 50]),
        output_token_ids=TokenLists.of([[99, 11], [], [3]]),
        stop_token_ids=np.array([11, 20]),
    )
    assert checked.bitmask is not None
    assert bitmask_allows(checked.bitmask, 5).tolist() == [[False, True, False, True, False]]
    assert checked.output is not None
    assert checked.output.values.tolist() == [4, int(outside(np.array([11]))[0]), 0]
    assert checked.stop_ids is not None
    assert checked.stop_ids.tolist() == [2]  # 11 is not in the head: nothing to ban
    with pytest.raises(InvalidInput, match="token_bitmask row 0 allows no token"):
        _check(TRIMMED, token_bitmask=_mask([11, 50]))


@pytest.mark.parametrize(
    ("options", "row"),
    [
        ({"token_bitmask": _mask([5], [5, 6], [7]), "stop_token_ids": np.array([7])}, None),
        (
            {
                "token_bitmask": _mask([5], [5, 6], [7]),
                "stop_token_ids": np.array([7]),
                "min_tokens": 1,
                "output_token_ids": TokenLists.of([[1], [1], []]),
            },
            2,
        ),
        ({"token_bitmask": _mask([4, 5]), "bad_words_ids": TokenLists.of([[4], [5]])}, 0),
        (
            {
                "token_bitmask": _mask([4, 5], [4, 5], [4, 5]),
                "bad_words_ids": TokenLists.of([[4], [1, 5]]),
                "output_token_ids": TokenLists.of([[0], [2, 1], [1]]),
            },
            1,
        ),
    ],
)
def test_a_row_with_no_token_left_is_refused_naming_the_row(
    options: dict[str, Any], row: int | None
) -> None:
    if row is None:  # min_tokens 0: the stop ids are not banned
        _check(**options)
        return
    with pytest.raises(InvalidInput, match=f"row {row} has no token left"):
        _check(**options)


def test_allowed_and_banned_ids_count_with_the_bitmask() -> None:
    allowed, banned = np.array([[5, 6], [5, 6], [6, 7]]), np.array([6])
    with pytest.raises(InvalidInput, match="row 2 has no token left"):
        decoding_options.processors(
            DecodingOptions(token_bitmask=_mask([5, 6])), ROWS, WHOLE, LIMITS, allowed, banned
        )
    checked = decoding_options.processors(
        DecodingOptions(token_bitmask=_mask([5, 6, 7])), ROWS, WHOLE, LIMITS, allowed, None
    )
    assert checked.bitmask is not None
    assert bitmask_allows(checked.bitmask, 100).sum(axis=1).tolist() == [2, 2, 2]
    with pytest.raises(InvalidInput, match="row 0 has no token left"):
        decoding_options.processors(None, ROWS, WHOLE, LIMITS, np.array([6]), banned)


def test_the_draws_are_bounded_and_any_decoding_option_asks_for_the_step() -> None:
    plain, _ = vocabulary_shape(VocabularyOptions(sample=SampleOptions()), ROWS, WHOLE, LIMITS, 1)
    assert plain.processors is None
    assert plain.sample is not None
    assert plain.sample.n is None
    assert plain.sample.draws == 1
    drawn, _ = vocabulary_shape(
        VocabularyOptions(sample=SampleOptions(n=MAX_DRAWS)), ROWS, WHOLE, LIMITS, 1
    )
    assert drawn.processors is not None
    assert drawn.sample is not None
    assert drawn.sample.n == MAX_DRAWS
    for n in (0, MAX_DRAWS + 1):
        with pytest.raises(
            InvalidInput, match=rf"sample.n must be an integer in \[1, {MAX_DRAWS}\]"
        ):
            vocabulary_shape(VocabularyOptions(sample=SampleOptions(n=n)), ROWS, WHOLE, LIMITS, 1)
    with pytest.raises(InvalidInput, match="logprobs_over='vocabulary' does not apply"):
        vocabulary_shape(
            VocabularyOptions(
                allowed_token_ids=np.array([1, 2]),
                logprobs_over="vocabulary",
                decoding=DecodingOptions(repetition_penalty=1.1),
            ),
            ROWS,
            WHOLE,
            LIMITS,
            1,
        )
