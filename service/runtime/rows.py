"""Embedding rows read from a weight file with ``pread``, for heads whose session holds the
projection alone (``service.runtime.layout``): float rows as stored, or quantized rows dequantized.

Why not a memory map: the kernel maps a file's page cache in large folios (2-4 MB per fault
measured here, whatever ``madvise`` says), so a thousand random ids mapped ~140 MB of a 154 MB
table into the process: resident memory would climb back to 2x W. ``pread`` copies just the
rows asked for; the page cache stays the kernel's (clean, shared, reclaimable), outside the
process's resident set.
"""

from __future__ import annotations

import os
import weakref
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


class FileRows:
    """Rows of one (rows, width) tensor stored at ``offset`` in a file.

    The file stays open (not mapped) for the life of this object; it may be unlinked.
    """

    def __init__(self, path: Path, offset: int, shape: tuple[int, ...], dtype: np.dtype[Any]):
        self.shape = (shape[0], int(np.prod(shape[1:])))
        self.dtype = dtype
        self._offset = offset
        self._row_bytes = self.shape[1] * dtype.itemsize
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        weakref.finalize(self, os.close, self._fd)
        if os.fstat(self._fd).st_size < offset + self.shape[0] * self._row_bytes:
            raise ValueError(f"{path.name} is shorter than the tensor it should hold")

    @classmethod
    def of(cls, tensor: TensorProto, directory: Path) -> FileRows:
        """The rows of an external-data tensor whose file lies in ``directory``."""
        info = {entry.key: entry.value for entry in tensor.external_data}
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
        shape = tuple(int(dim) for dim in tensor.dims)
        return cls(directory / info["location"], int(info.get("offset", 0)), shape, dtype)

    def read(self, ids: npt.NDArray[np.int64]) -> npt.NDArray[Any]:
        """The stored rows, in the stored dtype, one ``preadv`` straight into each row."""
        out = np.empty((len(ids), self.shape[1]), self.dtype)
        view = out.view(np.uint8)
        for index, row in enumerate(ids.tolist()):
            done = os.preadv(self._fd, [view[index]], self._offset + row * self._row_bytes)
            if done != self._row_bytes:
                raise OSError(f"short read of row {row}: {done} of {self._row_bytes} bytes")
        return out

    def rows(self, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.float32]:
        return self.read(ids).astype(np.float32, copy=False)


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
