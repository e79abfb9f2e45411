"""quantize and trim read a repository version as the service loads it: each file opened once,
never through a link, checked through the open file (``staging.private_copy``). A labels file
linked to a file outside the repository was copied into the new version as a regular file,
and served (issue 43: the answers' tokens were ``["line2", "root-secret"]``), while the loader
refused the same link in the version it came from."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from service.cli import main
from service.heads import DATA_FILE
from service.heads.files import HeadWeights, save_head
from service.heads.quantize import QuantSpec
from service.repository.disk import LABELS_FILE, VOCAB_MAP_FILE
from service.tools.checkpoints import CheckpointError
from service.tools.importer import quantize_version
from service.tools.trim import trim_version

VOCAB, D = 64, 16
SECRET = "line2\nroot-secret\n"


def _table() -> npt.NDArray[np.float32]:
    return np.random.default_rng(0).standard_normal((VOCAB, D)).astype(np.float32)


def _version(repository: Path, external: bool = False) -> Path:
    """``head/1``: a head, its labels and (a trimmed head's) map, each a regular file."""
    version = save_head(
        HeadWeights.from_arrays(_table()), repository / "head" / "1", external_data=external
    ).parent
    (version / LABELS_FILE).write_text("".join(f"t{i}\n" for i in range(VOCAB)))
    mapping = {"vocab_size": 2 * VOCAB, "token_ids": list(range(0, 2 * VOCAB, 2))}
    (version / VOCAB_MAP_FILE).write_text(json.dumps(mapping))
    return version


def _link_out(version: Path, name: str, outside: Path) -> None:
    """``name`` becomes a link to a file of the same content... outside the repository (the
    external data: its very bytes, so that only the link can be refused)."""
    target = outside / name
    target.write_bytes(SECRET.encode() if name == LABELS_FILE else (version / name).read_bytes())
    (version / name).unlink()
    (version / name).symlink_to(target)


def _files_holding(repository: Path, text: str) -> list[str]:
    """Regular files under ``repository`` (links not followed) whose bytes hold ``text``."""
    found = []
    for folder, _, names in os.walk(repository):
        for name in names:
            path = Path(folder) / name
            if not path.is_symlink() and text.encode() in path.read_bytes():
                found.append(str(path.relative_to(repository)))
    return found


def _quantize(repository: Path) -> object:
    return quantize_version(repository, "head", None, None, QuantSpec.parse("int8", 16))


def _trim(repository: Path) -> object:
    return trim_version(repository, "head", None, np.arange(0, 40, 2), "small")


@pytest.mark.parametrize("tool", [_quantize, _trim], ids=["quantize", "trim"])
@pytest.mark.parametrize("name", [LABELS_FILE, VOCAB_MAP_FILE, DATA_FILE])
def test_a_file_linked_out_of_the_repository_is_refused_as_the_loader_refuses_it(
    tmp_path: Path, tool: Callable[[Path], object], name: str
) -> None:
    repository, outside = tmp_path / "models", tmp_path / "outside"
    outside.mkdir()
    _link_out(_version(repository, external=True), name, outside)
    said = f"head/1/{name} is a link that resolves outside the repository: lmhead reads only"
    with pytest.raises(CheckpointError, match=said):
        tool(repository)
    assert sorted(p.name for p in (repository / "head").iterdir()) == ["1"]
    assert not (repository / "small").exists()
    assert _files_holding(repository, "root-secret") == []


def test_a_link_inside_the_repository_is_refused_too(tmp_path: Path) -> None:
    """The loader reads only regular files, wherever a link leads: so do the tools."""
    repository = tmp_path / "models"
    version = _version(repository)
    (version / LABELS_FILE).rename(repository / "labels.txt")
    (version / LABELS_FILE).symlink_to(repository / "labels.txt")
    with pytest.raises(CheckpointError, match="head/1/vocab.txt is a link: lmhead reads only"):
        _quantize(repository)
    with pytest.raises(CheckpointError, match="head/1/vocab.txt is a link: lmhead reads only"):
        _trim(repository)


def test_the_commands_refuse_a_labels_link_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through ``lmhead``: exit 2, one line naming the file; no version made of the link."""
    repository, outside = tmp_path / "models", tmp_path / "outside"
    outside.mkdir()
    _link_out(_version(repository), LABELS_FILE, outside)
    where = ["--repository", str(repository)]
    assert main(["quantize", "head", "--quantize", "int8", "--block-size", "16", *where]) == 2
    assert "head/1/vocab.txt is a link that resolves outside" in capsys.readouterr().err
    assert main(["trim", "head", "--keep", "0-9", "--name", "small", *where]) == 2
    assert "head/1/vocab.txt is a link that resolves outside" in capsys.readouterr().err
    assert _files_holding(repository, "root-secret") == []


def test_what_the_tools_write_is_what_the_version_held(tmp_path: Path) -> None:
    """Read through the private copy, labels and map still reach the new versions whole,
    and a version whose config names another labels file has those labels copied."""
    repository = tmp_path / "models"
    version = _version(repository, external=True)
    (version / LABELS_FILE).rename(version / "tokens.txt")
    (repository / "head" / "config.json").write_text(json.dumps({"labels": "tokens.txt"}))
    quantized = quantize_version(repository, "head", None, None, QuantSpec.parse("int8", 16))
    assert (quantized / "tokens.txt").read_text().split() == [f"t{i}" for i in range(VOCAB)]
    assert (quantized / VOCAB_MAP_FILE).read_bytes() == (version / VOCAB_MAP_FILE).read_bytes()
    trimmed = trim_version(repository, "head", 1, np.array([0, 2, 100]), "small")
    assert (trimmed / LABELS_FILE).read_text().split() == ["t0", "t1", "t50"]
    assert json.loads((trimmed / VOCAB_MAP_FILE).read_text())["token_ids"] == [0, 2, 100]
