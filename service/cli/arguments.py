"""The errors a command raises on purpose (printed as ``lmhead: message``): exit 2 for an
option the command refuses, as argparse's own refusals, and exit 1 when it could not do its
job; the argument types that refuse bad values before a command starts, and the message of
invalid settings."""

from __future__ import annotations

import argparse
from pathlib import Path

from pydantic import ValidationError

from service.digits import decimal
from service.errors import describe_validation_errors
from service.repository.disk import is_valid_name


def settings_message(error: ValidationError) -> str:
    """Settings' errors located by their environment variables (``port`` -> ``LMHEAD_PORT``)."""
    located = [
        {**item, "loc": tuple(f"LMHEAD_{str(part).upper()}" for part in item["loc"])}
        for item in error.errors()
    ]
    return describe_validation_errors(located, "")


class CommandError(Exception):
    """A command could not do its job for a reason the user can act on (no traceback)."""


class UsageError(CommandError):
    """An option's value, or a combination of options, the command refuses (exit 2)."""


def positive(text: str) -> int:
    """An integer >= 1 (versions, sizes, k, block sizes)."""
    return _integer(text, 1)


def non_negative(text: str) -> int:
    return _integer(text, 0)


def _integer(text: str, lowest: int) -> int:
    magnitude = decimal(text.removeprefix("-"))
    if magnitude is None:
        raise argparse.ArgumentTypeError(f"{text[:32]!r} is not an integer")
    value = -magnitude if text.startswith("-") else magnitude
    if value < lowest:
        raise argparse.ArgumentTypeError(f"{value} is below {lowest}")
    return value


def model_name(text: str) -> str:
    """A model name the service serves (and that stays inside the repository)."""
    if not is_valid_name(text):
        raise argparse.ArgumentTypeError(
            f"{text[:64]!r} is no model name: use letters, digits, '.', '_', '-' (starting with "
            "a letter or digit)"
        )
    return text


def repository_path(text: str) -> Path:
    """A repository directory (created when missing; never an existing file)."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(
            f"{text[:200]} is not a directory (from --repository or LMHEAD_REPOSITORY)"
        )
    return path
