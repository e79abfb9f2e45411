"""Top-k and log-sum-exp of logits already on the host: a small onnxruntime graph.

The decoding step (``service.plane.decoding``) processes a run's logits in numpy, in place,
and then needs what the head's own graph gives a plain top-k: each row's k largest values in
order (equal ones in id order) and its log-sum-exp. numpy has no top-k: ``argpartition`` over
a whole row runs on one core (64 rows of 128256 tokens: ~19 ms, more than the rest of the
step), and its log-sum-exp makes (rows x vocab) temporaries. onnxruntime's ``TopK`` (a heap
per row for a small k, rows across its threads) and ``LogSoftmax`` are the kernels the head's
graph runs; fed the numpy array as it is (no copy in), they give the same numbers for the
processed logits:

``values, ids = TopK(x, k)`` (sorted, ties to the lower index), and the log-sum-exp
``values[:, 0] - LogSoftmax(x)[row, ids[:, 0]]``, as the head's graph takes it (the top
token's log-softmax is ``-log(sum(exp(x - max)))``). A row of -inf alone (nothing allowed;
options refuse such rows before any run) would give NaN.

The session is built once per process, on first use (``selector``); it holds no weights.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

if TYPE_CHECKING:  # onnx is imported when the graph is built, never by a front's imports
    import onnx

Floats = npt.NDArray[np.float32]
Ids = npt.NDArray[np.int64]
#: Opset and IR version the oldest supported onnxruntime (1.18) runs.
OPSET = 17
IR_VERSION = 9


class Selector:
    """``top``: the k largest of (rows, vocab) float32 logits, descending (equal values in id
    order), their ids, and each row's log-sum-exp."""

    def __init__(self) -> None:
        options = ort.SessionOptions()
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self._session = ort.InferenceSession(
            _graph().SerializeToString(), options, providers=["CPUExecutionProvider"]
        )

    def top(self, logits: Floats, k: int) -> tuple[Floats, Ids, Floats]:
        k = min(k, logits.shape[1])
        feeds = {"logits": np.ascontiguousarray(logits), "k": np.array([k], np.int64)}
        values, ids, lse = self._session.run(None, feeds)
        return values, ids, lse


@functools.cache
def selector() -> Selector:
    """The process's one selector (built on first use: no work at import)."""
    return Selector()


def _graph() -> onnx.ModelProto:
    from onnx import TensorProto, helper, numpy_helper

    def value(name: str, kind: int, shape: list[str | int]) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, kind, shape)

    nodes = [
        helper.make_node("TopK", ["logits", "k"], ["values", "ids"], axis=1),
        helper.make_node("LogSoftmax", ["logits"], ["logprobs"], axis=1),
        helper.make_node("Slice", ["ids", "zero", "one", "one"], ["top_id"]),
        helper.make_node("GatherElements", ["logprobs", "top_id"], ["top_logprob"], axis=1),
        helper.make_node("Slice", ["values", "zero", "one", "one"], ["top_value"]),
        helper.make_node("Sub", ["top_value", "top_logprob"], ["lse_column"]),
        helper.make_node("Squeeze", ["lse_column", "one"], ["lse"]),
    ]
    graph = helper.make_graph(
        nodes,
        "lmhead_selection",
        [
            value("logits", TensorProto.FLOAT, ["rows", "vocab"]),
            value("k", TensorProto.INT64, [1]),
        ],
        [
            value("values", TensorProto.FLOAT, ["rows", "k"]),
            value("ids", TensorProto.INT64, ["rows", "k"]),
            value("lse", TensorProto.FLOAT, ["rows"]),
        ],
        [
            numpy_helper.from_array(np.array([0], np.int64), "zero"),
            numpy_helper.from_array(np.array([1], np.int64), "one"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    return model
