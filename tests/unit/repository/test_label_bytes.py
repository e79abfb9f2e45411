"""Token strings have a bound in bytes as a JSON answer encodes them (quotes and escapes
included), checked at load, and a loaded version says what its longest one costs: 32,000
labels of 1,024 control characters, each within the old bound of characters, made a 64-row
k=1000 answer 394 MB (issue 43, finding 5)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import orjson
import pytest
from safetensors.numpy import save_file

from service.heads.files import HeadWeights, save_head
from service.limits import Limits
from service.repository.disk import LABELS_FILE, RepositoryError, read_source
from service.repository.labels import MAX_LABEL_BYTES, LabelTable
from service.repository.loaded_version import LoadedVersion
from service.repository.open_version import LoadOptions, open_version
from service.repository.side_files import read_labels
from service.tools.checkpoints import CheckpointError
from service.tools.demo import demo_tokens
from service.tools.importer import import_checkpoint

VOCAB, D = 400, 8
OPTIONS = {"memory_mode": "shared", "intra_op_threads": 1, "default_k": 5}
LIMITS = Limits(max_rows=64, max_k=100, max_logits_bytes=2**24, max_inflight_bytes=2**26)
#: One control character: six bytes in JSON (``\u0001``).
CONTROL = "\x01"


def _encoded(label: str) -> int:
    """What the service's encoder writes for ``label``; Python's json (``ensure_ascii=False``,
    as Starlette's JSONResponse) writes the same bytes."""
    written = orjson.dumps(label)
    assert written == json.dumps(label, ensure_ascii=False).encode()
    return len(written)


def _just_over() -> str:
    """A label of 85 control characters and a letter: 88 characters (the old bound took
    1,024), 2 + 85 * 6 + 1 = 513 bytes in JSON."""
    return CONTROL * ((MAX_LABEL_BYTES - 2) // 6) + "a" * ((MAX_LABEL_BYTES - 2) % 6 + 1)


def test_a_label_over_the_bound_fails_its_read_naming_line_id_size_and_bound(
    tmp_path: Path,
) -> None:
    over = _just_over()
    assert _encoded(over) == MAX_LABEL_BYTES + 1
    assert len(over) < 100
    (tmp_path / LABELS_FILE).write_text(f"a\nb\n{over}\n")
    said = (
        f"vocab.txt line 3 (token id 2) takes {MAX_LABEL_BYTES + 1} bytes in a JSON answer "
        f"(quotes and escapes included); a token string takes at most {MAX_LABEL_BYTES}"
    )
    with pytest.raises(RepositoryError, match=re.escape(said)):
        read_labels(tmp_path, LABELS_FILE, 10)
    at_bound = over[:-1]
    assert _encoded(at_bound) == MAX_LABEL_BYTES
    (tmp_path / LABELS_FILE).write_text(f"a\nb\n{at_bound}\n")
    assert read_labels(tmp_path, LABELS_FILE, 10) == ["a", "b", at_bound]


def _version(repository: Path, labels: list[str] | None) -> Path:
    table = np.random.default_rng(0).standard_normal((VOCAB, D)).astype(np.float32)
    version = save_head(HeadWeights.from_arrays(table), repository / "m" / "1").parent
    if labels is not None:
        (version / LABELS_FILE).write_text("".join(f"{label}\n" for label in labels))
    return version


def _load(repository: Path) -> LoadedVersion:
    options = LoadOptions(**OPTIONS, limits=LIMITS, repository=repository)  # type: ignore[arg-type]
    return open_version(read_source(repository, "m"), 1, options)


def test_a_version_with_a_label_over_the_bound_fails_its_load(tmp_path: Path) -> None:
    labels = [f"t{i}" for i in range(VOCAB)]
    labels[123] = _just_over()
    _version(tmp_path, labels)
    with pytest.raises(RepositoryError, match=r"vocab.txt line 124 \(token id 123\) takes 513"):
        _load(tmp_path)


def test_label_bytes_is_the_largest_label_as_the_answers_encode_it(tmp_path: Path) -> None:
    """Demo-like labels, with the strings JSON escapes: a quote, a backslash, a tab, a control
    character, and characters of two, three and four UTF-8 bytes."""
    labels = demo_tokens(VOCAB)
    labels[7:13] = ['say "hi"', "C:\\dir", "\t\t", CONTROL * 20, "é" * 30, "😀" * 25]
    _version(tmp_path, labels)
    loaded = _load(tmp_path)
    assert loaded.label_bytes == max(map(_encoded, labels)) == _encoded(CONTROL * 20) == 122
    answered = loaded.tokens(np.arange(VOCAB).reshape(-1, 1))  # as an answer's rows hold them
    assert answered is not None
    assert max(len(orjson.dumps(token)) for (token,) in answered) == loaded.label_bytes


def test_columns_without_a_label_cost_a_null_and_no_labels_cost_nothing(
    tmp_path: Path,
) -> None:
    assert LabelTable.of(["a", "bc"], 2).encoded_bytes == 4  # "bc": quotes included
    assert LabelTable.of(["a", ""], 3).encoded_bytes == 4  # the third column answers null
    assert LabelTable.of([], 3).encoded_bytes == 4
    _version(tmp_path / "bare", None)
    assert _load(tmp_path / "bare").label_bytes == 0
    _version(tmp_path / "short", ["a"])  # 399 columns answer null
    assert _load(tmp_path / "short").label_bytes == 4


def test_import_refuses_a_tokenizer_whose_labels_the_service_would_refuse(
    tmp_path: Path,
) -> None:
    """The version would have been written, then failed every load."""
    source = tmp_path / "ckpt"
    source.mkdir()
    table = np.random.default_rng(0).standard_normal((VOCAB, D)).astype(np.float32)
    save_file({"model.embed_tokens.weight": table}, str(source / "model.safetensors"))
    vocab = {f"t{i}": i for i in range(VOCAB)} | {_just_over(): 42}
    (source / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}}))
    with pytest.raises(CheckpointError, match=r"string of token id 42 takes 513 bytes"):
        import_checkpoint(source, tmp_path / "models", "m")
    assert not (tmp_path / "models" / "m").exists()


def test_the_old_bound_of_characters_still_holds_through_the_new_one(tmp_path: Path) -> None:
    """A line of 1,025 characters was refused before; it is still (by its bytes)."""
    (tmp_path / LABELS_FILE).write_text("a\n" + "x" * 1025 + "\n")
    with pytest.raises(RepositoryError, match=r"line 2 \(token id 1\) takes 1027 bytes"):
        read_labels(tmp_path, LABELS_FILE, 10)
