"""Options read once (``codec.memo``): a remembered answer is the one validation gives, values
are told apart by type and bits, and refusals are refused every time."""

from __future__ import annotations

import pytest

from service.api.codec.wire import options
from service.api.schemas import TopKOptions
from service.errors import InvalidInput


def test_remembered_options_equal_a_fresh_validation() -> None:
    first = options(TopKOptions, {"k": 3, "temperature": 0.5})
    again = options(TopKOptions, {"k": 3, "temperature": 0.5})
    assert again == first == TopKOptions.model_validate({"k": 3, "temperature": 0.5})
    assert options(TopKOptions, {}) == TopKOptions()


def test_values_are_told_apart_by_type_and_bits() -> None:
    """``True`` is no k in JSON (strict) even after ``1`` was; 0.0 and -0.0 stay apart."""
    assert options(TopKOptions, {"k": 1}).k == 1
    with pytest.raises(InvalidInput):
        options(TopKOptions, {"k": True})
    assert options(TopKOptions, {"k": "2"}, strict=False).k == 2
    with pytest.raises(InvalidInput):
        options(TopKOptions, {"k": "2"})
    assert str(options(TopKOptions, {"temperature": -0.0}).temperature) == "-0.0"
    assert str(options(TopKOptions, {"temperature": 0.0}).temperature) == "0.0"


def test_a_refusal_is_refused_each_time() -> None:
    for _ in range(2):
        with pytest.raises(InvalidInput, match="unknown field 'bogus'"):
            options(TopKOptions, {"bogus": 1})
