"""Demo heads made on first run: a tied head and its untied twin, same vocab and d_model.

The untied twin keeps the tied head's table as its input embedding and gets an output matrix
that starts from the same table and drifts away (correlation 0.8), like a head fine-tuned
apart from its embedding: related but clearly different, so an A/B between the two has
something to find. Everything is seeded, so every machine makes the same files.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from service.repository import LABELS_FILE

TIED_NAME = "demo-tied"
UNTIED_NAME = "demo-untied"
_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "xe", "zu", "an", "er", "in", "on")


@dataclass(frozen=True)
class DemoSpec:
    vocab_size: int = 32000
    d_model: int = 512
    seed: int = 0
    dtype: str = "float32"


def write_demo_models(repository: str | Path, spec: DemoSpec = DemoSpec()) -> list[Path]:
    """Write ``demo-tied/1`` and ``demo-untied/1`` under ``repository``; return their dirs."""
    from service.heads import HeadWeights, save_head  # onnx: not for the CLI's every start

    rng = np.random.default_rng(spec.seed)
    scale = np.float32(spec.d_model**-0.5)
    table = rng.standard_normal((spec.vocab_size, spec.d_model), dtype=np.float32) * scale
    noise = rng.standard_normal((spec.vocab_size, spec.d_model), dtype=np.float32) * scale
    drifted = np.float32(0.8) * table + np.float32(0.6) * noise
    labels = "\n".join(demo_tokens(spec.vocab_size)) + "\n"
    written = []
    for name, weights in (
        (TIED_NAME, HeadWeights.from_arrays(table, dtype=spec.dtype)),
        (UNTIED_NAME, HeadWeights.from_arrays(table, drifted, dtype=spec.dtype)),
    ):

        def write(staging: Path, weights: HeadWeights = weights) -> None:
            save_head(weights, staging)
            (staging / LABELS_FILE).write_text(labels, encoding="utf-8")

        version_dir = Path(repository) / name / "1"
        _write_whole(version_dir, write)
        written.append(version_dir)
    return written


def _write_whole(version_dir: Path, write: Callable[[Path], None]) -> None:
    """``write`` fills a directory beside ``version_dir``, renamed into place once whole (an
    existing one, ``--force``, goes then): a full disk left half a head, which counted as
    present and was never written again (nor is a model directory left empty: a model)."""
    made = not version_dir.parent.exists()
    version_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".writing-", dir=version_dir.parent))
    try:
        write(staging)
        os.chmod(staging, 0o755)  # mkdtemp made it private
        if version_dir.exists():
            shutil.rmtree(version_dir)
        os.rename(staging, version_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if made and not any(version_dir.parent.iterdir()):
            version_dir.parent.rmdir()


def demo_tokens(vocab_size: int) -> list[str]:
    """Readable, unique token strings: specials, 256 byte tokens, then syllable words."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)]
    count = len(_SYLLABLES)
    index = 0
    while len(tokens) < vocab_size:
        word, rest = "", index
        while True:
            word += _SYLLABLES[rest % count]
            rest //= count
            if rest == 0:
                break
        tokens.append(("\u2581" + word) if index % 3 == 0 else word)
        index += 1
    return tokens[:vocab_size]
