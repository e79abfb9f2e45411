"""The inspector reports a head's final norm and refuses a norm side the service could not run:
tensors of the wrong shape, dtype or values, metadata without the side, a side that feeds
another output."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from service.heads.files import HeadWeights, save_head
from service.heads.graph import LOGITS
from service.heads.inspector import HeadInspectionError, inspect_head
from service.heads.norm import FINAL_NORM, NORM_WEIGHT, NORMED_STATES, FinalNorm
from tests.conftest import D_MODEL

Spoil = Callable[[onnx.ModelProto], None]


def _norm(kind: str = "rms", bias: bool = False) -> FinalNorm:
    rng = np.random.default_rng(0)
    return FinalNorm(
        kind,  # type: ignore[arg-type]
        1 + 0.1 * rng.standard_normal(D_MODEL),
        1e-5,
        rng.standard_normal(D_MODEL) if bias else None,
        "model.norm.weight",
    )


def _head(directory: Path, norm: FinalNorm | None, table: np.ndarray) -> Path:
    return save_head(HeadWeights.from_arrays(table, norm=norm), directory)


@pytest.mark.parametrize(("kind", "bias"), [("rms", False), ("layer", True), ("layer", False)])
def test_the_report_says_the_kind_epsilon_and_tensors(
    tmp_path: Path, table: np.ndarray, kind: str, bias: bool
) -> None:
    report = inspect_head(_head(tmp_path, _norm(kind, bias), table))
    expected = {"kind": kind, "epsilon": 1e-5, "source": "model.norm.weight"}
    if kind == "layer":
        expected |= {"bias": bias, "tensors": [NORM_WEIGHT, "final_norm.bias"]}
    else:
        expected |= {"tensors": [NORM_WEIGHT]}
    assert report.final_norm == expected
    assert report.to_dict()["final_norm"] == expected
    assert report.norm_text().startswith(f"{kind}, eps 1e-05")
    assert (", bias" in report.norm_text()) is bias


def test_a_head_without_a_norm_says_none(tied_path: Path) -> None:
    report = inspect_head(tied_path)
    assert report.final_norm is None
    assert report.norm_text() == "none (residual states are refused)"


def _replace_weight(values: np.ndarray) -> Spoil:
    def spoil(model: onnx.ModelProto) -> None:
        (index,) = [i for i, t in enumerate(model.graph.initializer) if t.name == NORM_WEIGHT]
        model.graph.initializer[index].CopyFrom(numpy_helper.from_array(values, NORM_WEIGHT))

    return spoil


def _drop_metadata(model: onnx.ModelProto) -> None:
    kept = [prop for prop in model.metadata_props if prop.key != FINAL_NORM]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)


def _bad_metadata(model: onnx.ModelProto) -> None:
    for prop in model.metadata_props:
        if prop.key == FINAL_NORM:
            prop.value = json.dumps({"kind": "batch", "epsilon": 1e-5})


def _feed_the_logits(model: onnx.ModelProto) -> None:
    """The projection reads the normed states: the norm side is no side of its own."""
    for node in model.graph.node:
        if node.op_type == "Gemm":
            node.input[0] = NORMED_STATES


def _drop_output(model: onnx.ModelProto) -> None:
    kept = [value for value in model.graph.output if value.name != NORMED_STATES]
    del model.graph.output[:]
    model.graph.output.extend(kept)


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        (_replace_weight(np.ones(D_MODEL + 1, np.float32)), r"shape \(49,\).*\(48,\)"),
        (_replace_weight(np.ones(D_MODEL, np.float64)), "float64"),
        (_replace_weight(np.full(D_MODEL, np.nan, np.float32)), "NaN"),
        (_drop_metadata, "takes 'residual_states' but says no lmhead.final_norm"),
        (_bad_metadata, "a kind among"),
        (_feed_the_logits, rf"feeds \[.*'{LOGITS}'.*\]: it must stay a side of its own"),
        (_drop_output, "gives the output 'normed_states'"),
    ],
    ids=["shape", "dtype", "nan", "no-metadata", "kind", "feeds-logits", "no-output"],
)
def test_a_norm_side_the_service_could_not_run_is_refused(
    tmp_path: Path, table: np.ndarray, spoil: Spoil, message: str
) -> None:
    path = _head(tmp_path, _norm(), table)
    model = onnx.load(str(path))
    spoil(model)
    onnx.save(model, str(path))
    with pytest.raises(HeadInspectionError, match=f"final norm: .*{message}"):
        inspect_head(path)


def test_a_norm_stored_as_external_data_is_read_there(tmp_path: Path, table: np.ndarray) -> None:
    path = _head(tmp_path, _norm("layer", bias=True), table)
    model = onnx.load(str(path))
    onnx.save(model, str(path), save_as_external_data=True, location="x.data", size_threshold=0)
    stored = onnx.load(str(path), load_external_data=False).graph.initializer
    assert any(
        t.name == NORM_WEIGHT and t.data_location == onnx.TensorProto.EXTERNAL for t in stored
    )
    report = inspect_head(path)
    assert report.final_norm is not None
    assert report.final_norm["bias"] is True
