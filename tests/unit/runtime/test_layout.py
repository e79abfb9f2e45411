"""How heads are laid out when opened (``service.runtime.layout``) and the rows read beside them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service import output_projection_tied
from service.heads.files import HeadWeights, save_head
from service.runtime.layout import Placement, open_head
from service.runtime.rows import FileRows
from service.runtime.session import HeadSession
from service.settings import MemoryMode

VOCAB, D_MODEL = 300, 32


@pytest.fixture(scope="module")
def table() -> np.ndarray:
    return np.random.default_rng(3).standard_normal((VOCAB, D_MODEL), dtype=np.float32)


@pytest.mark.parametrize("external", [False, True])
def test_a_shared_tied_head_is_split_and_answers_as_the_reference(
    tmp_path: Path, table: np.ndarray, external: bool
) -> None:
    path = save_head(HeadWeights.from_arrays(table), tmp_path / "head", external_data=external)
    files = sorted(item.name for item in path.parent.iterdir())
    session = open_head(path, Placement("shared"))
    assert isinstance(session.rows, FileRows)  # embeddings read beside the session
    hidden = np.random.default_rng(4).standard_normal((5, D_MODEL), dtype=np.float32)
    result = session.project(hidden, 7, full_logits=True)
    reference = output_projection_tied(hidden, table)
    assert result.logits is not None
    np.testing.assert_allclose(result.logits, reference, rtol=1e-4, atol=1e-4)
    assert (result.topk_token_ids[:, 0] == reference.argmax(axis=1)).all()
    ids = np.array([[0, 299, 5], [5, 5, 17]])
    np.testing.assert_array_equal(session.embed(ids), table[ids])
    # The head's own directory is never written to; the scratch copies are gone.
    assert sorted(item.name for item in path.parent.iterdir()) == files


def test_other_placements_keep_one_session(tmp_path: Path, table: np.ndarray) -> None:
    tied = save_head(HeadWeights.from_arrays(table), tmp_path / "tied")
    untied = save_head(HeadWeights.from_arrays(table, table[::-1]), tmp_path / "untied")
    placements: list[tuple[Path, MemoryMode]] = [
        (tied, "fast"),
        (untied, "shared"),
        (untied, "fast"),
    ]
    for path, mode in placements:
        session = open_head(path, Placement(mode))
        assert session.rows is None, (path, mode)
        np.testing.assert_array_equal(session.embed([3]), table[[3]])


def test_split_and_one_session_give_the_same_answers(tmp_path: Path, table: np.ndarray) -> None:
    path = save_head(HeadWeights.from_arrays(table), tmp_path / "head")
    split = open_head(path, Placement("shared"))
    whole = HeadSession(path, tied=True, memory_mode="fast")
    hidden = np.random.default_rng(5).standard_normal((3, D_MODEL), dtype=np.float32)
    a, b = split.project(hidden, 10), whole.project(hidden, 10)
    np.testing.assert_array_equal(a.topk_token_ids, b.topk_token_ids)
    np.testing.assert_allclose(a.topk_logits, b.topk_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(a.logsumexp, b.logsumexp, rtol=1e-5, atol=1e-5)


def test_file_rows_read_exact_rows_and_refuse_a_short_file(tmp_path: Path) -> None:
    values = np.arange(40, dtype=np.float32).reshape(10, 4)
    data = tmp_path / "rows.bin"
    data.write_bytes(b"\0" * 64 + values.tobytes())
    rows = FileRows(data, 64, (10, 4), np.dtype(np.float32))
    np.testing.assert_array_equal(rows.rows(np.array([9, 0, 9])), values[[9, 0, 9]])
    data.unlink()  # an open file stays readable: scratch copies may go once loaded
    np.testing.assert_array_equal(rows.rows(np.array([2])), values[[2]])
    short = tmp_path / "short.bin"
    short.write_bytes(values.tobytes()[:-4])
    with pytest.raises(ValueError, match="shorter than the tensor"):
        FileRows(short, 0, (10, 4), np.dtype(np.float32))
