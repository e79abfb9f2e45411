"""``a @ b.T`` for the data plane's small products (candidate logits), on onnxruntime.

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


@cache
def _session() -> ort.InferenceSession:
    # Imported here: the repository reaches this module, and a front process (which holds
    # no head) would otherwise map onnxruntime and onnx (~40 MB resident each front).
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from service.heads.graph import IR_VERSION, OPSET

    rows = helper.make_tensor_value_info("a", TensorProto.FLOAT, ["m", "d"])
    columns = helper.make_tensor_value_info("b", TensorProto.FLOAT, ["n", "d"])
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", "n"])
    gemm = helper.make_node("Gemm", ["a", "b"], ["y"], transB=1)
    graph = helper.make_graph([gemm], "matmul_transposed", [rows, columns], [out])
    model = helper.make_model(
        graph, ir_version=IR_VERSION, opset_imports=[helper.make_opsetid("", OPSET)]
    )
    options = ort.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
