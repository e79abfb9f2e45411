"""``lmhead lens``'s table and picture on a lens built by hand: the PNG has the size chosen for
its grid and opens as an image, the table shows each layer's top token, probability and the
target's rank, and ``--plot`` without matplotlib says how to install it before any call."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from service.cli import main
from service.cli.arguments import UsageError
from service.cli.logit_lens import (
    MAX_GRID_INCHES,
    figure_pixels,
    format_lens,
    lens_json,
    plot_lens,
    require_matplotlib,
)
from service.client import Lens

VOCAB = 50


def _lens(layers: int, positions: int, k: int = 3, targets: bool = True) -> Lens:
    """Layer l's top token at position p is ``(p + l // 2) % VOCAB``, its probability rising
    with depth; the targets are the last layer's top tokens."""
    layer = np.arange(layers)[:, None, None]
    ids = (np.arange(positions)[None, :, None] + layer // 2 + np.arange(k)) % VOCAB
    top = np.broadcast_to(np.linspace(0.05, 0.95, layers)[:, None], (layers, positions))
    logprobs = np.concatenate(
        [np.log(top)[..., None], np.log((1 - top) / k)[..., None].repeat(k - 1, axis=-1)], -1
    ).astype(np.float32)
    strings: list[list[list[str | None]]] = [
        [[f"tok{i}" for i in row] for row in grid] for grid in ids.tolist()
    ]
    target_ids = ids[-1, :, 0] if targets else None
    ranks = np.where(ids[..., 0] == ids[-1, :, 0], 0, layers - 1 - np.arange(layers)[:, None])
    return Lens(
        "m",
        3,
        True,
        ids.astype(np.int64),
        logprobs,
        np.full((layers, positions), 1.5, np.float32),
        np.zeros((layers, positions), np.float32),
        target_ids,
        None if target_ids is None else logprobs[..., 0].copy(),
        None if target_ids is None else ranks.astype(np.int64),
        strings,
    )


@pytest.mark.parametrize(("layers", "positions"), [(1, 1), (12, 7), (40, 20), (97, 61)])
def test_the_picture_has_the_size_chosen_for_its_grid(
    tmp_path: Path, layers: int, positions: int
) -> None:
    path = tmp_path / "lens.png"
    pixels = plot_lens(_lens(layers, positions), path, [f"t{i}" for i in range(positions)])
    assert pixels == figure_pixels(layers, positions)
    image = imread(path)
    assert image.shape == (pixels[1], pixels[0], 4)  # RGBA rows x columns
    assert image[..., :3].std() > 0.05  # drawn on, not a blank page


def test_sizes_grow_with_the_grid_and_stay_bounded() -> None:
    small, usual, large = figure_pixels(12, 8), figure_pixels(40, 20), figure_pixels(400, 300)
    assert small[0] < usual[0]
    assert small[1] < usual[1]
    assert usual[0] <= 1800
    assert usual[1] <= 1500
    margins = 3.0  # inches around the grid, at most
    assert large[0] <= (MAX_GRID_INCHES[0] + margins) * 100
    assert large[1] <= (MAX_GRID_INCHES[1] + margins) * 100


def test_a_lens_without_targets_or_strings_is_drawn_with_ids(tmp_path: Path) -> None:
    lens = _lens(6, 4, targets=False)
    bare = replace(lens, token_strings=None)  # a model without labels: ids
    plot_lens(bare, tmp_path / "bare.png")
    assert imread(tmp_path / "bare.png").shape[:2] == figure_pixels(6, 4)[::-1]
    table = format_lens(bare)
    assert "target" not in table
    assert " r0" not in table
    assert str(int(bare.token_ids[0, 0, 0])) in table.splitlines()[3]


def test_the_table_shows_each_layers_top_token_probability_and_target_rank() -> None:
    lens = _lens(4, 3)
    lines = format_lens(lens, ["one", "two", "three"]).splitlines()
    assert lines[0].startswith("m v3 (tied): 4 layers x 3 positions")
    header, target, *layers = lines[3:]
    assert header.split()[:4] == ["layer", "0", "1", "2"]
    assert target.split() == ["target", "one", "two", "three"]
    assert layers[0].split()[:4] == ["0", "tok0", "0.05", "r3"]
    assert layers[-1].split()[:4] == ["3", "tok1", "0.95", "r0"]
    assert layers[-1].split()[-2:] == ["1.50", "0.00"]  # mean entropy, mean KL


def test_the_json_has_every_field_of_the_answer() -> None:
    shown = lens_json(_lens(2, 3, k=4))
    assert (shown["layers"], shown["tokens"], shown["k"]) == (2, 3, 4)
    assert np.asarray(shown["token_ids"]).shape == (2, 3, 4)
    assert {"target_ids", "target_logprobs", "target_ranks", "token_strings"} <= set(shown)


def test_plot_without_matplotlib_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    with pytest.raises(UsageError, match=r"pip install '\.\[plot\]'"):
        require_matplotlib()
    hidden = tmp_path / "h.npy"
    np.save(hidden, np.zeros((2, 1, 4), np.float32))
    argv = ["lens", "m", "--hidden", str(hidden), "--plot", str(tmp_path / "p.png")]
    assert main([*argv, "--url", "http://127.0.0.1:9"]) == 2  # refused before any call
    assert "pip install '.[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def test_files_that_are_not_one_array_are_refused_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "text.npy").write_text("not an array")
    np.savez(tmp_path / "two.npz", a=np.zeros(2), b=np.ones(2))
    for name, said in (("text.npy", "is not a .npy array"), ("two.npz", "holds several arrays")):
        argv = ["lens", "m", "--hidden", str(tmp_path / name), "--url", "http://127.0.0.1:9"]
        assert main(argv) == 2
        assert f"--hidden: {tmp_path / name} " + said in capsys.readouterr().err
