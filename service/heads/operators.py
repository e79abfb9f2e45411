"""The operators a head is made of: a graph holding any other is not a head, and is refused.

Why: a head is a table lookup, a projection, a top-k and a log-sum-exp, but an ONNX file can
hold any program. A ``Loop`` of 1e11 turns made a load's warm-up run for ever (issue 43: the
loading thread wedged, and a stopped process with it); a ``ConstantOfShape`` of 2^28 floats
made a 2.4 KB file allocate 1 GiB a run. The inspector (so ``lmhead inspect``, every load and
every tool that reads a head) refuses a node whose operator is not in ``HEAD_OPERATORS``,
naming the node, the operator and its domain, before onnxruntime opens the file.

The list is what lmhead's own builders write (``service.heads.graph`` with its transforms,
``norm``, ``quantize``'s contrib operators; ``lmhead retie``'s ``FusedMatMul``) and the
exporter forms the inspector reads (``MatMul`` of W^T, ``Transpose``); the unit tests check
that every head lmhead writes passes it. ``service.heads.lse_graph`` adds a ``Loop`` and an
``If`` to the copy of the graph a CPU session loads, after this check: they are lmhead's own,
their turns bounded by the run's rows.

The list bounds what a graph is, not what a run costs: listed operators on large shapes take
long too (a chain of square MatMuls), which the warm-up deadline of a load bounds
(``service.repository.warm_up``). ``MAX_NODES`` bounds opening one: onnxruntime took 18 s to
open 20,000 nodes, time no warm-up deadline covers.
"""

from __future__ import annotations

import onnx

from service.heads.graph import MS_DOMAIN

#: onnx's own operators (the empty domain and its long name are the same domain).
ONNX_DOMAINS = frozenset({"", "ai.onnx"})
_ONNX = (
    # the projection, its dtype casts and the exporters' forms of it
    "Gemm",
    "MatMul",
    "Transpose",
    "Cast",
    "Identity",
    # the embedding lookup (a quantized table's codes reshaped, whole blocks trimmed)
    "Gather",
    "Reshape",
    "Slice",
    # transforms: scales, temperature, bias, soft-cap
    "Mul",
    "Div",
    "Add",
    "Tanh",
    # top-k and the log-sum-exp
    "Min",
    "TopK",
    "LogSoftmax",
    "GatherElements",
    "Sub",
    "Squeeze",
    # the final norm (RMS, LayerNorm)
    "ReduceMean",
    "Sqrt",
    "LayerNormalization",
)
#: onnxruntime's contrib operators a head uses: quantized projection and table, retie's matmul.
_CONTRIB = ("MatMulNBits", "GatherBlockQuantized", "FusedMatMul")
#: (domain, operator) of every node a head may hold.
HEAD_OPERATORS = frozenset(
    {("", name) for name in _ONNX} | {(MS_DOMAIN, name) for name in _CONTRIB}
)
#: The list as a refusal names it: by name, contrib operators with their domain.
LISTED = ", ".join(
    sorted(name if not domain else f"{domain}.{name}" for domain, name in HEAD_OPERATORS)
)
#: Nodes a graph may hold: lmhead's heads hold under 40, the largest with a norm, transforms
#: and a quantized table.
MAX_NODES = 256


def check_operators(model: onnx.ModelProto) -> None:
    """``ValueError`` naming the first node whose operator is not a head's, or what else
    makes the graph more than a head: too many nodes, functions of its own, a subgraph."""
    graph = model.graph
    if model.functions:
        names = ", ".join(sorted({f"{f.domain}.{f.name}" for f in model.functions}))[:200]
        raise ValueError(f"the model defines functions of its own ({names}); a head has none")
    if len(graph.node) > MAX_NODES:
        raise ValueError(
            f"the graph has {len(graph.node)} nodes; a head has at most {MAX_NODES} (lmhead's "
            "own have under 40)"
        )
    for node in graph.node:
        domain = "" if node.domain in ONNX_DOMAINS else node.domain
        if (domain, node.op_type) not in HEAD_OPERATORS:
            raise ValueError(
                f"node {node.name[:64]!r} is a {node.op_type[:64]} (domain "
                f"{(node.domain or 'ai.onnx')[:64]}): a head holds only the operators "
                f"lmhead's heads use: {LISTED}"
            )
        for attribute in node.attribute:
            if attribute.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
                raise ValueError(
                    f"node {node.name[:64]!r} holds a graph in its attribute "
                    f"{attribute.name[:64]!r}; a head's nodes hold none"
                )
