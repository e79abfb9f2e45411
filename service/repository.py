"""The model repository on disk: scan ``<name>/<version>/model.onnx``; synchronous, stateless.

Layout (Triton's)::

    models/
      <name>/config.json          optional: labels file, default k, max batch rows
      <name>/<version>/model.onnx (+ model.onnx.data when the weights are external)
      <name>/<version>/vocab.txt  optional token strings, line i = token id i

Names and versions are validated here so that nothing taken from a request can address a
path outside the repository: names are a strict pattern, and every model and version directory
must resolve (symlinks followed) to a place inside the repository.

A version's *signature* is the name, size and modification time of each of its files. The
registry reuses a loaded version whose signature is unchanged, and the poller only considers a
version once its signature has been stable across two scans (a copy in progress changes it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from service.errors import describe_validation_errors

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: The repository's file names, defined here only.
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
CONFIG_FILE = "config.json"
LABELS_FILE = "vocab.txt"
Signature = tuple[tuple[str, int, int], ...]


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
    signatures: dict[int, Signature] = field(default_factory=dict)

    def selected(self, pin: int | None = None) -> list[int]:
        """The versions to serve: the pinned one, or those the config's policy names."""
        if pin is not None:
            if pin not in self.versions:
                raise RepositoryError(
                    f"model {self.name!r} has no complete version {pin} on disk; "
                    f"versions: {sorted(self.versions) or 'none'}"
                )
            return [pin]
        policy = self.config.versions
        if not self.versions:
            return []
        if policy == "latest":
            return [max(self.versions)]
        if policy == "all":
            return sorted(self.versions)
        return sorted(set(policy) & set(self.versions))


def is_valid_name(name: str) -> bool:
    return bool(NAME_PATTERN.fullmatch(name)) and name not in {".", ".."}


def model_names(repository: Path) -> list[str]:
    """Model directories in the repository, sorted; hidden and odd names are skipped."""
    if not repository.is_dir():
        return []
    return sorted(
        entry.name for entry in repository.iterdir() if entry.is_dir() and is_valid_name(entry.name)
    )


def read_source(repository: Path, name: str) -> ModelSource:
    """Read one model directory; raise RepositoryError when it is missing or unusable."""
    if not is_valid_name(name):
        raise RepositoryError(
            f"invalid model name {name[:64]!r}: use letters, digits, '.', '_', '-' "
            "(starting with a letter or digit)"
        )
    root = repository.resolve()
    directory = repository / name
    if not directory.is_dir():
        raise RepositoryError(f"no model directory {name!r} in the repository")
    _check_inside(directory, root)
    versions: dict[int, Path] = {}
    for entry in directory.iterdir():
        if entry.is_dir() and entry.name.isdigit() and (entry / MODEL_FILE).is_file():
            _check_inside(entry, root)
            versions[int(entry.name)] = entry
    ordered = dict(sorted(versions.items()))
    signatures = {version: signature(path) for version, path in ordered.items()}
    return ModelSource(name, read_config(directory), ordered, signatures)


def signature(version_dir: Path) -> Signature:
    """Name, size and mtime of each file in a version directory (cheap: stat only)."""
    entries = []
    for entry in sorted(version_dir.iterdir()):
        if entry.is_file():
            stat = entry.stat()
            entries.append((entry.name, stat.st_size, stat.st_mtime_ns))
    return tuple(entries)


def _check_inside(path: Path, root: Path) -> None:
    if not path.resolve().is_relative_to(root):
        raise RepositoryError(f"{path.name!r} resolves outside the repository (symlink?)")


def read_config(directory: Path) -> ModelConfig:
    path = directory / CONFIG_FILE
    if not path.is_file():
        return ModelConfig()
    try:
        return ModelConfig.model_validate_json(path.read_bytes())
    except ValidationError as error:
        raise RepositoryError(f"{path}: {describe_validation_errors(error.errors())}") from None


def read_labels(version_dir: Path, filename: str, vocab_size: int) -> list[str] | None:
    """Token strings for a version, or None without a labels file; never more than the vocab."""
    path = (version_dir / filename).resolve()
    if not path.is_relative_to(version_dir.resolve()):
        raise RepositoryError(f"labels file {filename!r} is outside {version_dir}")
    if not path.is_file():
        return None
    labels = path.read_text(encoding="utf-8").split("\n")
    if labels and labels[-1] == "":
        labels.pop()
    if len(labels) > vocab_size:
        raise RepositoryError(
            f"{path} has {len(labels)} labels but the head has vocab_size {vocab_size}"
        )
    return labels
