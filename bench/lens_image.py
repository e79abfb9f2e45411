"""The README's logit-lens picture: the demo head read at every layer of a made-up model.

The demo head has no model behind it, so the states are made, with the pattern a real model's
lens shows: at layer 0 (the embeddings) each position predicts its own input token; the early
layers are unsure; some positions try a draft token in the middle layers; the later layers
settle on the next token, more surely the deeper they are. Each layer's state at a position is
a mix of the tied table's rows of those tokens and noise, its share of each set by the layer's
depth, divided by the final norm's scale (so the norm gives the mix back) and growing in size
with depth, as a residual stream does; the last layer is post-norm, as
``output_hidden_states`` gives it.

The states go through the real service (the demo heads served from a scratch repository,
``Client.lens``) and are drawn by ``lmhead lens --plot``'s own function.

    python -m bench.lens_image [--output docs/lens.png]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import numpy.typing as npt

from service.cli.logit_lens import plot_lens, target_labels
from service.client import Client
from service.heads import MODEL_FILE
from service.heads.files import read_head
from service.tools.demo import TIED_NAME, demo_tokens, write_demo_models
from tests.server import running_server

#: The embeddings' output and 12 layers, as GPT-2 small's ``output_hidden_states``.
LAYERS = 13
#: Input tokens; each position's next token is the following one (the last's is FINAL).
PHRASE = ("<s>", "\u2581kati", "lo", "\u2581mimi", "sa", "\u2581tine", "vo", "\u2581zune")
FINAL = "er"
#: A wrong guess some positions make in the middle layers before the right one wins.
DRAFTS = {0: "\u2581kane", 2: "\u2581mixe", 4: "\u2581titi", 6: "\u2581zuti"}
#: How surely the last layer names the next token (cosine to its row): 0.7 is near 1.
SURENESS = (0.72, 0.62, 0.7, 0.55, 0.72, 0.66, 0.7, 0.5)
SEED = 38
#: Where the picture goes: the README and docs/lens.md show it, naming this module.
OUTPUT = Path("docs/lens.png")


def lens_states(
    table: npt.NDArray[np.float32], scale: npt.NDArray[np.float32]
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """(layers, positions, d_model) residual states (the last layer still pre-norm) and the
    next token at each position."""
    labels = demo_tokens(len(table))
    ids = {text: labels.index(text) for text in (*PHRASE, FINAL, *DRAFTS.values())}
    inputs = [ids[text] for text in PHRASE]
    targets = np.array([*inputs[1:], ids[FINAL]], np.int64)
    unit = table / np.linalg.norm(table, axis=1, keepdims=True)
    rng = np.random.default_rng(SEED)
    states = np.empty((LAYERS, len(PHRASE), table.shape[1]), np.float32)
    for layer in range(LAYERS):
        depth = layer / (LAYERS - 1)
        for pos, token in enumerate(inputs):
            own = 0.9 * np.exp(-depth / 0.08)  # the embedding of the input, fading fast
            settled = SURENESS[pos] * np.clip((depth - 0.3) / 0.7, 0, 1) ** 0.8
            draft = 0.58 * np.exp(-(((depth - 0.5) / 0.14) ** 2)) if pos in DRAFTS else 0.0
            mix = own * unit[token] + settled * unit[targets[pos]]
            if pos in DRAFTS:
                mix = mix + draft * unit[ids[DRAFTS[pos]]]
            noise = rng.standard_normal(table.shape[1]) / np.sqrt(table.shape[1])
            rest = np.sqrt(max(0.04, 1 - own**2 - settled**2 - draft**2))
            states[layer, pos] = (1 + layer) * (mix + rest * noise) / scale
    return states, targets


def write_image(output: Path) -> tuple[int, int]:
    """Serve the demo heads, read the made-up states through ``demo-tied``, draw them."""
    with tempfile.TemporaryDirectory() as scratch:
        repository = Path(scratch)
        write_demo_models(repository)
        head = read_head(repository / TIED_NAME / "1" / MODEL_FILE)
        if head.norm is None:
            raise SystemExit(f"{TIED_NAME} holds no final norm: its residual states cannot be read")
        states, targets = lens_states(np.asarray(head.embedding, np.float32), head.norm.weight)
        states[-1] = head.norm.apply(states[-1]).astype(np.float32)  # post-norm, as HF gives it
        with running_server(repository) as url, Client(url) as client:
            lens = client.lens(TIED_NAME, states, k=5, target_ids=targets, tokens=True)
            labels = target_labels(client, lens, states.shape[-1])
    return plot_lens(lens, output, labels)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    width, height = write_image(args.output)
    size = args.output.stat().st_size
    print(f"wrote {args.output}: {width} x {height} px, {size:,} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
