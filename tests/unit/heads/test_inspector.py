"""The inspector tells tied, untied and broken ties apart, from the file alone."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from service.cli import main
from service.heads.files import HeadWeights, save_head
from service.heads.graph import IR_VERSION, OPSET
from service.heads.inspector import HeadInspectionError, inspect_head
from tests.conftest import D_MODEL, VOCAB

MATRIX_BYTES = VOCAB * D_MODEL * 4


def _model(graph: onnx.GraphProto) -> onnx.ModelProto:
    """A model every supported onnxruntime loads (onnx's own default IR is too new for some)."""
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION
    )


def _exported_style_head(
    path: Path, table: npt.NDArray[np.float32], second: npt.NDArray[np.float32], layout: str
) -> Path:
    """A head shaped like exporter output, with its own second initializer ``W2``.

    layout "columns": ``MatMul(h, W2)`` with W2 stored (d_model, vocab), what
    ``torch.onnx.export`` writes after folding ``Transpose(W)``; "transpose-node":
    ``MatMul(h, Transpose(W2))`` with W2 stored (vocab, d_model).
    """
    nodes = [helper.make_node("Gather", ["W", "ids"], ["emb"], "gather")]
    if layout == "columns":
        nodes.append(helper.make_node("MatMul", ["h", "W2"], ["logits"], "lm_head"))
    else:
        nodes += [
            helper.make_node("Transpose", ["W2"], ["W2t"], "transpose", perm=[1, 0]),
            helper.make_node("MatMul", ["h", "W2t"], ["logits"], "lm_head"),
        ]
    graph = helper.make_graph(
        nodes,
        "exported",
        [
            helper.make_tensor_value_info("h", TensorProto.FLOAT, ["n", D_MODEL]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["m"]),
        ],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", VOCAB]),
            helper.make_tensor_value_info("emb", TensorProto.FLOAT, ["m", D_MODEL]),
        ],
        [numpy_helper.from_array(table, "W"), numpy_helper.from_array(second, "W2")],
    )
    onnx.save_model(_model(graph), path)
    return path


def test_tied_head(tied_path: Path) -> None:
    report = inspect_head(tied_path)
    assert report.tied
    assert report.embedding_initializer == report.projection_initializer == "embedding.weight"
    assert (report.gather_node, report.projection_node) == ("embedding_gather", "output_projection")
    assert (report.vocab_size, report.d_model, report.dtype) == (VOCAB, D_MODEL, "float32")
    assert report.parameters == VOCAB * D_MODEL
    assert report.weight_bytes == MATRIX_BYTES
    assert report.bytes_saved_by_tying == MATRIX_BYTES
    assert report.duplicate is None
    assert not report.external_data


def test_untied_head(untied_path: Path) -> None:
    report = inspect_head(untied_path.parent)  # a version directory works too
    assert not report.tied
    assert (report.embedding_initializer, report.projection_initializer) == (
        "embedding.weight",
        "lm_head.weight",
    )
    assert report.parameters == 2 * VOCAB * D_MODEL
    assert report.weight_bytes == 2 * MATRIX_BYTES
    assert report.bytes_saved_by_tying == 0
    assert report.duplicate is None


def test_broken_tie_with_a_transposed_copy_is_reported_as_duplicated(
    tmp_path: Path, table: npt.NDArray[np.float32]
) -> None:
    path = _exported_style_head(
        tmp_path / "m.onnx", table, np.ascontiguousarray(table.T), "columns"
    )
    report = inspect_head(path)
    assert not report.tied
    assert report.duplicate == "transposed"
    assert report.duplicate_bytes == MATRIX_BYTES
    assert report.projection_transposed
    assert (report.embedding_initializer, report.projection_initializer) == ("W", "W2")


def test_broken_tie_with_an_identical_copy_is_reported_as_duplicated(
    tmp_path: Path, table: npt.NDArray[np.float32]
) -> None:
    path = _exported_style_head(tmp_path / "m.onnx", table, table.copy(), "transpose-node")
    report = inspect_head(path)
    assert not report.tied
    assert report.duplicate == "identical"
    assert not report.projection_transposed


def test_a_different_transposed_matrix_is_an_honest_untied_head(
    tmp_path: Path, table: npt.NDArray[np.float32], output_weight: npt.NDArray[np.float32]
) -> None:
    second = np.ascontiguousarray(output_weight.T)
    report = inspect_head(_exported_style_head(tmp_path / "m.onnx", table, second, "columns"))
    assert not report.tied
    assert report.duplicate is None


def test_one_differing_value_is_not_a_duplicate(
    tmp_path: Path, table: npt.NDArray[np.float32]
) -> None:
    second = table.copy()
    second[-1, -1] += 1.0
    report = inspect_head(
        _exported_style_head(tmp_path / "m.onnx", table, second, "transpose-node")
    )
    assert report.duplicate is None


@pytest.mark.parametrize("tied", [True, False])
def test_external_data_reports_like_inline(
    tmp_path: Path,
    table: npt.NDArray[np.float32],
    tied: bool,
) -> None:
    weights = HeadWeights.from_arrays(table, None if tied else table.copy())
    inline = inspect_head(save_head(weights, tmp_path / "inline"))
    external = inspect_head(save_head(weights, tmp_path / "external", external_data=True))
    assert external.external_data
    assert (external.tied, external.weight_bytes, external.duplicate) == (
        inline.tied,
        inline.weight_bytes,
        inline.duplicate,
    )
    assert external.duplicate == (None if tied else "identical")
    assert external.file_bytes >= inline.weight_bytes


def test_files_that_are_not_heads_get_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(HeadInspectionError, match="no ONNX file"):
        inspect_head(tmp_path / "missing.onnx")
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x00not a model")
    with pytest.raises(HeadInspectionError, match="not a readable ONNX model"):
        inspect_head(garbage)
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [numpy_helper.from_array(np.ones((2, 2), np.float32), "unused")],
    )
    onnx.save_model(_model(graph), tmp_path / "relu.onnx")
    with pytest.raises(HeadInspectionError, match=r"no embedding Gather.*\['unused'\]"):
        inspect_head(tmp_path / "relu.onnx")


def test_cli_json_has_the_documented_keys(
    tied_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(tied_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    required = {
        "tied",
        "embedding_initializer",
        "projection_initializer",
        "vocab_size",
        "d_model",
        "parameters",
        "weight_bytes",
    }
    assert required <= report.keys()
    assert report["tied"] is True
    assert report["vocab_size"] == VOCAB


def test_cli_text_names_a_broken_tie(
    tmp_path: Path, table: npt.NDArray[np.float32], capsys: pytest.CaptureFixture[str]
) -> None:
    path = _exported_style_head(
        tmp_path / "m.onnx", table, np.ascontiguousarray(table.T), "columns"
    )
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "DUPLICATED (transposed)" in out
    assert f"`lmhead retie` would save {MATRIX_BYTES:,} bytes" in out
    # one account of it: nothing is saved yet ("saved by tying 0" beside "re-tying saves")
    assert f"saved by tying   none yet ({MATRIX_BYTES:,} once re-tied)" in out


def test_cli_reports_errors_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(tmp_path / "nothing")]) == 2
    assert "lmhead: no ONNX file" in capsys.readouterr().err


@pytest.mark.parametrize("location", ["../elsewhere.data", "/etc/passwd", "sub/w.data"])
def test_external_data_anywhere_but_beside_the_model_is_refused(
    tmp_path: Path, tied_path: Path, location: str
) -> None:
    """Constant nodes may carry external data too: they are checked like initializers."""
    model = onnx.load(str(tied_path))
    constant = numpy_helper.from_array(np.ones(4, np.float32), "bias_constant")
    constant.ClearField("raw_data")
    constant.data_location = TensorProto.EXTERNAL
    constant.external_data.add(key="location", value=location)
    model.graph.node.append(helper.make_node("Constant", [], ["c"], value=constant))
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    with pytest.raises(HeadInspectionError, match="must be a file beside the model"):
        inspect_head(path)


@pytest.mark.parametrize("transforms", ['{"logit_scale": 1e39}', '{"softcap": 0}', '{"x": 1}'])
def test_transforms_metadata_the_graph_could_not_hold_is_refused(
    tmp_path: Path, table: npt.NDArray[np.float32], transforms: str
) -> None:
    """1e39 is finite as JSON but Inf as the float32 the graph holds (every logit Inf)."""
    path = save_head(HeadWeights.from_arrays(table), tmp_path / "m")
    model = onnx.load(str(path))
    helper.set_model_props(model, {"lmhead.transforms": transforms})
    onnx.save(model, str(path))
    with pytest.raises(HeadInspectionError, match="lmhead.transforms"):
        inspect_head(path)
