"""A head file's final norm side, checked as the inspector checks the rest of the file.

``read_norm`` reads back what lmhead wrote; the inspector must also say whether the norm runs
as the service would run it, before a session is made of it: the metadata names a kind and an
epsilon in (0, 1), the weight (and a LayerNorm's bias) is float32 of shape (d_model,) and
finite, the graph takes ``residual_states`` (rows, d_model) and gives ``normed_states``, and
nothing the norm side computes reaches another output: the tie, the embeddings and the logits
are the same with or without a norm. Tensors are read where they are stored (external data
memory-mapped, ``service.heads.external``): a file another tool rewrote may hold them there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import onnx
from onnx import TensorProto

from service.heads.external import stored_array
from service.heads.norm import (
    FINAL_NORM,
    NORM_BIAS,
    NORM_EPSILON,
    NORM_KINDS,
    NORM_WEIGHT,
    NORMED_STATES,
    RESIDUAL_STATES,
    FinalNorm,
)

NO_NORM = "none (residual states are refused)"


def inspect_norm(model: onnx.ModelProto, base_dir: Path, d_model: int) -> dict[str, Any] | None:
    """The norm as ``FinalNorm.describe`` says it, with its tensors' names; None for a head
    without one. A ``ValueError`` says what is wrong."""
    props = {prop.key: prop.value for prop in model.metadata_props}
    graph = model.graph
    if FINAL_NORM not in props:
        if any(value.name == RESIDUAL_STATES for value in graph.input):
            raise ValueError(f"the graph takes {RESIDUAL_STATES!r} but says no {FINAL_NORM}")
        return None
    kind, epsilon, bias, source = _described(props[FINAL_NORM])
    names = [NORM_WEIGHT] + ([NORM_BIAS] if kind == "layer" else [])
    tensors = {tensor.name: tensor for tensor in graph.initializer}
    arrays = []
    for name in names:
        tensor = tensors.get(name)
        if tensor is None:
            raise ValueError(f"a {kind} final norm needs the initializer {name!r}")
        if tensor.data_type != TensorProto.FLOAT or tuple(tensor.dims) != (d_model,):
            stored = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
            raise ValueError(
                f"{name} is {stored} of shape {tuple(tensor.dims)}; the norm side needs "
                f"float32 of shape ({d_model},)"
            )
        arrays.append(stored_array(tensor, base_dir))
    norm = FinalNorm(kind, arrays[0], epsilon, arrays[1] if bias else None, source)
    _check_wiring(graph, d_model)
    return norm.describe() | {"tensors": names}


def norm_summary(described: dict[str, Any] | None) -> str:
    """One line of a described norm: ``rms, eps 1e-05 (model.norm.weight)``."""
    if described is None:
        return NO_NORM
    shown = f"{described['kind']}, eps {described['epsilon']:g}"
    shown += ", bias" if described.get("bias") else ""
    return shown + (f" ({described['source']})" if described.get("source") else "")


def _described(text: str) -> tuple[Any, float, bool, str]:
    """Kind, epsilon, whether a bias is real (a LayerNorm without one adds zeros), source."""
    try:
        described = json.loads(text)
        kind, epsilon = described["kind"], described["epsilon"]
    except (ValueError, TypeError, KeyError):
        raise ValueError(f"metadata {FINAL_NORM} must be an object with kind and epsilon") from None
    if kind not in NORM_KINDS or isinstance(epsilon, bool) or not isinstance(epsilon, int | float):
        raise ValueError(f"metadata {FINAL_NORM}: a kind among {NORM_KINDS} and a number epsilon")
    return kind, float(epsilon), described.get("bias") is True, str(described.get("source", ""))


def _check_wiring(graph: onnx.GraphProto, d_model: int) -> None:
    """Residual rows in, normed rows out, and no other output downstream of the norm side."""
    value = next((value for value in graph.input if value.name == RESIDUAL_STATES), None)
    dims = [] if value is None else value.type.tensor_type.shape.dim
    if len(dims) != 2 or dims[1].dim_value != d_model:
        raise ValueError(f"a final norm takes a ({RESIDUAL_STATES}, {d_model}) input")
    outputs = {value.name for value in graph.output}
    if NORMED_STATES not in outputs:
        raise ValueError(f"a final norm gives the output {NORMED_STATES!r}")
    reached = {RESIDUAL_STATES, NORM_WEIGHT, NORM_BIAS, NORM_EPSILON}
    grown = True
    while grown:  # to a fixed point: a mangled file's nodes need not be sorted
        grown = False
        for node in graph.node:
            if reached.intersection(node.input) and not reached.issuperset(node.output):
                reached.update(node.output)
                grown = True
    if NORMED_STATES not in reached:
        raise ValueError(f"{NORMED_STATES!r} is not computed from {RESIDUAL_STATES!r}")
    crossed = sorted(reached & (outputs - {NORMED_STATES}))
    if crossed:
        raise ValueError(f"the final norm feeds {crossed}: it must stay a side of its own")
