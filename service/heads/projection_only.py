"""A head's graph with its embedding side removed (``service.runtime.layout`` serves a tied
head in ``shared`` memory mode from it)."""

from __future__ import annotations

import onnx

from service.heads.graph import EMBEDDING_CODES, EMBEDDINGS, INPUT_IDS


def without_embedding(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same head with its embedding side removed: a session of it holds W only for the
    projection (so onnxruntime may pack W and free the original), and the embedding rows are
    read elsewhere from the same weights (``HeadSession(table=...)``)."""
    stripped = onnx.ModelProto()
    stripped.CopyFrom(model)
    graph = stripped.graph
    embedding_side = {EMBEDDINGS, "embedding_rows", EMBEDDING_CODES, "embeddings_padded"}
    nodes = [node for node in graph.node if not set(node.output) & embedding_side]
    del graph.node[:]
    graph.node.extend(nodes)
    inputs = [value for value in graph.input if value.name != INPUT_IDS]
    del graph.input[:]
    graph.input.extend(inputs)
    outputs = [value for value in graph.output if value.name != EMBEDDINGS]
    del graph.output[:]
    graph.output.extend(outputs)
    used = {name for node in graph.node for name in node.input}
    kept = [tensor for tensor in graph.initializer if tensor.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return stripped
