"""Read an ONNX head and say how its weights are wired: tied, untied, or a broken tie.

A head is *tied* when one initializer feeds both the embedding ``Gather`` and the output
projection (``Gemm``/``MatMul``/``FusedMatMul``). Exporters often break the tie on the way to
ONNX: ``torch.onnx.export`` with constant folding writes W and a folded W^T, and some HF
checkpoints ship a redundant ``lm_head`` copy. Such a file has two initializers with the same
content; it is reported as *duplicated*, not as tied, with the bytes a re-tie would save.

Weights are compared without loading the file twice: external data is memory-mapped. A final
norm, when the head holds one, is checked and described by ``service.heads.norm_side``. A graph
holding any operator lmhead's heads do not use is refused (``service.heads.operators``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnx

from service.digits import decimal
from service.heads import MODEL_FILE
from service.heads.external import (
    check_location,
    check_stored,
    external_source,
    stored_array,
    stored_tensors,
)
from service.heads.graph import HIDDEN_STATES, UNTIED_ON_PURPOSE, HeadTransforms
from service.heads.norm_side import inspect_norm, norm_summary
from service.heads.operators import check_operators

PROJECTION_OPS = frozenset({"Gemm", "MatMul", "FusedMatMul"})
PASS_THROUGH_OPS = frozenset({"Identity", "Cast"})
TRACED_OPS = frozenset({"Transpose", "Reshape"})
QUANTIZED_GATHER = "GatherBlockQuantized"
QUANTIZED_PROJECTION = "MatMulNBits"
Duplicate = Literal["identical", "transposed"]


class HeadInspectionError(ValueError):
    """The file is not a head this inspector understands; the message says why."""


@dataclass(frozen=True)
class HeadReport:
    """What ``lmhead inspect`` prints; ``--json`` prints ``asdict`` of it."""

    path: str
    tied: bool
    embedding_initializer: str
    projection_initializer: str
    gather_node: str
    projection_node: str
    projection_transposed: bool
    vocab_size: int
    d_model: int
    dtype: str
    parameters: int
    weight_bytes: int
    bytes_saved_by_tying: int
    duplicate: Duplicate | None
    duplicate_bytes: int
    external_data: bool
    file_bytes: int
    transforms: dict[str, Any]
    format: int
    """``lmhead.format`` of files lmhead wrote (0 for other producers)."""
    untied_on_purpose: bool
    """An identical untied twin written on purpose (``lmhead import --untie``), not a broken
    tie."""
    quantization: dict[str, Any] | None = None
    """A block-quantized projection (``MatMulNBits``): bits, block size, whether the table is
    quantized and the one tensor set shared by both sides, the quantized bytes."""
    final_norm: dict[str, Any] | None = None
    """The model's final norm (kind, epsilon, bias, source, tensors), which residual states
    are read through; None: the head has none (``service.heads.norm_side``)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def norm_text(self) -> str:
        """The final norm in one line (``lmhead inspect``)."""
        return norm_summary(self.final_norm)


@dataclass(frozen=True)
class _Use:
    node: onnx.NodeProto
    initializer: str
    transposed: bool
    quantized: tuple[str, ...] = ()
    """Codes, scales and zero points of a block-quantized weight (none when float)."""


def resolve_model_path(path: str | Path) -> Path:
    """Accept a ``model.onnx`` file or a version directory that holds one."""
    candidate = Path(path)
    if candidate.is_dir():
        candidate = candidate / MODEL_FILE
    if not candidate.is_file():
        raise HeadInspectionError(f"no ONNX file at {candidate}")
    return candidate


def read_model(path: Path) -> onnx.ModelProto:
    """The ONNX graph at ``path``, its external data not read."""
    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as error:  # onnx raises DecodeError or OSError subclasses
        raise HeadInspectionError(f"{path} is not a readable ONNX model: {error}") from None


def inspect_head(path: str | Path, model: onnx.ModelProto | None = None) -> HeadReport:
    """Inspect the head at ``path`` (a file or a version directory); ``model``: its graph,
    when the caller has read it already (``read_model``)."""
    model_path = resolve_model_path(path)
    if model is None:
        model = read_model(model_path)
    graph = model.graph
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    inputs = {value.name for value in graph.input}
    weights = {name: t for name, t in initializers.items() if t.dims and name not in inputs}
    producers = {out: node for node in graph.node for out in node.output}
    gather = _find_gather(graph, producers, weights)
    vocab_size, d_model = _table_shape(graph, gather, weights)
    projection = _find_projection(graph, producers, weights, vocab_size, d_model)
    _check_contents(model, model_path.parent)
    props = {prop.key: prop.value for prop in model.metadata_props}
    try:
        final_norm = inspect_norm(model, model_path.parent, d_model)
    except ValueError as error:
        raise HeadInspectionError(f"final norm: {error}") from None
    report = _report(model_path, weights, gather, projection, vocab_size, d_model, props)
    return replace(report, final_norm=final_norm)


def _trace(name: str, producers: dict[str, onnx.NodeProto]) -> tuple[str, bool]:
    """Follow ``name`` back through Identity/Cast/Transpose (and the Reshape that gives
    quantized codes to ``GatherBlockQuantized``) to its source; note transposes."""
    transposed = False
    while name in producers and producers[name].op_type in PASS_THROUGH_OPS | TRACED_OPS:
        node = producers[name]
        transposed ^= node.op_type == "Transpose"
        name = node.input[0]
    return name, transposed


def _find_gather(
    graph: onnx.GraphProto,
    producers: dict[str, onnx.NodeProto],
    weights: dict[str, onnx.TensorProto],
) -> _Use:
    for node in graph.node:
        if node.op_type == QUANTIZED_GATHER and len(node.input) >= 3:
            source, _ = _trace(node.input[0], producers)
            if source in weights:
                quantized = (source, *_present(node.input[2:4]))
                return _Use(node, source, transposed=False, quantized=quantized)
        if node.op_type == "Gather" and node.input:
            source, transposed = _trace(node.input[0], producers)
            if source in weights and not transposed and len(weights[source].dims) == 2:
                return _Use(node, source, transposed=False)
    raise HeadInspectionError(
        "no embedding Gather reads a 2-D initializer; initializers found: "
        f"{sorted(weights) or 'none'}"
    )


def _find_projection(
    graph: onnx.GraphProto,
    producers: dict[str, onnx.NodeProto],
    weights: dict[str, onnx.TensorProto],
    vocab_size: int,
    d_model: int,
) -> _Use:
    """The matmul whose weight, as used, is (vocab, d_model)^T: it produces one logit per token."""
    for node in graph.node:
        if node.op_type == QUANTIZED_PROJECTION and len(node.input) >= 3:
            shape = (_attribute(node, "N"), _attribute(node, "K"))
            if node.input[1] in weights and shape == (vocab_size, d_model):
                quantized = _present(node.input[1:4])
                return _Use(node, node.input[1], transposed=False, quantized=quantized)
        if node.op_type not in PROJECTION_OPS:
            continue
        source, transposed = _trace(node.input[1], producers)
        if source not in weights or len(weights[source].dims) != 2:
            continue
        transposed ^= _attribute(node, "transB") == 1
        rows, cols = (int(dim) for dim in weights[source].dims)
        stored_as_table = (rows, cols) == (vocab_size, d_model) and transposed
        stored_as_columns = (rows, cols) == (d_model, vocab_size) and not transposed
        if stored_as_table or stored_as_columns:
            return _Use(node, source, transposed=stored_as_columns)
    raise HeadInspectionError(
        f"no Gemm/MatMul projects onto the {vocab_size}-token vocabulary from a "
        f"{d_model}-wide hidden state"
    )


def _present(names: Iterable[str]) -> tuple[str, ...]:
    """Inputs given (an optional input left out is an empty name)."""
    return tuple(name for name in names if name)


def _table_shape(
    graph: onnx.GraphProto, gather: _Use, weights: dict[str, onnx.TensorProto]
) -> tuple[int, int]:
    """(vocab, d_model): the table's shape, or for quantized codes their rows and the width
    of the hidden state (the codes are padded to whole blocks)."""
    if not gather.quantized:
        rows, cols = (int(dim) for dim in weights[gather.initializer].dims)
        return rows, cols
    for value in graph.input:
        dims = value.type.tensor_type.shape.dim
        if value.name == HIDDEN_STATES and len(dims) == 2 and dims[1].HasField("dim_value"):
            return int(weights[gather.initializer].dims[0]), int(dims[1].dim_value)
    raise HeadInspectionError(
        f"a quantized table needs a fixed-width 2-D {HIDDEN_STATES!r} input to give d_model"
    )


def _attribute(node: onnx.NodeProto, name: str) -> int:
    for attribute in node.attribute:
        if attribute.name == name:
            return int(attribute.i)
    return 0


def _report(
    model_path: Path,
    weights: dict[str, onnx.TensorProto],
    gather: _Use,
    projection: _Use,
    vocab_size: int,
    d_model: int,
    props: dict[str, str],
) -> HeadReport:
    tied = gather.initializer == projection.initializer and gather.quantized == projection.quantized
    table = weights[gather.initializer]
    quantization = _quantization(weights, gather, projection, tied)
    dtype = quantization["dtype"] if quantization else tensor_dtype(table)
    matrices = 1 if tied else 2
    parameters = matrices * vocab_size * d_model
    table_bytes = _bytes_of(weights, gather)
    weight_bytes = table_bytes + (0 if tied else _bytes_of(weights, projection))
    duplicate = None if tied else _duplicate(model_path.parent, weights, gather, projection)
    external = any(t.data_location == onnx.TensorProto.EXTERNAL for t in weights.values())
    files = {e.value for t in weights.values() for e in t.external_data if e.key == "location"}
    data_bytes = sum((model_path.parent / name).stat().st_size for name in files)
    return HeadReport(
        path=str(model_path),
        tied=tied,
        embedding_initializer=gather.initializer,
        projection_initializer=projection.initializer,
        gather_node=gather.node.name,
        projection_node=projection.node.name,
        projection_transposed=projection.transposed,
        vocab_size=vocab_size,
        d_model=d_model,
        dtype=dtype,
        parameters=parameters,
        weight_bytes=weight_bytes,
        bytes_saved_by_tying=table_bytes if tied else 0,
        duplicate=duplicate,
        duplicate_bytes=table_bytes if duplicate else 0,
        external_data=external,
        file_bytes=model_path.stat().st_size + data_bytes,
        transforms=_transforms(props.get("lmhead.transforms", "{}")),
        format=decimal(props.get("lmhead.format", "")) or 0,
        untied_on_purpose=props.get(UNTIED_ON_PURPOSE) == "true",
        quantization=quantization,
    )


def tensor_dtype(tensor: onnx.TensorProto) -> str:
    return str(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))


def _bytes(tensor: onnx.TensorProto) -> int:
    itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    return int(math.prod(tensor.dims) * itemsize)


def _bytes_of(weights: dict[str, onnx.TensorProto], use: _Use) -> int:
    """Bytes of the weight a node reads: one tensor, or a quantized weight's tensors."""
    return sum(_bytes(weights[name]) for name in use.quantized or (use.initializer,))


def _quantization(
    weights: dict[str, onnx.TensorProto],
    gather: _Use,
    projection: _Use,
    tied: bool,
) -> dict[str, Any] | None:
    """bits, block size, whether the table is quantized and shared, and the bytes."""
    if not projection.quantized:
        return None
    bits = _attribute(projection.node, "bits")
    return {
        "dtype": f"int{bits}",
        "bits": bits,
        "block_size": _attribute(projection.node, "block_size"),
        "accuracy_level": _attribute(projection.node, "accuracy_level"),
        "table": bool(gather.quantized),
        "shared": tied,
        "bytes": _bytes_of(weights, projection),
        "table_tensors": list(gather.quantized),
        "projection_tensors": list(projection.quantized),
    }


def _duplicate(
    base_dir: Path, weights: dict[str, onnx.TensorProto], gather: _Use, projection: _Use
) -> Duplicate | None:
    """Is the projection weight the embedding table again (as is, stored transposed, or the
    same quantized tensors)?"""
    if bool(gather.quantized) != bool(projection.quantized):
        return None
    if gather.quantized:
        pairs = zip(gather.quantized, projection.quantized, strict=False)
        same = all(
            a in weights and b in weights and _same(base_dir, weights[a], weights[b], False)
            for a, b in pairs
        )
        return "identical" if same and len(gather.quantized) == len(projection.quantized) else None
    table, weight = weights[gather.initializer], weights[projection.initializer]
    if not _same(base_dir, table, weight, projection.transposed):
        return None
    return "transposed" if projection.transposed else "identical"


def _same(base_dir: Path, a: onnx.TensorProto, b: onnx.TensorProto, transposed: bool) -> bool:
    """Equal values, ``b`` read transposed if asked; a first-row check rejects almost every
    honest pair before the full pass."""
    try:
        first, second = stored_array(a, base_dir), stored_array(b, base_dir)
    except ValueError as error:  # a data file that is missing or not a file
        raise HeadInspectionError(str(error)) from None
    candidate = second.T if transposed else second
    if candidate.shape != first.shape or candidate.dtype != first.dtype:
        return False
    if not np.array_equal(candidate[0], first[0]):
        return False
    return bool(np.array_equal(candidate, first))


TRANSFORM_KEYS = frozenset({"input_scale", "logit_scale", "softcap", "bias"})


def _transforms(text: str) -> dict[str, Any]:
    """``lmhead.transforms`` metadata: an object of known keys with numbers (bias: true)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict) or not set(value) <= TRANSFORM_KEYS:
        raise HeadInspectionError(
            f"metadata lmhead.transforms must be an object with keys among "
            f"{sorted(TRANSFORM_KEYS)}, got {text[:64]!r}"
        )
    for key, number in value.items():
        valid = number is True if key == "bias" else _finite_number(number)
        if not valid:
            raise HeadInspectionError(f"metadata lmhead.transforms.{key} is not valid")
    try:  # as the graph holds them: finite, non-zero float32
        HeadTransforms(**{key: float(v) for key, v in value.items() if key != "bias"})
    except ValueError as error:
        raise HeadInspectionError(f"metadata lmhead.transforms: {error}") from None
    return value


def _finite_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_contents(model: onnx.ModelProto, base_dir: Path) -> None:
    """Every tensor's values where onnxruntime would look for them, as many as its dims take
    (inline or in external data), else the runtime refuses the head; and a head's operators
    only (``service.heads.operators``): a graph that is any other program is not served."""
    try:
        for tensor in stored_tensors(model.graph):
            check_stored(tensor)
            check_location(tensor)
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                external_source(tensor, base_dir)
        check_operators(model)
    except ValueError as error:
        raise HeadInspectionError(str(error)) from None
