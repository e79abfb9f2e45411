"""Private copies of versions: each file opened once, without following links, checked
through the open file and copied from it; only the files a head uses, no further than it
reads them."""

from __future__ import annotations

import resource
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import numpy as np
import numpy.typing as npt
import pytest

from service.heads import DATA_FILE, MODEL_FILE
from service.heads.files import HeadWeights, save_head
from service.limits import Limits
from service.repository import staging
from service.repository.disk import RepositoryError, read_source
from service.repository.open_version import LoadOptions, open_version
from service.repository.staging import private_copy

OPTIONS = {"memory_mode": "shared", "intra_op_threads": 1, "default_k": 5}
LIMITS = Limits(max_rows=64, max_k=100, max_logits_bytes=2**24, max_inflight_bytes=2**26)


@pytest.fixture
def version(tmp_path: Path, table: npt.NDArray[np.float32]) -> Path:
    directory = tmp_path / "models" / "m" / "1"
    save_head(HeadWeights.from_arrays(table), directory, external_data=True)
    (directory / "vocab.txt").write_text("".join(f"t{i}\n" for i in range(len(table))))
    (tmp_path / "secret.txt").write_text("a file outside the repository\n")
    return directory


def _swap_for_a_link(version: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe's race, without the race: after a file was opened and checked, and before a
    byte of it is copied, it becomes a link to a file outside the repository."""
    copy = staging._copy

    def swap_then_copy(source: BinaryIO, target: BinaryIO, size: int) -> None:
        labels = version / "vocab.txt"
        if Path(target.name).name == labels.name and not labels.is_symlink():
            labels.unlink()
            labels.symlink_to(version.parents[2] / "secret.txt")
        copy(source, target, size)

    monkeypatch.setattr(staging, "_copy", swap_then_copy)


def test_a_file_swapped_for_a_link_after_its_check_is_copied_as_it_was(
    version: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = (version / "vocab.txt").read_bytes()
    _swap_for_a_link(version, monkeypatch)
    with private_copy(version, version.parents[1].resolve()) as private:
        assert private.bring("vocab.txt")
        assert (private.path / "vocab.txt").read_bytes() == expected


def test_a_version_loads_what_it_held_when_opened_never_the_link(
    version: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the loader: the labels copied are the version's own, and the version, changed
    while it was copied, is refused whole (never a mix, never the outside file)."""
    root = version.parents[1]
    source = read_source(root, "m")
    _swap_for_a_link(version, monkeypatch)
    options = LoadOptions(**OPTIONS, limits=LIMITS, repository=root)  # type: ignore[arg-type]
    with pytest.raises(RepositoryError, match="m/1 changed while being loaded"):
        open_version(source, 1, options)
    (version / "vocab.txt").unlink()  # put back as it was: it loads, with its own labels
    (version / "vocab.txt").write_text("".join(f"t{i}\n" for i in range(3)))
    monkeypatch.undo()
    loaded = open_version(read_source(root, "m"), 1, options)
    assert loaded.labels == ["t0", "t1", "t2"]


def test_a_link_in_a_version_is_refused_saying_where_it_leads(version: Path) -> None:
    (version / "vocab.txt").unlink()
    (version / "vocab.txt").symlink_to(version.parents[2] / "secret.txt")
    with (
        private_copy(version, version.parents[1].resolve()) as private,
        pytest.raises(RepositoryError, match="m/1/vocab.txt is a link that resolves outside"),
    ):
        private.bring("vocab.txt")


@contextmanager
def small_files(limit: int) -> Iterator[None]:
    """No file this process writes may pass ``limit`` bytes meanwhile (EFBIG past it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def test_files_the_head_does_not_use_cost_no_scratch(
    version: Path, table: npt.NDArray[np.float32]
) -> None:
    """A 2 GiB sparse stray file, and a 2 GiB sparse tail on the data file: the loader
    copies neither (each would pass the file size limit), and serves the head."""
    with (version / "junk.bin").open("wb") as junk:
        junk.truncate(2**31)
    data = version / DATA_FILE
    used = data.stat().st_size
    with data.open("r+b") as tail:
        tail.truncate(used + 2**31)
    root = version.parents[1]
    options = LoadOptions(**OPTIONS, limits=LIMITS, repository=root)  # type: ignore[arg-type]
    with small_files(64 * 2**20):
        loaded = open_version(read_source(root, "m"), 1, options)
    hidden = np.random.default_rng(0).standard_normal((2, table.shape[1]), dtype=np.float32)
    top = loaded.session.project(hidden, 3)
    np.testing.assert_array_equal(top.topk_token_ids, np.argsort(-(hidden @ table.T))[:, :3])
    assert (version / MODEL_FILE).stat().st_size < 64 * 2**20
