"""The model repository on disk: scan ``<name>/<version>/model.onnx``; synchronous, stateless.

Layout (Triton's)::

    models/
      <name>/config.json          optional: labels file, default k, max batch rows
      <name>/<version>/model.onnx (+ model.onnx.data when the weights are external)
      <name>/<version>/vocab.txt  optional token strings, line i = token id i

Names and versions are validated here so that nothing taken from a request can address a
path outside the repository: names are a strict pattern, and every model and version directory
must resolve (symlinks followed) to a place inside the repository.

A version's *signature* is the name, size and modification time of each of its files and of
the model's ``config.json``. The registry reuses a loaded version whose signature is unchanged
(a config edit or a file changed under the same number loads the version again), and the
poller only considers a version once its signature was stable across two scans (a copy in
progress changes it).

Versions are immutable once served: ``private_copy`` loads each from a copy that nobody else
can write (removed as soon as onnxruntime has it), so truncating or overwriting the files of a
served version changes nothing it answers, and a change is seen as a change (a new load).
"""

from __future__ import annotations

import json
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from service import staging
from service.digits import decimal
from service.errors import describe_validation_errors
from service.vocabulary import TokenSpace

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: The repository's file names, defined here only.
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
CONFIG_FILE = "config.json"
LABELS_FILE = "vocab.txt"
#: A trimmed head's original ids (``service.trim``).
VOCAB_MAP_FILE = "vocab_map.json"
Signature = tuple[tuple[str | int, ...], ...]
#: A version's private copy (locked by its loader while it loads from it: ``service.staging``).
COPY_PREFIX = "lmhead-version-"
MAX_CONFIG_BYTES = 1 << 20


class RepositoryError(ValueError):
    """A file in the repository is unusable; the message names the file and the problem."""


class ShadowConfig(BaseModel):
    """Replay a sampled fraction of this model's requests on another served model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    fraction: float = Field(default=0.1, ge=0.0, le=1.0)


class ModelConfig(BaseModel):
    """``<name>/config.json``: every field optional, unknown fields refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    versions: Literal["latest", "all"] | list[int] = "latest"
    """Which versions to load: the highest only (default, like Triton), all, or a list."""
    labels: str = LABELS_FILE
    """Token strings file inside each version directory (one token per line)."""

    @field_validator("labels")
    @classmethod
    def _plain_file_name(cls, value: str) -> str:
        if not is_valid_name(value):
            raise ValueError("must be a file name inside the version directory")
        return value

    default_k: int | None = Field(default=None, ge=1)
    """Top-k for requests that do not say; the service setting applies when absent."""
    d_model: int | None = Field(default=None, ge=1)
    """When set, a version with another d_model fails to load (protects a trunk's callers)."""
    max_batch_rows: int | None = Field(default=None, ge=1)
    """Cap on rows merged into one run for this model."""
    shadow: ShadowConfig | None = None
    """Shadow traffic: {"model": "candidate", "fraction": 0.1}."""
    shadow_k: int = Field(default=10, ge=1)
    """k of the top-k overlap that shadow metrics report."""


@dataclass(frozen=True)
class ModelSource:
    """One model directory: its config and its complete version directories."""

    name: str
    config: ModelConfig
    versions: dict[int, Path] = field(default_factory=dict)
    files: dict[int, Signature] = field(default_factory=dict)
    config_file: Signature = ()
    refused: dict[int, str] = field(default_factory=dict)
    """Version directories that are no version of this model (each says why): served never,
    reported as failed, and the model's other versions serve as if they were not there."""

    def signature(self, version: int) -> Signature:
        """The version's files with the model's config.json: an edit of either is a change."""
        return self.files[version] + self.config_file

    def selected(self, pin: int | None = None, present: frozenset[int] = frozenset()) -> list[int]:
        """The versions to serve: the pinned one, or those the config's policy names.
        ``present``: refused versions to count as there (served ones: a slip beside them
        must not make the policy pick an older version)."""
        versions = set(self.versions) | (present & set(self.refused))
        if pin is not None:
            if pin in self.refused and pin not in versions:
                raise RepositoryError(f"model {self.name!r} version {pin}: {self.refused[pin]}")
            if pin not in versions:
                raise RepositoryError(
                    f"model {self.name!r} has no complete version {pin} on disk; "
                    f"versions: {sorted(self.versions) or 'none'}"
                )
            return [pin]
        policy = self.config.versions
        if not versions:
            return []
        if policy == "latest":
            return [max(versions)]
        if policy == "all":
            return sorted(versions)
        return sorted(set(policy) & versions)


def is_valid_name(name: str) -> bool:
    return bool(NAME_PATTERN.fullmatch(name)) and name not in {".", ".."}


def model_names(repository: Path, only: str | None = None) -> list[str]:
    """Model directories in the repository, sorted; hidden and odd names are skipped.
    ``only`` keeps that one name (``LMHEAD_MODEL_NAME``: one model per server, as KServe
    runs them)."""
    if not repository.is_dir():
        return []
    return sorted(
        entry.name
        for entry in repository.iterdir()
        if is_valid_name(entry.name) and only in (None, entry.name) and maybe_dir(entry)
    )


def maybe_dir(entry: Path) -> bool:
    """A directory, or an entry that cannot be looked at (a link into a directory this user
    may not search, a target name too long): listed, it fails alone with its reason, where
    raising here stopped start-up and every scan."""
    try:
        return entry.is_dir()
    except OSError:
        return True


def cannot_read(error: OSError) -> str:
    """Why a file could not be read, without its path (reasons reach clients)."""
    return error.strerror or type(error).__name__


def _unreadable_version(entry: Path, error: OSError) -> str:
    return f"version {entry.name[:32]!r} cannot be read ({cannot_read(error)})"


def read_source(repository: Path, name: str) -> ModelSource:
    """Read one model directory; raise RepositoryError when it is missing or unusable."""
    if not is_valid_name(name):
        raise RepositoryError(
            f"invalid model name {name[:64]!r}: use letters, digits, '.', '_', '-' "
            "(starting with a letter or digit)"
        )
    root = repository.resolve()
    directory = repository / name
    try:
        if not directory.is_dir():
            raise RepositoryError(f"no model directory {name!r} in the repository")
        _check_inside(directory, root)
        ordered, refused = version_entries(directory, root)
        config_path = directory / CONFIG_FILE
        config_signature = file_signature(config_path) if config_path.exists() else ()
        config = read_config(directory, root)
    except OSError as error:
        why = cannot_read(error)
        raise RepositoryError(f"model directory {name!r} cannot be read ({why})") from None
    files = {}
    for version, path in list(ordered.items()):  # an unreadable version fails alone
        try:
            files[version] = signature(path)
        except OSError as error:
            refused[version] = _unreadable_version(path, error)
            del ordered[version]
    return ModelSource(name, config, ordered, files, config_signature, refused)


def version_dirs(directory: Path) -> dict[int, Path]:
    """A model directory's complete versions (a number and a model file), by number."""
    return _versions(directory)[0]


def version_entries(directory: Path, root: Path) -> tuple[dict[int, Path], dict[int, str]]:
    """Complete versions by number, and the version directories refused, each with why: one
    that resolves outside the repository (``root``, resolved), or a number two directories
    claim. A refused version fails alone; the model's other versions still serve."""
    ordered, refused = _versions(directory)
    for number, entry in list(ordered.items()):
        try:
            _check_inside(entry, root)
        except RepositoryError as error:
            refused[number] = str(error)
            del ordered[number]
    return ordered, refused


def _versions(directory: Path) -> tuple[dict[int, Path], dict[int, str]]:
    """Complete versions by number, and the numbers that two directories claim ("6" and
    "0006"): which one served would depend on the order the file system lists them in."""
    if not directory.is_dir():
        return {}, {}
    claims: dict[int, list[Path]] = {}
    unreadable: dict[int, str] = {}
    for entry in directory.iterdir():
        number = decimal(entry.name)  # "²" or 40 digits: not a version
        if number is None:
            continue
        try:
            if entry.is_dir() and (entry / MODEL_FILE).is_file():
                claims.setdefault(number, []).append(entry)
        except OSError as error:  # fails alone; the model's other versions still serve
            unreadable[number] = _unreadable_version(entry, error)
    versions = {number: entries[0] for number, entries in claims.items() if len(entries) == 1}
    refused = {
        number: f"directories {sorted(e.name[:32] for e in entries)} are all version "
        f"{number}: rename all but one"
        for number, entries in claims.items()
        if len(entries) > 1
    }
    for number, reason in unreadable.items():
        versions.pop(number, None)
        refused[number] = reason
    return dict(sorted(versions.items())), refused


def signature(version_dir: Path) -> Signature:
    """Each entry of a version directory (cheap: stat only): a file as ``file_signature``
    has it, anything else by name and kind, so removing a FIFO or a dangling link that failed
    a load is a change too, and the load is tried again."""
    entries: list[tuple[str | int, ...]] = []
    for path in sorted(version_dir.iterdir()):
        if path.is_file():
            entries += file_signature(path)
        else:
            entries.append((path.name, stat.S_IFMT(path.lstat().st_mode)))
    return tuple(entries)


def file_signature(path: Path) -> Signature:
    """Name, size, mtime, inode and mode: a file replaced with one of the same size and mtime
    (``rsync -a``, ``tar x`` of files built at a fixed time) has another inode, and a
    ``chmod`` that makes it readable changes the mode. Not the ctime: a hard link or a
    ``chown`` changes it, and would load an unchanged version again."""
    status = path.stat()
    return ((path.name, status.st_size, status.st_mtime_ns, status.st_ino, status.st_mode),)


@contextmanager
def private_copy(
    version_dir: Path, expected: Signature, root: Path, into: Path | None = None
) -> Iterator[Path]:
    """The version's files copied where nobody else can write them; removed on exit.

    Load from the copy, then let it go: onnxruntime keeps what it mapped (an unlinked file
    stays readable while mapped), and no later write to the repository reaches it. Only
    regular files inside the repository are copied (a FIFO would block the loader, a link out
    of the repository would serve files nobody put there); files that differ from ``expected``
    (``ModelSource.files`` as scanned) after the copy fail the load: never a mix of two versions.
    """
    target = Path(tempfile.mkdtemp(prefix=COPY_PREFIX, dir=into))
    lock = staging.hold(target)  # in use: ``sweep_stale_copies`` leaves it
    try:
        for path in sorted(version_dir.iterdir()):
            if path.is_dir():
                continue
            _check_regular(path, root)
            shutil.copyfile(path, target / path.name)
        if signature(version_dir) != expected:
            raise RepositoryError(
                f"the files of {version_dir.parent.name}/{version_dir.name} changed while "
                "being loaded; publish a version by renaming a complete directory into place"
            )
        yield target
    finally:
        shutil.rmtree(target, ignore_errors=True)
        lock.close()


def sweep_stale_copies(into: Path | None) -> list[str]:
    """Remove the version copies left by processes killed mid-load (no ``finally`` ran; each
    holds a whole head): a copy in use is locked (``service.staging``)."""
    return staging.sweep(into or Path(tempfile.gettempdir()), COPY_PREFIX)


def _check_regular(path: Path, root: Path) -> None:
    """A regular file, itself or behind a link that stays inside the repository."""
    where = f"{path.parent.parent.name}/{path.parent.name}/{path.name}"
    if not path.resolve().is_relative_to(root):
        raise RepositoryError(f"{where} resolves outside the repository")
    if not stat.S_ISREG(path.stat().st_mode):
        raise RepositoryError(f"{where} is not a regular file")


def _check_inside(path: Path, root: Path) -> None:
    if not path.resolve().is_relative_to(root):
        raise RepositoryError(f"{path.name!r} resolves outside the repository (symlink?)")


def read_config(directory: Path, root: Path) -> ModelConfig:
    path = directory / CONFIG_FILE
    if not path.exists():
        return ModelConfig()
    where = f"{directory.name}/{CONFIG_FILE}"
    _check_regular(path, root)
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise RepositoryError(f"{where} is over {MAX_CONFIG_BYTES} bytes")
    try:
        return ModelConfig.model_validate_json(path.read_bytes())
    except ValidationError as error:
        raise RepositoryError(f"{where}: {describe_validation_errors(error.errors())}") from None
    except OSError as error:
        raise RepositoryError(f"{where} cannot be read ({cannot_read(error)})") from None


def read_labels(version_dir: Path, filename: str, vocab_size: int) -> list[str] | None:
    """Token strings for a version, or None without a labels file; never more than the vocab."""
    path = version_dir / filename
    if not path.is_file():
        return None
    # Lines end at "\n" only: ``read_text`` would also end them at a "\r" inside a token
    # (universal newlines) and shift every later id's string.
    labels = path.read_bytes().decode("utf-8").split("\n")
    if labels and labels[-1] == "":
        labels.pop()
    if labels and all(label.endswith("\r") for label in labels):  # a file saved with CRLF
        labels = [label[:-1] for label in labels]
    if len(labels) > vocab_size:
        raise RepositoryError(
            f"{filename} has {len(labels)} labels but the head has vocab_size {vocab_size}"
        )
    return labels


def read_space(version_dir: Path, vocab_size: int) -> TokenSpace:
    """The version's token space: its own columns, or the original ids of a trimmed head."""
    path = version_dir / VOCAB_MAP_FILE
    if not path.is_file():
        return TokenSpace(vocab_size)
    try:
        mapping = json.loads(path.read_text(encoding="utf-8"))
        size, ids = int(mapping["vocab_size"]), np.array(mapping["token_ids"], np.int64)
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{VOCAB_MAP_FILE} is not a token map: {error}") from None
    if ids.shape != (vocab_size,):
        raise ValueError(f"{VOCAB_MAP_FILE} maps {ids.size} ids; the head has {vocab_size} rows")
    if (np.diff(ids) <= 0).any() or ids[0] < 0 or ids[-1] >= size:
        raise ValueError(f"{VOCAB_MAP_FILE} token_ids must ascend within [0, {size})")
    return TokenSpace(size, ids)
