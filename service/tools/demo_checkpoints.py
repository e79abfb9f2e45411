"""Small Hugging Face style checkpoints to try ``lmhead import`` on, written offline.

``gpt2-tiny`` is tied, as GPT-2 is: a float32 ``transformer.wte.weight`` and no ``lm_head``,
GPT-2's config keys and a byte-level BPE ``tokenizer.json`` with ``<|endoftext|>`` at the last
id. ``llama-tiny`` is untied, as Llama 2 is: float16 ``model.embed_tokens.weight`` and a
different ``lm_head.weight``, Llama's config keys and a byte-fallback BPE tokenizer with
``<unk>``, ``<s>`` and ``</s>``. Each holds its final norm too (GPT-2 its position table): what a
head made from the model's last layer needs. Neither has transformer blocks (``n_layer`` and
``num_hidden_layers`` are 0), so the files hold every tensor their config implies and stay a
few hundred KB, where a real model's download would take minutes.

The vocabularies are made, not downloaded: the demo heads' syllables merged into words, each
merge joining two tokens of the vocabulary, as the tokenizers library requires. Everything is
seeded: one seed, the same bytes on every machine.
"""

from __future__ import annotations

import errno
import json
import math
import string
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from service.tools.demo import SYLLABLES

GPT2_NAME = "gpt2-tiny"
LLAMA_NAME = "llama-tiny"
NAMES = (GPT2_NAME, LLAMA_NAME)
#: Llama's specials and byte tokens, the word marker and letters: below this no word fits.
MIN_VOCAB = 300
POSITIONS = 128
END_OF_TEXT = "<|endoftext|>"
LLAMA_SPECIALS = ("<unk>", "<s>", "</s>")
GPT2_SPACE = "\u0120"  # "Ġ": GPT-2's symbol for the space byte, a word's start
LLAMA_SPACE = "\u2581"  # "▁": SentencePiece's
FILES = ("config.json", "model.safetensors", "tokenizer.json")

Tensors = dict[str, npt.NDArray[Any]]


@dataclass(frozen=True)
class CheckpointSpec:
    vocab_size: int = 1024
    d_model: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if self.vocab_size < MIN_VOCAB:
            raise ValueError(
                f"a demo checkpoint has at least {MIN_VOCAB} tokens (Llama's byte tokens and "
                f"specials take 259), got {self.vocab_size}"
            )

    @property
    def heads(self) -> int:
        """Attention heads the config names: they must divide d_model."""
        return math.gcd(self.d_model, 4)


@dataclass(frozen=True)
class WrittenCheckpoint:
    """What ``lmhead demo --checkpoint`` prints of a checkpoint it wrote."""

    directory: Path
    summary: str
    bytes: int


def write_demo_checkpoints(
    directory: str | Path, spec: CheckpointSpec = CheckpointSpec(), replace: bool = False
) -> list[WrittenCheckpoint]:
    """Write ``gpt2-tiny`` and ``llama-tiny`` under ``directory``; each appears whole or not at
    all. An existing one is a ``FileExistsError`` unless ``replace``."""
    from safetensors.numpy import save  # not for the CLI's every start

    from service.repository.staging import write_whole

    taken = [name for name in NAMES if (Path(directory) / name).exists()]
    if taken and not replace:  # before anything is written: both or neither
        said = f"{' and '.join(taken)} exist{'s' if len(taken) == 1 else ''} already"
        raise FileExistsError(errno.EEXIST, f"{said} (--force rewrites)", str(directory))
    written = []
    for name, (config, tensors, tokenizer) in _checkpoints(spec).items():

        def write(
            staging: Path,
            config: Any = config,
            tensors: Tensors = tensors,
            tokenizer: Any = tokenizer,
        ) -> None:
            _write_json(staging / "config.json", config)
            # Bytes, then a file of ours: safetensors' own files are private (0600).
            (staging / "model.safetensors").write_bytes(save(tensors, metadata={"format": "pt"}))
            _write_json(staging / "tokenizer.json", tokenizer)

        target = Path(directory) / name
        write_whole(target, write, replace=replace)
        dtype = next(iter(tensors.values())).dtype.name
        tying = "tied" if config["tie_word_embeddings"] else "untied"
        summary = f"{tying}, {spec.vocab_size:,} tokens x {spec.d_model}, {dtype}"
        size = sum((target / file).stat().st_size for file in FILES)
        written.append(WrittenCheckpoint(target, summary, size))
    return written


def _checkpoints(spec: CheckpointSpec) -> dict[str, tuple[dict[str, Any], Tensors, Any]]:
    """Each checkpoint's config, tensors and tokenizer, by name."""
    return {
        GPT2_NAME: (_gpt2_config(spec), _gpt2_tensors(spec), gpt2_tokenizer(spec.vocab_size)),
        LLAMA_NAME: (_llama_config(spec), _llama_tensors(spec), llama_tokenizer(spec.vocab_size)),
    }


def _gpt2_config(spec: CheckpointSpec) -> dict[str, Any]:
    return {
        "activation_function": "gelu_new",
        "architectures": ["GPT2LMHeadModel"],
        "bos_token_id": spec.vocab_size - 1,
        "eos_token_id": spec.vocab_size - 1,
        "layer_norm_epsilon": 1e-5,
        "model_type": "gpt2",
        "n_embd": spec.d_model,
        "n_head": spec.heads,
        "n_inner": None,
        "n_layer": 0,
        "n_positions": POSITIONS,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "vocab_size": spec.vocab_size,
    }


def _llama_config(spec: CheckpointSpec) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "bos_token_id": LLAMA_SPECIALS.index("<s>"),
        "eos_token_id": LLAMA_SPECIALS.index("</s>"),
        "hidden_act": "silu",
        "hidden_size": spec.d_model,
        "intermediate_size": 4 * spec.d_model,
        "max_position_embeddings": POSITIONS,
        "model_type": "llama",
        "num_attention_heads": spec.heads,
        "num_hidden_layers": 0,
        "num_key_value_heads": spec.heads,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "vocab_size": spec.vocab_size,
    }


def _gpt2_tensors(spec: CheckpointSpec) -> Tensors:
    rng = np.random.default_rng((spec.seed, 0))
    return {
        "transformer.wte.weight": _normal(rng, (spec.vocab_size, spec.d_model), spec.d_model**-0.5),
        "transformer.wpe.weight": _normal(rng, (POSITIONS, spec.d_model), 0.01),
        "transformer.ln_f.weight": 1 + _normal(rng, (spec.d_model,), 0.1),
        "transformer.ln_f.bias": _normal(rng, (spec.d_model,), 0.02),
    }


def _llama_tensors(spec: CheckpointSpec) -> Tensors:
    """The head starts from the table and drifts away, as the demo heads' untied twin: related
    to the embedding, clearly not it."""
    rng = np.random.default_rng((spec.seed, 1))
    shape = (spec.vocab_size, spec.d_model)
    table = _normal(rng, shape, spec.d_model**-0.5)
    head = np.float32(0.8) * table + _normal(rng, shape, 0.6 * spec.d_model**-0.5)
    tensors = {
        "model.embed_tokens.weight": table,
        "lm_head.weight": head,
        "model.norm.weight": 1 + _normal(rng, (spec.d_model,), 0.1),
    }
    return {name: tensor.astype(np.float16) for name, tensor in tensors.items()}


def _normal(
    rng: np.random.Generator, shape: tuple[int, ...], scale: float
) -> npt.NDArray[np.float32]:
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)


def gpt2_tokenizer(vocab_size: int) -> dict[str, Any]:
    """GPT-2's tokenizer.json layout: byte-level BPE, the 256 byte symbols first."""
    merges = list(islice(_merges(GPT2_SPACE), vocab_size - 257))
    tokens = [*_byte_symbols(), *(left + right for left, right in merges), END_OF_TEXT]
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [_added(vocab_size - 1, END_OF_TEXT, normalized=True)],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": {"type": "ByteLevel", **byte_level, "trim_offsets": False},
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": _bpe(tokens, merges, unk_token=None, byte_fallback=False),
    }


def llama_tokenizer(vocab_size: int) -> dict[str, Any]:
    """Llama 2's tokenizer.json layout: specials, 256 byte-fallback tokens, merged pieces,
    then the single characters."""
    letters = [LLAMA_SPACE, *string.ascii_lowercase]
    bytes_ = [f"<0x{byte:02X}>" for byte in range(256)]
    count = vocab_size - len(LLAMA_SPECIALS) - len(bytes_) - len(letters)
    merges = list(islice(_merges(LLAMA_SPACE), count))
    tokens = [*LLAMA_SPECIALS, *bytes_, *(left + right for left, right in merges), *letters]
    start = {"SpecialToken": {"id": "<s>", "type_id": 0}}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            _added(i, token, normalized=False) for i, token in enumerate(LLAMA_SPECIALS)
        ],
        "normalizer": {
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": LLAMA_SPACE},
                {"type": "Replace", "pattern": {"String": " "}, "content": LLAMA_SPACE},
            ],
        },
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [start, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                start,
                {"Sequence": {"id": "A", "type_id": 0}},
                start,
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
        },
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": LLAMA_SPACE}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ],
        },
        "model": _bpe(tokens, merges, unk_token="<unk>", byte_fallback=True),
    }


def _bpe(
    tokens: list[str], merges: list[tuple[str, str]], unk_token: str | None, byte_fallback: bool
) -> dict[str, Any]:
    return {
        "type": "BPE",
        "dropout": None,
        "unk_token": unk_token,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": byte_fallback,
        "byte_fallback": byte_fallback,
        "vocab": {token: index for index, token in enumerate(tokens)},
        "merges": [f"{left} {right}" for left, right in merges],
    }


def _added(index: int, content: str, normalized: bool) -> dict[str, Any]:
    return {
        "id": index,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": normalized,
        "special": True,
    }


def _byte_symbols() -> list[str]:
    """GPT-2's 256 byte symbols in its vocabulary's order: printable bytes stand for
    themselves, the others (space, controls) take the code points from 256 on (space: "Ġ")."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [byte for byte in range(256) if byte not in printable]
    return [chr(byte) for byte in printable] + [chr(256 + n) for n in range(len(others))]


def _merges(marker: str) -> Iterator[tuple[str, str]]:
    """Endless BPE merges: each syllable from its two letters, each syllable after the word
    start ``marker``, then longer words one syllable at a time. Syllables are two letters, so
    no two merges make the same token."""
    for syllable in SYLLABLES:
        yield syllable[0], syllable[1]
    for syllable in SYLLABLES:
        yield marker, syllable
    words = [*SYLLABLES, *(marker + syllable for syllable in SYLLABLES)]
    while True:
        for word in words:
            for syllable in SYLLABLES:
                yield word, syllable
        words = [word + syllable for word in words for syllable in SYLLABLES]


def _write_json(path: Path, document: Any) -> None:
    path.write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
