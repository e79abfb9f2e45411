"""Read Hugging Face safetensors checkpoints without torch: only the embedding and head tensors
(and the final norm's, ``service.tools.final_norms``).

``safetensors`` memory-maps the files and slices are copied out row chunk by row chunk, so
importing a head never loads the whole checkpoint and the peak is the float32 head plus one
chunk. bf16 and fp16 convert to float32 exactly (numpy reads bf16 through ml_dtypes, which
onnx already depends on).

Head transforms from the config (Gemma-2 ``final_logit_softcapping``, Cohere ``logit_scale``,
the T5 family's tied ``d_model ** -0.5`` rescale) and Phi-2's ``lm_head.bias`` go into the graph.

Tying follows the checkpoint: no head tensor and ``tie_word_embeddings``
true (the default) -> tied; a head tensor equal to the embedding (OPT-125m, Qwen1.5 ship a
redundant copy) -> tied, with a note; no head but ``tie_word_embeddings: false`` -> an error,
never a random head.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so bf16 slices read exactly)
import numpy as np
import numpy.typing as npt
from safetensors import SafetensorError, safe_open

from service.heads.graph import HeadTransforms

EMBEDDING_TENSORS = (
    "model.embed_tokens.weight",  # Llama, Mistral, Qwen, Gemma, SmolLM, Phi
    "transformer.wte.weight",  # GPT-2 (with the model prefix)
    "wte.weight",  # GPT-2 (bare)
    "model.decoder.embed_tokens.weight",  # OPT
    "gpt_neox.embed_in.weight",  # GPT-NeoX, Pythia
    "shared.weight",  # T5
    "embed_tokens.weight",  # a bare LlamaModel, MistralModel, Qwen2Model, GemmaModel, PhiModel
    "decoder.embed_tokens.weight",  # a bare OPTModel
    "embed_in.weight",  # a bare GPTNeoXModel
)
HEAD_TENSORS = ("lm_head.weight", "embed_out.weight")
#: Models whose tied output is rescaled by d_model ** -0.5 (transformers'
#: ``...ForConditionalGeneration``: ``if config.tie_word_embeddings``).
T5_FAMILY = frozenset({"t5", "mt5", "umt5", "longt5", "switch_transformers"})
FLOAT_DTYPES = ("F32", "F16", "BF16")
CHUNKS = 32
BIAS_TENSOR = "lm_head.bias"
SCALE_RANGE = (1e-6, 1e6)


class CheckpointError(ValueError):
    """The checkpoint cannot become a head; the message says what was found and expected."""


@dataclass(frozen=True)
class HeadPlan:
    """Which tensors make the head, whether it is tied, and what the user should know."""

    embedding: str
    head: str | None
    tied: bool
    notes: list[str] = field(default_factory=list)


class Checkpoint:
    """A checkpoint directory: ``config.json`` and one or more ``.safetensors`` files."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"no checkpoint directory {self.directory}")
        self.config = _read_config(self.directory / "config.json")
        self._files = self._tensor_files()

    @property
    def names(self) -> list[str]:
        return sorted(self._files)

    def tensor(
        self, name: str, progress: Callable[[int, int], None] = lambda done, total: None
    ) -> npt.NDArray[np.float32]:
        """One tensor as float32 (exact for fp16 and bf16), read and converted in row chunks.

        Chunks keep the peak at the float32 result plus one chunk, and let a progress bar move.
        """
        with _opened(self._files[name], name) as handle:
            view = handle.get_slice(name)
            if view.get_dtype() not in FLOAT_DTYPES:
                raise CheckpointError(
                    f"tensor {name} has dtype {view.get_dtype()}, expected one of "
                    f"{', '.join(FLOAT_DTYPES)}"
                )
            shape = tuple(view.get_shape())
            result = np.empty(shape, np.float32)
            rows = shape[0] if shape else 1
            step = max(1, -(-rows // CHUNKS))
            for start in range(0, rows, step):
                end = min(start + step, rows)  # safetensors refuses slices past the end
                result[start:end] = _rows(view, start, end, self._files[name])
                progress(end, rows)
        return result

    def stored_dtype(self, name: str) -> str:
        """How the checkpoint stores tensor ``name``: float32, float16 or bfloat16 (what an
        import widens from, and ``--dtype`` could keep)."""
        with _opened(self._files[name], name) as handle:
            stored = str(handle.get_slice(name).get_dtype())
        return {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(stored, stored)

    def plan(
        self,
        *,
        embedding: str | None = None,
        head: str | None = None,
        tie: bool = False,
        untie: bool = False,
    ) -> HeadPlan:
        """Decide the head's tensors and tying (see the module docstring)."""
        embedding = embedding or _first(EMBEDDING_TENSORS, self._files)
        if embedding is None or embedding not in self._files:
            raise CheckpointError(
                "no input embedding tensor found; looked for "
                f"{', '.join(EMBEDDING_TENSORS)}; the checkpoint has: {_listing(self.names)} "
                "(name one with --embedding-tensor)"
            )
        head = head or _first(HEAD_TENSORS, self._files)
        if head is not None and head not in self._files:
            raise CheckpointError(f"no tensor {head!r}; the checkpoint has: {_listing(self.names)}")
        if head is None:
            if config_flag(self.config, "tie_word_embeddings", True) is False:
                raise CheckpointError(
                    "config.json says tie_word_embeddings: false but no head tensor was found "
                    f"(looked for {', '.join(HEAD_TENSORS)}); refusing to invent a random head"
                )
            notes = ["no head tensor: tied to the input embedding (tie_word_embeddings)"]
            return HeadPlan(embedding, None, tied=not untie, notes=notes)
        if tie:
            return HeadPlan(embedding, head, tied=True, notes=["--tie: the head tensor is dropped"])
        return HeadPlan(embedding, head, tied=False)

    def transforms(self, d_model: int, tied: bool) -> HeadTransforms:
        """Head transforms the config asks for (soft-cap, logit scale, T5's rescale). ``tied``:
        the head is the embedding (T5 rescales only then: a differing ``lm_head`` imported
        untied is served as an untied T5's, h @ lm_head.T)."""
        softcap = _scale(self.config, "final_logit_softcapping")
        logit_scale = _scale(self.config, "logit_scale")
        model_type = self.config.get("model_type")
        t5_tied = (
            tied
            and isinstance(model_type, str)
            and model_type in T5_FAMILY
            and config_flag(self.config, "tie_word_embeddings", True)
        )
        try:
            return HeadTransforms(
                input_scale=d_model**-0.5 if t5_tied else 1.0,
                logit_scale=1.0 if logit_scale is None else logit_scale,
                softcap=softcap,
            )
        except ValueError as error:  # beyond float32, as the graph stores them
            raise CheckpointError(f"config.json: {error}") from None

    def bias(self) -> npt.NDArray[np.float32] | None:
        """The output bias (Phi-2), when the checkpoint has one."""
        return self.tensor(BIAS_TENSOR) if BIAS_TENSOR in self._files else None

    def _tensor_files(self) -> dict[str, Path]:
        index = self.directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map = _json_file(index).get("weight_map")
            if not isinstance(weight_map, dict) or not all(
                isinstance(file, str) and file == Path(file).name and file not in ("", ".", "..")
                for file in weight_map.values()
            ):
                raise CheckpointError(
                    f"{index.name}: weight_map must map tensor names to .safetensors files "
                    "in the checkpoint's directory"
                )
            return {name: self.directory / file for name, file in weight_map.items()}
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no .safetensors files in {self.directory}")
        found: dict[str, Path] = {}
        for path in files:
            if not path.is_file():  # a FIFO would block the import for good
                raise CheckpointError(f"{path.name} is not a regular file")
            try:
                with safe_open(path, framework="numpy") as handle:
                    names = handle.keys()
            except Exception as error:  # safetensors raises its own SafetensorError
                raise _unreadable(path, error) from None
            for name in names:  # two files, one tensor: which is the model's is anyone's guess
                if name in found:
                    raise CheckpointError(
                        f"tensor {name} is in both {found[name].name} and {path.name}; "
                        "keep one (or add a model.safetensors.index.json)"
                    )
                found[name] = path
        return found


def tokenizer_tokens(directory: Path, vocab_size: int, notes: list[str]) -> list[str] | None:
    """Token strings by id from ``tokenizer.json`` or ``vocab.json``; None when neither (or
    when it holds no vocabulary). ``notes`` is told what did not fit the head's rows."""
    vocab: list[tuple[str, Any]] | None = None
    tokenizer = directory / "tokenizer.json"
    source = tokenizer if tokenizer.is_file() else directory / "vocab.json"
    if tokenizer.is_file():
        vocab = _tokenizer_vocab(tokenizer)
    elif (directory / "vocab.json").is_file():
        vocab = list(_json_file(directory / "vocab.json").items())
    if vocab is None:
        if tokenizer.is_file():
            notes.append(f"{tokenizer.name} has no model.vocab: no token strings")
        return None
    labels = [""] * vocab_size
    outside = 0
    for token, index in vocab:  # by id: a later pair (an added token) wins its id
        if type(index) is not int:
            raise CheckpointError(
                f"{source}: token {token[:32]!r} has id {str(index)[:32]!r}, not an integer"
            )
        if 0 <= index < vocab_size:
            labels[index] = _one_line(token)
        else:
            outside += 1
    _label_notes(source.name, vocab_size, outside, labels.count(""), notes)
    return labels


def _one_line(token: str) -> str:
    """A label as vocab.txt holds it: one line, UTF-8 (a lone surrogate, which JSON allows
    and UTF-8 does not, shows as its escape)."""
    line = token.replace("\n", "\\n").replace("\r", "\\r")
    return line.encode("utf-8", "backslashreplace").decode("utf-8")


def _label_notes(source: str, vocab_size: int, outside: int, empty: int, notes: list[str]) -> None:
    if outside:
        notes.append(f"{source}: {outside} token ids outside the head's {vocab_size} rows: dropped")
    if empty:  # padded vocabularies (Pythia's, Qwen's) have rows no token uses
        notes.append(f"{source}: {empty} of {vocab_size} rows have no token string")


def _tokenizer_vocab(tokenizer: Path) -> list[tuple[str, Any]] | None:
    """(token, id) pairs of a ``tokenizer.json``: its model's vocab, then its
    ``added_tokens`` (pairs, not a dict by token: an added token may share its text with a
    vocab entry of another id, and both ids keep their label)."""
    document = _json_file(tokenizer)
    model = document.get("model", {})
    raw = model.get("vocab") if isinstance(model, dict) else None
    vocab: dict[str, int] | None = None
    if isinstance(raw, dict):
        vocab = raw
    elif isinstance(raw, list):  # Unigram: [[piece, score], ...]
        pieces = [entry[0] if isinstance(entry, list) and entry else None for entry in raw]
        vocab = {piece: i for i, piece in enumerate(pieces) if isinstance(piece, str)}
        if len(vocab) != len(raw):
            raise CheckpointError(f"{tokenizer}: a Unigram vocab is [[piece, score], ...]")
    if vocab is None:
        return None  # special tokens (Llama-3's 128000-128255) live only in added_tokens
    return [*vocab.items(), *_added_tokens(document.get("added_tokens"), tokenizer)]


def _added_tokens(entries: Any, source: Path) -> list[tuple[str, Any]]:
    """``added_tokens`` of a ``tokenizer.json``: [{"id": 128009, "content": "<|eot_id|>"}]."""
    if entries is None:
        return []
    if not isinstance(entries, list) or not all(
        isinstance(entry, dict) and isinstance(entry.get("content"), str) for entry in entries
    ):
        raise CheckpointError(f"{source}: added_tokens is a list of {{id, content}} objects")
    return [(entry["content"], entry.get("id")) for entry in entries]


def _json_file(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file as an object, or a ``CheckpointError`` naming the file."""
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as error:  # not UTF-8, not JSON, too deep, 5000 digits
        raise CheckpointError(f"{path} is not valid JSON ({str(error)[:200]})") from None
    if not isinstance(found, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got a {type(found).__name__}")
    return found


def _first(candidates: tuple[str, ...], present: dict[str, Path]) -> str | None:
    return next((name for name in candidates if name in present), None)


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:40]) or "no tensors"
    return shown + (f", ... ({len(names)} in all)" if len(names) > 40 else "")


@contextmanager
def _opened(path: Path, name: str) -> Iterator[Any]:
    """``safe_open`` of the file holding tensor ``name``; the file's own faults name it (a
    shard's error named neither the shard nor the index). Reading it is ``_rows``'s."""
    if not path.is_file():
        state = "is not a regular file" if path.exists() else "is missing"
        raise CheckpointError(f"tensor {name} is in {path.name}, which {state}")
    try:
        handle = safe_open(path, framework="numpy")
        names = handle.keys()  # type: ignore[no-untyped-call]
    except SafetensorError as error:
        raise _unreadable(path, error) from None
    if name not in names:
        raise CheckpointError(f"tensor {name} is not in {path.name}, as the index says")
    with handle:
        yield handle


def _rows(view: Any, start: int, end: int, path: Path) -> Any:
    """Rows of a tensor's slice; a file cut short says so, naming the file."""
    try:
        return view[start:end]
    except SafetensorError as error:
        raise _unreadable(path, error) from None


def _unreadable(path: Path, error: Exception) -> CheckpointError:
    return CheckpointError(f"{path.name} is not a readable safetensors file: {error}")


def _read_config(path: Path) -> dict[str, Any]:
    """``config.json`` as a JSON object (an empty one when the file is absent)."""
    return _json_file(path) if path.is_file() else {}


def config_flag(config: dict[str, Any], key: str, default: bool) -> bool:
    """A true/false key of the config (``default`` when absent); anything else is refused."""
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise CheckpointError(f"config.json: {key} must be true or false, got {value!r:.40}")
    return value


def _scale(config: dict[str, Any], key: str) -> float | None:
    """A head scale from the config (None when absent): real heads use ones far inside
    ``SCALE_RANGE``; outside it every logit vanishes or overflows float32 (0 is no "off"
    switch either: transformers multiplies by it, or divides by it)."""
    value = config_number(config, key)
    low, high = SCALE_RANGE
    if value is not None and not low <= value <= high:
        raise CheckpointError(
            f"config.json: {key} must be a scale in [{low:g}, {high:g}] (Cohere's logit_scale "
            f"is 0.0625, Gemma-2's soft-cap 30), got {value!r:.40}"
        )
    return value


def config_number(config: dict[str, Any], key: str) -> float | None:
    """A finite number from the config, or None when absent or null."""
    value = config.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise CheckpointError(f"config.json: {key} must be a finite number, got {value!r:.40}")
    return float(value)
