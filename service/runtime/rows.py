"""Embedding rows read from a weight file, for heads whose session holds the projection alone
(``service.runtime.layout``): float rows as stored, or quantized rows dequantized.

The file is mapped, and a gather is one numpy take from the mapping (1,000 rows of the demo
head's table in ~0.1 ms; a ``pread`` per row took ~6 us each in the service, where every call
gives the interpreter's lock up and waits to get it back). The kernel maps a file's page cache
in large folios (2-4 MB per fault, whatever ``madvise`` asks ahead of it), so a thousand random
ids map most of the table: left mapped, resident memory would climb back to 2x W. So the
mapped pages are dropped from the process (``MADV_DONTNEED``) once gathers have read as many
rows as the table holds, and whenever the service is idle (``drop``): the page cache stays the
kernel's (clean, shared, reclaimable, charged to the container whether mapped or not), in the
process's resident set only between drops. Dropping after every gather cost each one its
faults again (0.26 ms for 1,000 rows, 0.55 ms served), which allowed tokens' gathers avoid;
an embedding lookup (``HeadSession.embed``) drops right after its gather, as a prompt's ids
spread over the table and would leave a process of 2x W after one request.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto

from service.heads.quantize import QuantSpec, dequantize

#: Quantized rows dequantized at a time (float temporaries ~4 x this x d_model x 4 bytes).
DEQUANTIZE_ROWS = 64


class RowSource(Protocol):
    """Float32 rows of an embedding table for a flat array of ids (already range-checked)."""

    def rows(self, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.float32]: ...

    def drop(self) -> None:
        """Hand back what reading rows keeps mapped (an idle service calls it)."""


class FileRows:
    """Rows of one (rows, width) tensor stored at ``offset`` in a file, mapped read-only for
    the life of this object (the file may be unlinked meanwhile)."""

    def __init__(self, path: Path, offset: int, shape: tuple[int, ...], dtype: np.dtype[Any]):
        self.shape = (shape[0], int(np.prod(shape[1:])))
        self.dtype = dtype
        row_bytes = self.shape[1] * dtype.itemsize
        with path.open("rb") as file:
            if os.fstat(file.fileno()).st_size < offset + self.shape[0] * row_bytes:
                raise ValueError(f"{path.name} is shorter than the tensor it should hold")
            self._map = mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ)
        self._table = np.ndarray(self.shape, dtype, buffer=self._map, offset=offset)
        self._table.flags.writeable = False
        self._gathered = 0  # rows read since the mapped pages were last dropped

    @classmethod
    def of(cls, tensor: TensorProto, directory: Path) -> FileRows:
        """The rows of an external-data tensor whose file lies in ``directory``."""
        info = {entry.key: entry.value for entry in tensor.external_data}
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
        shape = tuple(int(dim) for dim in tensor.dims)
        return cls(directory / info["location"], int(info.get("offset", 0)), shape, dtype)

    def read(self, ids: npt.NDArray[np.int64]) -> npt.NDArray[Any]:
        """The stored rows, in the stored dtype: one take from the mapping (see the module
        docstring for when its pages are dropped)."""
        found = np.take(self._table, ids, axis=0)
        self._gathered += len(ids)
        if self._gathered >= self.shape[0]:
            self.drop()
        return found

    def rows(self, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.float32]:
        return self.read(ids).astype(np.float32, copy=False)

    def drop(self) -> None:
        self._gathered = 0
        self._map.madvise(mmap.MADV_DONTNEED)


class QuantizedRows:
    """Embedding rows of a block-quantized table: codes, scales and zero points read per row
    (``FileRows``), dequantized with numpy exactly as ``GatherBlockQuantized`` would."""

    def __init__(self, parts: tuple[FileRows, ...], spec: QuantSpec, d_model: int) -> None:
        self._parts = parts
        self._spec = spec
        self._d_model = d_model

    def rows(self, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.float32]:
        """Dequantized ``DEQUANTIZE_ROWS`` at a time: the float temporaries stay small."""
        out = np.empty((len(ids), self._d_model), np.float32)
        for start in range(0, len(ids), DEQUANTIZE_ROWS):
            part = ids[start : start + DEQUANTIZE_ROWS]
            out[start : start + len(part)] = self._dequantized(part)
        return out

    def drop(self) -> None:
        for part in self._parts:
            part.drop()

    def _dequantized(self, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.float32]:
        codes, scales, *zero_points = (part.read(ids) for part in self._parts)
        if not zero_points:  # MatMulNBits' default: the middle code
            zero_points = [_middle_codes(len(ids), scales.shape[1], self._spec)]
        codes = codes.reshape(len(ids), scales.shape[1], -1)
        return dequantize(codes, scales, zero_points[0], self._spec, self._d_model)


def _middle_codes(count: int, blocks: int, spec: QuantSpec) -> npt.NDArray[np.uint8]:
    middle = 1 << (spec.bits - 1)
    if spec.bits == 8:
        return np.full((count, blocks), middle, np.uint8)
    return np.full((count, -(-blocks // 2)), middle | middle << 4, np.uint8)
