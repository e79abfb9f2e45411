"""``lmhead demo --checkpoint`` then ``lmhead import``, as the README shows them: the tied
GPT-2-like checkpoint becomes a tied head, the untied Llama-like one an untied head, their
logits are the checkpoints' own matrices' and their token strings come from tokenizer.json."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from safetensors.numpy import load_file

from service import output_projection_tied, output_projection_untied
from service.cli import main
from service.heads import MODEL_FILE
from service.heads.inspector import inspect_head
from service.runtime.session import HeadSession
from tests.conftest import initializers

HIDDEN = np.random.default_rng(5).standard_normal((6, 64)).astype(np.float32)


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The checkpoints (default size) and a repository holding both imported with the default
    options, through the command line."""
    root = tmp_path_factory.mktemp("demo")
    checkpoints, repository = root / "checkpoints", root / "models"
    assert main(["demo", "--checkpoint", str(checkpoints)]) == 0
    for name in ("gpt2-tiny", "llama-tiny"):
        args = ["import", str(checkpoints / name), "--name", name]
        assert main([*args, "--repository", str(repository)]) == 0
    return checkpoints, repository


def _logits(version_dir: Path, tied: bool) -> npt.NDArray[np.float32]:
    """The imported head's logits, run by the service's own onnxruntime session."""
    projection = HeadSession(version_dir / MODEL_FILE, tied=tied).project(
        HIDDEN, 5, full_logits=True
    )
    assert projection.logits is not None
    return projection.logits


def test_the_gpt2_checkpoint_becomes_a_tied_head_of_its_own_table(
    imported: tuple[Path, Path],
) -> None:
    checkpoints, repository = imported
    head = repository / "gpt2-tiny" / "1"
    report = inspect_head(head)
    assert report.tied
    assert (report.vocab_size, report.d_model, report.dtype) == (1024, 64, "float32")
    assert len(initializers(head / MODEL_FILE)) == 1
    tensors = load_file(str(checkpoints / "gpt2-tiny" / "model.safetensors"))
    table = tensors["transformer.wte.weight"].astype(np.float64)
    expected = output_projection_tied(HIDDEN.astype(np.float64), table)
    np.testing.assert_allclose(_logits(head, tied=True), expected, rtol=1e-5, atol=1e-5)


def test_the_llama_checkpoint_becomes_an_untied_head_of_its_lm_head(
    imported: tuple[Path, Path],
) -> None:
    checkpoints, repository = imported
    head = repository / "llama-tiny" / "1"
    report = inspect_head(head)
    assert not report.tied
    assert report.duplicate is None  # two different matrices, no broken tie
    assert (report.vocab_size, report.d_model, report.dtype) == (1024, 64, "float32")
    assert len(initializers(head / MODEL_FILE)) == 2
    tensors = load_file(str(checkpoints / "llama-tiny" / "model.safetensors"))
    assert tensors["lm_head.weight"].dtype == np.float16
    output = tensors["lm_head.weight"].astype(np.float64)  # float16 widens exactly
    expected = output_projection_untied(HIDDEN.astype(np.float64), output)
    np.testing.assert_allclose(_logits(head, tied=False), expected, rtol=1e-5, atol=1e-5)
    table = tensors["model.embed_tokens.weight"].astype(np.float64)
    assert not np.allclose(expected, output_projection_tied(HIDDEN.astype(np.float64), table))


@pytest.mark.parametrize(
    ("name", "specials"),
    [("gpt2-tiny", {1023: "<|endoftext|>"}), ("llama-tiny", {0: "<unk>", 1: "<s>", 2: "</s>"})],
)
def test_token_strings_come_from_the_tokenizer(
    imported: tuple[Path, Path], name: str, specials: dict[int, str]
) -> None:
    checkpoints, repository = imported
    document = json.loads((checkpoints / name / "tokenizer.json").read_text(encoding="utf-8"))
    by_id = {index: token for token, index in document["model"]["vocab"].items()}
    by_id |= {entry["id"]: entry["content"] for entry in document["added_tokens"]}
    labels = (repository / name / "1" / "vocab.txt").read_text(encoding="utf-8").splitlines()
    assert labels == [by_id[index] for index in range(1024)]
    assert {index: labels[index] for index in specials} == specials
    assert len(set(labels)) == len(labels)


def test_the_printed_commands_run_as_written(tmp_path: Path) -> None:
    """What ``demo --checkpoint`` prints is what a user pastes: each import it names runs."""
    lmhead = [sys.executable, "-m", "service"]
    env = {**os.environ, "LMHEAD_REPOSITORY": str(tmp_path / "models")}

    def run(args: list[str]) -> str:
        done = subprocess.run(
            lmhead + args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    printed = run(["demo", "--checkpoint", "checkpoints"]).splitlines()
    assert printed[0].startswith("wrote checkpoints/gpt2-tiny: tied, 1,024 tokens x 64, float32")
    assert printed[1].startswith("wrote checkpoints/llama-tiny: untied, 1,024 tokens x 64, float16")
    commands = [line.split() for line in printed if line.strip().startswith("lmhead import")]
    assert commands == [
        ["lmhead", "import", "checkpoints/gpt2-tiny", "--name", "gpt2-tiny"],
        ["lmhead", "import", "checkpoints/llama-tiny", "--name", "llama-tiny"],
    ]
    for line in printed[-2:]:
        assert "wrote " in run(shlex.split(line)[1:])
    assert not (tmp_path / "models" / "demo-tied").exists()  # checkpoints only, no demo heads
    assert inspect_head(tmp_path / "models" / "gpt2-tiny" / "1").tied
    assert not inspect_head(tmp_path / "models" / "llama-tiny" / "1").tied
