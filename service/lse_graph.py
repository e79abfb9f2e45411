"""The head graph's log-sum-exp computed a few rows at a time, for heads run on a CPU.

Why: the graph written by ``service.graph`` takes the log-sum-exp from one ``LogSoftmax`` over
all the run's logits, a second (rows x vocab) float32 tensor beside the logits themselves. A
``Loop`` over chunks of ``CHUNK_ROWS`` rows holds only a chunk's log-softmax (and the chunk's
slice) at a time, so a run needs one rows x vocab tensor instead of two: at the same memory a
run holds twice the rows, and prompt scoring (``service.scoring``) reads W half as often.
Measured on a CPU (128 x 128256 logits): the same time as the single ``LogSoftmax``
(16.2 vs 16.3 ms with the top-k) and no second rows x vocab tensor. On CUDA the files run as
written: each loop turn would cost a host round trip there.

``service.layout`` applies this to the copy of the graph a CPU session loads; files on disk
keep the single ``LogSoftmax`` (every runtime, every provider loads them).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

#: Rows per loop turn: a turn holds 2 x CHUNK_ROWS x vocab float32 (4 MB at 128256 tokens).
CHUNK_ROWS = 4
#: Metadata a chunked graph carries: how many rows x vocab float32 tensors one run holds.
LOGIT_COPIES = "lmhead.logit_copies"
#: The nodes of ``service.graph``'s single log-softmax form that the loop replaces.
_REPLACED = ("log_softmax", "max_log_softmax", "row_lse")


def chunk_logsumexp(model: onnx.ModelProto) -> bool:
    """Replace, in place, the log-sum-exp's ``LogSoftmax`` with the loop over row chunks.
    False (and nothing changed) for a graph that is not in ``service.graph``'s form."""
    graph = model.graph
    found = [node for node in graph.node if node.name in _REPLACED]
    if [node.name for node in found] != list(_REPLACED):
        return False
    kept = [node for node in graph.node if node.name not in _REPLACED]
    after = next(i for i, node in enumerate(kept) if "row_lse" in node.input)
    kept[after:after] = _loop_nodes(logits=found[0].input[0])
    del graph.node[:]
    graph.node.extend(kept)
    graph.initializer.extend(
        [
            numpy_helper.from_array(np.array([CHUNK_ROWS], np.int64), "lse_chunk_rows"),
            numpy_helper.from_array(np.array([CHUNK_ROWS - 1], np.int64), "lse_chunk_rest"),
            numpy_helper.from_array(np.zeros((0, 1), np.float32), "lse_none"),
        ]
    )
    entry = model.metadata_props.add()
    entry.key, entry.value = LOGIT_COPIES, "1"
    return True


def _loop_nodes(logits: str) -> list[onnx.NodeProto]:
    """``row_lse`` (rows, 1) = row_max - log_softmax(chunk)[row_argmax], chunk by chunk.

    The chunks' results are appended to a loop-carried (done, 1) tensor: the last chunk may
    be shorter, which a scan output (stacked, equal shapes) would not allow.
    """
    node = helper.make_node
    count = [
        node("Shape", [logits], ["lse_shape"], "lse_shape"),
        node("Slice", ["lse_shape", "zero", "one"], ["lse_rows"], "lse_rows"),
        node("Add", ["lse_rows", "lse_chunk_rest"], ["lse_rows_up"], "lse_rows_up"),
        node("Div", ["lse_rows_up", "lse_chunk_rows"], ["lse_turns_1d"], "lse_turns_1d"),
        node("Squeeze", ["lse_turns_1d"], ["lse_turns"], "lse_turns"),
    ]
    loop = node("Loop", ["lse_turns", "", "lse_none"], ["row_lse"], "row_lse_chunked")
    loop.attribute.append(helper.make_attribute("body", _body(logits)))
    return [*count, loop]


def _body(logits: str) -> onnx.GraphProto:
    node = helper.make_node
    value = helper.make_tensor_value_info
    nodes = [
        node("Mul", ["turn", "lse_chunk_rows"], ["start"]),
        node("Add", ["start", "lse_chunk_rows"], ["end"]),
        node("Slice", [logits, "start", "end", "zero"], ["chunk"]),
        node("Slice", ["row_max", "start", "end", "zero"], ["chunk_max"]),
        node("Slice", ["row_argmax", "start", "end", "zero"], ["chunk_argmax"]),
        node("LogSoftmax", ["chunk"], ["chunk_log_softmax"], axis=1),
        node("GatherElements", ["chunk_log_softmax", "chunk_argmax"], ["chunk_at_max"], axis=1),
        node("Sub", ["chunk_max", "chunk_at_max"], ["chunk_lse"]),
        node("Concat", ["lse_done", "chunk_lse"], ["lse_next"], axis=0),
        node("Identity", ["cond_in"], ["cond_out"]),
    ]
    return helper.make_graph(
        nodes,
        "row_lse_chunk",
        [
            value("turn", TensorProto.INT64, []),
            value("cond_in", TensorProto.BOOL, []),
            value("lse_done", TensorProto.FLOAT, ["done", 1]),
        ],
        [
            value("cond_out", TensorProto.BOOL, []),
            value("lse_next", TensorProto.FLOAT, ["done_next", 1]),
        ],
    )
