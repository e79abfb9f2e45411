"""lmhead retie: a duplicated tie (W plus W^T, or W plus a copy) becomes one initializer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
import pytest

from service.cli import main
from service.heads.files import HeadWeights, save_head
from service.heads.inspector import HeadInspectionError, inspect_head
from service.tools.retie import retie
from tests.conftest import D_MODEL, VOCAB
from tests.unit.heads.test_inspector import _exported_style_head


def _outputs(path: Path, hidden: npt.NDArray[np.float32]) -> list[npt.NDArray[np.float32]]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ids = np.array([0, 5, VOCAB - 1], np.int64)
    return list(session.run(None, {"h": hidden, "ids": ids}))


@pytest.mark.parametrize("layout", ["columns", "transpose-node"])
def test_retie_repairs_a_broken_tie_and_keeps_the_outputs(
    tmp_path: Path, table: npt.NDArray[np.float32], layout: str
) -> None:
    copy = np.ascontiguousarray(table.T) if layout == "columns" else table.copy()
    path = _exported_style_head(tmp_path / "exported.onnx", table, copy, layout)
    hidden = np.random.default_rng(0).standard_normal((4, D_MODEL)).astype(np.float32)
    before = _outputs(path, hidden)
    size_before = path.stat().st_size
    result = retie(path, tmp_path / "fixed.onnx")
    assert result.bytes_saved == VOCAB * D_MODEL * 4
    report = inspect_head(result.output)
    assert report.tied
    assert report.duplicate is None
    assert len(onnx.load(str(result.output)).graph.initializer) == 1
    assert size_before - result.output.stat().st_size >= 0.99 * result.bytes_saved
    for old, new in zip(before, _outputs(result.output, hidden), strict=True):
        np.testing.assert_allclose(new, old, rtol=1e-5, atol=1e-5)


def test_retie_refuses_tied_and_honest_untied_heads(
    tmp_path: Path,
    tied_path: Path,
    untied_path: Path,
) -> None:
    with pytest.raises(HeadInspectionError, match="tied already"):
        retie(tied_path, tmp_path / "x.onnx")
    with pytest.raises(HeadInspectionError, match="honest untied head"):
        retie(untied_path, tmp_path / "y.onnx")


def test_retie_cli_on_an_lmhead_untied_copy(
    tmp_path: Path, table: npt.NDArray[np.float32], capsys: pytest.CaptureFixture[str]
) -> None:
    path = save_head(HeadWeights.from_arrays(table, table.copy()), tmp_path / "v1")
    assert main(["retie", str(path.parent)]) == 2  # no silent rewrite: say -o or --in-place
    assert "--in-place" in capsys.readouterr().err
    assert not inspect_head(path).tied
    assert main(["retie", str(path.parent), "--in-place"]) == 0
    assert f"{VOCAB * D_MODEL * 4:,} bytes saved" in capsys.readouterr().out
    assert inspect_head(path).tied


def test_retie_in_place_refuses_a_data_file_linked_out_of_the_version(
    tmp_path: Path, table: npt.NDArray[np.float32]
) -> None:
    """In place, a data file linked outside would be written back as a regular file beside
    the model and served (issue 43, finding 3); the loader refuses the same link."""
    version = tmp_path / "repository" / "head" / "1"
    path = save_head(HeadWeights.from_arrays(table, table.copy()), version, external_data=True)
    data = path.with_name(path.name + ".data")
    outside = tmp_path / "outside.data"
    data.rename(outside)
    data.symlink_to(outside)
    with pytest.raises(HeadInspectionError, match="is a link"):
        retie(path)
    assert data.is_symlink()
    model = tmp_path / "elsewhere.onnx"
    path.rename(model)
    path.symlink_to(model)  # the model file itself linked: refused in place as well
    with pytest.raises(HeadInspectionError, match="model.onnx is a link"):
        retie(path)
