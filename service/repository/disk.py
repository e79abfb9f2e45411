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

Versions are immutable once served: ``staging.private_copy`` loads each from a copy nobody else
can write (removed as soon as onnxruntime has it), so truncating or overwriting the files of a
served version changes nothing it answers, and a change is seen as a change (a new load).
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from service.digits import decimal
from service.errors import describe_validation_errors
from service.heads import MODEL_FILE

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: The repository's file names beside the head's own (``service.heads``), defined here only.
CONFIG_FILE = "config.json"
LABELS_FILE = "vocab.txt"
#: A trimmed head's original ids (``service.tools.trim``).
VOCAB_MAP_FILE = "vocab_map.json"
Signature = tuple[tuple[str | int, ...], ...]
MAX_CONFIG_BYTES = 1 << 20


class RepositoryError(ValueError):
    """A file in the repository is unusable; the message names the file and the problem."""


class ShadowConfig(BaseModel):
    """Replay a sampled fraction of this model's requests on another served model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    fraction: float = Field(default=0.1, ge=0.0, le=1.0)

    @field_validator("model")
    @classmethod
    def _a_model_name(cls, value: str) -> str:
        """A name the repository could hold (``../../etc`` loaded, and shadowed nothing)."""
        if not is_valid_name(value):
            raise ValueError(f"{value[:64]!r} is no model name")
        return value


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


def open_regular(
    directory: Path, name: str, root: Path, where: str, dir_fd: int | None = None
) -> BinaryIO | None:
    """``name`` in ``directory`` (or in the directory open as ``dir_fd``), opened once without
    following a link and checked through the open file: a regular file, to be read from this
    file object only (a name checked, then opened again, could be swapped for a link to any
    file on the machine in between). None when there is no such file. ``where``: the name the
    errors give it (reasons reach clients: no machine paths)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a FIFO opens at once
    try:
        fd = os.open(name if dir_fd is not None else directory / name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as error:
        if error.errno == errno.ELOOP:  # the name is a link
            outside = not (directory / name).resolve().is_relative_to(root)
            raise RepositoryError(
                f"{where} is a link{' that resolves outside the repository' if outside else ''}"
                ": lmhead reads only regular files (copy the file in)"
            ) from None
        raise RepositoryError(f"{where} cannot be opened ({cannot_read(error)})") from None
    opened = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        opened.close()
        raise RepositoryError(f"{where} is not a regular file")
    os.set_blocking(fd, True)
    return opened


def _check_inside(path: Path, root: Path) -> None:
    if not path.resolve().is_relative_to(root):
        raise RepositoryError(f"{path.name!r} resolves outside the repository (symlink?)")


def read_config(directory: Path, root: Path) -> ModelConfig:
    where = f"{directory.name}/{CONFIG_FILE}"
    opened = open_regular(directory, CONFIG_FILE, root, where)
    if opened is None:
        return ModelConfig()
    try:
        with opened:
            if os.fstat(opened.fileno()).st_size > MAX_CONFIG_BYTES:
                raise RepositoryError(f"{where} is over {MAX_CONFIG_BYTES} bytes")
            return ModelConfig.model_validate_json(opened.read())
    except ValidationError as error:
        # An error of the whole file (not JSON, not an object) is the file's, not a "body:"
        why = describe_validation_errors(error.errors(), whole="")
        raise RepositoryError(f"{where}: {why}") from None
    except OSError as error:
        raise RepositoryError(f"{where} cannot be read ({cannot_read(error)})") from None
