"""Write and read ONNX heads: tied heads store ONE weight, untied heads two.

``HeadWeights`` holds the matrices (float32, float16 or bfloat16) and what goes around them;
``save_head`` writes ``model.onnx`` (and ``model.onnx.data`` when external), the graph coming
from ``service.heads.graph``; ``read_head`` reads a head lmhead wrote back into ``HeadWeights``
(external data memory-mapped, not read).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, numpy_helper

from service.heads import DATA_FILE, MODEL_FILE
from service.heads.external import stored_array
from service.heads.graph import (
    EMBEDDING_WEIGHT,
    OUTPUT_BIAS,
    OUTPUT_WEIGHT,
    QUANTIZATION,
    UNTIED_ON_PURPOSE,
    Head,
    HeadTransforms,
    head_model,
    quantized_names,
)
from service.heads.norm import FinalNorm, read_norm
from service.heads.quantize import QuantSpec, quantize

#: Serialized protobuf messages cannot exceed 2 GiB; keep headroom for the graph itself.
PROTOBUF_LIMIT_BYTES = 2**31 - 64 * 2**20
#: Offsets of tensors in the external data file, so each one can be memory-mapped.
EXTERNAL_ALIGNMENT = 64 * 1024
#: numpy dtypes of the stored matrices (bfloat16 through ml_dtypes, which onnx depends on).
NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}
#: Rows converted at a time when widening to float32, so no full float32 copy is held.
WIDEN_ROWS = 4096
FINITE_CHECK_ROWS = 4096  # rows checked for NaN/Inf at a time
TRANSFORM_SCALES = ("input_scale", "logit_scale", "softcap")


@dataclass(frozen=True)
class HeadWeights:
    """The matrices of a head, each (vocab_size, d_model); ``output`` is None when tied."""

    embedding: npt.NDArray[Any]
    output: npt.NDArray[Any] | None = None
    bias: npt.NDArray[np.float32] | None = None
    transforms: HeadTransforms = HeadTransforms()
    twin: bool = False
    """An untied head whose output matrix starts as a copy of the table on purpose (to be
    fine-tuned apart): the file says so, so the inspector does not call it a broken tie."""
    norm: FinalNorm | None = None
    """The model's final norm, for residual states (``service.heads.norm``)."""

    @classmethod
    def from_arrays(
        cls,
        embedding: npt.ArrayLike,
        output: npt.ArrayLike | None = None,
        *,
        bias: npt.ArrayLike | None = None,
        transforms: HeadTransforms | None = None,
        twin: bool = False,
        dtype: str = "float32",
        norm: FinalNorm | None = None,
    ) -> HeadWeights:
        """Check shapes and convert to contiguous ``dtype`` (float32, float16, bfloat16)."""
        if dtype not in NUMPY_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(NUMPY_DTYPES)}, got {dtype!r}")
        table = _as_weight(embedding, "embedding", NUMPY_DTYPES[dtype])
        head = None if output is None else _as_weight(output, "output", NUMPY_DTYPES[dtype])
        if head is not None and head.shape != table.shape:
            raise ValueError(
                f"output weight shape {head.shape} does not match embedding shape {table.shape}"
            )
        vector = None if bias is None else np.ascontiguousarray(bias, dtype=np.float32)
        if vector is not None and vector.shape != (table.shape[0],):
            raise ValueError(f"bias must have shape ({table.shape[0]},), got {vector.shape}")
        if vector is not None and not np.isfinite(vector).all():
            first = int(np.argwhere(~np.isfinite(vector))[0][0])
            raise ValueError(f"bias holds NaN or Inf (as float32) at token {first}")
        if norm is not None and norm.d_model != table.shape[1]:
            raise ValueError(
                f"the final norm is over {norm.d_model} values, d_model is {table.shape[1]}"
            )
        twin = twin and head is not None
        return cls(table, head, vector, transforms or HeadTransforms(), twin, norm)

    @property
    def tied(self) -> bool:
        return self.output is None

    @property
    def dtype(self) -> str:
        return dtype_name(self.embedding.dtype)

    @property
    def nbytes(self) -> int:
        return self.embedding.nbytes + (0 if self.output is None else self.output.nbytes)

    def stored_nbytes(
        self, quantization: QuantSpec | None = None, quantize_table: bool = False
    ) -> int:
        """Bytes of the weights as ``save_head`` would store them."""
        if quantization is None:
            return self.nbytes
        vocab_size, d_model = self.embedding.shape
        quantized = quantization.stored_bytes(vocab_size, d_model)
        if self.output is None:
            return quantized
        return quantized + (quantized if quantize_table else self.embedding.nbytes)

    def head(
        self,
        dtype: str | None = None,
        quantization: QuantSpec | None = None,
        quantize_table: bool = False,
    ) -> Head:
        vocab_size, d_model = self.embedding.shape
        table_quantized = quantization is not None and (self.tied or quantize_table)
        return Head(
            vocab_size,
            d_model,
            dtype or self.dtype,
            self.transforms,
            self.bias,
            self.twin,
            quantization,
            table_quantized,
            self.norm,
        )

    def matrices(self) -> list[tuple[str, npt.NDArray[Any]]]:
        named = [(EMBEDDING_WEIGHT, self.embedding)]
        return named + ([(OUTPUT_WEIGHT, self.output)] if self.output is not None else [])


def dtype_name(dtype: np.dtype[Any]) -> str:
    """The name of a stored matrix dtype (a ``ValueError`` for any other: int32, float64)."""
    for name, known in NUMPY_DTYPES.items():
        if known == dtype:
            return name
    raise ValueError(f"weights are {dtype}, expected one of {', '.join(NUMPY_DTYPES)}")


def _as_weight(array: npt.ArrayLike, name: str, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    matrix = np.asarray(array)
    if matrix.ndim != 2 or matrix.size == 0:
        raise ValueError(
            f"{name} must be a non-empty 2-D (vocab_size, d_model) array, got shape {matrix.shape}"
        )
    if not (np.issubdtype(matrix.dtype, np.floating) or matrix.dtype == ml_dtypes.bfloat16):
        raise ValueError(f"{name} must have a floating dtype, got {matrix.dtype}")
    with np.errstate(over="ignore"):  # values beyond float16 become Inf, refused below
        converted = np.ascontiguousarray(matrix.astype(dtype, copy=False))
    for start in range(0, len(converted), FINITE_CHECK_ROWS):  # bounded scratch memory
        finite = np.isfinite(converted[start : start + FINITE_CHECK_ROWS])
        if not finite.all():
            row = start + int(np.argwhere(~finite)[0][0])
            if np.isfinite(matrix[row]).all():  # finite until converted: past the dtype's range
                raise ValueError(
                    f"{name} row {row} holds values past {np.dtype(dtype).name}'s range: store "
                    "it as float32 or bfloat16"
                )
            raise ValueError(
                f"{name} holds NaN or Inf (as {np.dtype(dtype).name}) in row {row}: a head of "
                "it would answer NaN"
            )
    return converted


def build_head(weights: HeadWeights) -> onnx.ModelProto:
    """Build an in-memory head with the weights inline (fine below the protobuf limit)."""
    tensors = [_tensor(name, array) for name, array in weights.matrices()]
    return head_model(tensors, weights.head())


def _stored(
    weights: HeadWeights, dtype: str, quantization: QuantSpec | None, quantize_table: bool
) -> list[tuple[str, npt.NDArray[Any], np.dtype[Any]]]:
    """(name, array, stored dtype) of every weight tensor: a quantized matrix is three."""
    stored: list[tuple[str, npt.NDArray[Any], np.dtype[Any]]] = []
    for name, matrix in weights.matrices():
        is_output = name == OUTPUT_WEIGHT or weights.tied
        if quantization is None or not (is_output or quantize_table):
            stored.append((name, matrix, NUMPY_DTYPES[dtype]))
            continue
        packed = quantize(matrix, quantization)
        arrays: tuple[npt.NDArray[Any], ...] = (packed.data, packed.scales, packed.zero_points)
        stored += [(n, a, a.dtype) for n, a in zip(quantized_names(name), arrays, strict=True)]
    return stored


def save_head(
    weights: HeadWeights,
    directory: str | Path,
    *,
    external_data: bool | None = None,
    inline_limit_bytes: int = PROTOBUF_LIMIT_BYTES,
    widen: bool = False,
    quantization: QuantSpec | None = None,
    quantize_table: bool = False,
) -> Path:
    """Write ``model.onnx`` (and ``model.onnx.data`` when external) into ``directory``.

    ``external_data=None`` chooses external storage exactly when the weights exceed
    ``inline_limit_bytes`` (by default: would not fit in one protobuf message). External data
    is written straight from the numpy buffers (no second in-memory copy) at aligned offsets,
    so onnxruntime can memory-map it. ``widen`` writes a half-precision head as float32
    (external, converted in row chunks): how a CPU serves it. ``quantization`` stores the
    output matrix block-quantized (``service.heads.quantize``): the one matrix of a tied head, so
    its embedding lookup reads the same tensors; ``quantize_table`` quantizes an untied
    head's table too.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / MODEL_FILE
    dtype = "float32" if widen else weights.dtype
    stored = _stored(weights, dtype, quantization, quantize_table)
    nbytes = sum(array.size * stored_dtype.itemsize for _, array, stored_dtype in stored)
    if external_data is None:
        external_data = widen or nbytes > inline_limit_bytes
    head = weights.head(dtype, quantization, quantize_table)
    if not external_data:
        tensors = [_tensor(name, array.astype(target)) for name, array, target in stored]
        onnx.save_model(head_model(tensors, head), path)
        (directory / DATA_FILE).unlink(missing_ok=True)
        return path
    onnx.save_model(head_model(_write_external(stored, directory / DATA_FILE), head), path)
    return path


def read_head(path: str | Path, root: Path | None = None) -> HeadWeights:
    """A head lmhead wrote, as ``HeadWeights`` (external data memory-mapped, not read, and
    from inside ``root`` only, when given). Anything else is a ``ValueError`` that says why."""
    path = Path(path)
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as error:  # onnx raises DecodeError or OSError subclasses
        raise ValueError(f"{path} is not a readable ONNX model: {error}") from None
    tensors = {tensor.name: tensor for tensor in model.graph.initializer}
    props = {prop.key: prop.value for prop in model.metadata_props}
    if QUANTIZATION in props:
        raise ValueError(
            f"{path.parent.name}/{path.name} is quantized ({props[QUANTIZATION]}): its float "
            "weights are gone; quantize from the float head it came from"
        )
    if EMBEDDING_WEIGHT not in tensors:
        found = ", ".join(sorted(tensors)[:5]) or "none"
        raise ValueError(
            f"{path.parent.name}/{path.name} has no {EMBEDDING_WEIGHT!r} initializer (it holds "
            f"{found[:200]}): lmhead reads back the heads it wrote; import the checkpoint"
        )
    bias = tensors.get(OUTPUT_BIAS)
    return HeadWeights(
        stored_array(tensors[EMBEDDING_WEIGHT], path.parent, root),
        stored_array(tensors[OUTPUT_WEIGHT], path.parent, root)
        if OUTPUT_WEIGHT in tensors
        else None,
        None if bias is None else stored_array(bias, path.parent, root).astype(np.float32),
        _stored_transforms(props.get("lmhead.transforms", "{}")),
        props.get(UNTIED_ON_PURPOSE) == "true",
        read_norm(model),
    )


def _stored_transforms(text: str) -> HeadTransforms:
    """The ``lmhead.transforms`` metadata as ``HeadTransforms`` (a ``ValueError`` if mangled)."""
    try:
        found = json.loads(text)
        scales = {key: float(found[key]) for key in TRANSFORM_SCALES if key in found}
        return HeadTransforms(**scales)
    except (ValueError, TypeError, AttributeError) as error:
        raise ValueError(f"metadata lmhead.transforms is not valid ({error})") from None


def _tensor(name: str, array: npt.NDArray[Any]) -> TensorProto:
    if array.dtype == ml_dtypes.bfloat16:  # stored as its raw 16-bit patterns
        return onnx.helper.make_tensor(
            name, TensorProto.BFLOAT16, array.shape, array.view(np.uint16).tobytes(), raw=True
        )
    return numpy_helper.from_array(array, name)


def _write_external(
    stored: list[tuple[str, npt.NDArray[Any], np.dtype[Any]]], data_path: Path
) -> list[TensorProto]:
    """Each array at an aligned offset of one data file, converted row chunk by row chunk."""
    tensors = []
    with data_path.open("wb") as stream:
        for name, array, dtype in stored:
            offset = -stream.tell() % EXTERNAL_ALIGNMENT + stream.tell()
            stream.seek(offset)
            for chunk in _row_chunks(array, dtype):
                chunk.tofile(stream)
            proto = TensorProto(name=name, data_type=_element_type(dtype), dims=array.shape)
            proto.data_location = TensorProto.EXTERNAL
            length = array.size * dtype.itemsize
            for key, value in (
                ("location", data_path.name),
                ("offset", str(offset)),
                ("length", str(length)),
            ):
                proto.external_data.add(key=key, value=value)
            tensors.append(proto)
    return tensors


def _element_type(dtype: np.dtype[Any]) -> int:
    if dtype == ml_dtypes.bfloat16:
        return TensorProto.BFLOAT16
    return onnx.helper.np_dtype_to_tensor_dtype(dtype)


def _row_chunks(array: npt.NDArray[Any], dtype: np.dtype[Any]) -> Iterator[npt.NDArray[Any]]:
    if array.dtype == dtype:
        yield array
        return
    for start in range(0, len(array), WIDEN_ROWS):
        yield array[start : start + WIDEN_ROWS].astype(dtype)
