"""The ``lmhead`` command as a user runs it: demo models on first run, then inspect."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from service.demo import demo_tokens
from service.heads import EMBEDDING_WEIGHT, OUTPUT_WEIGHT
from tests.conftest import initializers


def _lmhead(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service", *args], capture_output=True, text=True, check=True
    )


def _inspect(path: Path) -> dict[str, object]:
    report: dict[str, object] = json.loads(_lmhead("inspect", str(path), "--json").stdout)
    return report


def test_demo_writes_a_tied_and_an_untied_head_in_the_repository_layout(tmp_path: Path) -> None:
    out = _lmhead(
        "demo", "--repository", str(tmp_path), "--vocab-size", "600", "--d-model", "32"
    ).stdout
    assert "demo-tied" in out
    tied = _inspect(tmp_path / "demo-tied" / "1")
    untied = _inspect(tmp_path / "demo-untied" / "1" / "model.onnx")
    assert (tied["tied"], untied["tied"]) == (True, False)
    assert tied["vocab_size"] == untied["vocab_size"] == 600
    assert tied["d_model"] == untied["d_model"] == 32
    assert untied["duplicate"] is None
    for name in ("demo-tied", "demo-untied"):
        labels = (tmp_path / name / "1" / "vocab.txt").read_text(encoding="utf-8").splitlines()
        assert labels == demo_tokens(600)
        assert len(set(labels)) == 600


def test_untied_demo_shares_the_table_but_not_the_output_matrix(tmp_path: Path) -> None:
    _lmhead("demo", "--repository", str(tmp_path), "--vocab-size", "300", "--d-model", "16")
    (table,) = initializers(tmp_path / "demo-tied/1/model.onnx").values()
    untied = initializers(tmp_path / "demo-untied/1/model.onnx")
    embedding, output = untied[EMBEDDING_WEIGHT], untied[OUTPUT_WEIGHT]
    np.testing.assert_array_equal(embedding, table)
    correlation = np.corrcoef(embedding.ravel(), output.ravel())[0, 1]
    assert 0.7 < correlation < 0.9


def test_demo_is_made_once_and_seeded(tmp_path: Path) -> None:
    args = ("demo", "--repository", str(tmp_path), "--vocab-size", "300", "--d-model", "16")
    _lmhead(*args)
    model = tmp_path / "demo-tied" / "1" / "model.onnx"
    first = model.read_bytes()
    assert "already" in _lmhead(*args).stdout
    _lmhead(*args, "--force")
    assert model.read_bytes() == first


def test_default_demo_is_the_documented_size(tmp_path: Path) -> None:
    _lmhead("demo", "--repository", str(tmp_path))
    text = _lmhead("inspect", str(tmp_path / "demo-tied" / "1")).stdout
    assert "tied: one initializer feeds the Gather and the projection" in text
    assert "32000 x 512 float32" in text
    assert _inspect(tmp_path / "demo-untied" / "1")["weight_bytes"] == 2 * 32000 * 512 * 4
