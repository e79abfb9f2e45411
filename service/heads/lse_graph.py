"""A second way to the log-sum-exp, a few rows at a time, for scoring runs on a CPU.

Why: the graph written by ``service.heads.graph`` takes the log-sum-exp from one ``LogSoftmax`` over
all the run's logits, a second (rows x vocab) float32 tensor beside the logits themselves.
Prompt scoring (``service.plane.scoring``) fetches the logits and must stay within a fixed memory
bound, so that copy halved the rows of a scoring run (49 of a 128256-token head in 48 MB) and
W was read twice as often: 1.24x the time of plain top-k over the same rows.

A ``Loop`` over chunks of ``CHUNK_ROWS`` rows holds only a chunk's slice and log-softmax at a
time, so a run holds its logits once. But it costs one more pass over the logits (the slice
copies, one thread): measured +7-15% on a 32000 x 512 head, +1-2% on 128256 x 2048. So the
graph keeps both ways behind an ``If`` on the input ``LSE_IN_CHUNKS``: top-k runs take the
single ``LogSoftmax`` as written (the ``If`` costs ~10 us a run), scoring runs the loop.

Only where the projection writes the logits itself (``Gemm``, ``MatMulNBits``): a head with
a bias or a soft-cap computes them through intermediates that hold two rows x vocab tensors
anyway (measured 2.1x one run's logits with the loop or without), so it gains nothing.

``service.runtime.layout`` applies this to the copy of the graph a CPU session loads; files on disk
are not changed, and on CUDA they run as written (a loop turn there is a host round trip).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

#: Rows per loop turn: a turn holds 2 x CHUNK_ROWS x vocab float32 (4 MB at 128256 tokens).
CHUNK_ROWS = 4
#: The graph input that chooses the loop (true) or the single ``LogSoftmax`` (false).
LSE_IN_CHUNKS = "lse_in_chunks"
#: Operators that write the logits themselves (the loop's only gain is then real).
_PROJECTIONS = ("Gemm", "MatMul", "MatMulNBits")
#: The nodes of ``service.heads.graph``'s single log-softmax form, kept as the ``If``'s else branch.
_WHOLE = ("log_softmax", "max_log_softmax", "row_lse")
_OUTPUT = "row_lse"


def add_chunked_logsumexp(model: onnx.ModelProto) -> bool:
    """Put the loop beside the single ``LogSoftmax`` (in place), chosen by ``LSE_IN_CHUNKS``.
    False (and nothing changed) for a graph not in ``service.heads.graph``'s form, or whose logits
    come out of transforms rather than the projection (see the module docstring)."""
    graph = model.graph
    whole = [node for node in graph.node if node.name in _WHOLE]
    if [node.name for node in whole] != list(_WHOLE) or whole[-1].output[0] != _OUTPUT:
        return False
    makers = [node.op_type for node in graph.node if whole[0].input[0] in node.output]
    if makers not in ([op] for op in _PROJECTIONS):
        return False
    kept = [node for node in graph.node if node.name not in _WHOLE]
    before = next(i for i, node in enumerate(kept) if _OUTPUT in node.input)
    kept[before:before] = [_choice(whole)]
    del graph.node[:]
    graph.node.extend(kept)
    graph.input.append(helper.make_tensor_value_info(LSE_IN_CHUNKS, TensorProto.BOOL, [1]))
    graph.initializer.extend(
        [
            numpy_helper.from_array(np.array([CHUNK_ROWS], np.int64), "lse_chunk_rows"),
            numpy_helper.from_array(np.array([CHUNK_ROWS - 1], np.int64), "lse_chunk_rest"),
            numpy_helper.from_array(np.zeros((0, 1), np.float32), "lse_none"),
        ]
    )
    return True


def _choice(whole: list[onnx.NodeProto]) -> onnx.NodeProto:
    """``If(LSE_IN_CHUNKS)``: the loop, else the written nodes (their output renamed: a
    branch's outputs are its own names)."""
    logits = whole[0].input[0]
    written = []
    for node in whole:
        copied = onnx.NodeProto()
        copied.CopyFrom(node)
        outputs = ["row_lse_whole" if name == _OUTPUT else name for name in node.output]
        del copied.output[:]
        copied.output.extend(outputs)
        written.append(copied)
    value = helper.make_tensor_value_info
    return helper.make_node(
        "If",
        [LSE_IN_CHUNKS],
        [_OUTPUT],
        "row_lse_choice",
        then_branch=helper.make_graph(
            _loop_nodes(logits),
            "row_lse_in_chunks",
            [],
            [value("row_lse_chunks", TensorProto.FLOAT, ["rows", 1])],
        ),
        else_branch=helper.make_graph(
            written, "row_lse_whole", [], [value("row_lse_whole", TensorProto.FLOAT, ["rows", 1])]
        ),
    )


def _loop_nodes(logits: str) -> list[onnx.NodeProto]:
    """``row_lse_chunks`` (rows, 1) = row_max - log_softmax(chunk)[row_argmax], chunk by chunk.

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
    loop = node("Loop", ["lse_turns", "", "lse_none"], ["row_lse_chunks"], "row_lse_chunked")
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
