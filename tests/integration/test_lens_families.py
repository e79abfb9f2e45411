"""Every family's final norm served: each family's checkpoint (``tests.families``, in its Hugging
Face convention) imported with ``lmhead import`` and served by a real process; residual states
on /topk, /logits, V2 and every layer of /lens against the float64 reference of that family's
own norm and head."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from service.cli import main
from service.heads.reference import log_softmax
from tests import families
from tests.families import D_MODEL, FAMILIES
from tests.server import running_server

ROWS = 5
LAYERS, TOKENS = 3, 4
#: float32 math on logits up to ~5 (measured worst ~1.3e-6 in tests/unit/tools).
TOL: dict[str, Any] = {"rtol": 1e-5, "atol": 5e-5}


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("families")
    repository = root / "models"
    for family in FAMILIES:
        source = families.write_checkpoint(family, root / "checkpoints" / family)
        assert main(["import", str(source), "--name", family, "--repository", str(repository)]) == 0
    with running_server(repository) as base_url:
        yield base_url


def _post(url: str, path: str, **body: Any) -> Any:
    answer = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


@pytest.mark.parametrize("family", FAMILIES)
def test_residual_states_on_topk_logits_and_v2(url: str, family: str) -> None:
    residual = families.residual_states(ROWS, seed=3)
    want = families.reference_logits(family, residual)
    topk = _post(
        url, f"/v1/models/{family}/topk", hidden_states=residual.tolist(), k=4, states="residual"
    )
    for row, result in enumerate(topk["results"]):
        np.testing.assert_allclose(result["logits"], np.sort(want[row])[::-1][:4], **TOL)
        np.testing.assert_allclose(want[row, result["token_ids"]], result["logits"], **TOL)
    stream = io.BytesIO()
    np.save(stream, residual)
    logits = httpx.post(
        f"{url}/v1/models/{family}/logits?states=residual",
        content=stream.getvalue(),
        headers={"content-type": "application/x-npy"},
    )
    assert logits.status_code == 200, logits.text
    np.testing.assert_allclose(np.load(io.BytesIO(logits.content)), want, **TOL)
    tensor = {"name": "hidden_states", "shape": [ROWS, D_MODEL], "datatype": "FP32"}
    tensor["data"] = residual.ravel().tolist()
    v2 = _post(
        url,
        f"/v2/models/{family}/infer",
        inputs=[tensor],
        parameters={"k": 4, "states": "residual"},
    )
    (values,) = [o["data"] for o in v2["outputs"] if o["name"] == "topk_logits"]
    np.testing.assert_allclose(
        np.reshape(values, (ROWS, 4)), np.sort(want, -1)[:, ::-1][:, :4], **TOL
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_every_layer_of_the_lens(url: str, family: str) -> None:
    """Every layer residual (``last_layer: residual``), so the reference reads each the same."""
    layers = np.stack([families.residual_states(TOKENS, seed=10 + n) for n in range(LAYERS)])
    want = np.stack([log_softmax(families.reference_logits(family, layer)) for layer in layers])
    lens = _post(
        url,
        f"/v1/models/{family}/lens",
        hidden_states=layers.tolist(),
        k=3,
        last_layer="residual",
        target_ids=[1, 2, 3, 4],
    )
    ids = np.array(lens["token_ids"])
    np.testing.assert_allclose(lens["logprobs"], np.take_along_axis(want, ids, -1), **TOL)
    np.testing.assert_allclose(lens["logprobs"], np.sort(want, -1)[..., ::-1][..., :3], **TOL)
    probs = np.exp(want)
    np.testing.assert_allclose(lens["entropy"], -(probs * want).sum(-1), **TOL)
    np.testing.assert_allclose(lens["kl_to_last"], (probs[-1] * (want[-1] - want)).sum(-1), **TOL)
    targets = want[:, np.arange(TOKENS), [1, 2, 3, 4]]
    np.testing.assert_allclose(lens["target_logprobs"], targets, **TOL)
