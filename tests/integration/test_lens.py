"""Residual states and the logit lens over real HTTP (native, V2, gRPC): every number checked
against a float64 reference of the head's final norm and projection (``FinalNorm.apply`` is
checked against each family's own formula in tests/unit/tools/test_final_norms.py)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import pytest

from service.heads.files import HeadWeights, save_head
from service.heads.norm import FinalNorm
from service.heads.reference import log_softmax
from tests.server import free_port, running_server

VOCAB, D = 500, 32
RNG = np.random.default_rng(38)
TABLE = RNG.standard_normal((VOCAB, D), dtype=np.float32)
OUTPUT = RNG.standard_normal((VOCAB, D), dtype=np.float32)
NORMS = {
    "rms": FinalNorm("rms", (1 + 0.2 * RNG.standard_normal(D)).astype(np.float32), 1e-6),
    "layer": FinalNorm(
        "layer",
        (1 + 0.2 * RNG.standard_normal(D)).astype(np.float32),
        1e-5,
        (0.1 * RNG.standard_normal(D)).astype(np.float32),
    ),
}
LAYERS, TOKENS = 4, 70  # 70 positions: several lens runs (32 positions x 4 layers each)
STATES = (3 * RNG.standard_normal((LAYERS, TOKENS, D)) + 0.5).astype(np.float32)
TARGETS = RNG.integers(0, VOCAB, TOKENS)
TOL: dict[str, Any] = {"rtol": 1e-4, "atol": 2e-4}
GRPC_PORT = free_port()


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    repository = tmp_path_factory.mktemp("lens")
    save_head(HeadWeights.from_arrays(TABLE, norm=NORMS["rms"]), repository / "rms" / "1")
    save_head(
        HeadWeights.from_arrays(TABLE, OUTPUT, norm=NORMS["layer"]), repository / "layer" / "1"
    )
    save_head(HeadWeights.from_arrays(TABLE), repository / "plain" / "1")
    labels = "\n".join(f"tok{i}" for i in range(VOCAB)) + "\n"
    (repository / "rms" / "1" / "vocab.txt").write_text(labels)
    with running_server(repository, grpc_port=str(GRPC_PORT)) as base_url:
        yield base_url


def _logprobs(model: str, states: npt.NDArray[np.float32], residual: bool = True) -> Any:
    """float64 log-softmax of the head's logits, the norm first when ``residual``."""
    rows = NORMS[model].apply(states) if residual else states.astype(np.float64)
    matrix = TABLE if model == "rms" else OUTPUT
    return log_softmax(rows @ matrix.astype(np.float64).T)


def _lens_reference(model: str) -> dict[str, Any]:
    every = np.stack(
        [_logprobs(model, STATES[layer], layer < LAYERS - 1) for layer in range(LAYERS)]
    )
    probs = np.exp(every)
    return {
        "logprobs": every,
        "entropy": -(probs * every).sum(-1),
        "kl_to_last": (probs[-1] * (every[-1] - every)).sum(-1),
        "target_logprobs": every[:, np.arange(TOKENS), TARGETS],
        "target_ranks": (every > every[:, np.arange(TOKENS), TARGETS][..., None]).sum(-1),
    }


def _npy(array: npt.NDArray[Any]) -> bytes:
    stream = io.BytesIO()
    np.save(stream, array)
    return stream.getvalue()


@pytest.mark.parametrize("model", ["rms", "layer"])
def test_every_layer_of_the_lens_matches_the_reference(url: str, model: str) -> None:
    body = {"hidden_states": STATES.tolist(), "k": 4, "target_ids": TARGETS.tolist()}
    answer = httpx.post(f"{url}/v1/models/{model}/lens", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    got, want = answer.json(), _lens_reference(model)
    assert (got["layers"], got["tokens"], got["k"]) == (LAYERS, TOKENS, 4)
    ids = np.array(got["token_ids"])
    assert np.array_equal(ids, np.argsort(-want["logprobs"], axis=-1, kind="stable")[..., :4])
    chosen = np.take_along_axis(want["logprobs"], ids, -1)
    np.testing.assert_allclose(got["logprobs"], chosen, **TOL)
    for field in ("entropy", "kl_to_last", "target_logprobs"):
        np.testing.assert_allclose(got[field], want[field], **TOL, err_msg=field)
    assert np.array_equal(got["target_ranks"], want["target_ranks"])
    assert got["target_ids"] == TARGETS.tolist()
    assert np.all(np.array(got["kl_to_last"])[-1] == 0)  # the last layer against itself
    if model == "rms":  # labels: every top token's string, [layer][token][k]
        assert got["token_strings"][2][5] == [f"tok{i}" for i in ids[2, 5]]


def test_the_lens_answers_npz_from_an_npy_body(url: str) -> None:
    answer = httpx.post(
        f"{url}/v1/models/layer/lens",
        params={"k": "3", "target_ids": str(TARGETS.tolist()), "last_layer": "residual"},
        content=_npy(STATES),
        headers={"content-type": "application/x-npy", "accept": "application/x-npz"},
    )
    assert answer.status_code == 200, answer.text
    arrays = np.load(io.BytesIO(answer.content))
    every = np.stack([_logprobs("layer", STATES[layer]) for layer in range(LAYERS)])
    assert arrays["token_ids"].shape == (LAYERS, TOKENS, 3)
    np.testing.assert_allclose(arrays["logprobs"], np.sort(every, -1)[..., ::-1][..., :3], **TOL)
    assert arrays["kl_to_last"][-1].max() == 0
    assert arrays["target_ranks"].dtype == np.int64


def test_final_states_skip_the_norm(url: str) -> None:
    body = {"hidden_states": STATES[:, :3].tolist(), "states": "final", "k": 2}
    answer = httpx.post(f"{url}/v1/models/rms/lens", json=body)
    assert answer.status_code == 200, answer.text
    every = np.stack([_logprobs("rms", STATES[layer, :3], False) for layer in range(LAYERS)])
    np.testing.assert_allclose(
        answer.json()["logprobs"], np.sort(every, -1)[..., ::-1][..., :2], **TOL
    )


@pytest.mark.parametrize("model", ["rms", "layer"])
def test_residual_states_on_topk_logits_score_and_compare(url: str, model: str) -> None:
    rows = STATES[1, :6]
    want = _logprobs(model, rows)
    topk = httpx.post(
        f"{url}/v1/models/{model}/topk",
        json={"hidden_states": rows.tolist(), "states": "residual", "k": 3, "logprobs": True},
    ).json()
    for row, result in enumerate(topk["results"]):
        assert result["token_ids"] == np.argsort(-want[row], kind="stable")[:3].tolist()
        np.testing.assert_allclose(result["logprobs"], want[row, result["token_ids"]], **TOL)
    logits = httpx.post(
        f"{url}/v1/models/{model}/logits",
        params={"states": "residual"},
        content=_npy(rows),
        headers={"content-type": "application/x-npy"},
    )
    got = np.load(io.BytesIO(logits.content))
    np.testing.assert_allclose(log_softmax(got.astype(np.float64)), want, **TOL)
    targets = TARGETS[:6].tolist()
    score = httpx.post(
        f"{url}/v1/models/{model}/score",
        json={"hidden_states": rows.tolist(), "target_ids": targets, "states": "residual"},
    ).json()
    expected = want[np.arange(6), targets]
    np.testing.assert_allclose([r["logprob"] for r in score["results"]], expected, **TOL)
    compare = httpx.post(
        f"{url}/v1/compare",
        json={"models": [model, model], "hidden_states": rows.tolist(), "states": "residual"},
    ).json()
    assert compare["top1_agreement"] == 1.0


def test_residual_states_over_v2_http_and_grpc(url: str) -> None:
    import tritonclient.grpc as grpc_client

    rows = STATES[2, :5]
    want = np.argsort(-_logprobs("rms", rows), axis=-1, kind="stable")[:, :3]
    tensor = {
        "name": "hidden_states",
        "shape": [5, D],
        "datatype": "FP32",
        "data": rows.ravel().tolist(),
    }
    body = {"inputs": [tensor], "parameters": {"k": 3, "states": "residual"}}
    answer = httpx.post(f"{url}/v2/models/rms/infer", json=body).json()
    (ids,) = [o for o in answer["outputs"] if o["name"] == "topk_token_ids"]
    assert np.array_equal(np.reshape(ids["data"], (5, 3)), want)
    client = grpc_client.InferenceServerClient(f"127.0.0.1:{GRPC_PORT}")
    entry = grpc_client.InferInput("hidden_states", [5, D], "FP32")
    entry.set_data_from_numpy(rows)
    result = client.infer("rms", [entry], parameters={"k": 3, "states": "residual"})
    assert np.array_equal(result.as_numpy("topk_token_ids"), want)


@pytest.mark.parametrize(
    ("path", "body", "status", "named"),
    [
        ("plain/topk", {"hidden_states": [[0.0] * D], "states": "residual"}, 422, "states"),
        ("plain/lens", {"hidden_states": [[[0.0] * D]]}, 422, "states"),
        ("rms/lens", {"hidden_states": [[0.0] * D]}, 422, "hidden_states"),
        (
            "rms/lens",
            {"hidden_states": [[[0.0] * D]], "states": "final", "last_layer": "residual"},
            422,
            "last_layer",
        ),
        ("rms/lens", {"hidden_states": [[[0.0] * D]], "target_ids": [1, 2]}, 422, "target_ids"),
        ("rms/topk", {"hidden_states": [[0.0] * D], "states": "normed"}, 422, "states"),
    ],
)
def test_bad_states_are_refused_naming_the_field(
    url: str, path: str, body: dict[str, Any], status: int, named: str
) -> None:
    answer = httpx.post(f"{url}/v1/models/{path}", json=body)
    assert answer.status_code == status, answer.text
    assert named in answer.json()["error"]["message"]


def test_mixed_states_in_one_v2_request_are_refused(url: str) -> None:
    tensor = {
        "name": "hidden_states",
        "shape": [1, D],
        "datatype": "FP32",
        "data": [0.0] * D,
        "parameters": {"states": "final"},
    }
    body = {"inputs": [tensor], "parameters": {"states": "residual"}}
    answer = httpx.post(f"{url}/v2/models/rms/infer", json=body)
    assert answer.status_code == 400
    assert "states" in answer.json()["error"]


def test_the_lens_crosses_from_a_front_to_the_engine(tmp_path: Path) -> None:
    """``LMHEAD_WORKERS=2``: the request and its answer cross the processes' channel."""
    save_head(HeadWeights.from_arrays(TABLE, norm=NORMS["rms"]), tmp_path / "rms" / "1")
    body = {"hidden_states": STATES[:, :5].tolist(), "target_ids": TARGETS[:5].tolist()}
    with running_server(tmp_path, workers="2") as split_url:
        answer = httpx.post(f"{split_url}/v1/models/rms/lens", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    want = _lens_reference("rms")
    np.testing.assert_allclose(answer.json()["entropy"], want["entropy"][:, :5], **TOL)
    assert np.array_equal(answer.json()["target_ranks"], want["target_ranks"][:, :5])
