"""Exported graphs: a tied file stores one matrix that feeds both sides; untied stores two."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnx
import pytest

from service.heads import DATA_FILE, MODEL_FILE
from service.heads.files import (
    EXTERNAL_ALIGNMENT,
    NUMPY_DTYPES,
    HeadWeights,
    build_head,
    read_head,
    save_head,
)
from service.heads.graph import (
    ELEMENT_TYPES,
    EMBEDDING_WEIGHT,
    IR_VERSION,
    OPSET,
    OUTPUT_WEIGHT,
    HeadTransforms,
)
from service.heads.inspector import inspect_head
from tests.conftest import D_MODEL, VOCAB, initializers


def _consumers(model: onnx.ModelProto, name: str) -> list[str]:
    return sorted(node.op_type for node in model.graph.node if name in node.input)


def test_tied_file_has_one_matrix_feeding_gather_and_projection(tied_path: Path) -> None:
    onnx.checker.check_model(str(tied_path), full_check=True)
    model = onnx.load(str(tied_path))
    weights = initializers(tied_path)
    assert [array.shape for array in weights.values()] == [(VOCAB, D_MODEL)]
    (name,) = weights
    assert _consumers(model, name) == ["Gather", "Gemm"]
    gemm = next(node for node in model.graph.node if node.op_type == "Gemm")
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in gemm.attribute}
    assert attributes.get("transB") == 1  # W read as stored: no Transpose(W) to fold
    assert not any(node.op_type == "Transpose" for node in model.graph.node)
    assert {prop.key: prop.value for prop in model.metadata_props}["lmhead.tied"] == "true"


def test_untied_file_has_two_matrices_one_per_side(untied_path: Path) -> None:
    onnx.checker.check_model(str(untied_path), full_check=True)
    model = onnx.load(str(untied_path))
    weights = initializers(untied_path)
    assert [array.shape for array in weights.values()] == [(VOCAB, D_MODEL)] * 2
    embedding, output = weights
    assert _consumers(model, embedding) == ["Gather"]
    assert _consumers(model, output) == ["Gemm"]


def test_tied_file_is_about_half_the_untied_file(tied_path: Path, untied_path: Path) -> None:
    ratio = tied_path.stat().st_size / untied_path.stat().st_size
    assert 0.49 < ratio < 0.51


def test_saved_weights_are_the_given_arrays(
    tied_path: Path,
    untied_path: Path,
    table: npt.NDArray[np.float32],
    output_weight: npt.NDArray[np.float32],
) -> None:
    (tied,) = initializers(tied_path).values()
    np.testing.assert_array_equal(tied, table)
    embedding, output = initializers(untied_path).values()
    np.testing.assert_array_equal(embedding, table)
    np.testing.assert_array_equal(output, output_weight)


@pytest.mark.parametrize("tied", [True, False])
def test_external_data_holds_each_matrix_once_at_aligned_offsets(
    tmp_path: Path, table: npt.NDArray[np.float32], tied: bool
) -> None:
    weights = HeadWeights.from_arrays(table, None if tied else table[::-1])
    path = save_head(weights, tmp_path, external_data=True)
    assert path == tmp_path / MODEL_FILE
    onnx.checker.check_model(str(path), full_check=True)
    data_bytes = (tmp_path / DATA_FILE).stat().st_size
    matrices = 1 if tied else 2
    assert matrices * table.nbytes <= data_bytes < matrices * table.nbytes + EXTERNAL_ALIGNMENT
    assert path.stat().st_size < 4096  # the graph only
    model = onnx.load(str(path), load_external_data=False)
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            offset = int({e.key: e.value for e in tensor.external_data}["offset"])
            assert offset % EXTERNAL_ALIGNMENT == 0
    read_back = list(initializers(path).values())
    np.testing.assert_array_equal(read_back[0], table)
    assert len(read_back) == matrices


def test_external_data_is_chosen_automatically_above_the_protobuf_limit(
    tmp_path: Path, table: npt.NDArray[np.float32]
) -> None:
    weights = HeadWeights.from_arrays(table)
    save_head(weights, tmp_path / "small")
    assert not (tmp_path / "small" / DATA_FILE).exists()
    save_head(weights, tmp_path / "big", inline_limit_bytes=table.nbytes - 1)
    assert (tmp_path / "big" / DATA_FILE).stat().st_size == table.nbytes


def test_resaving_inline_removes_a_stale_data_file(
    tmp_path: Path, table: npt.NDArray[np.float32]
) -> None:
    save_head(HeadWeights.from_arrays(table), tmp_path, external_data=True)
    save_head(HeadWeights.from_arrays(table), tmp_path, external_data=False)
    assert not (tmp_path / DATA_FILE).exists()


def test_weights_are_converted_exactly_to_float32() -> None:
    half = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float16)
    weights = HeadWeights.from_arrays(half)
    assert weights.embedding.dtype == np.float32
    np.testing.assert_array_equal(weights.embedding.astype(np.float16), half)
    model = build_head(weights)
    assert onnx.numpy_helper.to_array(model.graph.initializer[0]).dtype == np.float32


def test_bad_weights_are_refused_with_the_shapes() -> None:
    with pytest.raises(ValueError, match=r"does not match embedding shape \(8, 4\)"):
        HeadWeights.from_arrays(np.ones((8, 4)), np.ones((8, 5)))
    with pytest.raises(ValueError, match=r"2-D .* got shape \(8,\)"):
        HeadWeights.from_arrays(np.ones(8))
    with pytest.raises(ValueError, match="floating dtype, got int64"):
        HeadWeights.from_arrays(np.ones((8, 4), np.int64))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("external", [False, True])
def test_a_half_precision_tied_head_keeps_one_initializer(
    tmp_path: Path, table: npt.NDArray[np.float32], dtype: str, external: bool
) -> None:
    """W stored in half precision, still ONE tensor for both sides (through Casts), half the
    bytes, and the file says so; inputs and outputs stay float32."""
    path = save_head(HeadWeights.from_arrays(table, dtype=dtype), tmp_path, external_data=external)
    onnx.checker.check_model(str(path), full_check=True)
    model = onnx.load(str(path), load_external_data=False)
    matrices = [t for t in model.graph.initializer if len(t.dims) == 2]
    assert [t.data_type for t in matrices] == [ELEMENT_TYPES[dtype]]
    (name,) = (t.name for t in matrices)
    assert _consumers(model, name) == ["Gather", "Gemm"]
    report = inspect_head(path)
    assert (report.tied, report.dtype) == (True, dtype)
    assert report.weight_bytes == table.size * 2
    assert {p.key: p.value for p in model.metadata_props}["lmhead.dtype"] == dtype
    assert (model.ir_version, model.opset_import[0].version) == (IR_VERSION, OPSET)
    assert {v.type.tensor_type.elem_type for v in model.graph.output} <= {
        onnx.TensorProto.FLOAT,
        onnx.TensorProto.INT64,
    }
    read = read_head(path)
    np.testing.assert_array_equal(
        read.embedding.astype(np.float32), table.astype(NUMPY_DTYPES[dtype]).astype(np.float32)
    )


def test_widening_writes_float32_from_half_weights(
    tmp_path: Path, table: npt.NDArray[np.float32]
) -> None:
    half = HeadWeights.from_arrays(table, table[::-1], dtype="bfloat16")
    path = save_head(half, tmp_path / "half")
    widened = save_head(read_head(path), tmp_path / "wide", widen=True)
    report = inspect_head(widened)
    assert (report.dtype, report.tied) == ("float32", False)
    stored = initializers(widened)
    np.testing.assert_array_equal(stored[EMBEDDING_WEIGHT], half.embedding.astype(np.float32))
    assert half.output is not None
    np.testing.assert_array_equal(stored[OUTPUT_WEIGHT], half.output.astype(np.float32))


def test_reading_a_head_takes_no_bytes_from_outside_its_directory(
    tmp_path: Path, table: npt.NDArray[np.float32]
) -> None:
    """``trim`` and ``quantize`` read heads back: external data pointing elsewhere on the
    machine (a path, or a link out of the repository) is refused, never made into weights;
    a link that stays inside the repository (a hub cache's blobs) is read."""
    repository = tmp_path / "models"
    path = save_head(HeadWeights.from_arrays(table), repository / "m" / "1", external_data=True)
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"s" * table.nbytes)
    (path.parent / "out.bin").symlink_to(secret)
    (repository / "blobs").mkdir()
    (path.parent / DATA_FILE).rename(repository / "blobs" / "data")
    (path.parent / "in.bin").symlink_to(repository / "blobs" / "data")
    model = onnx.load(str(path), load_external_data=False)
    (entry,) = [e for e in model.graph.initializer[0].external_data if e.key == "location"]
    for location, refusal in [
        (str(secret), "must be a file beside the model"),
        ("../../../secret.bin", "must be a file beside the model"),
        ("out.bin", "is not a regular file inside the repository"),
    ]:
        entry.value = location
        onnx.save_model(model, path)
        with pytest.raises(ValueError, match=refusal):
            read_head(path, root=repository)
    entry.value = "in.bin"
    onnx.save_model(model, path)
    np.testing.assert_array_equal(read_head(path, root=repository).embedding, table)


@pytest.mark.parametrize(
    "transform",
    [
        {"logit_scale": float("nan")},
        {"logit_scale": 1e39},  # finite in float64, Inf as the graph stores it
        {"input_scale": 0.0},
        {"softcap": 0.0},
        {"softcap": -30.0},
    ],
)
def test_head_transforms_must_be_finite_non_zero_float32(transform: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be a finite"):
        HeadTransforms(**transform)
