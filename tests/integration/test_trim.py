"""Trimmed vocabularies: ``lmhead trim`` as a user runs it, then the trimmed heads served next to
the full ones, answering in original ids, equal to the full head restricted to the kept ids."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import pytest

from service.repository.disk import VOCAB_MAP_FILE
from service.repository.side_files import read_space
from service.tools.demo import demo_tokens
from tests.conftest import D_MODEL, VOCAB, initializers, reference_logits, write_tied_and_untied
from tests.server import running_server

KEEP = np.array(sorted({*range(0, 300, 3), 996, 500, 501}), np.int64)
HIDDEN = np.random.default_rng(31).standard_normal((5, D_MODEL)).astype(np.float32)
RTOL, ATOL = 1e-4, 1e-4


def _lmhead(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service", *args], capture_output=True, text=True, check=False
    )


@pytest.fixture(scope="module")
def repository(
    tmp_path_factory: pytest.TempPathFactory,
    table: npt.NDArray[np.float32],
    output_weight: npt.NDArray[np.float32],
) -> Path:
    root = tmp_path_factory.mktemp("models")
    write_tied_and_untied(root, table, output_weight)
    keep_file = root.parent / "keep.npy"
    np.save(keep_file, KEEP[::-1])  # order and repeats do not matter
    for model in ("tied", "untied"):
        done = _lmhead(
            "trim", model, "--keep", str(keep_file), "--name", f"{model}-trim",
            "--repository", str(root),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "tokens kept" in done.stdout
    return root


@pytest.fixture(scope="module")
def url(repository: Path) -> Iterator[str]:
    with running_server(repository) as base_url:
        yield base_url


def test_the_trimmed_files_keep_the_rows_the_tie_and_the_labels(repository: Path) -> None:
    tied = initializers(repository / "tied-trim" / "1" / "model.onnx")
    assert len(tied) == 1  # still ONE matrix
    (rows,) = tied.values()
    full = initializers(repository / "tied" / "1" / "model.onnx")
    np.testing.assert_array_equal(rows, next(iter(full.values()))[KEEP])
    assert len(initializers(repository / "untied-trim" / "1" / "model.onnx")) == 2
    mapping = json.loads((repository / "tied-trim" / "1" / VOCAB_MAP_FILE).read_text())
    assert mapping == {"vocab_size": VOCAB, "token_ids": KEEP.tolist()}
    labels = (repository / "tied-trim" / "1" / "vocab.txt").read_text().split("\n")[:-1]
    assert labels == [demo_tokens(VOCAB)[i] for i in KEEP]


@pytest.mark.parametrize("model", ["tied", "untied"])
def test_answers_equal_the_full_head_restricted_in_original_ids(
    url: str, repository: Path, model: str
) -> None:
    body = {"hidden_states": HIDDEN.tolist(), "k": 4, "logprobs": True}
    answer = httpx.post(f"{url}/v1/models/{model}-trim/topk", json=body).json()
    restricted = reference_logits(repository / model / "1", HIDDEN)[:, KEEP]
    for row, result in enumerate(answer["results"]):
        order = np.argsort(-restricted[row], kind="stable")[:4]
        assert result["token_ids"] == KEEP[order].tolist()
        np.testing.assert_allclose(result["logits"], restricted[row, order], rtol=RTOL, atol=ATOL)
    if model == "tied":
        tokens = demo_tokens(VOCAB)
        assert answer["results"][0]["tokens"] == [
            tokens[i] for i in answer["results"][0]["token_ids"]
        ]


def test_requests_name_original_ids_and_trimmed_ones_are_422(url: str, repository: Path) -> None:
    embedded = httpx.post(f"{url}/v1/models/tied-trim/embed", json={"input_ids": [996, 3]}).json()
    table = next(iter(initializers(repository / "tied" / "1" / "model.onnx").values()))
    np.testing.assert_array_equal(np.array(embedded["embeddings"], np.float32), table[[996, 3]])
    score = {"hidden_states": HIDDEN[:2].tolist(), "target_ids": [500, 501], "k": 2}
    scored = httpx.post(f"{url}/v1/models/untied-trim/score", json=score).json()
    restricted = reference_logits(repository / "untied" / "1", HIDDEN[:2])[:, KEEP]
    for row, target in enumerate([500, 501]):
        column = int(np.flatnonzero(target == KEEP)[0])
        want = restricted[row, column] - np.log(np.exp(restricted[row]).sum())
        np.testing.assert_allclose(scored["results"][row]["logprob"], want, rtol=RTOL, atol=ATOL)
        assert set(scored["alternatives"][row]["ids"]) <= set(KEEP.tolist())
    refused = httpx.post(f"{url}/v1/models/tied-trim/embed", json={"input_ids": [1]})
    assert refused.status_code == 422
    assert "token 1 is not in this trimmed head's vocabulary" in refused.json()["error"]["message"]
    bias: dict[str, Any] = {"hidden_states": HIDDEN.tolist(), "logit_bias": {"2": 1.0}}
    assert httpx.post(f"{url}/v1/models/tied-trim/topk", json=bias).status_code == 422


def test_sampled_and_allowed_ids_are_original_too(url: str) -> None:
    body = {"hidden_states": HIDDEN.tolist(), "allowed_token_ids": [996, 500, 9], "k": 3}
    answer = httpx.post(f"{url}/v1/models/untied-trim/topk", json=body | {"sample": {"seed": 1}})
    assert answer.status_code == 200, answer.text
    for result in answer.json()["results"]:
        assert sorted(result["token_ids"]) == [9, 500, 996]
        assert result["sampled_token_id"] in (9, 500, 996)


def test_a_broken_vocab_map_fails_the_load_with_a_reason(tmp_path: Path) -> None:
    (tmp_path / VOCAB_MAP_FILE).write_text(json.dumps({"vocab_size": 10, "token_ids": [3, 2]}))
    with pytest.raises(ValueError, match="must ascend"):
        read_space(tmp_path, 2)
    (tmp_path / VOCAB_MAP_FILE).write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a token map"):
        read_space(tmp_path, 2)
    assert read_space(tmp_path / "absent", 7).kept is None


def test_trim_refuses_ids_outside_the_vocabulary(repository: Path) -> None:
    done = _lmhead(
        "trim", "tied", "--keep", "0-2000", "--name", "x", "--repository", str(repository)
    )
    assert done.returncode == 2
    assert "--keep: 2000 is past the head's ids, [0, 997)" in done.stderr


def test_heads_trimmed_to_other_tokens_are_never_compared(
    url: str, repository: Path, tmp_path: Path
) -> None:
    """Column i is another token in each: compare (and shadow) would pair them unlike with
    unlike, as two heads of other vocab sizes would be."""
    keep_file = tmp_path / "other.npy"
    np.save(keep_file, np.arange(len(KEEP)) + 300)  # as many tokens, other ids
    done = _lmhead(
        "trim", "tied", "--keep", str(keep_file), "--name", "other-trim",
        "--repository", str(repository),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert httpx.post(f"{url}/v2/repository/models/other-trim/load").status_code == 200
    body = {"hidden_states": HIDDEN.tolist()}
    same = httpx.post(f"{url}/v1/compare", json=body | {"models": ["tied-trim", "untied-trim"]})
    assert same.status_code == 200, same.text
    other = httpx.post(f"{url}/v1/compare", json=body | {"models": ["tied-trim", "other-trim"]})
    assert other.status_code == 422
    assert "do not name the same tokens" in other.json()["error"]["message"]
