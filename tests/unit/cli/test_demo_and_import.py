"""``demo --checkpoint`` and ``import`` as the command line runs them: checkpoints written and
never overwritten unasked; ``--to-version`` writes, the old ``--version`` too (with a note);
a half-precision checkpoint widened to float32 says so, unless ``--dtype`` chose."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from service.cli import main
from service.heads.inspector import inspect_head

SMALL = ["--vocab-size", "300", "--d-model", "8"]
DEPRECATION = (
    "lmhead: --version of import is deprecated: use --to-version (it will name the version "
    "to read, as everywhere else)"
)
WIDENED = (
    "lmhead: note: the checkpoint stores float16; the head is stored as float32 (2x its bytes, "
    "exact on every provider); --dtype float16 keeps half precision"
)


@pytest.fixture
def checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    directory = tmp_path / "checkpoints"
    assert main(["demo", "--checkpoint", str(directory), *SMALL]) == 0
    capsys.readouterr()
    return directory


def _import(checkpoint: Path, repository: Path, *extra: str) -> int:
    name = checkpoint.name
    return main(
        ["import", str(checkpoint), "--name", name, "--repository", str(repository), *extra]
    )


def test_demo_checkpoint_prints_what_it_wrote_and_the_imports_to_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "my checkpoints"  # a space: the printed commands quote it
    repository = tmp_path / "models"
    assert main(["demo", "--checkpoint", str(directory), "--repository", str(repository)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"wrote {directory / 'gpt2-tiny'}: tied, 1,024 tokens x 64, float32")
    assert lines[1].startswith(f"wrote {directory / 'llama-tiny'}: untied, 1,024 tokens x 64")
    assert lines[-2:] == [
        f"  lmhead import '{directory / 'gpt2-tiny'}' --name gpt2-tiny",
        f"  lmhead import '{directory / 'llama-tiny'}' --name llama-tiny",
    ]
    assert not repository.exists()  # checkpoints only: no demo heads


def test_demo_checkpoint_keeps_what_exists_unless_forced(
    checkpoints: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = checkpoints / "llama-tiny" / "model.safetensors"
    before = weights.read_bytes()
    again = ["demo", "--checkpoint", str(checkpoints), *SMALL, "--seed", "7"]
    assert main(again) == 1
    error = capsys.readouterr().err
    assert "gpt2-tiny and llama-tiny exist already (--force rewrites)" in error
    assert weights.read_bytes() == before
    assert main([*again, "--force"]) == 0
    assert weights.read_bytes() != before


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--dtype", "float16"], "--dtype is for the demo heads"),
        (["--vocab-size", "100"], "--vocab-size: a demo checkpoint has at least 300 tokens"),
    ],
)
def test_demo_checkpoint_refuses_options_it_cannot_honour(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert main(["demo", "--checkpoint", str(tmp_path / "c"), *extra]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_import_writes_to_version_and_the_old_version_flag_still_works_with_a_note(
    checkpoints: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gpt2, repository = checkpoints / "gpt2-tiny", tmp_path / "models"
    assert _import(gpt2, repository, "--to-version", "3") == 0
    assert DEPRECATION not in capsys.readouterr().err
    assert _import(gpt2, repository, "--version", "5") == 0
    captured = capsys.readouterr()
    assert DEPRECATION in captured.err.splitlines()
    assert f"wrote {repository / 'gpt2-tiny' / '5'}" in captured.out
    assert sorted(p.name for p in (repository / "gpt2-tiny").iterdir()) == ["3", "5"]
    assert _import(gpt2, repository, "--version", "6", "--to-version", "7") == 2
    assert "--version 6 and --to-version 7 disagree" in capsys.readouterr().err
    assert _import(gpt2, repository, "--to-version", "3") == 2  # exists: named by its flag
    assert "choose another --to-version" in capsys.readouterr().err


def test_a_half_precision_checkpoint_widened_by_default_says_so(
    checkpoints: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    llama, repository = checkpoints / "llama-tiny", tmp_path / "models"
    assert _import(llama, repository) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [WIDENED]
    assert inspect_head(repository / "llama-tiny" / "1").dtype == "float32"
    for dtype in ("float32", "float16"):  # chosen: nothing to tell
        assert _import(llama, repository, "--dtype", dtype) == 0
        assert capsys.readouterr().err == ""
    assert inspect_head(repository / "llama-tiny" / "3").dtype == "float16"
    assert _import(checkpoints / "gpt2-tiny", repository) == 0  # float32: nothing widened
    assert capsys.readouterr().err == ""


def test_a_bfloat16_checkpoint_names_bfloat16(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table = np.random.default_rng(0).standard_normal((50, 8)).astype(ml_dtypes.bfloat16)
    checkpoint = tmp_path / "bf16"
    checkpoint.mkdir()
    save_file({"model.embed_tokens.weight": table}, str(checkpoint / "model.safetensors"))
    assert _import(checkpoint, tmp_path / "models") == 0
    error = capsys.readouterr().err
    assert "the checkpoint stores bfloat16; the head is stored as float32" in error
    assert "--dtype bfloat16 keeps half precision" in error
