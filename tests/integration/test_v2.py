"""Open Inference Protocol (V2) with the real tritonclient and raw HTTP: numbers and errors."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from service.heads.files import HeadWeights, save_head
from service.heads.reference import log_softmax, logsumexp, top_k
from service.tools.demo import demo_tokens
from tests.conftest import D_MODEL, VOCAB, reference_logits
from tests.server import running_server

HIDDEN = np.random.default_rng(21).standard_normal((3, D_MODEL)).astype(np.float32)


@pytest.fixture(scope="module")
def url(repository: Path) -> Iterator[str]:
    with running_server(repository) as base_url:
        yield base_url


@pytest.fixture
def client(url: str) -> Iterator[triton.InferenceServerClient]:
    connection = triton.InferenceServerClient(url.removeprefix("http://"))
    yield connection
    connection.close()


def _logits(repository: Path, model: str, hidden: npt.NDArray[np.floating]) -> npt.NDArray[Any]:
    return reference_logits(repository / model / "1", hidden)


def test_health_and_metadata(client: triton.InferenceServerClient, url: str) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("tied")
    assert not client.is_model_ready("missing")
    metadata = client.get_model_metadata("untied")
    assert metadata["platform"] == "onnx_onnxv1"
    assert metadata["versions"] == ["1"]
    inputs = {i["name"]: (i["datatype"], i["shape"]) for i in metadata["inputs"]}
    assert inputs == {"hidden_states": ("FP32", [-1, D_MODEL]), "input_ids": ("INT64", [-1])}
    outputs = {o["name"]: (o["datatype"], o["shape"]) for o in metadata["outputs"]}
    assert outputs["logits"] == ("FP32", [-1, VOCAB])
    assert outputs["topk_token_ids"] == ("INT64", [-1, -1])
    assert client.get_model_metadata("tied", model_version="1")["name"] == "tied"
    server = httpx.get(f"{url}/v2").json()
    assert "binary_tensor_data" in server["extensions"]
    assert "classification" in server["extensions"]


@pytest.mark.parametrize("model", ["tied", "untied"])
@pytest.mark.parametrize("binary_in", [True, False])
@pytest.mark.parametrize("binary_out", [True, False])
def test_infer_topk_equals_reference(
    client: triton.InferenceServerClient,
    repository: Path,
    model: str,
    binary_in: bool,
    binary_out: bool,
) -> None:
    hidden = triton.InferInput("hidden_states", list(HIDDEN.shape), "FP32")
    hidden.set_data_from_numpy(HIDDEN, binary_data=binary_in)
    names = ["topk_token_ids", "topk_logits", "topk_logprobs", "logsumexp"]
    outputs = [triton.InferRequestedOutput(n, binary_data=binary_out) for n in names]
    result = client.infer(model, [hidden], outputs=outputs, parameters={"k": 4})
    logits = _logits(repository, model, HIDDEN)
    values, ids = top_k(logits, 4)
    np.testing.assert_array_equal(result.as_numpy("topk_token_ids"), ids)
    np.testing.assert_allclose(result.as_numpy("topk_logits"), values, rtol=1e-4, atol=1e-4)
    expected_lp = np.take_along_axis(log_softmax(logits), ids, axis=-1)
    np.testing.assert_allclose(result.as_numpy("topk_logprobs"), expected_lp, atol=1e-4)
    np.testing.assert_allclose(result.as_numpy("logsumexp"), logsumexp(logits), atol=1e-4)
    assert result.get_response()["model_version"] == "1"


def test_full_logits_and_fp16_input(client: triton.InferenceServerClient, repository: Path) -> None:
    half = HIDDEN.astype(np.float16)
    hidden = triton.InferInput("hidden_states", list(half.shape), "FP16")
    hidden.set_data_from_numpy(half)
    result = client.infer("untied", [hidden], outputs=[triton.InferRequestedOutput("logits")])
    expected = _logits(repository, "untied", half.astype(np.float32))
    np.testing.assert_allclose(result.as_numpy("logits"), expected, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("binary_out", [True, False])
def test_classification_extension(
    client: triton.InferenceServerClient, repository: Path, binary_out: bool
) -> None:
    hidden = triton.InferInput("hidden_states", list(HIDDEN.shape), "FP32")
    hidden.set_data_from_numpy(HIDDEN)
    requested = triton.InferRequestedOutput("logits", binary_data=binary_out, class_count=3)
    result = client.infer("tied", [hidden], outputs=[requested])
    strings = result.as_numpy("logits")
    assert strings.shape == (3, 3)
    values, ids = top_k(_logits(repository, "tied", HIDDEN), 3)
    labels = demo_tokens(VOCAB)
    for row in range(3):
        for col in range(3):
            text = strings[row, col]
            value, index, label = (text.decode() if isinstance(text, bytes) else text).split(":")
            assert int(index) == ids[row, col]
            assert label == labels[ids[row, col]]
            assert abs(float(value) - values[row, col]) < 1e-4


def test_embeddings_from_input_ids(
    client: triton.InferenceServerClient, table: npt.NDArray[np.float32]
) -> None:
    ids = np.array([3, 0, VOCAB - 1], dtype=np.int64)
    tensor = triton.InferInput("input_ids", [3], "INT64")
    tensor.set_data_from_numpy(ids)
    result = client.infer("tied", [tensor])
    np.testing.assert_array_equal(result.as_numpy("embeddings"), table[ids])


def test_repository_extension_drives_hot_swap(
    client: triton.InferenceServerClient, repository: Path, table: npt.NDArray[np.float32]
) -> None:
    index = {row["name"]: row["state"] for row in client.get_model_repository_index()}
    assert index == {"tied": "READY", "untied": "READY"}
    save_head(HeadWeights.from_arrays(table * -1.0), repository / "untied" / "2")
    client.load_model("untied")
    hidden = triton.InferInput("hidden_states", list(HIDDEN.shape), "FP32")
    hidden.set_data_from_numpy(HIDDEN)
    result = client.infer("untied", [hidden])
    assert result.get_response()["model_version"] == "2"
    expected = top_k(HIDDEN.astype(np.float64) @ -table.T.astype(np.float64), 5)[1]
    np.testing.assert_array_equal(result.as_numpy("topk_token_ids"), expected)
    client.unload_model("untied")
    assert not client.is_model_ready("untied")
    shutil.rmtree(repository / "untied" / "2")
    client.load_model("untied")  # back to version 1 for the other tests
    assert client.is_model_ready("untied", model_version="1")


def test_json_data_may_be_nested_or_flat(url: str, repository: Path) -> None:
    expected = top_k(_logits(repository, "tied", HIDDEN[:2]), 5)[1].tolist()
    for data in (HIDDEN[:2].tolist(), HIDDEN[:2].reshape(-1).tolist()):
        body = {
            "id": "req-1",
            "inputs": [
                {"name": "hidden_states", "shape": [2, D_MODEL], "datatype": "FP32", "data": data}
            ],
        }
        answer = httpx.post(f"{url}/v2/models/tied/infer", json=body).json()
        assert answer["id"] == "req-1"
        assert answer["model_name"] == "tied"
        ids = next(o for o in answer["outputs"] if o["name"] == "topk_token_ids")
        assert ids["shape"] == [2, 5]
        assert np.array(ids["data"]).reshape(2, 5).tolist() == expected


def _binary_body(header: dict[str, Any], *blobs: bytes) -> tuple[bytes, dict[str, str]]:
    raw = json.dumps(header).encode()
    return raw + b"".join(blobs), {"inference-header-content-length": str(len(raw))}


def _hidden_input(rows: int, **extra: Any) -> dict[str, Any]:
    return {"name": "hidden_states", "shape": [rows, D_MODEL], "datatype": "FP32", **extra}


GOOD = HIDDEN[:1].tobytes()
GOOD_SIZE = {"binary_data_size": len(GOOD)}
ERROR_CASES: list[tuple[str, str, bytes, dict[str, str], int]] = [
    (
        "unknown model",
        "/v2/models/nope/infer",
        *_binary_body({"inputs": [_hidden_input(1, parameters=GOOD_SIZE)]}, GOOD),
        404,
    ),
    (
        "unknown version",
        "/v2/models/tied/versions/9/infer",
        *_binary_body({"inputs": [_hidden_input(1, parameters=GOOD_SIZE)]}, GOOD),
        404,
    ),
    ("malformed header", "/v2/models/tied/infer", b'{"inputs": [', {}, 400),
    ("no inputs", "/v2/models/tied/infer", b'{"inputs": []}', {}, 400),
    (
        "wrong datatype",
        "/v2/models/tied/infer",
        json.dumps(
            {"inputs": [{**_hidden_input(1), "datatype": "INT32", "data": [1] * D_MODEL}]}
        ).encode(),
        {},
        400,
    ),
    (
        "shape does not match data",
        "/v2/models/tied/infer",
        json.dumps({"inputs": [_hidden_input(2, data=[0.5] * D_MODEL)]}).encode(),
        {},
        400,
    ),
    (
        "wrong d_model",
        "/v2/models/tied/infer",
        json.dumps({"inputs": [{**_hidden_input(1), "shape": [1, 3], "data": [0.5] * 3}]}).encode(),
        {},
        400,
    ),
    (
        "unknown input",
        "/v2/models/tied/infer",
        json.dumps(
            {"inputs": [{**_hidden_input(1), "name": "x", "data": [0.5] * D_MODEL}]}
        ).encode(),
        {},
        400,
    ),
    (
        "unknown output",
        "/v2/models/tied/infer",
        json.dumps(
            {"inputs": [_hidden_input(1, data=[0.5] * D_MODEL)], "outputs": [{"name": "probs"}]}
        ).encode(),
        {},
        400,
    ),
    (
        "NaN in a binary tensor",
        "/v2/models/tied/infer",
        *_binary_body(
            {"inputs": [_hidden_input(1, parameters={"binary_data_size": len(GOOD)})]},
            np.full((1, D_MODEL), np.nan, np.float32).tobytes(),
        ),
        400,
    ),
    (
        "binary size does not match shape",
        "/v2/models/tied/infer",
        *_binary_body({"inputs": [_hidden_input(1, parameters={"binary_data_size": 8})]}, GOOD[:8]),
        400,
    ),
    (
        "binary sizes do not add up to the body",
        "/v2/models/tied/infer",
        *_binary_body(
            {"inputs": [_hidden_input(1, parameters={"binary_data_size": len(GOOD)})]},
            GOOD + b"extra",
        ),
        400,
    ),
    (
        "header length beyond the body",
        "/v2/models/tied/infer",
        b'{"inputs": []}',
        {"inference-header-content-length": "4096"},
        400,
    ),
    (
        "an input given twice",
        "/v2/models/tied/infer",
        json.dumps({"inputs": [_hidden_input(1, data=[0.5] * D_MODEL)] * 2}).encode(),
        {},
        400,
    ),
    (
        "header length of more digits than any body",
        "/v2/models/tied/infer",
        b'{"inputs": []}',
        {"inference-header-content-length": "9" * 5000},
        400,
    ),
    (
        "classification on another output",
        "/v2/models/tied/infer",
        json.dumps(
            {
                "inputs": [_hidden_input(1, data=[0.5] * D_MODEL)],
                "outputs": [{"name": "topk_logits", "parameters": {"classification": 2}}],
            }
        ).encode(),
        {},
        400,
    ),
    (
        "a shape of 2**63 rows",
        "/v2/models/tied/infer",
        json.dumps({"inputs": [{**_hidden_input(1), "shape": [2**63, 0], "data": []}]}).encode(),
        {},
        400,
    ),
    (
        "a shape of 2**32 x 2**32 x 0",
        "/v2/models/tied/infer",
        json.dumps(
            {"inputs": [{**_hidden_input(1), "shape": [2**32, 2**32, 0], "data": []}]}
        ).encode(),
        {},
        400,
    ),
    (
        "INT64 data beyond int64",
        "/v2/models/tied/infer",
        json.dumps(
            {"inputs": [{"name": "input_ids", "shape": [1], "datatype": "INT64", "data": [2**63]}]}
        ).encode(),
        {},
        400,
    ),
    (
        "INT32 data beyond int32",
        "/v2/models/tied/infer",
        json.dumps(
            {"inputs": [{"name": "input_ids", "shape": [1], "datatype": "INT32", "data": [2**40]}]}
        ).encode(),
        {},
        400,
    ),
    (
        "floats as INT64 ids",
        "/v2/models/tied/infer",
        json.dumps(
            {
                "inputs": [
                    {"name": "input_ids", "shape": [2], "datatype": "INT64", "data": [1.9, 2.9]}
                ]
            }
        ).encode(),
        {},
        400,
    ),
    (
        "number strings as INT64 ids",
        "/v2/models/tied/infer",
        json.dumps(
            {
                "inputs": [
                    {"name": "input_ids", "shape": [2], "datatype": "INT64", "data": ["1", "2"]}
                ]
            }
        ).encode(),
        {},
        400,
    ),
    (
        "temperature 1e39",
        "/v2/models/tied/infer",
        json.dumps(
            {
                "inputs": [_hidden_input(1, data=[0.5] * D_MODEL)],
                "parameters": {"temperature": 1e39},
            }
        ).encode(),
        {},
        400,
    ),
    (
        "an id that is no string",
        "/v2/models/tied/infer",
        json.dumps(
            {"inputs": [_hidden_input(1, data=[0.5] * D_MODEL)], "id": {"nested": [1]}}
        ).encode(),
        {},
        400,
    ),
    (
        "an id too long to echo whole",  # it came back cut to 256 characters
        "/v2/models/tied/infer",
        json.dumps({"inputs": [_hidden_input(1, data=[0.5] * D_MODEL)], "id": "r" * 300}).encode(),
        {},
        400,
    ),
    (
        "k as a boolean",
        "/v2/models/tied/infer",
        json.dumps(
            {"inputs": [_hidden_input(1, data=[0.5] * D_MODEL)], "parameters": {"k": True}}
        ).encode(),
        {},
        400,
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "headers", "status"),
    [case[1:] for case in ERROR_CASES],
    ids=[case[0] for case in ERROR_CASES],
)
def test_v2_errors(url: str, path: str, body: bytes, headers: dict[str, str], status: int) -> None:
    response = httpx.post(f"{url}{path}", content=body, headers=headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error, str)
    assert error
    good_body, good_headers = _binary_body(
        {"inputs": [_hidden_input(1, parameters={"binary_data_size": len(GOOD)})]}, GOOD
    )
    after = httpx.post(f"{url}/v2/models/tied/infer", content=good_body, headers=good_headers)
    assert after.status_code == 200


def test_a_header_length_in_other_digits_is_400(url: str) -> None:
    """ "\xb2" (latin-1 "²") is a digit to ``str.isdigit`` and not to ``int``."""
    response = httpx.post(
        f"{url}/v2/models/tied/infer",
        content=b'{"inputs": []}',
        headers=[(b"inference-header-content-length", b"\xb2")],
    )
    assert response.status_code == 400, response.text
    assert "must be a byte count" in response.json()["error"]


def test_json_outputs_cut_to_their_own_k(url: str, repository: Path) -> None:
    """Outputs narrower than the run's k are strided views of its answer; JSON writes them."""
    body: dict[str, Any] = {
        "inputs": [_hidden_input(len(HIDDEN), data=HIDDEN.reshape(-1).tolist())],
        "outputs": [
            {"name": "topk_logprobs", "parameters": {"k": 1}},
            {"name": "topk_token_ids", "parameters": {"k": 1}},
            {"name": "topk_logits", "parameters": {"k": 3}},
        ],
    }
    answer = httpx.post(f"{url}/v2/models/tied/infer", json=body)
    assert answer.status_code == 200, answer.text
    outputs = {output["name"]: output for output in answer.json()["outputs"]}
    logits = _logits(repository, "tied", HIDDEN)
    values, ids = top_k(logits, 3)
    assert outputs["topk_token_ids"]["shape"] == [len(HIDDEN), 1]
    assert outputs["topk_token_ids"]["data"] == ids[:, 0].tolist()
    np.testing.assert_allclose(
        np.reshape(outputs["topk_logits"]["data"], (-1, 3)), values, rtol=1e-4, atol=1e-4
    )
    best = np.take_along_axis(log_softmax(logits), ids[:, :1], axis=1)[:, 0]
    np.testing.assert_allclose(outputs["topk_logprobs"]["data"], best, rtol=1e-4, atol=1e-4)
    # The request's k holds for the outputs without their own, beside a wider classification.
    body["parameters"] = {"k": 2}
    body["outputs"] = [
        {"name": "topk_token_ids"},
        {"name": "logits", "parameters": {"classification": 3}},
    ]
    answer = httpx.post(f"{url}/v2/models/tied/infer", json=body)
    assert answer.status_code == 200, answer.text
    outputs = {output["name"]: output for output in answer.json()["outputs"]}
    assert outputs["topk_token_ids"]["shape"] == [len(HIDDEN), 2]
    assert outputs["topk_token_ids"]["data"] == ids[:, :2].reshape(-1).tolist()
    assert outputs["logits"]["shape"] == [len(HIDDEN), 3]
    # Without a k anywhere, a narrower classification does not narrow the top-k output.
    del body["parameters"]
    body["outputs"][1]["parameters"]["classification"] = 2
    answer = httpx.post(f"{url}/v2/models/tied/infer", json=body)
    assert answer.json()["outputs"][0]["shape"] == [len(HIDDEN), 5]  # the default k
    # The request's k is checked even when every output has its own.
    for k in (0, -1):
        body["parameters"] = {"k": k}
        body["outputs"] = [{"name": "topk_logits", "parameters": {"k": 3}}]
        answer = httpx.post(f"{url}/v2/models/tied/infer", json=body)
        assert answer.status_code == 400
        assert "parameter k must be an integer >= 1" in answer.json()["error"]


def test_binary_answer_layout(url: str, repository: Path) -> None:
    body, headers = _binary_body(
        {
            "inputs": [_hidden_input(1, parameters={"binary_data_size": len(GOOD)})],
            "parameters": {"binary_data_output": True, "k": 2},
        },
        GOOD,
    )
    response = httpx.post(f"{url}/v2/models/tied/infer", content=body, headers=headers)
    length = int(response.headers["inference-header-content-length"])
    header = json.loads(response.content[:length])
    sizes = [o["parameters"]["binary_data_size"] for o in header["outputs"]]
    assert sizes == [2 * 8, 2 * 4]  # INT64 ids then FP32 logits, k = 2
    assert len(response.content) == length + sum(sizes)
    values, expected_ids = top_k(_logits(repository, "tied", HIDDEN[:1]), 2)
    ids = struct.unpack("<2q", response.content[length : length + 16])
    assert list(ids) == expected_ids[0].tolist()
    logits = np.frombuffer(response.content[length + 16 :], dtype="<f4")
    np.testing.assert_allclose(logits, values[0], rtol=1e-4, atol=1e-4)


def test_client_errors_reach_tritonclient(client: triton.InferenceServerClient) -> None:
    wrong = triton.InferInput("hidden_states", [1, 3], "FP32")
    wrong.set_data_from_numpy(np.ones((1, 3), np.float32))
    with pytest.raises(InferenceServerException, match="d_model"):
        client.infer("tied", [wrong])
