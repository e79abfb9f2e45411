"""The files beside a head (vocab.txt, vocab_map.json, config.json) as a careless operator
writes them: read right where they are right, refused with the file named where not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.repository.disk import ModelConfig, RepositoryError
from service.repository.labels import MAX_LABEL_BYTES
from service.repository.side_files import read_labels, read_space


@pytest.mark.parametrize(
    ("content", "labels"),
    [
        (b"a\r\nb\r\nc", ["a", "b", "c"]),  # CRLF, no final newline: served "a\r", "b\r"
        (b"\xef\xbb\xbfa\nb\n", ["a", "b"]),  # a byte-order mark was part of token 0
        (b"a\rx\nb\n", ["a\rx", "b"]),  # a CR inside a token stays
        (b'q"\\\x00\n', ['q"\\\x00']),
    ],
)
def test_labels_read_as_written(tmp_path: Path, content: bytes, labels: list[str]) -> None:
    (tmp_path / "vocab.txt").write_bytes(content)
    assert read_labels(tmp_path, "vocab.txt", 10) == labels


def test_labels_that_would_swell_every_answer_are_refused(tmp_path: Path) -> None:
    """A 10 MB line was repeated in each answer that named its token: 2 GB for 200 rows."""
    (tmp_path / "vocab.txt").write_text("a\n" + "x" * (MAX_LABEL_BYTES - 1) + "\n")
    with pytest.raises(RepositoryError, match=r"vocab.txt line 2 \(token id 1\) takes 513 bytes"):
        read_labels(tmp_path, "vocab.txt", 10)
    (tmp_path / "vocab.txt").write_bytes(b"ok\n\xff\n")
    with pytest.raises(RepositoryError, match=r"vocab.txt is not UTF-8 text \(invalid start"):
        read_labels(tmp_path, "vocab.txt", 10)
    (tmp_path / "vocab.txt").unlink()
    (tmp_path / "vocab.txt").mkdir()  # served with no tokens, and no word of it
    with pytest.raises(RepositoryError, match="vocab.txt must be a text file"):
        read_labels(tmp_path, "vocab.txt", 10)


@pytest.mark.parametrize(
    "mapping",
    [
        {"vocab_size": 10, "token_ids": [0.9, 1.9]},  # read as [0, 1]
        {"vocab_size": "10", "token_ids": [0, 1]},
        {"vocab_size": True, "token_ids": [0, 1]},
        {"vocab_size": 10**30, "token_ids": [0, 1]},
        {"vocab_size": 10, "token_ids": [[0], [1]]},
        {"vocab_size": 10, "token_ids": 5},
    ],
)
def test_a_token_map_of_other_types_is_refused(tmp_path: Path, mapping: object) -> None:
    (tmp_path / "vocab_map.json").write_text(json.dumps(mapping))
    with pytest.raises(ValueError, match="vocab_map.json is not a token map: vocab_size and"):
        read_space(tmp_path, 2)


def test_a_token_map_too_large_or_too_deep_is_refused_unread(tmp_path: Path) -> None:
    """100 MB of map took 1.2 GB to parse before it was refused; deep nesting escaped the
    message as a RecursionError."""
    (tmp_path / "vocab_map.json").write_text('{"vocab_size": 10, "token_ids": [' + " " * 10**5)
    with pytest.raises(ValueError, match="far larger than a map of 2 ids"):
        read_space(tmp_path, 2)
    (tmp_path / "vocab_map.json").write_text("[" * 10**4 + "]" * 10**4)
    with pytest.raises(ValueError, match="is not a token map"):
        read_space(tmp_path, 10**4)


def test_a_map_that_keeps_every_id_in_place_is_no_trim(tmp_path: Path) -> None:
    """compare refused a head against itself behind such a map ("trimmed to other ids")."""
    (tmp_path / "vocab_map.json").write_text(json.dumps({"vocab_size": 3, "token_ids": [0, 1, 2]}))
    assert read_space(tmp_path, 3).kept is None


def test_a_shadow_must_name_a_model() -> None:
    with pytest.raises(ValueError, match="'../../etc' is no model name"):
        ModelConfig.model_validate({"shadow": {"model": "../../etc"}})
