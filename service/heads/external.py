"""External data of ONNX heads: where a tensor's bytes are, checked before anything maps them.

onnxruntime refuses a head whose external data is missing, short, or named outside its
directory; the inspector, ``quantize`` and ``trim`` read heads with numpy, and check the same
things here, so they never report or rewrite a head the service would refuse (nor read bytes
from elsewhere on the machine).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, numpy_helper

from service.digits import decimal

#: Element types stored two to a byte.
FOUR_BIT_TYPES = frozenset({TensorProto.INT4, TensorProto.UINT4})


def stored_array(tensor: TensorProto, base_dir: Path, root: Path | None = None) -> npt.NDArray[Any]:
    """A tensor's values; external data is memory-mapped rather than read, from where
    ``external_source`` allows."""
    if tensor.data_location != TensorProto.EXTERNAL:
        check_stored(tensor)
        try:
            return numpy_helper.to_array(tensor)
        except Exception as error:  # raw bytes that disagree with the dims, an unknown type
            raise ValueError(f"initializer {tensor.name[:64]!r} cannot be read: {error}") from None
    data, offset, _ = external_source(tensor, base_dir, root)
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
    return np.memmap(data, dtype=dtype, mode="r", offset=offset, shape=tuple(tensor.dims))


def external_source(
    tensor: TensorProto, base_dir: Path, root: Path | None = None
) -> tuple[Path, int, int]:
    """Where an external tensor's bytes are (file, offset, byte count), checked as onnxruntime
    checks them at load, so the inspector, quantize and trim see what the service would
    refuse: a file named beside the model (``check_location``), a regular file, itself or
    behind a link that stays inside ``root`` when given (the repository: a link out of it
    would make a served head of any file on the machine), that holds the bytes the dims and
    type take at the offset (and ``length``, when given, says so too)."""
    check_location(tensor)
    info = {entry.key: entry.value for entry in tensor.external_data}
    name, location = tensor.name[:64], info.get("location", "")
    data = base_dir / location
    outside = root is not None and not data.resolve().is_relative_to(root.resolve())
    if not location or outside or not data.is_file():
        raise ValueError(
            f"external data of {name!r}: {location[:128]!r} is not a regular file"
            + (" inside the repository" if root is not None else "")
        )
    needed = _stored_bytes(tensor)
    offset, length = decimal(info.get("offset", "0")), info.get("length")
    if offset is None or (length is not None and decimal(length) != needed):
        raise ValueError(
            f"external data of {name!r}: offset {info.get('offset')!r:.24} and length "
            f"{length!r:.24} must be whole numbers of at most 18 digits, the length {needed} "
            f"(dims {list(tensor.dims)})"
        )
    size = data.stat().st_size
    if size < offset + needed:
        raise ValueError(
            f"external data of {name!r}: {location[:128]!r} has {size} bytes, too few for "
            f"{needed} at offset {offset} (dims {list(tensor.dims)})"
        )
    return data, offset, needed


#: The typed field an inline tensor's values are in, when not in ``raw_data`` (ONNX's rules).
TYPED_FIELDS: dict[int, str] = {
    TensorProto.FLOAT: "float_data",
    TensorProto.DOUBLE: "double_data",
    TensorProto.INT64: "int64_data",
    TensorProto.UINT32: "uint64_data",
    TensorProto.UINT64: "uint64_data",
    **dict.fromkeys(
        (
            TensorProto.INT32,
            TensorProto.INT16,
            TensorProto.INT8,
            TensorProto.UINT16,
            TensorProto.UINT8,
            TensorProto.BOOL,
            TensorProto.FLOAT16,
            TensorProto.BFLOAT16,
        ),
        "int32_data",
    ),
}


def check_stored(tensor: TensorProto) -> None:
    """An inline tensor holds exactly what its dims and type take: the service's runtime
    refuses one that does not, so the inspector, quantize and trim do too, naming the
    tensor, its dims and both sizes (a [2**31, 2**31] table was reported as 18 EB)."""
    needed = _stored_bytes(tensor)  # refuses negative dims and unknown types
    if tensor.data_location == TensorProto.EXTERNAL:
        return  # ``external_source`` checks the file holds them
    field = TYPED_FIELDS.get(tensor.data_type)
    if tensor.raw_data:
        held = len(tensor.raw_data)
    elif field is not None:
        held = len(getattr(tensor, field)) * (needed // max(1, _count(tensor)))
    else:
        return  # strings, or packed types in typed fields: onnx's reader says what it finds
    if held != needed:
        kind = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
        raise ValueError(
            f"initializer {tensor.name[:64]!r} holds {held} bytes, but its dims "
            f"{list(tensor.dims)[:8]} of {kind} take {needed}"
        )


def _count(tensor: TensorProto) -> int:
    return int(np.prod(tensor.dims, dtype=object))


def _stored_bytes(tensor: TensorProto) -> int:
    """Bytes a tensor's values take (4-bit types two to a byte)."""
    if any(dim < 0 for dim in tensor.dims):
        raise ValueError(
            f"initializer {tensor.name[:64]!r} has negative dims {list(tensor.dims)[:8]}: "
            "every dim is a size"
        )
    count = _count(tensor)
    if tensor.data_type in FOUR_BIT_TYPES:
        return -(-count // 2)
    try:
        return count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except (KeyError, ValueError, TypeError):
        raise ValueError(
            f"initializer {tensor.name[:64]!r} has unknown type {tensor.data_type}"
        ) from None


def external_extents(model: onnx.ModelProto) -> dict[str, int | None]:
    """The files a head's external data lives in, each with the bytes its tensors reach
    (offset + length): what a loader must copy of each, and no more. Locations are checked
    (``check_location``); a tensor that cannot be sized makes it the whole file (None)."""
    extents: dict[str, int | None] = {}
    for tensor in stored_tensors(model.graph):
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        check_location(tensor)
        info = {entry.key: entry.value for entry in tensor.external_data}
        location = info.get("location", "")
        offset = decimal(info.get("offset", "0"))
        try:
            end = None if offset is None else offset + _stored_bytes(tensor)
        except ValueError:  # the inspector says what is wrong with it
            end = None
        reached = extents.get(location, 0)
        extents[location] = None if end is None or reached is None else max(reached, end)
    return extents


def stored_tensors(graph: onnx.GraphProto) -> Iterator[TensorProto]:
    """Every tensor a graph stores: initializers, and constants held by node attributes."""
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors


def check_location(tensor: TensorProto) -> None:
    """External data must be a file in the model's own directory: a plain file name, no
    ``..``, no absolute path, no subdirectory (whatever the onnxruntime version accepts), so
    that no head can be made of, or hand out, bytes from elsewhere on the machine."""
    for entry in tensor.external_data:
        if entry.key == "location" and (
            entry.value != Path(entry.value).name or entry.value in ("", ".", "..")
        ):
            raise ValueError(
                f"external data of {tensor.name[:64]!r} must be a file beside the model, "
                f"got {entry.value[:128]!r}"
            )
