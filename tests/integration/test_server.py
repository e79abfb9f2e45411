"""The real service over real HTTP: numbers equal the numpy reference; metadata; versions."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import pytest

from service.heads.files import HeadWeights, save_head
from service.heads.reference import log_softmax, logsumexp, top_k
from service.tools.demo import demo_tokens
from tests.conftest import D_MODEL, VOCAB, reference_logits, write_tied_and_untied
from tests.server import live_server, poll, running_server, server_process

NPY = "application/x-npy"


@pytest.fixture(scope="module")
def repository(
    tmp_path_factory: pytest.TempPathFactory,
    table: npt.NDArray[np.float32],
    output_weight: npt.NDArray[np.float32],
) -> Path:
    root = tmp_path_factory.mktemp("repository")
    write_tied_and_untied(root, table, output_weight)
    save_head(HeadWeights.from_arrays(table, output_weight[::-1]), root / "untied" / "2")
    (root / "untied" / "config.json").write_text(json.dumps({"versions": "all"}))
    save_head(HeadWeights.from_arrays(table), root / "configured" / "1")
    (root / "configured" / "config.json").write_text(json.dumps({"default_k": 3}))
    (root / "broken" / "1").mkdir(parents=True)
    (root / "broken" / "1" / "model.onnx").write_bytes(b"not an onnx file")
    return root


@pytest.fixture(scope="module")
def client(repository: Path) -> Iterator[httpx.Client]:
    with (
        running_server(repository, max_logits_bytes=str(VOCAB * 4 * 20)) as url,
        httpx.Client(base_url=url, timeout=30) as http,
    ):
        yield http


def _reference(
    repository: Path, model: str, version: int, hidden: npt.NDArray[np.floating]
) -> npt.NDArray[np.float64]:
    return reference_logits(repository / model / str(version), hidden)


def _hidden(*shape: int, seed: int = 0) -> npt.NDArray[np.float32]:
    return np.random.default_rng(seed).standard_normal((*shape, D_MODEL)).astype(np.float32)


def _npy(array: npt.NDArray[Any]) -> bytes:
    stream = io.BytesIO()
    np.save(stream, array)
    return stream.getvalue()


def _check_topk(
    results: list[dict[str, Any]], logits: npt.NDArray[np.float64], k: int, logprobs: bool
) -> None:
    flat = logits.reshape(-1, logits.shape[-1])
    values, ids = top_k(flat, k)
    assert len(results) == len(flat)
    got_ids = np.array([r["token_ids"] for r in results])
    np.testing.assert_array_equal(got_ids, ids)
    got_values = np.array([r["logits"] for r in results])
    np.testing.assert_allclose(got_values, values, rtol=1e-4, atol=1e-4)
    if logprobs:
        expected = np.take_along_axis(log_softmax(flat), ids, axis=-1)
        got = np.array([r["logprobs"] for r in results])
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    else:
        assert all("logprobs" not in r for r in results)


def test_live_and_ready(client: httpx.Client) -> None:
    assert client.get("/health/live").json() == {"status": "live"}
    ready = client.get("/health/ready")
    assert ready.status_code == 200
    assert ready.json()["models"] == {
        "broken": "FAILED",
        "configured": "READY",
        "tied": "READY",
        "untied": "READY",
    }


def test_model_metadata(client: httpx.Client) -> None:
    models = {m["name"]: m for m in client.get("/v1/models").json()["models"]}
    tied, untied = models["tied"], models["untied"]
    assert (tied["tied"], untied["tied"]) == (True, False)
    for model in (tied, untied):
        assert (model["vocab_size"], model["d_model"], model["dtype"]) == (
            VOCAB,
            D_MODEL,
            "float32",
        )
        assert model["state"] == "READY"
    assert tied["parameters"] == VOCAB * D_MODEL
    assert untied["parameters"] == 2 * VOCAB * D_MODEL
    assert tied["weight_bytes"] == VOCAB * D_MODEL * 4
    assert (untied["versions"], untied["served_version"]) == ([1, 2], 2)
    assert tied["labels"] is True
    assert untied["labels"] is False
    assert models["configured"]["default_k"] == 3
    assert client.get("/v1/models/tied").json() == tied


def test_a_model_that_fails_to_load_is_reported_and_the_others_serve(
    client: httpx.Client,
) -> None:
    broken = client.get("/v1/models/broken").json()
    assert broken["state"] == "FAILED"
    assert "not a readable ONNX model" in broken["failed_versions"]["1"]
    response = client.post("/v1/models/broken/topk", json={"hidden_states": _hidden(1).tolist()})
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "model_not_ready"


@pytest.mark.parametrize("model", ["tied", "untied"])
@pytest.mark.parametrize("shape", [(1,), (4,), (2, 3)])
@pytest.mark.parametrize("logprobs", [True, False])
def test_topk_json_equals_reference(
    client: httpx.Client,
    repository: Path,
    model: str,
    shape: tuple[int, ...],
    logprobs: bool,
) -> None:
    hidden = _hidden(*shape, seed=len(shape))
    body = {"hidden_states": hidden.tolist(), "k": 7, "logprobs": logprobs}
    response = client.post(f"/v1/models/{model}/topk", json=body)
    assert response.status_code == 200, response.text
    payload = response.json()
    version = 1 if model == "tied" else 2
    assert (payload["model"], payload["version"], payload["tied"]) == (
        model,
        version,
        model == "tied",
    )
    assert (payload["k"], payload["shape"]) == (7, list(shape))
    assert response.headers["x-lmhead-version"] == str(version)
    _check_topk(payload["results"], _reference(repository, model, version, hidden), 7, logprobs)


def test_tokens_come_from_the_labels_file(client: httpx.Client) -> None:
    payload = client.post("/v1/models/tied/topk", json={"hidden_states": _hidden(2).tolist()})
    labels = demo_tokens(VOCAB)
    for result in payload.json()["results"]:
        assert result["tokens"] == [labels[i] for i in result["token_ids"]]
    untied = client.post("/v1/models/untied/topk", json={"hidden_states": _hidden(1).tolist()})
    assert "tokens" not in untied.json()["results"][0]


def test_default_k_comes_from_settings_or_model_config(client: httpx.Client) -> None:
    body = {"hidden_states": _hidden(1).tolist()}
    assert client.post("/v1/models/tied/topk", json=body).json()["k"] == 5
    assert client.post("/v1/models/configured/topk", json=body).json()["k"] == 3


def test_temperature_scales_values_and_keeps_order(client: httpx.Client, repository: Path) -> None:
    hidden = _hidden(3, seed=11)
    body = {"hidden_states": hidden.tolist(), "k": 6, "logprobs": True, "temperature": 0.5}
    results = client.post("/v1/models/tied/topk", json=body).json()["results"]
    _check_topk(results, _reference(repository, "tied", 1, hidden) / 0.5, 6, logprobs=True)


@pytest.mark.parametrize("model", ["tied", "untied"])
def test_topk_npy_in_json_out_and_npy_out(
    client: httpx.Client, repository: Path, model: str
) -> None:
    hidden = _hidden(2, 3, seed=5)
    logits = _reference(repository, model, 1 if model == "tied" else 2, hidden)
    url = f"/v1/models/{model}/topk?k=4&logprobs=true"
    as_json = client.post(url, content=_npy(hidden), headers={"content-type": NPY})
    assert as_json.status_code == 200, as_json.text
    _check_topk(as_json.json()["results"], logits, 4, logprobs=True)
    half = client.post(url, content=_npy(hidden.astype(np.float16)), headers={"content-type": NPY})
    assert half.status_code == 200
    binary = client.post(url, content=_npy(hidden), headers={"content-type": NPY, "accept": NPY})
    assert binary.headers["content-type"] == NPY
    records = np.load(io.BytesIO(binary.content))
    assert records.shape == (2, 3)
    values, ids = top_k(logits, 4)
    np.testing.assert_array_equal(records["token_ids"], ids)
    np.testing.assert_allclose(records["logits"], values, rtol=1e-4, atol=1e-4)
    expected_lp = np.take_along_axis(log_softmax(logits), ids, axis=-1)
    np.testing.assert_allclose(records["logprobs"], expected_lp, rtol=1e-4, atol=1e-4)


def test_topk_npz_answer_has_one_array_per_field(client: httpx.Client, repository: Path) -> None:
    hidden = _hidden(3, seed=6)
    response = client.post(
        "/v1/models/tied/topk?k=2",
        content=_npy(hidden),
        headers={"content-type": NPY, "accept": "application/x-npz"},
    )
    arrays = np.load(io.BytesIO(response.content))
    assert sorted(arrays.files) == ["logits", "logsumexp", "token_ids"]
    logits = _reference(repository, "tied", 1, hidden)
    np.testing.assert_array_equal(arrays["token_ids"], top_k(logits, 2)[1])
    np.testing.assert_allclose(arrays["logsumexp"], logsumexp(logits), rtol=1e-5, atol=1e-4)


def test_full_logits_npy_by_default_and_json_when_asked(
    client: httpx.Client, repository: Path
) -> None:
    hidden = _hidden(2, 2, seed=8)
    expected = _reference(repository, "untied", 2, hidden)
    binary = client.post("/v1/models/untied/logits", json={"hidden_states": hidden.tolist()})
    assert binary.headers["content-type"] == NPY
    np.testing.assert_allclose(np.load(io.BytesIO(binary.content)), expected, rtol=1e-4, atol=1e-4)
    as_json = client.post(
        "/v1/models/untied/logits",
        json={"hidden_states": hidden.tolist()},
        headers={"accept": "application/json"},
    )
    np.testing.assert_allclose(as_json.json()["logits"], expected, rtol=1e-4, atol=1e-4)


def test_full_logits_above_the_size_limit_are_refused(client: httpx.Client) -> None:
    response = client.post("/v1/models/tied/logits", json={"hidden_states": _hidden(21).tolist()})
    assert response.status_code == 413
    message = response.json()["error"]["message"]
    assert "21 rows x 997 tokens" in message
    assert "LMHEAD_MAX_LOGITS_BYTES" in message
    at_limit = client.post("/v1/models/tied/logits", json={"hidden_states": _hidden(20).tolist()})
    assert at_limit.status_code == 200
    assert np.load(io.BytesIO(at_limit.content)).shape == (20, VOCAB)


@pytest.mark.parametrize("model", ["tied", "untied"])
def test_embed_returns_rows_of_the_table(
    client: httpx.Client, model: str, table: npt.NDArray[np.float32]
) -> None:
    ids = [[0, 7, VOCAB - 1], [3, 3, 2]]
    payload = client.post(f"/v1/models/{model}/embed", json={"input_ids": ids}).json()
    np.testing.assert_array_equal(np.array(payload["embeddings"], np.float32), table[ids])
    binary = client.post(
        f"/v1/models/{model}/embed",
        content=_npy(np.array(ids)),
        headers={"content-type": NPY, "accept": NPY},
    )
    np.testing.assert_array_equal(np.load(io.BytesIO(binary.content)), table[ids])


def test_a_specific_version_can_be_addressed(client: httpx.Client, repository: Path) -> None:
    hidden = _hidden(2, seed=3)
    body = {"hidden_states": hidden.tolist(), "k": 3}
    for url in ("/v1/models/untied/versions/1/topk", "/v1/models/untied/topk?version=1"):
        payload = client.post(url, json=body).json()
        assert payload["version"] == 1
        _check_topk(payload["results"], _reference(repository, "untied", 1, hidden), 3, False)
    latest = client.post("/v1/models/untied/topk", json=body).json()
    assert latest["version"] == 2
    _check_topk(latest["results"], _reference(repository, "untied", 2, hidden), 3, False)


def test_metrics_count_requests_by_model_version_and_outcome(client: httpx.Client) -> None:
    client.post("/v1/models/tied/topk", json={"hidden_states": _hidden(1).tolist()})
    client.post("/v1/models/tied/topk", json={"hidden_states": [[1.0]]})
    client.post("/v1/models/nope/topk", json={"hidden_states": [[1.0]]})
    text = client.get("/metrics").text
    calls = 'lmhead_requests_total{{model="{}",outcome="{}",verb="topk",version="{}"}}'
    assert calls.format("tied", "ok", "1") in text
    assert calls.format("tied", "invalid_input", "1") in text
    assert calls.format("", "model_not_found", "") in text  # unknown names grow no series
    http = 'lmhead_http_requests_total{{endpoint="/v1/models/{{name}}/topk",status="{}"}}'
    assert http.format("200") in text
    assert http.format("422") in text
    assert 'lmhead_model_loaded{model="untied",tied="false",version="2"} 1.0' in text
    assert "lmhead_inference_duration_seconds_bucket" in text
    assert 'lmhead_model_load_failures_total{model="broken"} 1.0' in text


def test_an_answer_leaves_in_one_write(client: httpx.Client) -> None:
    """Head and body go out in one syscall (uvicorn wrote them apart: two syscalls, two TCP
    segments, a client woken twice per answer), counted by the kernel (``/proc/PID/io``):
    per request that write and the inference thread's wake-up of the event loop."""
    server = server_process(str(client.base_url))
    body = {"hidden_states": _hidden(2).tolist(), "k": 3}
    client.post("/v1/models/tied/topk", json=body).raise_for_status()  # warm
    before = _write_calls(server.pid)
    for _ in range(20):
        client.post("/v1/models/tied/topk", json=body).raise_for_status()
    assert 20 <= _write_calls(server.pid) - before < 50  # it was 60 (uvloop's writes count)


def _write_calls(pid: int) -> int:
    fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(fields["syscw"])


def test_debug_logging_shows_each_run(repository: Path) -> None:
    """LMHEAD_LOG_LEVEL=debug said nothing in normal operation; now each run is one line."""
    with live_server(repository, log_level="debug") as (url, log):
        poll(lambda: httpx.get(f"{url}/health/ready").status_code == 200 or None, "readiness")
        hidden = np.zeros((3, D_MODEL), np.float32).tolist()
        assert httpx.post(f"{url}/v1/models/tied/topk", json={"hidden_states": hidden}).is_success
        assert poll(lambda: "ran 3 rows of 1 requests" in log() or None, "the run's line")
