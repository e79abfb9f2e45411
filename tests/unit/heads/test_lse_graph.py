"""The log-sum-exp in row chunks (``service.heads.lse_graph``): what CPU sessions score with.

The loop must give the same answers as the single ``LogSoftmax`` of the written file at every
row count (chunks end mid-run); every head opened on a CPU whose projection writes the logits
has it (a bias or soft-cap head keeps its written form); the file on disk keeps its own form.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from service.heads.files import HeadWeights, save_head
from service.heads.graph import HeadTransforms
from service.heads.lse_graph import CHUNK_ROWS, LSE_IN_CHUNKS, add_chunked_logsumexp
from service.heads.quantize import QuantSpec
from service.runtime.layout import Placement, chunked_copy, open_head
from service.runtime.session import RUNTIME_VERSION, HeadSession
from service.settings import MemoryMode
from tests.conftest import D_MODEL, VOCAB, reference_logits

#: onnxruntime before 1.31 dies (SIGFPE) in TopK on no rows; the service never runs none there.
NO_ROWS = (0,) if RUNTIME_VERSION >= (1, 31) else ()


def _reference_lse(logits: npt.NDArray[np.floating]) -> npt.NDArray[np.float64]:
    """log-sum-exp of each row in float64."""
    wide = logits.astype(np.float64)
    top = wide.max(axis=1, keepdims=True)
    lse: npt.NDArray[np.float64] = top + np.log(np.exp(wide - top).sum(axis=1, keepdims=True))
    return lse[:, 0]


def _operators(path: Path) -> set[str]:
    return {node.op_type for node in onnx.load(str(path), load_external_data=False).graph.node}


@pytest.mark.parametrize("transforms", ["plain", "scaled"])
def test_both_ways_answer_as_the_written_graph_at_every_row_count(
    tmp_path: Path,
    table: npt.NDArray[np.float32],
    transforms: str,
) -> None:
    """Scoring runs take the loop (chunks end mid-run), top-k runs the written nodes."""
    scales = HeadTransforms(0.5, 2.0) if transforms == "scaled" else HeadTransforms()
    path = save_head(HeadWeights.from_arrays(table, transforms=scales), tmp_path / "head")
    chunked = HeadSession(chunked_copy(path, tmp_path / "chunked"), tied=True)
    written = HeadSession(path, tied=True)
    assert (chunked.score_copies, written.score_copies) == (1, 2)
    rng = np.random.default_rng(7)
    for rows in (*NO_ROWS, 1, CHUNK_ROWS - 1, CHUNK_ROWS, CHUNK_ROWS + 1, 3 * CHUNK_ROWS + 2):
        hidden = rng.standard_normal((rows, D_MODEL), dtype=np.float32) * 3
        targets = rng.integers(0, VOCAB, rows)
        theirs = written.project(hidden, 5, full_logits=True)
        assert theirs.logits is not None
        reference = _reference_lse(theirs.logits)  # of the logits the graph computed
        for ours in (chunked.score(hidden, targets, 5), written.score(hidden, targets, 5)):
            assert ours.logsumexp.shape == (rows,)
            np.testing.assert_allclose(ours.logsumexp, reference, rtol=1e-5, atol=1e-4)
            np.testing.assert_array_equal(ours.topk_token_ids, theirs.topk_token_ids)
            np.testing.assert_array_equal(ours.target_logit, theirs.logits[range(rows), targets])
        plain = chunked.project(hidden, 5)
        np.testing.assert_array_equal(plain.logsumexp, theirs.logsumexp)  # the written nodes
        np.testing.assert_allclose(_loop_lse(chunked.path, hidden), reference, rtol=1e-5, atol=1e-4)


def _loop_lse(path: Path, hidden: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """The then branch run directly, whatever ``HeadSession`` chooses to feed."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {
        "hidden_states": hidden,
        "input_ids": np.zeros(0, np.int64),
        "k": np.array([3], np.int64),
        "temperature": np.ones((len(hidden), 1), np.float32),
        LSE_IN_CHUNKS: np.array([True]),
    }
    (lse,) = session.run(["logsumexp"], feeds)
    return np.asarray(lse, np.float32)


def test_a_bias_or_softcap_head_keeps_its_written_form(
    tmp_path: Path, table: npt.NDArray[np.float32], output_weight: npt.NDArray[np.float32]
) -> None:
    """Its logits come out of transforms, whose intermediates hold two rows x vocab tensors
    with the loop or without: the loop would buy nothing (``service.heads.lse_graph``)."""
    weights = HeadWeights.from_arrays(
        table, bias=output_weight[:, 0], transforms=HeadTransforms(0.5, 2.0, 30.0)
    )
    path = save_head(weights, tmp_path / "head")
    assert chunked_copy(path, tmp_path / "chunked") == path
    session = open_head(path, Placement("fast"))
    assert session.score_copies == 2
    hidden = np.random.default_rng(11).standard_normal((7, D_MODEL), dtype=np.float32)
    full = session.project(hidden, 3, full_logits=True)
    assert full.logits is not None
    scored = session.score(hidden, np.arange(7), 3)
    np.testing.assert_allclose(scored.logsumexp, _reference_lse(full.logits), rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(scored.target_logit, full.logits[range(7), range(7)])


@pytest.mark.parametrize(
    ("kind", "mode"),
    [("tied", "shared"), ("tied", "fast"), ("untied", "shared"), ("int4", "shared")],
)
def test_every_cpu_session_has_the_loop_and_the_file_is_untouched(
    tmp_path: Path,
    table: npt.NDArray[np.float32],
    output_weight: npt.NDArray[np.float32],
    kind: str,
    mode: MemoryMode,
) -> None:
    weights = HeadWeights.from_arrays(table, None if kind != "untied" else output_weight)
    quantization = QuantSpec(4, 32) if kind == "int4" else None
    path = save_head(weights, tmp_path / kind, quantization=quantization)
    before = path.read_bytes()
    session = open_head(path, Placement(mode))
    assert session.score_copies == 1
    assert path.read_bytes() == before
    assert "LogSoftmax" in _operators(path)
    assert "Loop" not in _operators(path)
    hidden = np.random.default_rng(8).standard_normal((6, D_MODEL), dtype=np.float32)
    full = session.project(hidden, 3, full_logits=True)
    assert full.logits is not None
    ours = session.score(hidden, np.arange(6), 3)  # the loop
    np.testing.assert_allclose(ours.logsumexp, _reference_lse(full.logits), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(ours.logsumexp, full.logsumexp, rtol=1e-5, atol=1e-4)
    if quantization is None:  # the quantized kernels of one session and of a split differ
        reference = _reference_lse(reference_logits(path, hidden))
        np.testing.assert_allclose(ours.logsumexp, reference, rtol=1e-5, atol=1e-4)


def test_a_graph_of_another_form_is_left_as_it_is() -> None:
    node = helper.make_node("LogSoftmax", ["x"], ["y"], "log_softmax", axis=1)
    value = helper.make_tensor_value_info
    graph = helper.make_graph([node], "other", [value("x", 1, ["r", 4])], [value("y", 1, ["r", 4])])
    model = helper.make_model(graph)
    before = model.SerializeToString()
    assert not add_chunked_logsumexp(model)
    assert model.SerializeToString() == before


def test_ranks_count_higher_tokens_and_equal_ones_with_lower_ids(tmp_path: Path) -> None:
    """Rows 2, 5 and 9 of the table are equal: their logits tie for every hidden state."""
    table = np.random.default_rng(9).standard_normal((12, D_MODEL), dtype=np.float32)
    table[5] = table[9] = table[2]
    session = open_head(save_head(HeadWeights.from_arrays(table), tmp_path / "ties"))
    hidden = np.random.default_rng(10).standard_normal((4, D_MODEL), dtype=np.float32)
    targets = np.array([2, 5, 9, 0])
    scored = session.score(hidden, targets, 3)
    logits = hidden.astype(np.float64) @ table.T.astype(np.float64)
    for row, target in enumerate(targets):
        higher = (logits[row] > logits[row, target] + 1e-9).sum()
        tied_before = {2: 0, 5: 1, 9: 2}.get(int(target), 0)
        assert scored.rank[row] == higher + tied_before, (row, target)
