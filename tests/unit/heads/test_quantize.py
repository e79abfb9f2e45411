"""Block-quantized heads: the numpy quantizer, the file (one shared tensor set when tied), the
runtime's answers against the numpy reference on the dequantized weights, the inspector."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnx
import pytest
from onnx import numpy_helper

from bench.heads import peaked_states
from service.heads.files import HeadWeights, read_head, save_head
from service.heads.graph import IR_VERSION, OPSET, QUANTIZATION, HeadTransforms, quantized_names
from service.heads.inspector import HeadReport, inspect_head
from service.heads.quantize import QuantSpec, dequantize, quantize
from service.plane.comparison import agreement
from service.runtime.layout import Placement, open_head, required_runtime
from service.runtime.rows import QuantizedRows
from service.tools.retie import retie
from tests.conftest import skip_unless_runnable

VOCAB, D_MODEL = 700, 96  # 96 = 3 blocks of 32: odd block counts pack 4-bit zero points
SPECS = [QuantSpec(8, 32), QuantSpec(4, 32), QuantSpec(4, 64), QuantSpec(8, 128)]


@pytest.fixture(scope="module")
def table() -> npt.NDArray[np.float32]:
    return np.random.default_rng(11).standard_normal((VOCAB, D_MODEL), dtype=np.float32)


@pytest.fixture(scope="module")
def other() -> npt.NDArray[np.float32]:
    return np.random.default_rng(12).standard_normal((VOCAB, D_MODEL), dtype=np.float32)


def _hidden(rows: int = 6, seed: int = 13) -> npt.NDArray[np.float32]:
    return np.random.default_rng(seed).standard_normal((rows, D_MODEL), dtype=np.float32)


def test_specs_are_checked_and_named() -> None:
    assert QuantSpec.parse("int8") == QuantSpec(8, 128)
    assert QuantSpec.parse("int4") == QuantSpec(4, 128)
    assert QuantSpec.parse("int4", 32).describe() == "int4, blocks of 32"
    bad: list[Callable[[], QuantSpec]] = [
        lambda: QuantSpec.parse("int3"),
        lambda: QuantSpec(4, 48),
        lambda: QuantSpec(8, 8),
    ]
    for make in bad:
        with pytest.raises(ValueError, match="int8 or int4|power of two"):
            make()


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_each_value_is_within_half_a_step_and_bytes_are_as_declared(
    table: npt.NDArray[np.float32], spec: QuantSpec
) -> None:
    packed = quantize(table, spec)
    restored = packed.dequantize()
    assert restored.shape == table.shape
    steps = np.repeat(packed.scales, spec.block_size, axis=1)[:, :D_MODEL]
    assert np.all(np.abs(restored - table) <= steps / 2 * (1 + 1e-5) + 1e-7)
    assert packed.nbytes == spec.stored_bytes(VOCAB, D_MODEL)
    # Zero stays exactly zero, and an all-zero block decodes exactly.
    zeros = np.zeros((2, D_MODEL), np.float32)
    zeros[1, :5] = [0.5, -1.0, 0.0, 2.0, 0.0]
    again = quantize(zeros, spec).dequantize()
    np.testing.assert_array_equal(again[0], 0.0)
    assert again[1, 2] == 0.0
    assert again[1, 4] == 0.0
    extreme = zeros.copy()  # finite float32 whose range is not: a scale that overflowed
    extreme[1, :2] = [1.8e38, -1.8e38]
    wide = quantize(extreme, spec)
    assert np.isfinite(wide.scales).all()
    error = np.abs(wide.dequantize()[1, :2].astype(np.float64) - [1.8e38, -1.8e38])
    assert (error <= wide.scales[1, 0] / 2 * (1 + 1e-5)).all()  # within half a step, as any


@pytest.mark.parametrize("spec", [QuantSpec(8, 32), QuantSpec(4, 32)], ids=str)
@pytest.mark.parametrize("external", [False, True])
def test_a_tied_quantized_file_stores_one_tensor_set_read_by_both_sides(
    tmp_path: Path, table: npt.NDArray[np.float32], spec: QuantSpec, external: bool
) -> None:
    path = save_head(
        HeadWeights.from_arrays(table), tmp_path, quantization=spec, external_data=external
    )
    model = onnx.load(str(path))
    assert model.ir_version == IR_VERSION
    assert [o.version for o in model.opset_import if o.domain == ""] == [OPSET]
    names = {tensor.name for tensor in model.graph.initializer}
    codes, scales, zero_points = quantized_names("embedding.weight")
    assert {codes, scales, zero_points} <= names
    assert not any(name.startswith("lm_head") for name in names)
    nodes = {node.op_type: node for node in model.graph.node}
    assert list(nodes["MatMulNBits"].input[1:]) == [codes, scales, zero_points]
    reshape = nodes["Reshape"]
    assert reshape.input[0] == codes
    assert nodes["GatherBlockQuantized"].input[0] == reshape.output[0]
    assert list(nodes["GatherBlockQuantized"].input[2:]) == [scales, zero_points]
    # The stored bytes are the quantizer's, exactly.
    stored = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    expected = quantize(table, spec)
    np.testing.assert_array_equal(stored[codes], expected.data)
    np.testing.assert_array_equal(stored[scales], expected.scales)
    props = {prop.key: prop.value for prop in model.metadata_props}
    assert json.loads(props[QUANTIZATION])["bits"] == spec.bits


@pytest.mark.parametrize("spec", [QuantSpec(8, 32), QuantSpec(4, 32)], ids=str)
@pytest.mark.parametrize("mode", ["shared", "fast"])
def test_answers_match_the_reference_on_the_dequantized_weights(
    tmp_path: Path, table: npt.NDArray[np.float32], spec: QuantSpec, mode: str
) -> None:
    path = save_head(HeadWeights.from_arrays(table), tmp_path, quantization=spec)
    placement = Placement("shared" if mode == "shared" else "fast")
    skip_unless_runnable(path, placement)
    session = open_head(path, placement)
    assert isinstance(session.rows, QuantizedRows) == (mode == "shared")
    restored = quantize(table, spec).dequantize().astype(np.float64)
    hidden = _hidden()
    result = session.project(hidden, 5, full_logits=True)
    reference = hidden.astype(np.float64) @ restored.T
    assert result.logits is not None
    # int8 activations (accuracy level 4): ~1% of the logit scale.
    scale = np.abs(reference).max()
    np.testing.assert_allclose(result.logits, reference, atol=0.02 * scale)
    lse = np.log(np.exp(reference - reference.max(1, keepdims=True)).sum(1)) + reference.max(1)
    np.testing.assert_allclose(result.logsumexp, lse, atol=0.02 * scale)
    ids = np.array([[0, 699], [17, 17]])
    np.testing.assert_array_equal(session.embed(ids), restored.astype(np.float32)[ids])


def test_transforms_and_bias_apply_around_the_quantized_projection(
    tmp_path: Path, table: npt.NDArray[np.float32], other: npt.NDArray[np.float32]
) -> None:
    spec = QuantSpec(8, 32)
    bias = other[:, 0]
    transforms = HeadTransforms(input_scale=0.5, logit_scale=2.0, softcap=15.0)
    weights = HeadWeights.from_arrays(table, bias=bias, transforms=transforms)
    path = save_head(weights, tmp_path, quantization=spec)
    skip_unless_runnable(path)
    session = open_head(path)
    restored = quantize(table, spec).dequantize().astype(np.float64)
    hidden = _hidden()
    raw = (hidden * 0.5) @ restored.T + bias
    expected = np.tanh(raw * 2.0 / 15.0) * 15.0 / 0.7
    result = session.project(hidden, 5, temperature=0.7, full_logits=True)
    assert result.logits is not None
    np.testing.assert_allclose(result.logits, expected, atol=0.02 * np.abs(expected).max())


def test_untied_heads_quantize_the_output_and_the_table_only_when_asked(
    tmp_path: Path, table: npt.NDArray[np.float32], other: npt.NDArray[np.float32]
) -> None:
    spec = QuantSpec(4, 32)
    weights = HeadWeights.from_arrays(table, other)
    plain = inspect_head(save_head(weights, tmp_path / "a", quantization=spec))
    both = inspect_head(save_head(weights, tmp_path / "b", quantization=spec, quantize_table=True))
    assert plain.embedding_initializer == "embedding.weight"
    assert plain.quantization is not None
    assert not plain.quantization["table"]
    assert both.quantization is not None
    assert both.quantization["table"]
    assert not both.tied
    assert not both.quantization["shared"]
    session = open_head(tmp_path / "a" / "model.onnx")
    np.testing.assert_array_equal(session.embed([3, 4]), table[[3, 4]])  # float table as is
    restored = quantize(other, spec).dequantize().astype(np.float64)
    hidden = _hidden()
    result = session.project(hidden, 3, full_logits=True)
    assert result.logits is not None
    reference = hidden @ restored.T
    np.testing.assert_allclose(result.logits, reference, atol=0.02 * np.abs(reference).max())


def test_the_inspector_reports_bits_blocks_sharing_and_bytes(
    tmp_path: Path, table: npt.NDArray[np.float32]
) -> None:
    spec = QuantSpec(4, 32)
    report = inspect_head(save_head(HeadWeights.from_arrays(table), tmp_path, quantization=spec))
    assert report.tied
    assert report.dtype == "int4"
    assert report.parameters == VOCAB * D_MODEL
    assert report.quantization is not None
    assert report.quantization["shared"]
    assert report.quantization["bits"] == 4
    assert report.quantization["block_size"] == 32
    assert report.quantization["bytes"] == spec.stored_bytes(VOCAB, D_MODEL)
    assert report.weight_bytes == report.bytes_saved_by_tying == report.quantization["bytes"]


def test_a_duplicated_quantized_tie_is_found_and_retied(
    tmp_path: Path, table: npt.NDArray[np.float32]
) -> None:
    spec = QuantSpec(8, 32)
    path = save_head(
        HeadWeights.from_arrays(table, table), tmp_path, quantization=spec, quantize_table=True
    )
    report = inspect_head(path)
    assert report.duplicate == "identical"
    assert report.duplicate_bytes == spec.stored_bytes(VOCAB, D_MODEL)
    skip_unless_runnable(path, Placement("fast"))  # retie checks the tie in one session
    result = retie(path, tmp_path / "retied" / "model.onnx")
    assert result.max_abs_difference == 0.0
    retied = inspect_head(result.output)
    assert retied.tied
    assert retied.quantization is not None
    assert retied.quantization["shared"]
    assert retied.weight_bytes == report.weight_bytes // 2
    props = {p.key: p.value for p in onnx.load(str(result.output)).metadata_props}
    assert props["lmhead.tied"] == "true"  # the file's own metadata says so too (said false)


def test_float_weights_are_not_read_back_from_a_quantized_head(
    tmp_path: Path, table: npt.NDArray[np.float32]
) -> None:
    path = save_head(HeadWeights.from_arrays(table), tmp_path, quantization=QuantSpec(4, 32))
    with pytest.raises(ValueError, match="is quantized"):
        read_head(path)


def test_required_runtimes_follow_the_operators_used(
    tmp_path: Path, table: npt.NDArray[np.float32], other: npt.NDArray[np.float32]
) -> None:
    def report(spec: QuantSpec | None, tied: bool = True) -> HeadReport:
        weights = HeadWeights.from_arrays(table, None if tied else other)
        directory = tmp_path / f"{spec}{tied}"
        return inspect_head(save_head(weights, directory, quantization=spec))

    assert required_runtime(report(None), split=True) == (1, 18)
    assert required_runtime(report(QuantSpec(4, 32)), split=True) == (1, 18)
    assert required_runtime(report(QuantSpec(8, 32)), split=True) == (1, 22)
    assert required_runtime(report(QuantSpec(4, 32)), split=False) == (1, 27)
    assert required_runtime(report(QuantSpec(8, 32)), split=False) == (1, 23)
    untied = report(QuantSpec(4, 32), tied=False)
    assert required_runtime(untied, split=False) == (1, 18)


@pytest.mark.parametrize(
    ("spec", "top1"),
    [(QuantSpec(8, 128), 0.99), (QuantSpec(4, 128), 0.97), (QuantSpec(4, 64), 0.97)],
)
def test_quantized_heads_agree_with_fp32_on_peaked_states(
    tmp_path: Path, spec: QuantSpec, top1: float
) -> None:
    """The acceptance bar on states like a trained trunk's (bench/heads.py: 50257 x 768)."""
    rng = np.random.default_rng(21)
    table = (rng.standard_normal((8192, 256), dtype=np.float32) * 0.02).astype(np.float32)
    exact = open_head(save_head(HeadWeights.from_arrays(table), tmp_path / "fp32"))
    path = save_head(HeadWeights.from_arrays(table), tmp_path / spec.name, quantization=spec)
    skip_unless_runnable(path)
    quantized = open_head(path)
    hidden = peaked_states(table, 256)
    a = exact.project(hidden, 10, full_logits=True).logits
    b = quantized.project(hidden, 10, full_logits=True).logits
    assert a is not None
    assert b is not None
    stats = agreement(a, b, 10)
    assert stats["top1_agreement"] >= top1, stats
    assert stats["kl_ab"]["mean"] <= 0.01, stats


def test_dequantize_matches_the_stored_codes(table: npt.NDArray[np.float32]) -> None:
    spec = QuantSpec(4, 32)
    packed = quantize(table[:3], spec)
    np.testing.assert_array_equal(
        dequantize(packed.data, packed.scales, packed.zero_points, spec, D_MODEL),
        packed.dequantize(),
    )
