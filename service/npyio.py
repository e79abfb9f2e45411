"""``.npy`` and ``.npz`` bytes read safely from several threads (the service and its client), and
``.npz`` answers written without ``zipfile`` (``write_npz``).

numpy parses an ``.npy`` header with ``ast.literal_eval``. On CPython 3.11 the AST
constructor's recursion depth is kept per interpreter, not per thread, so two threads parsing
at once can fail with ``SystemError: AST constructor recursion depth mismatch`` (python/cpython
issue 106905; it failed a client thread's valid answer in lmhead's tests, and the service
parses large bodies in worker threads beside small ones on the event loop). Headers are
parsed under one lock; the data, the bulk of the bytes, is not copied or locked.

The header numpy itself writes (``np.save``, and so every client) is read by a strict pattern
instead, with no lock: 2 us where ``literal_eval`` took 30 (a fifth of a front's CPU on a
64-row ``.npy`` request, profiled). Anything else goes to numpy's parser as before.
"""

from __future__ import annotations

import io
import math
import re
import struct
import threading
import zipfile
import zlib
from typing import Any

import numpy as np
import numpy.typing as npt

_HEADERS = threading.Lock()


class NpyError(ValueError):
    """A ``.npy`` body this module refuses, with a reason a client may read (ints only)."""


def read_npy(data: bytes | memoryview) -> npt.NDArray[Any]:
    """The array of one ``.npy`` file, a read-only view of ``data`` (ValueError if broken).

    The header must describe the data exactly: no negative dimension (numpy's parser takes
    ``(-1, 512)``, and ``frombuffer`` would then read whatever is there) and no byte missing
    or left over."""
    header = header_by_pattern(data)
    if header is None:
        shape, fortran, dtype, start = header_by_numpy(data)
    else:
        shape, fortran, dtype, start = header
    if dtype.hasobject:
        raise NpyError("object arrays are not read (they would need pickle)")
    if any(size < 0 for size in shape):
        raise NpyError(f"negative dimension in shape {shape}"[:120])
    count = math.prod(shape)
    if len(data) - start != count * dtype.itemsize:
        raise NpyError(f"the header's shape {shape}"[:100] + " does not match the data's size")
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=start)
    return flat.reshape(shape, order="F" if fortran else "C")


Header = tuple[tuple[int, ...], bool, np.dtype[Any], int]  # shape, Fortran order, dtype, data


def header_by_pattern(data: bytes | memoryview) -> Header | None:
    """The header as ``np.save`` writes it (version 1.0, one simple dtype), or None."""
    if data[:8] != b"\x93NUMPY\x01\x00" or len(data) < 10:
        return None
    length = int.from_bytes(data[8:10], "little")
    if length > MAX_HEADER_BYTES:  # numpy refuses it (its guard against huge literals)
        return None
    start = 10 + length
    match = _PLAIN.fullmatch(data, 10, start)
    if match is None:
        return None
    descr, fortran, dims = match.groups()
    try:
        dtype = np.dtype(descr.decode())
    except TypeError:  # not a type numpy knows: its own parser says so
        return None
    shape = tuple(int(dim) for dim in dims.split(b",") if dim.strip())
    return shape, fortran == b"True", dtype, start


def header_by_numpy(data: bytes | memoryview) -> Header:
    """The header as numpy's own parser reads it (``ValueError`` for what it refuses)."""
    stream = io.BytesIO(data)
    with _HEADERS:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
        elif version in ((2, 0), (3, 0)):  # 3.0 only adds utf-8 field names (refused below)
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
        else:
            raise ValueError(f"unknown .npy version {version}")
    return shape, fortran, dtype, stream.tell()


#: numpy's own limit on a header (``max_header_size``): longer ones go to it, to be refused.
MAX_HEADER_BYTES = 10000
_DIM = rb"(?:0|[1-9][0-9]{0,17})"  # a Python int literal: no leading zero
#: ``{'descr': '<f4', 'fortran_order': False, 'shape': (64, 512), }``, space-padded to a
#: newline: what numpy writes for a plain dtype (a structured one is a list: not matched).
#: The shape is a tuple as Python writes one: ``()``, ``(3,)``, ``(2, 3)`` (``(3)`` is an int).
_PLAIN = re.compile(
    rb"\{'descr': '([<>|=]?[a-zA-Z][0-9]{0,3})', 'fortran_order': (True|False), "
    rb"'shape': \((|" + _DIM + rb",|" + _DIM + rb"(?:, " + _DIM + rb")+)\), \} *\n"
)


#: Arrays a request's ``.npz`` body may hold (the hidden states and the array options).
MAX_NPZ_ENTRIES = 32


def read_npz_body(data: bytes) -> dict[str, npt.NDArray[Any]]:
    """Every array of a request's ``.npz`` body, by name, read as ``read_npy`` reads one
    (``np.savez`` writes them stored: each is a view of the body, nothing is inflated). A
    compressed entry is refused: its inflated size is the sender's to choose (a zip bomb),
    where a stored one is bounded by the body's own bytes."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        entries = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as error:
        raise NpyError("not a .npz (zip) archive") from error
    if len(entries) > MAX_NPZ_ENTRIES:
        raise NpyError(f"{len(entries)} arrays; at most {MAX_NPZ_ENTRIES}")
    arrays: dict[str, npt.NDArray[Any]] = {}
    view = memoryview(data)
    for entry in entries:
        name = entry.filename.removesuffix(".npy")
        if entry.compress_type != zipfile.ZIP_STORED:
            raise NpyError(f"array {name[:64]!r} is compressed; send it stored (np.savez)")
        if name in arrays or not name.isidentifier():
            raise NpyError(f"array name {name[:64]!r} is given twice or is not a plain name")
        start = _member_start(view, entry)
        arrays[name] = read_npy(view[start : start + entry.file_size])  # a view, no copy
    return arrays


def _member_start(view: memoryview, entry: zipfile.ZipInfo) -> int:
    """Where a stored member's bytes start: past its local header (30 bytes, its name and
    extra field, whose lengths the local header holds, not the central directory)."""
    offset = entry.header_offset
    local = bytes(view[offset : offset + 30])
    if len(local) < 30 or local[:4] != b"PK\x03\x04":
        raise NpyError("broken .npz archive (a member's local header)")
    name_length = int.from_bytes(local[26:28], "little")
    extra_length = int.from_bytes(local[28:30], "little")
    start = offset + 30 + name_length + extra_length
    if start + entry.file_size > len(view):
        raise NpyError("broken .npz archive (a member past the end)")
    return start


def read_npz(data: bytes) -> dict[str, npt.NDArray[Any]]:
    """Every array of an ``.npz`` archive, writable, as ``np.load`` gives them: an archive of
    stored ``.npy`` members (``write_npz``'s, ``np.savez``'s) is read from its central
    directory (``np.load`` took ~110 us of a one-row top-k answer's client time); any other,
    or anything odd in it, is ``np.load``'s (read whole under the lock)."""
    arrays = _stored_arrays(data)
    if arrays is not None:
        return arrays
    with _HEADERS:
        return dict(np.load(io.BytesIO(data), allow_pickle=False))


def _stored_arrays(data: bytes) -> dict[str, npt.NDArray[Any]] | None:
    """The members of a zip without a comment or zip64 records, all stored ``.npy`` files,
    each copied out of ``data``; None for any other archive."""
    end = len(data) - 22
    if end < 0 or data[end : end + 4] != b"PK\x05\x06":
        return None
    count, _, offset = struct.unpack_from("<HII", data, end + 10)
    arrays: dict[str, npt.NDArray[Any]] = {}
    for _ in range(count):
        if data[offset : offset + 4] != b"PK\x01\x02" or offset + 46 > end:
            return None
        method, stored, size = struct.unpack_from("<H8xII", data, offset + 10)
        name_length, extra, comment = struct.unpack_from("<HHH", data, offset + 28)
        (local,) = struct.unpack_from("<I", data, offset + 42)
        name = data[offset + 46 : offset + 46 + name_length]
        if method != zipfile.ZIP_STORED or stored != size or not name.endswith(b".npy"):
            return None
        if data[local : local + 4] != b"PK\x03\x04" or local + 30 > end:
            return None
        start = local + 30 + sum(struct.unpack_from("<HH", data, local + 26))
        try:
            array = read_npy(data[start : start + size]).copy()
        except Exception:  # np.load says what is wrong with it
            return None
        arrays[name[:-4].decode("utf-8", "replace")] = array
        offset += 46 + name_length + extra + comment
    return arrays


#: A zip member's date and time as DOS writes them: 1980-01-01 00:00 (the answer's own time
#: says nothing; ``np.savez`` writes the clock's).
_DOS_DATE = (1 << 5) | 1
#: Sizes past this need zip64 records: such archives go to ``np.savez``.
_ZIP32_BYTES = (1 << 32) - 1


def write_npz(arrays: dict[str, npt.NDArray[Any]]) -> bytes:
    """The ``.npz`` archive ``np.savez(**arrays)`` would write (members stored, each an
    ``.npy`` of version 1.0, C order), built in one join: ``np.savez`` goes through
    ``zipfile`` and took ~190 us (profiled) for a one-row top-k answer of three arrays.
    Arrays of structured or object dtypes, and archives past 4 GiB, go to ``np.savez``."""
    if any(array.dtype.fields is not None or array.dtype.hasobject for array in arrays.values()):
        return _savez(arrays)
    parts: list[Any] = []
    directory: list[bytes] = []
    offset = 0
    for name, array in arrays.items():
        data = np.require(array, requirements="C")
        header = _npy_header(data)
        member = (name + ".npy").encode()
        size = len(header) + data.nbytes
        if offset + size > _ZIP32_BYTES:
            return _savez(arrays)
        body = data.reshape(-1).view(np.uint8).data if data.nbytes else b""
        crc = zlib.crc32(body, zlib.crc32(header))
        fields = struct.pack("<HHHHHIII", 20, 0, 0, 0, _DOS_DATE, crc, size, size)
        parts += [b"PK\x03\x04", fields, struct.pack("<HH", len(member), 0), member, header]
        parts.append(body)
        central = struct.pack("<HHHHH", len(member), 0, 0, 0, 0) + struct.pack("<II", 0, offset)
        directory.append(b"PK\x01\x02" + struct.pack("<H", 20) + fields + central + member)
        offset += 30 + len(member) + size
    listing = b"".join(directory)
    count = len(directory)
    end = struct.pack("<4s4H2IH", b"PK\x05\x06", 0, 0, count, count, len(listing), offset, 0)
    return b"".join([*parts, listing, end])


def _npy_header(array: npt.NDArray[Any]) -> bytes:
    """Version 1.0's magic and header for a C-order array, padded as numpy pads it (the data
    starts at a multiple of 64 bytes)."""
    descr = np.lib.format.dtype_to_descr(array.dtype)
    text = f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': {array.shape!r}, }}"
    padding = 64 - (10 + len(text) + 1) % 64
    encoded = (text + " " * (padding % 64) + "\n").encode("latin-1")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(encoded)) + encoded


def _savez(arrays: dict[str, npt.NDArray[Any]]) -> bytes:
    stream = io.BytesIO()
    # Numeric arrays are never pickled: no allow_pickle=False, which numpy < 2.2 stored as an
    # array of that name (and Any: numpy >= 2.2's stubs match **arrays against allow_pickle).
    fields: dict[str, Any] = dict(arrays)
    np.savez(stream, **fields)
    return stream.getvalue()
