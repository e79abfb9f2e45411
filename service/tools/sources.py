"""The version a command makes another of (``lmhead quantize``, ``lmhead trim``), read as the
service loads it.

The files are read from a private copy made by the loader's own code
(``staging.private_copy``, ``PrivateCopy.bring_head``): each file the head uses opened once,
never through a link, checked through the open file and copied from it. A second reader with
checks of its own drifted from the loader's: it followed a labels file linked to a file
outside the repository, and wrote that file into the new version as a regular file, which was
then served (issue 43), while the loader refused the link in the version it came from. Now a
version the service would refuse is refused here with the loader's message, and what is
copied into the new version is what the loader would have served.

The copy is made where the loader makes its own (the system's temp directory, ``TMPDIR``) and
removed when the command is done with it; a command killed meanwhile leaves it locked no
longer, and the next service sweeps it.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from service.digits import decimal
from service.heads import MODEL_FILE
from service.heads.files import HeadWeights, dtype_name, read_head
from service.repository.disk import VOCAB_MAP_FILE, read_config, signature
from service.repository.side_files import read_labels, read_space
from service.repository.staging import private_copy
from service.runtime.vocabulary import TokenSpace
from service.tools.checkpoints import CheckpointError


@dataclass(frozen=True)
class SourceFiles:
    """A version as the service would load it, read from its private copy (valid inside
    ``opened_version`` only: the copy goes when it ends)."""

    directory: Path
    """The version's directory in the repository (what messages name)."""
    copy: Path
    """Its private copy: the files the head uses, regular files only."""
    weights: HeadWeights
    labels_file: str
    """The labels file's name (the model's ``config.json`` may name another than vocab.txt)."""
    labels: list[str] | None
    space: TokenSpace

    def copy_side_files(self, staging: Path) -> None:
        """The labels file and token map, as checked, into a new version of the same rows and
        the same model (the same ``config.json``): copied from the private copy, never from
        the repository again."""
        for name in (self.labels_file, VOCAB_MAP_FILE):
            if (self.copy / name).is_file():
                shutil.copyfile(self.copy / name, staging / name)


@contextmanager
def opened_version(repository: str | Path, name: str, version: int | None) -> Iterator[SourceFiles]:
    """``name``'s version (the newest by default), read as the loader reads it; anything the
    loader would refuse is a ``CheckpointError`` naming the file (the private copy's path
    never shows)."""
    model_dir = Path(repository) / name
    source = source_version(model_dir, version)
    root = Path(repository).resolve()
    copy: Path | None = None
    with ExitStack() as stack:
        try:
            labels_file = read_config(model_dir, root).labels
            expected = signature(source)
            private = stack.enter_context(private_copy(source, root))
            copy = private.path
            rows = private.bring_head(labels_file).vocab_size
            private.check_unchanged(expected)
            files = SourceFiles(
                source,
                copy,
                read_float_head(copy),
                labels_file,
                read_labels(copy, labels_file, rows),
                read_space(copy, rows),
            )
        except ValueError as error:  # RepositoryError, HeadInspectionError, UnicodeDecodeError
            raise CheckpointError(f"{source}: {_said_of(error, copy, source)}") from None
        yield files


def _said_of(error: ValueError, copy: Path | None, source: Path) -> str:
    """The error's message with the private copy named as the version it copies."""
    text = str(error)
    if copy is not None:
        text = text.replace(str(copy), str(source))
        text = text.replace(copy.name, f"{source.parent.name}/{source.name}")
    return text


def source_version(model_dir: Path, version: int | None) -> Path:
    """A model's version directory (the newest by default) that holds a head file."""
    versions = {n: p for p in model_dir.glob("*") if (n := decimal(p.name)) is not None}
    if not versions:
        raise CheckpointError(f"no versions of {model_dir.name!r} in {model_dir.parent}")
    number = version if version is not None else max(versions)
    source = versions.get(number, model_dir / str(number))  # "001" is version 1
    if not (source / MODEL_FILE).is_file():
        raise CheckpointError(f"{source} holds no {MODEL_FILE}")
    return source


def read_float_head(directory: Path) -> HeadWeights:
    """A float head, checked as an import checks a checkpoint (finite float32, float16 or
    bfloat16 weights), so that what is made of it loads."""
    try:
        read = read_head(directory / MODEL_FILE, root=directory)
        return HeadWeights.from_arrays(
            read.embedding,
            read.output,
            bias=read.bias,
            transforms=read.transforms,
            twin=read.twin,
            dtype=dtype_name(read.embedding.dtype),
            norm=read.norm,
        )
    except ValueError as error:  # already quantized, or not a head the service would load
        raise CheckpointError(f"{error} (--version picks another)") from None
