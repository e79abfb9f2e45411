"""``.npy`` and ``.npz`` bytes read safely from several threads (the service and its client).

numpy parses an ``.npy`` header with ``ast.literal_eval``. On CPython 3.11 the AST
constructor's recursion depth is kept per interpreter, not per thread, so two threads parsing
at once can fail with ``SystemError: AST constructor recursion depth mismatch`` (python/cpython
issue 106905; it failed a client thread's valid answer in lmhead's tests, and the service
parses large bodies in worker threads beside small ones on the event loop). Headers are
parsed under one lock; the data, the bulk of the bytes, is not copied or locked.
"""

from __future__ import annotations

import io
import math
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

_HEADERS = threading.Lock()


def read_npy(data: bytes) -> npt.NDArray[Any]:
    """The array of one ``.npy`` file, a read-only view of ``data`` (ValueError if broken).

    The header must describe the data exactly: no negative dimension (numpy's parser takes
    ``(-1, 512)``, and ``frombuffer`` would then read whatever is there) and no byte missing
    or left over."""
    stream = io.BytesIO(data)
    with _HEADERS:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
        elif version in ((2, 0), (3, 0)):  # 3.0 only adds utf-8 field names (refused below)
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
        else:
            raise ValueError(f"unknown .npy version {version}")
    if dtype.hasobject:
        raise ValueError("object arrays are not read (they would need pickle)")
    if any(size < 0 for size in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    count = math.prod(shape)
    if len(data) - stream.tell() != count * dtype.itemsize:
        raise ValueError(f"the header's shape {shape} does not match the data's size")
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=stream.tell())
    return flat.reshape(shape, order="F" if fortran else "C")


def read_npz(data: bytes) -> dict[str, npt.NDArray[Any]]:
    """Every array of an ``.npz`` archive (small answers: read whole under the lock)."""
    with _HEADERS:
        return dict(np.load(io.BytesIO(data), allow_pickle=False))
