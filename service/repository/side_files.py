"""The files beside a head that name its tokens: the labels file (a token string per line)
and a trimmed head's map to the original ids. Read as a careless operator writes them: right
where they are right, refused with the file named where not, and bounded in size before
anything is parsed (a labels line repeats in every answer that names its token).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from service.repository.disk import VOCAB_MAP_FILE, RepositoryError
from service.repository.labels import MAX_LABEL_BYTES, first_over_bound
from service.runtime.vocabulary import TokenSpace

#: Labels files: a token string per row (a 262k vocabulary takes ~3 MB), none very long
#: (``labels.MAX_LABEL_BYTES`` each).
MAX_LABELS_BYTES = 64 * 2**20
#: A trimmed head's map: ``"123456789, "`` per id at most, in JSON.
MAP_BYTES_PER_ROW = 24


def read_labels(version_dir: Path, filename: str, vocab_size: int) -> list[str] | None:
    """Token strings for a version, or None without a labels file; never more than the vocab,
    none past ``MAX_LABEL_BYTES`` as a JSON answer encodes it (each answer repeats its tokens'
    strings: one 10 MB line made a 200-row answer 2 GB, and 32,000 lines of 1,024 control
    characters, six bytes each in JSON, a 64-row answer 394 MB), no file above
    ``MAX_LABELS_BYTES``."""
    path = version_dir / filename
    if not path.exists():
        return None
    if not path.is_file() or path.stat().st_size > MAX_LABELS_BYTES:
        raise RepositoryError(
            f"{filename} must be a text file of at most {MAX_LABELS_BYTES} bytes, a token "
            "string per line"
        )
    try:
        text = path.read_bytes().decode("utf-8-sig")  # a byte-order mark is no part of token 0
    except UnicodeDecodeError as error:
        raise RepositoryError(
            f"{filename} is not UTF-8 text ({error.reason} at byte {error.start})"
        ) from None
    # Lines end at "\n" only: ``read_text`` would also end them at a "\r" inside a token
    # (universal newlines) and shift every later id's string.
    labels = text.split("\n")
    ended = labels[:-1]  # the last is what follows the final newline ("" when it ends in one)
    if ended and all(label.endswith("\r") for label in ended):  # a file saved with CRLF
        labels = [label[:-1] for label in ended] + labels[-1:]
    if labels and labels[-1] == "":
        labels.pop()
    if len(labels) > vocab_size:
        raise RepositoryError(
            f"{filename} has {len(labels)} labels but the head has vocab_size {vocab_size}"
        )
    over = first_over_bound(labels)
    if over is not None:
        index, size = over
        raise RepositoryError(
            f"{filename} line {index + 1} (token id {index}) takes {size} bytes in a JSON "
            f"answer (quotes and escapes included); a token string takes at most "
            f"{MAX_LABEL_BYTES}"
        )
    return labels


def read_space(version_dir: Path, vocab_size: int) -> TokenSpace:
    """The version's token space: its own columns, or the original ids of a trimmed head (a
    map that keeps every id in place is no trim)."""
    path = version_dir / VOCAB_MAP_FILE
    if not path.is_file():
        return TokenSpace(vocab_size)
    if path.stat().st_size > MAP_BYTES_PER_ROW * vocab_size + 1024:  # never parsed: 11x in RAM
        raise ValueError(f"{VOCAB_MAP_FILE} is far larger than a map of {vocab_size} ids")
    try:
        mapping = json.loads(path.read_text(encoding="utf-8"))
        size, ids = mapping["vocab_size"], mapping["token_ids"]
        if not _whole(size) or not isinstance(ids, list) or not all(map(_whole, ids)):
            raise TypeError("vocab_size and token_ids must be whole numbers below 2**62")
        kept = np.array(ids, np.int64)
    except (ValueError, KeyError, TypeError, RecursionError) as error:
        raise ValueError(f"{VOCAB_MAP_FILE} is not a token map: {str(error)[:200]}") from None
    if kept.shape != (vocab_size,):
        raise ValueError(f"{VOCAB_MAP_FILE} maps {kept.size} ids; the head has {vocab_size} rows")
    if (np.diff(kept) <= 0).any() or kept[0] < 0 or kept[-1] >= size:
        raise ValueError(f"{VOCAB_MAP_FILE} token_ids must ascend within [0, {size})")
    if size == vocab_size:  # every id kept, in place
        return TokenSpace(vocab_size)
    return TokenSpace(size, kept)


def _whole(value: object) -> bool:
    return type(value) is int and 0 <= value < 2**62
