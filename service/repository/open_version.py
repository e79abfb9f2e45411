"""Open one version of a model: copy the files its head uses, inspect, open and label it.

Everything is read from a private copy of the version (``staging.private_copy``): what is
served is what was inspected, whatever happens to the repository's files afterwards. Only
the files the head uses are copied, each no further than the head reads it: the graph, the
external data files it names (up to the last byte a tensor takes), the labels file and a
trimmed head's id map (each refused past its size limit before a byte is copied). Any other
file in the version is left where it is: a stray file, however large or sparse, costs no
scratch space. Its warm-up runs apart, under a deadline (``service.repository.warm_up``): this
part's time is bounded by the files' sizes, a run's by nothing but the graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from service.heads import MODEL_FILE
from service.heads.inspector import HeadReport
from service.limits import Limits
from service.repository.disk import ModelConfig, ModelSource, RepositoryError
from service.repository.loaded_version import LoadedVersion
from service.repository.side_files import read_labels, read_space
from service.repository.staging import private_copy
from service.runtime.layout import Placement, open_head
from service.runtime.session import HeadSession
from service.settings import MemoryMode


@dataclass(frozen=True)
class LoadOptions:
    memory_mode: MemoryMode
    intra_op_threads: int
    default_k: int
    limits: Limits
    repository: Path
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    scratch: Path | None = None
    """Where private copies of versions are made while loading (the system's temp dir)."""
    tf32: bool = False

    @property
    def placement(self) -> Placement:
        return Placement(self.memory_mode, self.intra_op_threads, self.providers, self.tf32)


class VersionLoadError(ValueError):
    """A version could not be opened; the message names the model and version, not a path."""


def open_version(source: ModelSource, version: int, options: LoadOptions) -> LoadedVersion:
    """Copy, inspect, open and label one version, not yet warmed up (blocking; run it off the
    event loop, on the one thread that opens sessions)."""
    root = options.repository.resolve()
    directory, config = source.versions[version], source.config
    with private_copy(directory, root, options.scratch) as private:
        try:
            report = private.bring_head(config.labels)
            private.check_unchanged(source.files[version])
            session = open_head(
                private.path / MODEL_FILE, options.placement, report=report, scratch=private.path
            )
            labels = read_labels(private.path, config.labels, report.vocab_size)
            space = read_space(private.path, report.vocab_size)
        except RepositoryError:
            raise
        except Exception as error:  # say where, not the private copy's temporary path
            text = str(error).replace(str(private.path), f"{source.name}/{version}")
            raise VersionLoadError(f"{type(error).__name__}: {text}") from None
    _check_shapes(session, report, config)
    default_k = config.default_k or options.default_k
    options.limits.check_default_k(default_k)
    return LoadedVersion(
        name=source.name,
        version=version,
        session=session,
        report=report,
        config=config,
        labels=labels,
        default_k=default_k,
        signature=source.signature(version),
        token_space=space if space.kept is not None else None,
    )


def _check_shapes(session: HeadSession, report: HeadReport, config: ModelConfig) -> None:
    if (session.vocab_size, session.d_model) != (report.vocab_size, report.d_model):
        raise ValueError(
            f"graph outputs say vocab {session.vocab_size} x d_model {session.d_model} but the "
            f"weights are {report.vocab_size} x {report.d_model}"
        )
    if config.d_model is not None and report.d_model != config.d_model:
        raise ValueError(
            f"head has d_model {report.d_model} but config.json requires {config.d_model}"
        )
