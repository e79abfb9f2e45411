"""Numbers read from text (URL versions, header byte counts, version directories, metadata,
command-line ids): ASCII digits only, at most 18 of them.

``str.isdigit`` also takes "²" and "٣", which ``int`` refuses (a 500 or a crashed scan where
they came in), and ``int`` takes any length (5,000 digits; a directory "9" x 40 became the
newest version). 18 digits always fit an int64.
"""

from __future__ import annotations

import re

DIGITS = re.compile(r"[0-9]{1,18}")


def decimal(text: str) -> int | None:
    """The number ``text`` spells in ASCII digits, or None when it is anything else."""
    return int(text) if DIGITS.fullmatch(text) else None
