"""A head is only a head: every graph lmhead writes passes the operator list, any other
operator is refused by the inspector (so by ``lmhead inspect`` and by every load), named."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnx
import pytest
from onnx import helper

from service.cli import main
from service.heads.files import HeadWeights, save_head
from service.heads.graph import MS_DOMAIN, HeadTransforms
from service.heads.inspector import HeadInspectionError, inspect_head
from service.heads.norm import FinalNorm
from service.heads.operators import HEAD_OPERATORS, MAX_NODES, check_operators
from service.heads.projection_only import without_embedding
from service.heads.quantize import QuantSpec
from service.tools.retie import retie
from tests.conftest import D_MODEL
from tests.hostile_heads import slow_head, with_constant_of_shape, with_loop
from tests.unit.heads.test_inspector import _exported_style_head

Table = npt.NDArray[np.float32]
RMS = FinalNorm("rms", np.linspace(0.5, 1.5, D_MODEL), 1e-5)
LAYER = FinalNorm("layer", np.linspace(0.5, 1.5, D_MODEL), 1e-5, np.linspace(-1, 1, D_MODEL))


def _saved(
    *,
    untied: bool = False,
    bias: bool = False,
    dtype: str = "float32",
    transforms: HeadTransforms | None = None,
    norm: FinalNorm | None = None,
    twin: bool = False,
    quantization: QuantSpec | None = None,
    quantize_table: bool = False,
) -> Callable[[Path, Table], Path]:
    """A head ``save_head`` writes, with these weights and options."""

    def write(directory: Path, table: Table) -> Path:
        weights = HeadWeights.from_arrays(
            table,
            table[::-1].copy() if untied else None,
            bias=np.linspace(-1, 1, len(table)) if bias else None,
            transforms=transforms,
            twin=twin,
            dtype=dtype,
            norm=norm,
        )
        return save_head(
            weights, directory, quantization=quantization, quantize_table=quantize_table
        )

    return write


def _retied(layout: str) -> Callable[[Path, Table], Path]:
    """``lmhead retie`` of an exporter's broken tie: Gemm with transB flipped, or FusedMatMul."""

    def write(directory: Path, table: Table) -> Path:
        copy = np.ascontiguousarray(table.T) if layout == "columns" else table.copy()
        exported = _exported_style_head(directory / "exported.onnx", table, copy, layout)
        return retie(exported, directory / "retied.onnx").output

    return write


def _exported(layout: str) -> Callable[[Path, Table], Path]:
    """An exporter's head as the inspector reads it (MatMul, Transpose)."""

    def write(directory: Path, table: Table) -> Path:
        copy = np.ascontiguousarray(table.T) if layout == "columns" else table.copy()
        return _exported_style_head(directory / "exported.onnx", table, copy, layout)

    return write


HEADS = {
    "tied": _saved(),
    "untied": _saved(untied=True),
    "twin": _saved(untied=True, twin=True),
    "float16": _saved(dtype="float16"),
    "bfloat16 untied": _saved(dtype="bfloat16", untied=True),
    "scales": _saved(transforms=HeadTransforms(input_scale=0.5, logit_scale=2.0)),
    "softcap": _saved(transforms=HeadTransforms(logit_scale=2.0, softcap=30.0)),
    "bias": _saved(bias=True),
    "rms norm": _saved(norm=RMS),
    "layer norm, float16, softcap": _saved(
        norm=LAYER, dtype="float16", transforms=HeadTransforms(softcap=30.0)
    ),
    "int8 tied": _saved(quantization=QuantSpec(8, 32)),
    "int4 tied, padded blocks": _saved(quantization=QuantSpec(4, 32), norm=RMS),
    "int4 untied, table quantized": _saved(
        quantization=QuantSpec(4, 16), untied=True, quantize_table=True
    ),
    "int8 untied, float table": _saved(quantization=QuantSpec(8, 16), untied=True),
    "exported MatMul": _exported("columns"),
    "exported MatMul of Transpose": _exported("transpose-node"),
    "retied Gemm": _retied("transpose-node"),
    "retied FusedMatMul": _retied("columns"),
}


@pytest.mark.parametrize("make", HEADS.values(), ids=HEADS.keys())
def test_every_head_lmhead_writes_or_reads_passes(
    tmp_path: Path, table: Table, make: Callable[[Path, Table], Path]
) -> None:
    """The list is what lmhead's builders emit (graph, norm, quantize, retie) and the
    exporter forms the inspector reads; the projection-only graph a shared-memory session
    loads is a part of the same head."""
    path = make(tmp_path, table)
    model = onnx.load(str(path), load_external_data=False)
    check_operators(model)
    check_operators(without_embedding(model))
    inspect_head(path)


def test_the_list_holds_no_control_flow_or_generators() -> None:
    """What a head never needs, and what made heads of a few KB hostile (issue 43)."""
    names = {name for _, name in HEAD_OPERATORS}
    assert not names & {"Loop", "Scan", "If", "ConstantOfShape", "Expand", "Tile", "Range"}
    assert {domain for domain, _ in HEAD_OPERATORS} == {"", MS_DOMAIN}


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (with_loop, "node 'spin' is a Loop (domain ai.onnx)"),
        (with_constant_of_shape, "node 'fill' is a ConstantOfShape (domain ai.onnx)"),
    ],
    ids=["Loop", "ConstantOfShape"],
)
def test_a_graph_with_another_operator_is_not_a_head(
    tmp_path: Path,
    table: Table,
    make: Callable[[Path, Table], Path],
    named: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = make(tmp_path, table)
    with pytest.raises(HeadInspectionError, match="Gemm") as refused:
        inspect_head(path)
    assert named in str(refused.value)
    assert main(["inspect", str(path)]) == 2  # `lmhead inspect` says it, in one line
    assert named in capsys.readouterr().err


def test_an_operator_of_the_list_in_another_domain_is_refused(
    tmp_path: Path, tied_path: Path
) -> None:
    """A domain names whose kernel runs: ``Gemm`` of a custom domain is not onnx's Gemm."""
    model = onnx.load(str(tied_path))
    gemm = next(node for node in model.graph.node if node.op_type == "Gemm")
    gemm.domain = "com.example"
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    with pytest.raises(ValueError, match=r"'output_projection' is a Gemm \(domain com.example\)"):
        check_operators(model)


def test_functions_and_subgraphs_are_refused(tied_path: Path) -> None:
    """A model-local function may be named like a listed operator; an attribute may hold a
    graph: a head has neither."""
    model = onnx.load(str(tied_path))
    function = helper.make_function("", "Gemm", ["x"], ["y"], [], [helper.make_opsetid("", 17)])
    model.functions.append(function)
    with pytest.raises(ValueError, match="defines functions"):
        check_operators(model)
    model = onnx.load(str(tied_path))
    branch = helper.make_graph([], "branch", [], [])
    model.graph.node[0].attribute.append(helper.make_attribute("hidden", branch))
    with pytest.raises(ValueError, match="holds a graph in its attribute 'hidden'"):
        check_operators(model)


def test_more_nodes_than_a_head_has_are_refused(tmp_path: Path, table: Table) -> None:
    """onnxruntime takes seconds to open tens of thousands of nodes (18 s for 20,000): a
    head has a few dozen."""
    path = slow_head(tmp_path, table, width=2, turns=MAX_NODES)
    with pytest.raises(HeadInspectionError, match=f"at most {MAX_NODES}"):
        inspect_head(path)
    inspect_head(slow_head(tmp_path / "fits", table, width=2, turns=MAX_NODES // 2))
