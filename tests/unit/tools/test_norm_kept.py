"""Every tool that writes or rewrites a head keeps its final norm: quantize (the norm stays
float32), trim (the norm is over d_model, which trimming keeps), retie (its side untouched, its
tensors in model.onnx), import's ``--tie`` and ``--untie``, the demo heads and the demo
checkpoints' imports. Tolerances as in ``test_final_norms``; the norm side of a rewritten head
gives the same normed states as the head it came from (float32, within 1e-6)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from service.cli import main
from service.heads import MODEL_FILE
from service.heads.files import HeadWeights, read_head, save_head
from service.heads.inspector import inspect_head
from service.heads.norm import NORM_BIAS, NORM_WEIGHT, FinalNorm
from service.heads.quantize import QuantSpec
from service.runtime.layout import open_head
from service.runtime.session import HeadSession
from service.tools.demo import DemoSpec, write_demo_models
from service.tools.demo_checkpoints import (
    GPT2_NAME,
    LLAMA_NAME,
    CheckpointSpec,
    write_demo_checkpoints,
)
from service.tools.importer import ImportOptions, import_checkpoint, quantize_version
from service.tools.trim import trim_version
from tests import families
from tests.conftest import skip_unless_runnable
from tests.unit.tools.test_final_norms import ATOL, RTOL, assert_logits

NORMED_RTOL = 1e-6


def _imported(tmp_path: Path, family: str, **options: Any) -> Path:
    source = families.write_checkpoint(family, tmp_path / "checkpoints" / family)
    chosen = ImportOptions(**options)
    return import_checkpoint(source, tmp_path / "models", family, chosen).directory


def _session(version: Path) -> HeadSession:
    return open_head(version / MODEL_FILE)


def _same_norm(first: Path, second: Path) -> None:
    before, after = _session(first), _session(second)
    residual = np.random.default_rng(0).standard_normal((8, before.d_model)).astype(np.float32)
    np.testing.assert_allclose(
        after.normalize(3 * residual + 1),
        before.normalize(3 * residual + 1),
        rtol=NORMED_RTOL,
        atol=NORMED_RTOL,
    )
    assert inspect_head(second).final_norm == inspect_head(first).final_norm


@pytest.mark.parametrize(
    ("family", "bits", "error"),
    [("phi", "int8", 0.02), ("gemma", "int4", 0.2)],  # measured: 0.8-1% and 7-10%
)
def test_quantize_keeps_the_norm_in_float(
    tmp_path: Path, family: str, bits: str, error: float
) -> None:
    """The quantized head's logits of residual states stay within ``error`` of the largest
    reference logit: the blocks' rounding, not the norm (its states equal the float head's)."""
    source = _imported(tmp_path, family)
    written = quantize_version(tmp_path / "models", family, None, None, QuantSpec.parse(bits, 32))
    skip_unless_runnable(written / MODEL_FILE)
    model = onnx.load(str(written / MODEL_FILE))
    norm_tensors = [t for t in model.graph.initializer if t.name in (NORM_WEIGHT, NORM_BIAS)]
    assert norm_tensors
    assert all(t.data_type == onnx.TensorProto.FLOAT for t in norm_tensors)
    _same_norm(source, written)
    residual = families.residual_states(8)
    quantized = _session(written)
    logits = quantized.project(quantized.normalize(residual), 1, full_logits=True).logits
    expected = families.reference_logits(family, residual)
    assert logits is not None
    assert np.abs(logits - expected).max() < error * np.abs(expected).max()


def test_trim_keeps_the_norm_and_the_kept_columns(tmp_path: Path) -> None:
    source = _imported(tmp_path, "gpt2")
    keep = np.arange(0, families.VOCAB, 3)
    trimmed = trim_version(tmp_path / "models", "gpt2", None, keep, "small")
    _same_norm(source, trimmed)
    residual = families.residual_states(8)
    session = _session(trimmed)
    logits = session.project(session.normalize(residual), 1, full_logits=True).logits
    assert logits is not None
    expected = families.reference_logits("gpt2", residual)[:, keep]
    np.testing.assert_allclose(logits, expected, rtol=RTOL, atol=ATOL)


def test_retie_keeps_the_norm_side_and_its_tensors_in_the_model_file(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    table = rng.standard_normal((64, 512)).astype(np.float32)  # a norm past onnx's 1024 bytes
    norm = FinalNorm("layer", 1 + 0.1 * rng.standard_normal(512), 1e-5, rng.standard_normal(512))
    weights = HeadWeights.from_arrays(table, table.copy(), norm=norm)
    path = save_head(weights, tmp_path / "v1", external_data=True)
    residual = (3 * rng.standard_normal((4, 512)) + 1).astype(np.float32)
    before = _session(path.parent).normalize(residual)
    assert main(["retie", str(path.parent), "--in-place"]) == 0
    report = inspect_head(path)
    assert report.tied
    assert report.final_norm is not None
    assert report.final_norm["kind"] == "layer"
    model = onnx.load(str(path), load_external_data=False)
    kept = {t.name: t for t in model.graph.initializer if t.name in (NORM_WEIGHT, NORM_BIAS)}
    assert set(kept) == {NORM_WEIGHT, NORM_BIAS}
    assert all(t.data_location != onnx.TensorProto.EXTERNAL for t in kept.values())
    read = read_head(path)
    assert read.norm is not None
    np.testing.assert_array_equal(read.norm.weight, norm.weight)
    np.testing.assert_array_equal(_session(path.parent).normalize(residual), before)


def test_untie_and_tie_keep_the_norm(tmp_path: Path) -> None:
    tied = _imported(tmp_path / "tied", "gpt2")
    twin = _imported(tmp_path / "twin", "gpt2", untie=True)
    assert not inspect_head(twin).tied
    assert inspect_head(twin).untied_on_purpose
    _same_norm(tied, twin)
    assert_logits(_session(twin), "gpt2", families.residual_states(8))
    untied = _imported(tmp_path / "untied", "llama")
    forced = _imported(tmp_path / "forced", "llama", tie=True)
    assert inspect_head(forced).tied
    _same_norm(untied, forced)


def test_the_demo_heads_end_with_an_rms_norm(tmp_path: Path) -> None:
    tied, untied = write_demo_models(tmp_path, DemoSpec(vocab_size=300, d_model=32))
    for version in (tied, untied):
        norm = inspect_head(version).final_norm
        assert norm is not None
        assert (norm["kind"], norm["epsilon"]) == ("rms", 1e-5)
        weight = read_head(version / MODEL_FILE).norm
        assert weight is not None
        assert weight.weight.min() > 0.5
        assert weight.weight.max() < 1.5
        assert np.std(weight.weight) > 0.01  # not all ones: the norm shows in the lens
    _same_norm(tied, untied)


def test_the_demo_checkpoints_import_with_their_final_norms(tmp_path: Path) -> None:
    write_demo_checkpoints(tmp_path / "checkpoints", CheckpointSpec(vocab_size=400, d_model=16))
    summaries = {}
    for name in (GPT2_NAME, LLAMA_NAME):
        result = import_checkpoint(tmp_path / "checkpoints" / name, tmp_path / "models", name)
        summaries[name] = result.final_norm
        assert _session(result.directory).has_norm
    assert summaries == {
        GPT2_NAME: "layer, eps 1e-05, bias (transformer.ln_f.weight, transformer.ln_f.bias)",
        LLAMA_NAME: "rms, eps 1e-05 (model.norm.weight)",
    }
