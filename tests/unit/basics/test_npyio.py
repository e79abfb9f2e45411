"""``service.npyio``: .npy/.npz bytes read as numpy writes them, from many threads at once."""

from __future__ import annotations

import io
import zipfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from service.npyio import (
    header_by_numpy,
    header_by_pattern,
    read_npy,
    read_npz,
    read_npz_body,
    write_npz,
)


def _npy(array: np.ndarray) -> bytes:
    stream = io.BytesIO()
    np.save(stream, array)
    return stream.getvalue()


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4)),
        np.zeros((0, 5), np.float16),
        np.array(7, np.int64),
        np.array([b"ab", b"c"]),
    ],
)
def test_arrays_read_back_equal(array: np.ndarray) -> None:
    read = read_npy(_npy(array))
    assert read.dtype == array.dtype
    np.testing.assert_array_equal(read, array)


def test_broken_and_object_files_are_refused() -> None:
    good = _npy(np.arange(10, dtype=np.float32))
    for broken, why in (
        (good[:20], "reading array header"),
        (good[:-4], "does not match"),
        (b"not an npy file at all", "magic string"),
    ):
        with pytest.raises(ValueError, match=why):
            read_npy(broken)
    stream = io.BytesIO()
    np.save(stream, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="object arrays"):
        read_npy(stream.getvalue())


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_every_npy_version_is_read(version: tuple[int, int]) -> None:
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    stream = io.BytesIO()
    np.lib.format.write_array(stream, array, version=version)
    np.testing.assert_array_equal(read_npy(stream.getvalue()), array)


def test_a_header_must_describe_the_data_exactly() -> None:
    rows = np.zeros((2, 4), np.float32)
    good = _npy(rows)
    with pytest.raises(ValueError, match="does not match"):
        read_npy(good + b"\0" * 4)  # a row more than the header says
    stream = io.BytesIO()
    header = {"descr": "<f4", "fortran_order": False, "shape": (-1, 4)}
    np.lib.format.write_array_header_1_0(stream, header)
    with pytest.raises(ValueError, match="negative dimension"):
        read_npy(stream.getvalue() + rows.tobytes())


def test_many_threads_parse_headers_at_once() -> None:
    """CPython 3.11's AST depth counter is per interpreter: an unlocked header parse failed
    with SystemError once in CI, under load (too rare to reproduce here on demand); under the
    lock, every one of these parallel reads must come back equal."""
    arrays = [np.random.default_rng(i).standard_normal((i % 7 + 1, 3)) for i in range(64)]
    npy = [_npy(a) for a in arrays]
    stream = io.BytesIO()
    np.savez(stream, token_ids=np.arange(6).reshape(2, 3), logits=np.ones((2, 3), np.float32))
    npz = stream.getvalue()

    def read(index: int) -> bool:
        archive = read_npz(npz)
        same = np.array_equal(read_npy(npy[index]), arrays[index])
        return same and archive["token_ids"].shape == (2, 3)

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(read, list(range(64)) * 20))


@pytest.mark.parametrize(
    "array",
    [
        np.arange(24, dtype=np.float32).reshape(2, 3, 4),
        np.asfortranarray(np.arange(12, dtype=np.float16).reshape(3, 4)),
        np.arange(5, dtype=">i4"),
        np.zeros((0,), np.uint8),
        np.array(1.5),
        np.array(["ab", "c"]),
        np.zeros(3, dtype=[("a", "<f4"), ("b", "<i2")]),
    ],
)
def test_the_fast_header_reads_what_numpy_reads(array: np.ndarray) -> None:
    """``np.save``'s own headers take the pattern (structured dtypes fall to numpy); both
    give the same shape, order, dtype and data offset."""
    data = _npy(array)
    fast = header_by_pattern(data)
    assert (fast is None) == (array.dtype.names is not None)
    if fast is not None:
        assert fast == header_by_numpy(data)
    np.testing.assert_array_equal(read_npy(data), array)


def test_headers_numpy_would_not_write_go_to_numpy() -> None:
    """Other spacing or key order is still read (by numpy); what numpy refuses (a type it does
    not know, a leading zero, ``(6)`` for a shape, a header past its 10000-byte limit) is
    still refused, as a ValueError (found by a probe: the pattern took the last three)."""
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    body = array.tobytes()
    for header, error in (
        ("{'shape': (2, 3), 'fortran_order': False, 'descr': '<f4'}", None),
        ("{'descr':'<f4','fortran_order':False,'shape':(2,3)}", None),
        ("{'descr': '<f9', 'fortran_order': False, 'shape': (2, 3), }", "descr"),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (2, -3), }", "negative"),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (02, 3), }", "Cannot parse"),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (6), }", "shape is not valid"),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }" + " " * 10000, "large"),
    ):
        padded = header.encode() + b" " * (63 - len(header)) + b"\n"
        data = b"\x93NUMPY\x01\x00" + len(padded).to_bytes(2, "little") + padded + body
        assert header_by_pattern(data) is None
        if error is None:
            np.testing.assert_array_equal(read_npy(data), array)
        else:
            with pytest.raises(ValueError, match=error):
                read_npy(data)


WRITTEN = [
    {"token_ids": np.arange(10, dtype=np.int64)[None], "logits": np.ones((1, 10), np.float32)},
    {"empty": np.zeros((0, 5), np.float32), "word": np.array("processed"), "seed": np.uint64(7)},
    {"fortran": np.asfortranarray(np.arange(12.0).reshape(3, 4)), "flags": np.array([True])},
    {"strided": np.arange(24, dtype=np.int16).reshape(2, 3, 4)[:, ::2], "half": np.ones(3, "<f2")},
    {"records": np.zeros(3, dtype=[("x", "<i8"), ("y", "<f4", (2,))])},  # np.savez writes it
]


@pytest.mark.parametrize("arrays", WRITTEN)
def test_written_npz_reads_back_as_savez_wrote_it(arrays: dict[str, np.ndarray]) -> None:
    """``write_npz`` is a valid zip that numpy, zipfile and the body reader read back equal
    (values, dtype, shape, names in order), as ``np.savez``'s archive reads."""
    data = write_npz({name: np.asarray(array) for name, array in arrays.items()})
    archive = zipfile.ZipFile(io.BytesIO(data))
    assert archive.testzip() is None
    assert [info.compress_type for info in archive.infolist()] == [zipfile.ZIP_STORED] * len(arrays)
    reference = io.BytesIO()
    fields: dict[str, Any] = dict(arrays)  # numpy's stubs match **arrays against allow_pickle
    np.savez(reference, **fields)
    for read in (read_npz(data), read_npz(reference.getvalue())):
        assert list(read) == list(arrays)
        for name, array in arrays.items():
            assert read[name].dtype == np.asarray(array).dtype
            np.testing.assert_array_equal(read[name], array)
    if "records" not in arrays:  # a request body's reader takes plain arrays only
        body = read_npz_body(data)
        for name, array in arrays.items():
            np.testing.assert_array_equal(body[name], array)


@pytest.mark.parametrize("arrays", WRITTEN)
def test_npz_read_without_zipfile_equals_np_load_and_is_writable(
    arrays: dict[str, np.ndarray],
) -> None:
    """``read_npz`` reads stored archives itself (``write_npz``'s and ``np.savez``'s) and
    gives what ``np.load`` gives: names, dtypes, shapes, values, writable arrays; a
    compressed archive is ``np.load``'s, read the same."""
    fields: dict[str, Any] = {name: np.asarray(array) for name, array in arrays.items()}
    saved, compressed = io.BytesIO(), io.BytesIO()
    np.savez(saved, **fields)
    np.savez_compressed(compressed, **fields)
    for data in (write_npz(fields), saved.getvalue(), compressed.getvalue()):
        read = read_npz(data)
        loaded = dict(np.load(io.BytesIO(data), allow_pickle=False))
        assert list(read) == list(loaded)
        for name, array in loaded.items():
            assert (read[name].dtype, read[name].shape) == (array.dtype, array.shape)
            np.testing.assert_array_equal(read[name], array)
            assert read[name].flags.writeable


def test_a_broken_npz_is_refused_as_np_load_refuses_it() -> None:
    """Truncated or garbled archives are ``np.load``'s to judge: the same error."""
    data = write_npz({"a": np.arange(6.0)})
    for broken in (data[:-5], data[:40] + b"\0" * 8 + data[48:], b"PK\x05\x06" + data[4:]):
        try:
            dict(np.load(io.BytesIO(broken), allow_pickle=False))
        except Exception as error:  # whichever numpy raises
            expected: type[Exception] = type(error)
        else:
            pytest.fail("np.load read a broken archive")
        with pytest.raises(expected):
            read_npz(broken)
