"""The command line's argument types: bad values refused before a command starts, with a
message that says what was wrong (and never the whole value)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from service.cli.arguments import model_name, non_negative, positive, repository_path


@pytest.mark.parametrize(("text", "value"), [("1", 1), ("42", 42), ("007", 7)])
def test_positive_integers_are_read(text: str, value: int) -> None:
    assert positive(text) == value


@pytest.mark.parametrize(
    ("text", "message"),
    [("0", "0 is below 1"), ("-3", "-3 is below 1"), ("1.5", "not an integer"), ("", "integer")],
)
def test_other_values_are_refused_saying_why(text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        positive(text)


def test_non_negative_takes_zero() -> None:
    assert non_negative("0") == 0
    with pytest.raises(argparse.ArgumentTypeError, match="below 0"):
        non_negative("-1")


def test_a_long_bad_value_is_cut_in_the_message() -> None:
    with pytest.raises(argparse.ArgumentTypeError) as raised:
        positive("x" * 10_000)
    assert len(str(raised.value)) < 100


@pytest.mark.parametrize("name", ["../etc", ".hidden", "a/b", "", "x" * 200])
def test_names_that_would_leave_the_repository_are_refused(name: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="no model name"):
        model_name(name)


def test_a_repository_that_is_a_file_is_refused(tmp_path: Path) -> None:
    file = tmp_path / "models"
    file.write_text("")
    with pytest.raises(argparse.ArgumentTypeError, match="is not a directory"):
        repository_path(str(file))
    assert repository_path(str(tmp_path / "new")) == tmp_path / "new"
