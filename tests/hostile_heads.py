"""Heads whose graphs hold more than a head (issue 43), for the tests of what lmhead refuses
and of how it bounds a load.

Each is a real head ``save_head`` wrote, with nodes put in front of its projection: the
projection reads ``hidden_states`` plus what the added nodes compute (zero), so every top-k
run goes through them, and the inspector still finds the table and the projection: only the
added nodes decide.

* ``with_loop``: a ``Loop`` of ``trips`` turns (1e11: a run that never ends);
* ``with_constant_of_shape``: a ``ConstantOfShape`` of ``elements`` floats (2^28 is 1 GiB from
  a graph of a few KB);
* ``slow_head``: a chain of square ``MatMul`` of ``width``, made only of operators lmhead's
  own heads use (the allowlist takes it): a run of minutes whose every node is short, so
  onnxruntime's terminate flag stops it between two of them. What the warm-up deadline, the
  control plane around a slow load and a stop during one are tested with.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper, numpy_helper

from service.heads.files import HeadWeights, save_head
from service.heads.graph import HIDDEN_STATES, K

#: What the projection reads instead of ``hidden_states``: the hidden state plus the zero the
#: added nodes compute.
_FED = "hidden_plus_extra"


def with_loop(directory: Path, table: npt.NDArray[np.float32], trips: int = 10**11) -> Path:
    """A head whose every run first spins ``trips`` turns of a ``Loop`` named ``spin``."""
    value = helper.make_tensor_value_info
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Identity", ["carried_in"], ["carried_out"]),
        ],
        "spin_body",
        [
            value("turn", TensorProto.INT64, []),
            value("cond_in", TensorProto.BOOL, []),
            value("carried_in", TensorProto.FLOAT, [1]),
        ],
        [value("cond_out", TensorProto.BOOL, []), value("carried_out", TensorProto.FLOAT, [1])],
    )
    nodes = [helper.make_node("Loop", ["trips", "", "carried"], ["spun"], "spin", body=body)]
    constants: dict[str, npt.NDArray[Any]] = {
        "trips": np.array(trips, np.int64),
        "carried": np.zeros(1, np.float32),
    }
    return _extended(directory, table, nodes, constants, "spun")


def with_constant_of_shape(
    directory: Path, table: npt.NDArray[np.float32], elements: int = 2**28
) -> Path:
    """A head whose every run first fills ``elements`` floats (``ConstantOfShape`` named
    ``fill``) and takes their mean."""
    nodes = [
        helper.make_node("ConstantOfShape", ["fill_shape"], ["filled"], "fill"),
        helper.make_node("ReduceMean", ["filled"], ["fill_mean"], "fill_mean", axes=[0]),
    ]
    constants = {"fill_shape": np.array([elements], np.int64)}
    return _extended(directory, table, nodes, constants, "fill_mean")


def slow_head(
    directory: Path, table: npt.NDArray[np.float32], width: int = 3072, turns: int = 200
) -> Path:
    """A head whose every run first multiplies a (width, width) matrix by itself ``turns``
    times: ~0.3 s a turn at 3072 on one core of a 2024 server (~1 minute a run). The chain
    starts from the ``k`` input, so nothing of it is constant-folded when the session opens."""
    node = helper.make_node
    nodes = [
        node("Cast", [K], ["slow_k"], to=TensorProto.FLOAT),
        node("Reshape", ["slow_k", "slow_shape"], ["slow_k_11"]),
        node("MatMul", ["slow_column", "slow_k_11"], ["slow_column_k"]),
        node("MatMul", ["slow_column_k", "slow_row"], ["slow_0"]),
        *(node("MatMul", [f"slow_{i}", f"slow_{i}"], [f"slow_{i + 1}"]) for i in range(turns)),
        node("ReduceMean", [f"slow_{turns}"], ["slow_mean"], axes=[0, 1], keepdims=1),
    ]
    constants: dict[str, npt.NDArray[Any]] = {
        "slow_shape": np.array([1, 1], np.int64),
        "slow_column": np.zeros((width, 1), np.float32),
        "slow_row": np.zeros((1, width), np.float32),
    }
    return _extended(directory, table, nodes, constants, "slow_mean")


def _extended(
    directory: Path,
    table: npt.NDArray[np.float32],
    nodes: list[onnx.NodeProto],
    constants: Mapping[str, npt.NDArray[Any]],
    extra: str,
) -> Path:
    """``save_head`` of ``table``, then ``nodes`` in front, their ``extra`` added to the
    hidden state the projection reads."""
    path = save_head(HeadWeights.from_arrays(table), directory)
    model = onnx.load(str(path))
    graph = model.graph
    for existing in graph.node:
        for index, name in enumerate(existing.input):
            if name == HIDDEN_STATES:
                existing.input[index] = _FED
    added = [*nodes, helper.make_node("Add", [HIDDEN_STATES, extra], [_FED], "add_extra")]
    written = list(graph.node)
    del graph.node[:]
    graph.node.extend(added + written)
    graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in constants.items())
    onnx.save(model, str(path))
    return path
