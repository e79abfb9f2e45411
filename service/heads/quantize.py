"""Block quantization of a head's matrices, in onnxruntime's ``MatMulNBits`` layout (numpy only).

Each row of a (vocab, d_model) matrix is cut into blocks of ``block_size`` values along
d_model; a block keeps one float32 scale and one zero point (asymmetric: min and max of the
block, zero always representable) and ``bits``-bit codes:

* ``data`` uint8 (vocab, blocks, block_size * bits / 8): two 4-bit codes per byte, low
  nibble first;
* ``scales`` float32 (vocab, blocks);
* ``zero_points`` uint8 (vocab, blocks) for 8 bits, (vocab, ceil(blocks / 2)) packed for 4.

``MatMulNBits`` reads exactly these three tensors for the projection and
``GatherBlockQuantized`` the same ones (``data`` through a ``Reshape`` to 2-D) for the
embedding, so a tied head stores them once. A value is ``(code - zero_point) * scale``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

#: Rows quantized at a time: temporaries stay ~ROWS x d_model x 20 bytes, whatever the vocab.
QUANTIZE_ROWS = 4096
BITS = (4, 8)
#: Defaults chosen by bench/heads.py at 50257 x 768 (README "Quantized heads").
DEFAULT_BLOCK_SIZE = {8: 128, 4: 128}
#: ``MatMulNBits`` accuracy level 4: int8 activations and integer dot products. Level 0/1
#: dequantizes the weights on every call: measured 30-70x slower for 8 bits.
ACCURACY_LEVEL = 4


@dataclass(frozen=True)
class QuantSpec:
    """How to quantize: ``bits`` (4 or 8) per value, one scale per ``block_size`` values."""

    bits: int
    block_size: int

    @classmethod
    def parse(cls, name: str, block_size: int | None = None) -> QuantSpec:
        """``int8`` or ``int4`` (as on the command line), with the default block size."""
        bits = {"int8": 8, "int4": 4}.get(name)
        if bits is None:
            raise ValueError(f"quantization must be int8 or int4, got {name!r}")
        return cls(bits, block_size or DEFAULT_BLOCK_SIZE[bits])

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {self.bits}")
        size = self.block_size
        if size < 16 or size > 256 or size & (size - 1):
            raise ValueError(f"block size must be a power of two in [16, 256], got {size}")

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    def describe(self) -> str:
        return f"{self.name}, blocks of {self.block_size}"

    def blocks(self, d_model: int) -> int:
        return -(-d_model // self.block_size)

    def zero_point_columns(self, d_model: int) -> int:
        return -(-self.blocks(d_model) * self.bits // 8)

    def stored_bytes(self, vocab_size: int, d_model: int) -> int:
        """Bytes of data, scales and zero points for one (vocab_size, d_model) matrix."""
        blocks = self.blocks(d_model)
        data = blocks * self.block_size * self.bits // 8
        return vocab_size * (data + 4 * blocks + self.zero_point_columns(d_model))


@dataclass(frozen=True)
class QuantizedMatrix:
    """A (vocab, d_model) matrix as block-quantized tensors (the module docstring's layout)."""

    data: npt.NDArray[np.uint8]
    scales: npt.NDArray[np.float32]
    zero_points: npt.NDArray[np.uint8]
    spec: QuantSpec
    d_model: int

    @property
    def vocab_size(self) -> int:
        return int(self.data.shape[0])

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scales.nbytes + self.zero_points.nbytes

    def dequantize(self, rows: npt.NDArray[np.int64] | slice = slice(None)) -> Any:
        """float32 values of some rows (all by default)."""
        return dequantize(
            self.data[rows], self.scales[rows], self.zero_points[rows], self.spec, self.d_model
        )


def quantize(matrix: npt.NDArray[Any], spec: QuantSpec) -> QuantizedMatrix:
    """Quantize a (vocab, d_model) matrix of any float dtype, ``QUANTIZE_ROWS`` rows at a time."""
    vocab_size, d_model = matrix.shape
    blocks = spec.blocks(d_model)
    data = np.empty((vocab_size, blocks, spec.block_size * spec.bits // 8), np.uint8)
    scales = np.empty((vocab_size, blocks), np.float32)
    zero_points = np.empty((vocab_size, spec.zero_point_columns(d_model)), np.uint8)
    for start in range(0, vocab_size, QUANTIZE_ROWS):
        part = slice(start, start + QUANTIZE_ROWS)
        data[part], scales[part], zero_points[part] = _quantize_rows(matrix[part], spec)
    return QuantizedMatrix(data, scales, zero_points, spec, d_model)


def _quantize_rows(rows: npt.NDArray[Any], spec: QuantSpec) -> tuple[npt.NDArray[Any], ...]:
    count, d_model = rows.shape
    blocks = spec.blocks(d_model)
    padded = np.zeros((count, blocks * spec.block_size), np.float32)
    padded[:, :d_model] = rows
    values = padded.reshape(count, blocks, spec.block_size)
    low = np.minimum(values.min(axis=2), 0.0)
    high = np.maximum(values.max(axis=2), 0.0)
    top = (1 << spec.bits) - 1
    # The range in float64: a block spanning -1.8e38..1.8e38 (finite float32) overflowed to an
    # inf scale, and the head decoded NaN and failed to load; once divided by ``top`` it fits.
    scales = ((high.astype(np.float64) - low) / top).astype(np.float32)
    scales[scales == 0] = 1.0  # an all-zero block: any scale decodes it exactly
    zero = np.clip(np.rint(-low / scales), 0, top)
    codes = np.clip(np.rint(values / scales[..., None]) + zero[..., None], 0, top)
    return _pack(codes.astype(np.uint8), spec.bits), scales, _pack(zero.astype(np.uint8), spec.bits)


def _pack(codes: npt.NDArray[np.uint8], bits: int) -> npt.NDArray[np.uint8]:
    """Two 4-bit codes per byte along the last axis (low nibble first); 8-bit as is."""
    if bits == 8:
        return codes
    if codes.shape[-1] % 2:
        codes = np.concatenate([codes, np.zeros((*codes.shape[:-1], 1), np.uint8)], axis=-1)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def _unpack(packed: npt.NDArray[np.uint8], bits: int, count: int) -> npt.NDArray[np.uint8]:
    if bits == 8:
        return packed[..., :count]
    codes = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), np.uint8)
    codes[..., 0::2] = packed & 0x0F
    codes[..., 1::2] = packed >> 4
    return codes[..., :count]


def dequantize(
    data: npt.NDArray[np.uint8],
    scales: npt.NDArray[np.float32],
    zero_points: npt.NDArray[np.uint8],
    spec: QuantSpec,
    d_model: int,
) -> npt.NDArray[np.float32]:
    """float32 rows from their stored codes, scales and zero points (bit-exact with
    ``GatherBlockQuantized``)."""
    count, blocks = scales.shape
    codes = _unpack(data, spec.bits, spec.block_size).astype(np.float32)
    zero = _unpack(zero_points, spec.bits, blocks).astype(np.float32)
    values = (codes - zero[..., None]) * scales[..., None]
    return np.ascontiguousarray(values.reshape(count, blocks * spec.block_size)[:, :d_model])
