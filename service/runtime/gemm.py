"""``a @ b.T`` for the data plane's small products (candidate logits), on onnxruntime; and the
same product's top-k and log-sum-exp (``top_of_product``), when only those are wanted.

Why not numpy: its OpenBLAS keeps its threads spinning after a multi-threaded product (2**28
cycles by default, ~100 ms), so the next onnxruntime run found its cores taken: measured here,
a full-head run right after a 1,000-candidate product took 1.25x as long. onnxruntime's own
threads are told not to spin (as every head's session is), so a product costs only itself.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import onnx
    import onnxruntime as ort


def matmul_transposed(
    a: npt.NDArray[np.float32], b: npt.NDArray[np.float32]
) -> npt.NDArray[np.float32]:
    """(m, d) x (n, d) -> (m, n) float32."""
    (product,) = _session().run(
        None,
        {
            "a": np.ascontiguousarray(a, dtype=np.float32),
            "b": np.ascontiguousarray(b, dtype=np.float32),
        },
    )
    result: npt.NDArray[np.float32] = product
    return result


def top_of_product(
    a: npt.NDArray[np.float32],
    b: npt.NDArray[np.float32],
    temperature: npt.NDArray[np.float32],
    k: int,
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """The k largest of ``(a @ b.T) / temperature`` per row (values descending, then their
    columns: equal values in column order, TopK's rule) and each row's log-sum-exp, without
    the (m, n) logits reaching Python: one run (a numpy partition and log-sum-exp of 64 x 1,000
    logits took ~0.4 ms, the product itself ~0.3)."""
    feeds = {
        "a": np.ascontiguousarray(a, dtype=np.float32),
        "b": np.ascontiguousarray(b, dtype=np.float32),
        "t": np.ascontiguousarray(temperature.reshape(-1, 1), dtype=np.float32),
        "k": np.array([k], np.int64),
    }
    values, columns, lse = _top_session().run(None, feeds)
    return values, columns, lse


#: Constants of ``_top_session``'s slices: the first column.
FIRST = (("zero", 0), ("one", 1))


@cache
def _top_session() -> ort.InferenceSession:
    from onnx import TensorProto, helper, numpy_helper

    node = helper.make_node
    first = [numpy_helper.from_array(np.array([v], np.int64), name) for name, v in FIRST]
    graph = helper.make_graph(
        [
            node("Gemm", ["a", "b"], ["product"], transB=1),
            node("Div", ["product", "t"], ["y"]),
            node("TopK", ["y", "k"], ["values", "columns"], axis=1, largest=1, sorted=1),
            # lse = max - log_softmax[argmax], as the heads' graphs take it (``heads.graph``:
            # the fused LogSoftmax is faster than ReduceLogSumExp: 0.59 against 0.77 ms here)
            node("LogSoftmax", ["y"], ["log_softmax"], axis=1),
            node("Slice", ["values", "zero", "one", "one"], ["row_max"]),
            node("Slice", ["columns", "zero", "one", "one"], ["row_argmax"]),
            node("GatherElements", ["log_softmax", "row_argmax"], ["max_log_softmax"], axis=1),
            node("Sub", ["row_max", "max_log_softmax"], ["lse_column"]),
            node("Squeeze", ["lse_column", "one"], ["lse"]),
        ],
        "top_of_product",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, ["m", "d"]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, ["n", "d"]),
            helper.make_tensor_value_info("t", TensorProto.FLOAT, ["m", 1]),
            helper.make_tensor_value_info("k", TensorProto.INT64, [1]),
        ],
        [
            helper.make_tensor_value_info("values", TensorProto.FLOAT, ["m", "k"]),
            helper.make_tensor_value_info("columns", TensorProto.INT64, ["m", "k"]),
            helper.make_tensor_value_info("lse", TensorProto.FLOAT, ["m"]),
        ],
        initializer=first,
    )
    return _load(graph)


@cache
def _session() -> ort.InferenceSession:
    from onnx import TensorProto, helper

    rows = helper.make_tensor_value_info("a", TensorProto.FLOAT, ["m", "d"])
    columns = helper.make_tensor_value_info("b", TensorProto.FLOAT, ["n", "d"])
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", "n"])
    gemm = helper.make_node("Gemm", ["a", "b"], ["y"], transB=1)
    return _load(helper.make_graph([gemm], "matmul_transposed", [rows, columns], [out]))


def _load(graph: onnx.GraphProto) -> ort.InferenceSession:
    # Imported here: the repository reaches this module, and a front process (which holds
    # no head) would otherwise map onnxruntime and onnx (~40 MB resident each front).
    import onnxruntime as ort
    from onnx import helper

    from service.heads.graph import IR_VERSION, OPSET

    model = helper.make_model(
        graph, ir_version=IR_VERSION, opset_imports=[helper.make_opsetid("", OPSET)]
    )
    options = ort.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
