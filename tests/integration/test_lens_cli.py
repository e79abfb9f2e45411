"""The logit lens through the client and ``lmhead lens`` against a real server, checked with
float64 numpy: each layer's states through the head's final norm (``FinalNorm.apply``), then
the projection, log-softmax, entropy and KL(last layer || this one); ``states="residual"`` on
every other call; the table and the picture of ``lmhead lens --targets --plot``."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from matplotlib.image import imread

from service.cli.logit_lens import figure_pixels
from service.client import AsyncClient, Client, Lens
from service.errors import InvalidInput
from service.heads.files import HeadWeights, save_head
from service.heads.norm import FinalNorm
from service.heads.reference import log_softmax, top_k
from service.tools.demo import demo_tokens
from tests.conftest import D_MODEL, VOCAB, reference_logits
from tests.server import running_server

LAYERS, POSITIONS, K = 6, 5, 4
_rng = np.random.default_rng(38)
NORMS = {
    "normed": FinalNorm("rms", _rng.uniform(0.5, 1.5, D_MODEL).astype(np.float32), 1e-5),
    "layered": FinalNorm(
        "layer",
        _rng.uniform(0.5, 1.5, D_MODEL).astype(np.float32),
        1e-5,
        _rng.normal(0, 0.1, D_MODEL).astype(np.float32),
    ),
}
#: Residual states whose scale grows with depth, as a residual stream's does.
RESIDUAL = (
    _rng.standard_normal((LAYERS, POSITIONS, D_MODEL)) * np.arange(1, LAYERS + 1)[:, None, None]
).astype(np.float32)
TARGETS = _rng.integers(0, VOCAB, POSITIONS)
RTOL, ATOL = 1e-4, 1e-4


def _hidden(model: str) -> npt.NDArray[np.float32]:
    """As ``output_hidden_states`` gives them: residual, the last layer post-norm."""
    states = RESIDUAL.copy()
    states[-1] = NORMS[model].apply(RESIDUAL[-1]).astype(np.float32)
    return states


@pytest.fixture(scope="module")
def repository(
    tmp_path_factory: pytest.TempPathFactory,
    table: npt.NDArray[np.float32],
    output_weight: npt.NDArray[np.float32],
) -> Path:
    """``normed`` (tied, RMS, labels), ``layered`` (untied, LayerNorm with a bias, no labels),
    ``plain`` (no norm)."""
    root = tmp_path_factory.mktemp("models")
    save_head(HeadWeights.from_arrays(table, norm=NORMS["normed"]), root / "normed" / "1")
    (root / "normed" / "1" / "vocab.txt").write_text("\n".join(demo_tokens(VOCAB)) + "\n")
    layered = HeadWeights.from_arrays(table, output_weight, norm=NORMS["layered"])
    save_head(layered, root / "layered" / "1")
    save_head(HeadWeights.from_arrays(table), root / "plain" / "1")
    return root


@pytest.fixture(scope="module")
def url(repository: Path) -> Iterator[str]:
    with running_server(repository) as base_url:
        yield base_url


def _reference(repository: Path, model: str, normed: npt.NDArray[np.float64]) -> dict[str, Any]:
    """The lens of final (normed) states (layers, tokens, d_model), in float64."""
    logits = reference_logits(repository / model / "1", normed.reshape(-1, D_MODEL))
    logprobs = log_softmax(logits).reshape(LAYERS, POSITIONS, -1)
    top, ids = top_k(logprobs, K)
    probabilities = np.exp(logprobs)
    target = np.take_along_axis(logprobs, TARGETS[None, :, None], -1)
    return {
        "token_ids": ids,
        "logprobs": top,
        "entropy": -(probabilities * logprobs).sum(-1),
        "kl_to_last": (probabilities[-1] * (logprobs[-1] - logprobs)).sum(-1),
        "target_logprobs": target[..., 0],
        "target_ranks": (logprobs > target).sum(-1),
    }


def _assert_equal(lens: Lens, want: dict[str, Any]) -> None:
    np.testing.assert_array_equal(lens.token_ids, want["token_ids"])
    np.testing.assert_array_equal(lens.target_ranks, want["target_ranks"])
    for name in ("logprobs", "target_logprobs"):
        np.testing.assert_allclose(getattr(lens, name), want[name], rtol=RTOL, atol=ATOL)
    for name in ("entropy", "kl_to_last"):  # sums over the vocabulary of float32 log-probs
        np.testing.assert_allclose(getattr(lens, name), want[name], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("model", ["normed", "layered"])
def test_client_lens_equals_the_reference_as_npz_and_as_json(
    url: str, repository: Path, model: str
) -> None:
    normed = NORMS[model].apply(RESIDUAL)
    normed[-1] = _hidden(model)[-1]  # the last layer read as it came (last_layer="final")
    want = _reference(repository, model, normed)
    with Client(url) as client:
        binary = client.lens(model, _hidden(model), k=K, target_ids=TARGETS)
        spoken = client.lens(model, _hidden(model), k=K, target_ids=TARGETS, tokens=True)
    with Client(url, binary=False) as client:
        plain = client.lens(model, _hidden(model), k=K, target_ids=TARGETS)
    for lens in (binary, spoken, plain):
        assert (lens.model, lens.version, lens.tied) == (model, 1, model == "normed")
        assert (lens.layers, lens.tokens, lens.k) == (LAYERS, POSITIONS, K)
        np.testing.assert_array_equal(lens.target_ids, TARGETS)
        _assert_equal(lens, want)
    assert lens.entropy.dtype == np.float32
    np.testing.assert_array_equal(spoken.token_ids, binary.token_ids)
    for name in ("logprobs", "entropy", "kl_to_last", "target_logprobs"):
        np.testing.assert_allclose(getattr(spoken, name), getattr(binary, name), atol=1e-6)
    assert binary.token_strings is None  # .npz carries no strings
    labels = demo_tokens(VOCAB)
    expected = [[[labels[i] for i in row] for row in grid] for grid in spoken.token_ids.tolist()]
    assert spoken.token_strings == (expected if model == "normed" else None)


def test_async_lens_reads_every_layer_residual_or_every_layer_final(
    url: str, repository: Path
) -> None:
    """``last_layer="residual"``: the last layer is normed like the others; ``states="final"``:
    no layer is."""
    normed = NORMS["normed"].apply(RESIDUAL)
    asked: dict[str, Any] = {"k": K, "target_ids": TARGETS}

    async def scenario() -> tuple[Lens, Lens, Lens]:
        async with AsyncClient(url) as client:
            return await asyncio.gather(
                client.lens("normed", RESIDUAL, last_layer="residual", **asked),
                client.lens("normed", normed.astype(np.float32), states="final", **asked),
                client.lens("normed", RESIDUAL, last_layer="residual", tokens=True, **asked),
            )

    residual, final, spoken = asyncio.run(scenario())
    want = _reference(repository, "normed", normed)
    for lens in (residual, final, spoken):
        _assert_equal(lens, want)
    assert spoken.token_strings is not None
    np.testing.assert_allclose(residual.kl_to_last[-1], 0.0, atol=1e-5)


def test_states_residual_on_topk_logits_score_and_compare(url: str, repository: Path) -> None:
    rows = RESIDUAL[1]
    logits = reference_logits(repository / "normed" / "1", NORMS["normed"].apply(rows))
    with Client(url) as client:
        top = client.topk("normed", rows, k=3, logprobs=True, states="residual")
        full = client.logits("normed", rows, states="residual")
        scored = client.score("normed", rows, TARGETS, states="residual")
        compared = client.compare("normed", "layered", rows, states="residual", k=3)
        unnormed = client.logits("normed", rows)  # not sent: final states, as before
    np.testing.assert_array_equal(top.token_ids, top_k(logits, 3)[1])
    np.testing.assert_allclose(full.array, logits, rtol=RTOL, atol=ATOL)
    got = [row["logprob"] for row in scored["results"]]
    want = log_softmax(logits)[np.arange(POSITIONS), TARGETS]
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    assert compared["rows"] == POSITIONS
    expected = reference_logits(repository / "normed" / "1", rows)
    np.testing.assert_allclose(unnormed.array, expected, rtol=RTOL, atol=ATOL)


def test_a_head_without_a_norm_refuses_residual_states(url: str) -> None:
    with Client(url) as client, pytest.raises(InvalidInput, match="norm"):
        client.lens("plain", RESIDUAL)
    with Client(url) as client:  # final states need no norm
        assert client.lens("plain", RESIDUAL, states="final").layers == LAYERS


def _lmhead(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service", "lens", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_lmhead_lens_prints_the_table_and_draws_the_picture(
    url: str, repository: Path, tmp_path: Path
) -> None:
    np.save(tmp_path / "hidden.npy", _hidden("normed"))
    np.save(tmp_path / "targets.npy", TARGETS)
    picture = tmp_path / "lens.png"
    done = _lmhead(
        "normed",
        *("--hidden", str(tmp_path / "hidden.npy"), "--targets", str(tmp_path / "targets.npy")),
        *("--plot", str(picture), "--k", "3", "--url", url),
    )
    assert done.returncode == 0, done.stderr
    normed = NORMS["normed"].apply(RESIDUAL)
    normed[-1] = _hidden("normed")[-1]
    want = _reference(repository, "normed", normed)
    labels = demo_tokens(VOCAB)
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"normed v1 (tied): {LAYERS} layers x {POSITIONS} positions")
    header, target, *rows = lines[3:]
    assert header.split()[: POSITIONS + 1] == ["layer", *map(str, range(POSITIONS))]
    assert target.split() == ["target", *(labels[i] for i in TARGETS)]
    assert len(rows) == LAYERS
    for layer, row in enumerate(rows):
        cells = row.split()
        assert cells[0] == str(layer)
        shown = [cells[1 + 3 * pos : 4 + 3 * pos] for pos in range(POSITIONS)]
        top = [labels[i] for i in want["token_ids"][layer, :, 0]]
        assert [cell[0] for cell in shown] == top
        assert [cell[2] for cell in shown] == [f"r{r}" for r in want["target_ranks"][layer]]
        probability = np.exp(want["logprobs"][layer, :, 0])
        np.testing.assert_allclose([float(cell[1]) for cell in shown], probability, atol=0.006)
    assert f"wrote {picture}" in done.stderr
    width, height = figure_pixels(LAYERS, POSITIONS)
    assert imread(picture).shape == (height, width, 4)


def test_lmhead_lens_json_is_the_answer_and_errors_are_said(url: str, tmp_path: Path) -> None:
    np.save(tmp_path / "hidden.npy", _hidden("layered"))
    done = _lmhead("layered", "--hidden", str(tmp_path / "hidden.npy"), "--json", "--url", url)
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    with Client(url) as client:
        lens = client.lens("layered", _hidden("layered"))
    assert (shown["layers"], shown["tokens"], shown["k"]) == (LAYERS, POSITIONS, lens.k)
    np.testing.assert_array_equal(shown["token_ids"], lens.token_ids)
    assert "token_strings" not in shown  # no labels: the table shows ids
    table = _lmhead("layered", "--hidden", str(tmp_path / "hidden.npy"), "--url", url)
    assert table.stdout.splitlines()[3 + 1].split()[1] == str(lens.token_ids[0, 0, 0])
    refused = _lmhead("plain", "--hidden", str(tmp_path / "hidden.npy"), "--url", url)
    assert refused.returncode == 1
    assert "the service answered 422" in refused.stderr
