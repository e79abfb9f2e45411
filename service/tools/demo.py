"""Demo heads made on first run: a tied head and its untied twin, same vocab and d_model.

The untied twin keeps the tied head's table as its input embedding and gets an output matrix
that starts from the same table and drifts away (correlation 0.8), like a head fine-tuned
apart from its embedding: related but clearly different, so an A/B between the two has
something to find. Both end a model with the same final RMS norm (a scale near 1, eps 1e-5,
as Llama's), so the demo can read residual states and show the logit lens. Everything is
seeded, so every machine makes the same files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from service.repository.disk import LABELS_FILE

TIED_NAME = "demo-tied"
UNTIED_NAME = "demo-untied"
#: Two letters each, so a word of them splits into its syllables one way only.
SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "xe", "zu", "an", "er", "in", "on")
NORM_EPSILON = 1e-5
#: How far the norm's scale strays from 1 (a trained model's final norm is not all ones).
NORM_SPREAD = 0.1


@dataclass(frozen=True)
class DemoSpec:
    vocab_size: int = 32000
    d_model: int = 512
    seed: int = 0
    dtype: str = "float32"


def write_demo_models(repository: str | Path, spec: DemoSpec = DemoSpec()) -> list[Path]:
    """Write ``demo-tied/1`` and ``demo-untied/1`` under ``repository``; return their dirs."""
    from service.heads.files import HeadWeights, save_head  # onnx: not for the CLI's every start
    from service.heads.norm import FinalNorm
    from service.repository.staging import write_whole

    rng = np.random.default_rng(spec.seed)
    scale = np.float32(spec.d_model**-0.5)
    table = rng.standard_normal((spec.vocab_size, spec.d_model), dtype=np.float32) * scale
    noise = rng.standard_normal((spec.vocab_size, spec.d_model), dtype=np.float32) * scale
    drifted = np.float32(0.8) * table + np.float32(0.6) * noise
    norm_scale = 1 + NORM_SPREAD * rng.standard_normal(spec.d_model, dtype=np.float32)
    norm = FinalNorm("rms", norm_scale, NORM_EPSILON, source="demo")
    labels = "\n".join(demo_tokens(spec.vocab_size)) + "\n"
    written = []
    for name, weights in (
        (TIED_NAME, HeadWeights.from_arrays(table, dtype=spec.dtype, norm=norm)),
        (UNTIED_NAME, HeadWeights.from_arrays(table, drifted, dtype=spec.dtype, norm=norm)),
    ):

        def write(staging: Path, weights: HeadWeights = weights) -> None:
            save_head(weights, staging)
            (staging / LABELS_FILE).write_text(labels, encoding="utf-8")

        version_dir = Path(repository) / name / "1"
        write_whole(version_dir, write, replace=True)  # --force rewrites them
        written.append(version_dir)
    return written


def demo_tokens(vocab_size: int) -> list[str]:
    """Readable, unique token strings: specials, 256 byte tokens, then syllable words."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)]
    count = len(SYLLABLES)
    index = 0
    while len(tokens) < vocab_size:
        word, rest = "", index
        while True:
            word += SYLLABLES[rest % count]
            rest //= count
            if rest == 0:
                break
        tokens.append(("\u2581" + word) if index % 3 == 0 else word)
        index += 1
    return tokens[:vocab_size]
