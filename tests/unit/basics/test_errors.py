"""Validation errors say what was wrong and, for a short plain value, what came; never a
payload, and never a number the client did not write."""

from __future__ import annotations

import pytest

from service.errors import describe_validation_errors


def _described(value: object) -> str:
    error = {"loc": ("body", "sample", "seed"), "msg": "Input should be a valid integer"}
    return describe_validation_errors([{**error, "input": value}])


@pytest.mark.parametrize(("value", "shown"), [(7, ", got 7"), (-1.5, ", got -1.5"), ("ten", "")])
def test_a_short_plain_value_is_shown(value: object, shown: str) -> None:
    expected = "sample.seed: Input should be a valid integer"
    assert _described(value) == expected + (shown or ", got 'ten'")


@pytest.mark.parametrize("value", [float(2**64), 1e-30, 10**30, "x" * 100, [1, 2]])
def test_odd_numbers_and_payloads_are_not_echoed(value: object) -> None:
    """2**64 sent as digits reaches pydantic as 1.8446744073709552e+19 (a float): shown, it
    read as a number the client never sent."""
    assert _described(value) == "sample.seed: Input should be a valid integer"
