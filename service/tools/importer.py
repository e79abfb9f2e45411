"""``lmhead import``: turn a Hugging Face checkpoint into a served head, tied exactly when the
model is tied (or when asked: ``--tie`` / ``--untie``), with the model's final norm when its
family has one (``service.tools.final_norms``; ``--no-norm`` leaves it out)."""

from __future__ import annotations

import errno
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from service.digits import decimal
from service.heads.files import HeadWeights, save_head
from service.heads.quantize import QuantSpec
from service.repository import staging
from service.repository.disk import LABELS_FILE
from service.repository.labels import MAX_LABEL_BYTES, first_over_bound
from service.tools.checkpoints import Checkpoint, CheckpointError, tokenizer_tokens
from service.tools.final_norms import NO_NORM, final_norm
from service.tools.sources import opened_version

#: Above this the weights go to model.onnx.data: written straight from the numpy buffers (no
#: protobuf copy, so the import peak stays near the checkpoint tensor plus its float32 copy)
#: and memory-mapped by onnxruntime when served.
EXTERNAL_DATA_ABOVE_BYTES = 256 * 2**20
#: Versions are at most 18 digits (``service.digits``).
MAX_VERSION = 10**18 - 1


@dataclass(frozen=True)
class ImportOptions:
    to_version: int | None = None
    """The version to write (None: the next free one)."""
    embedding_tensor: str | None = None
    head_tensor: str | None = None
    tie: bool = False
    untie: bool = False
    external_data: bool | None = None
    dtype: str = "float32"
    """Stored dtype of the matrices: float32, float16 or bfloat16 (half the bytes)."""
    quantization: QuantSpec | None = None
    """Block-quantize the output matrix (the one matrix when tied)."""
    quantize_table: bool = False
    """Untied heads: quantize the embedding table too."""
    no_norm: bool = False
    """Leave the model's final norm out (``service.tools.final_norms`` finds it): the head
    then reads final states only."""


@dataclass
class ImportResult:
    directory: Path
    tied: bool
    vocab_size: int
    d_model: int
    labels: bool
    notes: list[str] = field(default_factory=list)
    checkpoint_dtypes: tuple[str, ...] = ()
    """How the checkpoint stores the tensors the head was made of (float16: widened to
    float32 unless ``ImportOptions.dtype`` kept it)."""
    final_norm: str | None = None
    """The final norm kept, in one line (``rms, eps 1e-05 (model.norm.weight)``); None: none."""


def import_checkpoint(
    source: str | Path, repository: str | Path, name: str, options: ImportOptions = ImportOptions()
) -> ImportResult:
    """Read the embedding (and head) tensors and write ``repository/name/version/``."""
    if options.tie and options.untie:
        raise CheckpointError("--tie and --untie contradict each other")
    checkpoint = Checkpoint(source)
    plan = checkpoint.plan(
        embedding=options.embedding_tensor,
        head=options.head_tensor,
        tie=options.tie,
        untie=options.untie,
    )
    table = checkpoint.tensor(plan.embedding, Progress(f"[1/3] reading {plan.embedding}"))
    if table.ndim != 2 or not table.size:
        raise CheckpointError(
            f"embedding {plan.embedding} has shape {table.shape}; a head needs a non-empty "
            "(vocab_size, d_model) matrix (--embedding-tensor names another)"
        )
    notes = list(plan.notes)
    notes += _config_notes(checkpoint, len(table))
    weights, tied_in_source = _weights(checkpoint, plan.head, table, options, notes)
    transforms = checkpoint.transforms(table.shape[1], tied=tied_in_source)
    bias = checkpoint.bias()
    if transforms.describe() or bias is not None or options.dtype != "float32":
        weights = _arrays(  # NaN or Inf in the bias, or in the weights as --dtype, refused
            weights.embedding,
            weights.output,
            bias=bias,
            transforms=transforms,
            twin=weights.twin,
            dtype=options.dtype,
        )
        shown = transforms.describe() | ({"bias": True} if bias is not None else {})
        if shown:  # a half-precision head alone has none to tell
            notes.append(f"head transforms in the graph: {shown}")
    if options.no_norm:
        found = None
        notes.append(f"--no-norm: {NO_NORM}")
    else:  # float32 whatever --dtype: a side of its own, never quantized
        found = final_norm(checkpoint, table.shape[1])
        weights = replace(weights, norm=found.norm)
        notes += found.notes
    labels = _bounded(tokenizer_tokens(checkpoint.directory, table.shape[0], notes), checkpoint)
    external = options.external_data
    stored = weights.stored_nbytes(options.quantization, options.quantize_table)
    if external is None:
        external = stored > EXTERNAL_DATA_ABOVE_BYTES

    def write(staging: Path) -> None:
        writing = Progress(f"[3/3] writing {name}")
        writing(0, 1)
        save_head(
            weights,
            staging,
            external_data=external,
            quantization=options.quantization,
            quantize_table=options.quantize_table,
        )
        if labels is not None:
            (staging / LABELS_FILE).write_text("\n".join(labels) + "\n", encoding="utf-8")
        writing(1, 1)

    directory = write_version(Path(repository) / name, options.to_version, write)
    if options.quantization is not None:
        notes.append(f"{options.quantization.describe()}: {stored:,} bytes of weights")
    vocab_size, d_model = table.shape
    read = [plan.embedding] + ([plan.head] if plan.head and not weights.tied else [])
    dtypes = tuple(sorted({checkpoint.stored_dtype(tensor) for tensor in read}))
    kept = None if found is None else found.summary
    return ImportResult(
        directory, weights.tied, vocab_size, d_model, labels is not None, notes, dtypes, kept
    )


def _bounded(labels: list[str] | None, checkpoint: Checkpoint) -> list[str] | None:
    """The tokenizer's strings, refused before anything is written when one is past the bound
    the service loads labels with (the version would fail every load)."""
    over = None if labels is None else first_over_bound(labels)
    if over is not None:
        index, size = over
        raise CheckpointError(
            f"{checkpoint.directory}: the tokenizer's string of token id {index} takes {size} "
            f"bytes in a JSON answer; lmhead serves token strings of at most {MAX_LABEL_BYTES}"
        )
    return labels


def _weights(
    checkpoint: Checkpoint,
    head_name: str | None,
    table: npt.NDArray[np.float32],
    options: ImportOptions,
    notes: list[str],
) -> tuple[HeadWeights, bool]:
    """The head's weights, and whether the checkpoint's head is its embedding (T5's rescale
    follows that, even when ``--untie`` stores a separate copy)."""
    if head_name is None:
        if options.untie:
            notes.append("--untie: the head starts as a separate copy of the embedding")
            return _arrays(table, table.copy(), twin=True), True
        return _arrays(table), True
    head = checkpoint.tensor(head_name, Progress(f"[2/3] reading {head_name}"))
    if head.shape != table.shape:
        raise CheckpointError(
            f"head {head_name} has shape {head.shape} but the embedding has {table.shape}"
        )
    if options.tie:
        notes.append(_tie_warning(table, head))
        return _arrays(table), True
    redundant = bool(np.array_equal(head, table))
    if redundant and not options.untie:
        notes.append(f"{head_name} equals the embedding (a redundant copy): tied")
        return _arrays(table), True
    if checkpoint.config.get("tie_word_embeddings") is True and not redundant:
        notes.append(
            f"config.json says tie_word_embeddings, but {head_name} differs from the "
            "embedding: imported untied, as the weights are (--tie ties it to the embedding)"
        )
    return _arrays(table, head), redundant


def _arrays(
    table: npt.NDArray[np.float32],
    head: npt.NDArray[np.float32] | None = None,
    **options: Any,
) -> HeadWeights:
    """``HeadWeights.from_arrays``; NaN or Inf in the weights is the checkpoint's fault."""
    try:
        return HeadWeights.from_arrays(table, head, **options)
    except ValueError as error:
        raise CheckpointError(str(error)) from None


def _config_notes(checkpoint: Checkpoint, rows: int) -> list[str]:
    if (checkpoint.directory / "config.json").is_file():
        said = checkpoint.config.get("vocab_size")
        if said is None or said == rows:
            return []
        return [f"config.json says vocab_size {str(said)[:40]}; the embedding has {rows} rows"]
    return [
        "WARNING no config.json: tying from the tensors alone, and no head transforms "
        "(a Gemma-2 soft-cap, Cohere logit_scale or T5's tied rescale would be missing)"
    ]


def _tie_warning(table: npt.NDArray[np.float32], head: npt.NDArray[np.float32]) -> str:
    """How much forcing the tie changes the outputs, on random hidden states."""
    hidden = np.random.default_rng(0).standard_normal((64, table.shape[1])).astype(np.float32)
    tied, untied = hidden @ table.T, hidden @ head.T
    agreement = float(np.mean(tied.argmax(axis=1) == untied.argmax(axis=1)))
    change = float(np.mean(np.abs(tied - untied)))
    return (
        f"WARNING --tie changes the outputs: top-1 agreement {agreement:.0%} and mean |logit "
        f"change| {change:.3g} on 64 random hidden states"
    )


def _version_dir(model_dir: Path, version: int | None, flag: str) -> Path:
    existing = [n for p in model_dir.glob("*") if (n := decimal(p.name)) is not None]
    number = version if version is not None else max(existing, default=0) + 1
    if number > MAX_VERSION:  # a longer name is no version to the service: never seen
        raise CheckpointError(
            f"version {number} of {model_dir} is past the largest one served ({MAX_VERSION}); "
            f"choose a smaller {flag}"
        )
    directory = model_dir / str(number)
    if directory.exists() or number in existing:  # "0003" is version 3 too
        raise CheckpointError(
            f"version {number} of {model_dir} exists already; choose another {flag}"
        )
    return directory


def quantize_version(
    repository: str | Path,
    name: str,
    version: int | None,
    to_version: int | None,
    spec: QuantSpec,
    quantize_table: bool = False,
) -> Path:
    """Write a block-quantized copy of ``name``'s version (the newest by default) as a new
    version, its labels and token map (a trimmed head's original ids) included, each as the
    service would load it (``sources.opened_version``); it appears complete (renamed into
    place) or not at all."""
    with opened_version(repository, name, version) as source:

        def write(staging: Path) -> None:
            stored = source.weights.stored_nbytes(spec, quantize_table)
            save_head(
                source.weights,
                staging,
                external_data=stored > EXTERNAL_DATA_ABOVE_BYTES,
                quantization=spec,
                quantize_table=quantize_table,
            )
            source.copy_side_files(staging)

        return write_version(Path(repository) / name, to_version, write, flag="--to-version")


def write_version(
    model_dir: Path,
    to_version: int | None,
    write: Callable[[Path], None],
    flag: str = "--to-version",
) -> Path:
    """``write`` fills the new version, which appears complete or not at all
    (``staging.write_whole``). ``flag``: the option that chose ``to_version``, named when
    that version exists."""
    if model_dir.exists() and not model_dir.is_dir():
        raise CheckpointError(f"{model_dir} is a file, not a model directory")
    target = _version_dir(model_dir, to_version, flag)
    try:
        staging.write_whole(target, write)
    except FileExistsError:  # another command published this version meanwhile
        taken = f"version {target.name} was written meanwhile (choose another {flag})"
        raise FileExistsError(errno.EEXIST, taken, str(target)) from None
    return target


class Progress:
    """A one-line progress bar on stderr; silent when stderr is not a terminal."""

    WIDTH = 30

    def __init__(self, label: str) -> None:
        self.label = label
        self.enabled = sys.stderr.isatty()

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        filled = self.WIDTH * done // max(total, 1)
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        end = "\n" if done >= total else ""
        print(
            f"\r{self.label} [{bar}] {100 * done // max(total, 1):3d}%",
            end=end,
            file=sys.stderr,
            flush=True,
        )
