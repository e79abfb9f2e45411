"""Quantized heads end to end: made with the command line, served by a real uvicorn process,
reported by every front end, compared with their fp32 twin, and held once in memory."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import numpy.typing as npt
import pytest
from safetensors.numpy import save_file

from bench.heads import peaked_states
from service.heads.files import HeadWeights, save_head
from service.heads.quantize import QuantSpec, quantize
from tests.conftest import skip_unless_runnable
from tests.server import running_server

VOCAB, D_MODEL = 2000, 128


def _lmhead(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service", *args], capture_output=True, text=True, check=check
    )


@pytest.fixture(scope="module")
def table() -> npt.NDArray[np.float32]:
    rng = np.random.default_rng(31)
    return (rng.standard_normal((VOCAB, D_MODEL), dtype=np.float32) * 0.05).astype(np.float32)


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory, table: npt.NDArray[np.float32]) -> Path:
    """``head/1`` fp32 tied with labels, ``head/2`` its int8 copy (``lmhead quantize``; both
    served), ``exact/1`` the fp32 head again and ``small/1`` imported from a checkpoint with
    ``--quantize int4``."""
    root = tmp_path_factory.mktemp("quantized")
    repository = root / "models"
    save_head(HeadWeights.from_arrays(table), repository / "head" / "1")
    save_head(HeadWeights.from_arrays(table), repository / "exact" / "1")
    (repository / "head" / "config.json").write_text(json.dumps({"versions": "all"}))
    (repository / "head" / "1" / "vocab.txt").write_text(
        "\n".join(f"t{i}" for i in range(VOCAB)) + "\n"
    )
    _lmhead("quantize", "head", "--repository", str(repository), "--quantize", "int8")
    checkpoint = root / "checkpoint"
    checkpoint.mkdir()
    save_file({"model.embed_tokens.weight": table}, str(checkpoint / "model.safetensors"))
    (checkpoint / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    done = _lmhead(
        "import", str(checkpoint), "--name", "small", "--repository", str(repository),
        "--quantize", "int4", "--block-size", "32",
    )  # fmt: skip
    assert "int4, blocks of 32" in done.stdout
    return repository


@pytest.fixture(scope="module")
def url(repository: Path) -> Iterator[str]:
    with running_server(repository, provider="cpu") as base:
        yield base


def test_quantize_writes_a_complete_readable_version_with_labels(repository: Path) -> None:
    version = repository / "head" / "2"
    assert (version / "vocab.txt").read_text() == (
        repository / "head" / "1" / "vocab.txt"
    ).read_text()
    assert stat.S_IMODE(version.stat().st_mode) == 0o755
    assert not [p for p in (repository / "head").iterdir() if p.name.startswith(".")]
    text = _lmhead("inspect", str(version)).stdout
    assert "int8, blocks of 128" in text
    assert "one set of codes, scales and zero points feeds both sides" in text
    report = json.loads(_lmhead("inspect", str(repository / "small" / "1"), "--json").stdout)
    assert report["tied"]
    assert report["dtype"] == "int4"
    assert report["quantization"]["block_size"] == 32
    assert report["weight_bytes"] == QuantSpec(4, 32).stored_bytes(VOCAB, D_MODEL)


def test_quantize_refuses_what_it_cannot_do(repository: Path) -> None:
    again = _lmhead(
        "quantize", "head", "--repository", str(repository), "--quantize", "int4",
        "--version", "2", check=False,
    )  # fmt: skip
    assert again.returncode == 2
    assert "is quantized" in again.stderr
    assert "Traceback" not in again.stderr
    bad_block = _lmhead(
        "quantize", "head", "--repository", str(repository), "--quantize", "int4",
        "--block-size", "48", check=False,
    )  # fmt: skip
    assert bad_block.returncode == 2  # an option refused, as argparse refuses one
    assert "power of two" in bad_block.stderr
    assert sorted(p.name for p in (repository / "head").iterdir()) == ["1", "2", "config.json"]


def test_metadata_reports_the_quantization_on_both_protocols(url: str, repository: Path) -> None:
    skip_unless_runnable(repository / "head" / "2" / "model.onnx")
    native = httpx.get(f"{url}/v1/models/head", params={"version": 2}).json()
    assert native["dtype"] == "int8"
    assert native["compute_dtype"] == "int8"
    assert native["layout"] == "split"
    assert native["quantization"]["shared"] is True
    assert native["quantization"]["bits"] == 8
    assert "table_tensors" not in native["quantization"]
    v2 = httpx.get(f"{url}/v2/models/head/versions/2").json()
    assert v2["parameters"]["dtype"] == "int8"
    assert v2["parameters"]["block_size"] == 128
    assert v2["parameters"]["bits"] == native["quantization"]["bits"]
    assert v2["parameters"]["table_quantized"] is native["quantization"]["table"]
    assert v2["parameters"]["tied"] is native["quantization"]["shared"]
    plain = httpx.get(f"{url}/v2/models/head/versions/1").json()
    assert "block_size" not in plain["parameters"]


def test_served_answers_match_the_dequantized_reference(
    url: str, table: npt.NDArray[np.float32]
) -> None:
    hidden = peaked_states(table, 8)
    body = {"hidden_states": hidden.tolist(), "k": 3}
    results = httpx.post(f"{url}/v1/models/small/topk", json=body).json()["results"]
    restored = quantize(table, QuantSpec(4, 32)).dequantize().astype(np.float64)
    reference = hidden.astype(np.float64) @ restored.T
    np.testing.assert_array_equal(
        np.array([r["token_ids"][0] for r in results]), reference.argmax(axis=1)
    )
    np.testing.assert_allclose(
        np.array([r["logits"][0] for r in results]),
        reference.max(axis=1),
        atol=0.02 * np.abs(reference).max(),
    )
    ids = [[0, 5, VOCAB - 1]]
    embedded = httpx.post(f"{url}/v1/models/small/embed", json={"input_ids": ids}).json()
    np.testing.assert_array_equal(
        np.array(embedded["embeddings"], np.float32), restored.astype(np.float32)[ids]
    )


@pytest.mark.parametrize(("model", "version"), [("small", 1), ("head", 2)])
def test_a_quantized_head_answers_the_same_with_a_zero_bias_or_its_own_top_allowed(
    url: str, repository: Path, model: str, version: int
) -> None:
    """Bias and allowed tokens take their logits from the graph itself, as plain top-k does:
    the int8 activations of its projection make dequantized rows differ by up to ~0.1,
    which reordered near ties (a zero bias changed a top-1)."""
    skip_unless_runnable(repository / model / str(version) / "model.onnx")
    hidden = np.random.default_rng(32).standard_normal((24, D_MODEL)).astype(np.float32)
    path = f"{url}/v1/models/{model}/versions/{version}/topk"

    def top(**options: object) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
        body = {"hidden_states": hidden.tolist(), "k": 5, **options}
        results = httpx.post(path, json=body).json()["results"]
        return np.array([r["token_ids"] for r in results]), np.array([r["logits"] for r in results])

    ids, logits = top()
    for options in (
        {"logit_bias": {str(token): 0.0 for token in ids[:, 0].tolist()[:8]}},
        {"allowed_token_ids": ids.tolist()},
    ):
        shaped_ids, shaped_logits = top(**options)
        np.testing.assert_array_equal(shaped_ids, ids)
        np.testing.assert_allclose(shaped_logits, logits, rtol=1e-5, atol=1e-5)


def test_compare_gives_agreement_and_kl_against_the_fp32_twin(
    url: str, table: npt.NDArray[np.float32]
) -> None:
    hidden = peaked_states(table, 64)
    body = {"models": ["exact", "small"], "hidden_states": hidden.tolist(), "k": 10}
    answer = httpx.post(f"{url}/v1/compare", json=body).json()
    assert answer["rows"] == 64
    assert answer["top1_agreement"] >= 0.97
    assert 0.0 < answer["kl_ab"]["mean"] <= 0.01
    assert 0.5 < answer["topk_overlap"] <= 1.0
    blocks = {block["name"]: block for block in answer["models"]}
    assert blocks["small"]["quantization"]["bits"] == 4
