"""Request options checked once, before any math: what comes out is in the head's columns and
in range, and what cannot be served is refused saying what was wrong."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from service.errors import InvalidInput, PayloadTooLarge
from service.limits import Limits
from service.messages import SampleOptions, VocabularyOptions
from service.plane.options import token_lists, vocabulary_shape
from service.runtime.vocabulary import Shape, TokenSpace

LIMITS = Limits(max_rows=128, max_k=50, max_logits_bytes=2**20, max_inflight_bytes=2**24)
WHOLE = TokenSpace(100)
TRIMMED = TokenSpace(100, np.array([3, 10, 20, 40, 99], np.int64))  # 5 of 100 ids kept


def _shape(
    space: TokenSpace = WHOLE, temperature: float = 1.0, **options: Any
) -> tuple[Shape, float]:
    return vocabulary_shape(VocabularyOptions(**options), 2, space, LIMITS, temperature)


def test_a_trimmed_head_takes_original_ids_and_works_in_columns() -> None:
    shape, _ = _shape(
        TRIMMED,
        allowed_token_ids=np.array([99, 10]),
        logit_bias={"20": 1.5},
        banned_token_ids=np.array([3]),
    )
    assert shape.allowed is not None
    assert shape.bias is not None
    assert shape.allowed.tolist() == [4, 1]
    assert shape.bias.ids.tolist() == [0, 2]  # sorted columns: 3 banned, 20 biased
    assert shape.bias.values.tolist() == [-np.inf, 1.5]
    assert shape.over == "candidates"  # log-probs over the allowed tokens by default
    with pytest.raises(InvalidInput, match="token 11 is not in this trimmed head"):
        _shape(TRIMMED, allowed_token_ids=np.array([11]))


def test_bias_is_taken_at_the_run_temperature() -> None:
    shape, temperature = _shape(logit_bias={7: 2.0}, temperature=0.5)
    assert temperature == 0.5
    assert shape.bias is not None
    assert shape.bias.values.tolist() == [4.0]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"allowed_token_ids": np.array([1, 2, 1])}, "names token 1 twice"),
        ({"allowed_token_ids": np.array([[1, 2]] * 3)}, "one list per row: got 3 lists for 2 rows"),
        ({"allowed_token_ids": np.array([[1, 2]])}, "got 1 list for 2 rows"),
        ({"allowed_token_ids": np.array([100])}, r"must be in \[0, 100\)"),
        ({"banned_token_ids": np.arange(100)}, "bans all 100 tokens"),
        ({"banned_token_ids": np.array([[21], [19]])}, "one flat list of ids, banned on every row"),
        (
            {"allowed_token_ids": np.array([4, 5]), "banned_token_ids": np.array([4, 5])},
            "every allowed token of a row is banned",
        ),
        ({"logit_bias": {"07": 1.0}}, "keys must be token ids"),
        ({"logit_bias": {"7": 101.0}}, r"in \[-100, 100\]"),
        ({"logit_bias": {"7": True}}, "values must be numbers"),
        ({"logprobs_over": "tokens"}, "must be 'candidates' or 'vocabulary'"),
        ({"logprobs_over": "candidates"}, "needs allowed_token_ids"),
        ({"sample": SampleOptions(top_p=0.0)}, r"top_p must be in \(0, 1\]"),
        ({"sample": SampleOptions(seed=2**63)}, r"seed must be in \[0, 2\*\*63\)"),
        ({"sample": SampleOptions(top_k=51)}, "sample.top_k must be between 1 and 50"),
        ({"sample": SampleOptions(temperature=0.7)}, None),
    ],
)
def test_options_that_cannot_be_served_are_refused_saying_why(
    options: dict[str, Any], message: str | None
) -> None:
    if message is None:  # the one valid case: sampling at its own temperature
        _, temperature = _shape(**options)
        assert temperature == 0.7
        return
    with pytest.raises(InvalidInput, match=message):
        _shape(**options)


def test_more_ids_than_the_row_limit_are_too_large() -> None:
    with pytest.raises(PayloadTooLarge, match="LMHEAD_MAX_ROWS"):
        token_lists(np.arange(129), 1, TokenSpace(1000), LIMITS, "allowed_token_ids")
