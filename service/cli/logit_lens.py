"""``lmhead lens``: every layer's hidden states read through a served head (the logit lens),
printed as a table of each layer's top token per position and, with ``--plot``, drawn as the
familiar picture: layers up the side (layer 0 at the bottom, as tuned-lens and nnsight draw
it), positions across, each cell its top token coloured by that token's probability.

The service does the reading (``Client.lens``); this module only shows what it answers, so
the table, the JSON and the picture are of one answer. matplotlib is the optional ``plot``
extra, imported only to draw: without it ``--plot`` says how to install it before any call.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from service.cli.arguments import CommandError, UsageError
from service.client import Client, Lens
from service.errors import ServiceError

PLOT_INSTALL = "pip install '.[plot]'"
#: Pixels per inch of the picture; its size is whole pixels (``figure_pixels``).
DPI = 100
#: One cell's size (inches) while the grid fits ``MAX_GRID_INCHES``; past that cells shrink.
CELL_INCHES = (0.72, 0.3)
MAX_GRID_INCHES = (18.0, 13.0)
#: Around the grid: layer labels (left), colour bar (right), title and targets (top), axis.
MARGIN_INCHES = {"left": 0.9, "right": 1.35, "top": 0.95, "bottom": 0.6}
FONT_POINTS = 7.0
#: Below this (cells shrunk for a large grid) cells are coloured but not labelled.
SMALLEST_FONT_POINTS = 4.5
#: A cell's token is cut to this many characters (and an ellipsis): 8 fit a default cell.
TOKEN_CHARS = 8
#: Tick labels at most this many along an axis (every n-th past it).
MAX_TICKS = 45
#: Target strings are looked up in runs of this many ids (one top-k call each).
LOOKUP_IDS = 64


def lens_command(args: argparse.Namespace, url: str) -> int:
    """Ask the service, print the table (or the JSON), and draw the picture when asked."""
    if args.plot is not None:
        require_matplotlib()
    hidden = _npy(args.hidden, "--hidden")
    targets = None if args.targets is None else _npy(args.targets, "--targets")
    try:
        with Client(url.rstrip("/"), timeout=300) as client:
            lens = client.lens(
                args.model,
                hidden,
                k=args.k,
                target_ids=targets,
                states=args.states,
                last_layer=args.last_layer,
                tokens=True,  # the table shows strings where the model has them
                version=args.version,
            )
            shown = args.plot is not None or not args.json  # the JSON has ids only
            labels = target_labels(client, lens, int(hidden.shape[-1])) if shown else None
    except httpx.TransportError as error:
        raise CommandError(f"{url} is not reachable: {error}") from None
    except ServiceError as error:
        raise CommandError(f"the service answered {error.status}: {error.message}") from None
    print(json.dumps(lens_json(lens)) if args.json else format_lens(lens, labels, args.states))
    if args.plot is not None:
        width, height = plot_lens(lens, args.plot, labels)
        print(f"wrote {args.plot} ({width} x {height} px)", file=sys.stderr)
    return 0


def _npy(path: Path, flag: str) -> np.ndarray[Any, Any]:
    """An array from a ``.npy`` file, or a refusal that names the flag (a missing file is
    reported as the OS says it)."""
    try:
        array = np.load(path, allow_pickle=False)
    except ValueError:  # not .npy (numpy then guesses a pickle), or pickled objects
        raise UsageError(f"{flag}: {path} is not a .npy array (np.save writes one)") from None
    if not isinstance(array, np.ndarray):  # an .npz archive
        raise UsageError(f"{flag}: {path} holds several arrays; save one with np.save")
    return array


def require_matplotlib() -> None:
    """Before any call: a picture was asked for and cannot be drawn (exit 2, as a refused
    option)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(
            f"--plot needs matplotlib, the plot extra: {PLOT_INSTALL} (or pip install matplotlib)"
        ) from None


def target_labels(client: Client, lens: Lens, d_model: int) -> list[str] | None:
    """The targets' strings (None without targets, or when the model has no labels): the lens
    answers strings for its top tokens only, so they are asked of ``/topk`` restricted to the
    targets (a zero row: every target comes back, with its string). Falls back to ids."""
    if lens.target_ids is None or lens.token_strings is None:
        return None
    wanted = sorted(set(lens.target_ids.tolist()))
    strings: dict[int, str | None] = {}
    zero = np.zeros((1, d_model), np.float32)
    try:
        for start in range(0, len(wanted), LOOKUP_IDS):
            ids = wanted[start : start + LOOKUP_IDS]
            top = client.topk(
                lens.model, zero, len(ids), tokens=True, version=lens.version, allowed_token_ids=ids
            )
            if top.tokens is not None:
                strings.update(zip(top.token_ids[0].tolist(), top.tokens[0], strict=True))
    except ServiceError:  # a lower LMHEAD_MAX_K, say: ids still tell which token it is
        strings = {}
    return [_label(strings.get(i), i) for i in lens.target_ids.tolist()]


def lens_json(lens: Lens) -> dict[str, Any]:
    """The lens as the service's JSON answer has it (absent fields left out)."""
    shown: dict[str, Any] = {
        "model": lens.model,
        "version": lens.version,
        "tied": lens.tied,
        "k": lens.k,
        "layers": lens.layers,
        "tokens": lens.tokens,
        "token_ids": lens.token_ids.tolist(),
        "logprobs": lens.logprobs.tolist(),
        "entropy": lens.entropy.tolist(),
        "kl_to_last": lens.kl_to_last.tolist(),
    }
    if lens.token_strings is not None:
        shown["token_strings"] = lens.token_strings
    for name in ("target_ids", "target_logprobs", "target_ranks"):
        value = getattr(lens, name)
        if value is not None:
            shown[name] = value.tolist()
    return shown


def top_labels(lens: Lens) -> list[list[str]]:
    """[layer][position] the top token's string, or its id where the model has no label."""
    ids = lens.token_ids[..., 0].tolist()
    strings = lens.token_strings
    return [
        [
            _label(None if strings is None else strings[layer][pos][0], ids[layer][pos])
            for pos in range(lens.tokens)
        ]
        for layer in range(lens.layers)
    ]


def format_lens(lens: Lens, targets: list[str] | None = None, states: str = "residual") -> str:
    """One line per layer (layer 0 first): each position's top token and its probability,
    with the target's rank where targets were sent; the layer's mean entropy and KL to the
    last layer at the end of its line."""
    labels, probability = top_labels(lens), np.exp(lens.logprobs[..., 0])
    ranks = lens.target_ranks
    rows = [["layer", *(str(pos) for pos in range(lens.tokens)), "H nats", "KL nats"]]
    if lens.target_ids is not None:
        shown = targets or [str(i) for i in lens.target_ids.tolist()]
        rows.append(["target", *(_short(text, 12) for text in shown), "", ""])
    for layer in range(lens.layers):
        cells = [
            f"{_short(labels[layer][pos], 12)} {probability[layer, pos]:.2f}"
            + ("" if ranks is None else f" r{ranks[layer, pos]}")
            for pos in range(lens.tokens)
        ]
        entropy, kl = lens.entropy[layer].mean(), lens.kl_to_last[layer].mean()
        rows.append([str(layer), *cells, f"{entropy:.2f}", f"{kl:.2f}"])
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        for row in rows
    ]
    how = "through the head's final norm" if states == "residual" else "as final states"
    head = "tied" if lens.tied else "untied"
    note = "; rN: the target's rank (0: the top token)" if ranks is not None else ""
    return "\n".join(
        [
            f"{lens.model} v{lens.version} ({head}): {lens.layers} layers x {lens.tokens} "
            f"positions read {how}",
            f"each cell: the top token and its probability{note}; H: mean entropy; KL: mean "
            "KL(last layer || this one)",
            "",
            *(line.rstrip() for line in lines),
        ]
    )


def figure_pixels(layers: int, positions: int) -> tuple[int, int]:
    """The picture's (width, height) in pixels for a grid of ``layers`` x ``positions``:
    ``CELL_INCHES`` a cell while the grid fits ``MAX_GRID_INCHES``, smaller cells past it."""
    width, height = _cell_inches(layers, positions)
    margins = MARGIN_INCHES
    inches = (
        margins["left"] + positions * width + margins["right"],
        margins["bottom"] + layers * height + margins["top"],
    )
    return round(inches[0] * DPI), round(inches[1] * DPI)


def plot_lens(lens: Lens, path: Path, targets: list[str] | None = None) -> tuple[int, int]:
    """Write the logit-lens picture of ``lens`` to ``path`` (PNG); its size in pixels.

    The Agg canvas of a bare ``Figure``, never pyplot: no global backend, no display needed;
    no "Software" stamp, so one lens makes the same bytes with any matplotlib that draws it
    alike. A cell whose top token is the target is labelled in bold."""
    from matplotlib.figure import Figure

    layers, positions = lens.layers, lens.tokens
    pixels = figure_pixels(layers, positions)
    # A quarter pixel more: matplotlib truncates inches x dpi, and 0.29 x 100 is 28.999...
    figure = Figure(figsize=((pixels[0] + 0.25) / DPI, (pixels[1] + 0.25) / DPI), dpi=DPI)
    margins = {side: inches * DPI for side, inches in MARGIN_INCHES.items()}
    left, bottom = margins["left"] / pixels[0], margins["bottom"] / pixels[1]
    grid = figure.add_axes(
        (
            left,
            bottom,
            1 - left - margins["right"] / pixels[0],
            1 - bottom - margins["top"] / pixels[1],
        )
    )
    probability = np.exp(lens.logprobs[..., 0].astype(np.float64))
    image = grid.imshow(
        probability, cmap="Blues", vmin=0.0, vmax=1.0, origin="lower", aspect="auto"
    )
    _label_cells(grid, lens, probability)
    grid.set_xticks(*_ticks(positions))
    grid.set_yticks(*_ticks(layers))
    grid.tick_params(labelsize=8)
    grid.set_xlabel("position", fontsize=9)
    grid.set_ylabel("layer", fontsize=9)
    if targets is not None:
        top = grid.secondary_xaxis("top")
        where, _ = _ticks(positions)
        top.set_xticks(where, [_escaped(_short(targets[i], TOKEN_CHARS)) for i in where])
        top.tick_params(labelsize=7, rotation=45)
        top.set_xlabel("target (bold: the top token is the target)", fontsize=8)
    head = "tied" if lens.tied else "untied"
    figure.suptitle(f"logit lens: {lens.model} v{lens.version} ({head})", fontsize=11)
    beside = (margins["right"] - 0.25 * DPI) / pixels[0]  # a quarter inch off the grid
    colours = figure.add_axes(
        (1 - beside, bottom, 0.18 * DPI / pixels[0], grid.get_position().height)
    )
    bar = figure.colorbar(image, cax=colours)
    bar.set_label("probability of the top token", fontsize=8)
    bar.ax.tick_params(labelsize=7)
    with warnings.catch_warnings():  # a token's glyph missing from the font: drawn as a box
        warnings.filterwarnings("ignore", "Glyph .* missing from", UserWarning)
        figure.savefig(path, format="png", dpi=DPI, metadata={"Software": None})
    return pixels


def _label_cells(grid: Any, lens: Lens, probability: np.ndarray[Any, Any]) -> None:
    """Each cell's top token, white on dark cells; bold where it is the target."""
    width, height = _cell_inches(lens.layers, lens.tokens)
    points = FONT_POINTS * min(1.0, width / CELL_INCHES[0], height / CELL_INCHES[1])
    if points < SMALLEST_FONT_POINTS:
        return
    labels = top_labels(lens)
    hits = None if lens.target_ids is None else lens.token_ids[..., 0] == lens.target_ids
    for layer in range(lens.layers):
        for pos in range(lens.tokens):
            grid.text(
                pos,
                layer,
                _escaped(_short(labels[layer][pos], TOKEN_CHARS)),
                ha="center",
                va="center",
                fontsize=points,
                color="white" if probability[layer, pos] > 0.55 else "black",
                fontweight="bold" if hits is not None and hits[layer, pos] else "normal",
            )


def _cell_inches(layers: int, positions: int) -> tuple[float, float]:
    return (
        min(CELL_INCHES[0], MAX_GRID_INCHES[0] / max(positions, 1)),
        min(CELL_INCHES[1], MAX_GRID_INCHES[1] / max(layers, 1)),
    )


def _ticks(count: int) -> tuple[list[int], list[str]]:
    """Every index while they fit, else every n-th."""
    step = max(1, math.ceil(count / MAX_TICKS))
    where = list(range(0, count, step))
    return where, [str(i) for i in where]


def _label(text: str | None, token_id: int) -> str:
    """A token as shown: its string with newlines and tabs visible, or its id."""
    if text is None:
        return str(token_id)
    return text.replace("\n", "\\n").replace("\t", "\\t") or repr(text)


def _short(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[: chars - 1] + "\u2026"


def _escaped(text: str) -> str:
    """matplotlib reads text between two ``$`` as mathematics: a token's ``$`` is drawn."""
    return text.replace("$", r"\$")
