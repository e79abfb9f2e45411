"""Speculative verification over the Open Inference Protocol (V2), on a real server: an infer
with the input ``draft_token_ids`` over REST (``tritonclient.http`` with binary tensors, and
plain JSON) and gRPC (``tritonclient.grpc``) answers what the native ``/verify`` answers for
the same seeds: a chain with draft_probs, the decoding step's options with allowed ids, a
tree, a draft_model; bad input is refused with the native message (400 / INVALID_ARGUMENT);
split mode answers as one process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import numpy.typing as npt
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from service.client import Client
from service.heads.files import HeadWeights, save_head
from tests.server import free_port, running_server

VOCAB, D, DRAFT_D = 300, 16, 8
RNG = np.random.default_rng(146)
TABLE = (0.4 * RNG.standard_normal((VOCAB, D))).astype(np.float32)
DRAFTER = (0.4 * RNG.standard_normal((VOCAB, DRAFT_D))).astype(np.float32)
SEQUENCES, K = 5, 3
HIDDEN = RNG.standard_normal((SEQUENCES, K + 1, D)).astype(np.float32)
SEEDS = np.arange(60, 60 + SEQUENCES, dtype=np.int64)
Arrays = dict[str, npt.NDArray[Any]]


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("verify-v2")
    save_head(HeadWeights.from_arrays(TABLE), root / "head" / "1")
    save_head(HeadWeights.from_arrays(DRAFTER), root / "drafter" / "1")
    return root


@pytest.fixture(scope="module")
def served(repository: Path) -> Iterator[tuple[str, str]]:
    """The server's HTTP URL and gRPC address."""
    port = free_port()
    with running_server(repository, grpc_port=str(port)) as url:
        yield url, f"127.0.0.1:{port}"


def _drafts() -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """A draft distribution near the target's at T = 0.8 and drafts drawn from it."""
    logits = HIDDEN[:, :K].astype(np.float64) @ TABLE.astype(np.float64).T / 0.8
    target = np.exp(logits - logits.max(axis=2, keepdims=True))
    target /= target.sum(axis=2, keepdims=True)
    draft = 0.3 * RNG.dirichlet(np.full(VOCAB, 0.1), size=(SEQUENCES, K)) + 0.7 * target
    ids = np.array([[RNG.choice(VOCAB, p=row) for row in rows] for rows in draft])
    return ids.astype(np.int64), draft.astype(np.float32)


def _native(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    answer = httpx.post(f"{url}/v1/models/head/verify", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    results: list[dict[str, Any]] = answer.json()["results"]
    return results


def _trimmed(outputs: Arrays) -> list[dict[str, Any]]:
    """V2's padded outputs as the native answer's sequences."""
    rows = []
    for s, accepted in enumerate(outputs["accepted"].tolist()):
        logprobs = outputs["logprobs"][s, : accepted + 1].astype(np.float64)
        rows.append(
            {
                "accepted": accepted,
                "token_ids": outputs["token_ids"][s, : accepted + 1].tolist(),
                "logprobs": logprobs.tolist(),
                "nodes": outputs["nodes"][s, :accepted].tolist(),
                "seed": int(outputs["seed"][s]),
            }
        )
        assert (outputs["token_ids"][s, accepted + 1 :] == -1).all()  # padding
        assert np.isnan(outputs["logprobs"][s, accepted + 1 :]).all()
    return rows


def _same(v2: list[dict[str, Any]], native: list[dict[str, Any]]) -> None:
    for mine, theirs in zip(v2, native, strict=True):
        for key in ("accepted", "token_ids", "nodes", "seed"):
            assert mine[key] == theirs[key], key
        np.testing.assert_allclose(mine["logprobs"], theirs["logprobs"], rtol=1e-6, atol=1e-6)


def _http_inputs(arrays: Arrays) -> list[triton_http.InferInput]:
    tensors = []
    for name, array in arrays.items():
        kind = "FP32" if array.dtype == np.float32 else "INT64"
        tensor = triton_http.InferInput(name, list(array.shape), kind)
        tensor.set_data_from_numpy(array)  # binary on the wire
        tensors.append(tensor)
    return tensors


@pytest.mark.parametrize("binary", [True, False])
def test_a_chain_over_v2_http_answers_as_native(served: tuple[str, str], binary: bool) -> None:
    url, _ = served
    ids, draft = _drafts()
    arrays: Arrays = {"hidden_states": HIDDEN, "draft_token_ids": ids, "draft_probs": draft}
    native = _native(
        url,
        {**{k: v.tolist() for k, v in arrays.items()}, "temperature": 0.8, "seeds": SEEDS.tolist()},
    )
    assert len({sequence["accepted"] for sequence in native}) >= 2
    client = triton_http.InferenceServerClient(url.removeprefix("http://"))
    names = ("accepted", "token_ids", "logprobs", "nodes", "seed")
    result = client.infer(
        "head",
        _http_inputs({**arrays, "seeds": SEEDS}),
        outputs=[triton_http.InferRequestedOutput(name, binary_data=binary) for name in names],
        parameters={"temperature": 0.8},
    )
    outputs = {name: result.as_numpy(name) for name in names}
    assert outputs["token_ids"].shape == (SEQUENCES, K + 1)
    assert outputs["nodes"].shape == (SEQUENCES, K)
    _same(_trimmed(outputs), native)
    assert result.get_response()["parameters"] == {"logprobs_mode": "raw"}


def test_the_decoding_options_over_v2_json_answer_as_native(served: tuple[str, str]) -> None:
    """Plain JSON tensors (no client library): allowed ids per sequence, output histories
    as values and lengths, a presence penalty, top-k and processed log-probs; and the same
    through ``Client.verify`` (an .npz body)."""
    url, _ = served
    ids, _ = _drafts()
    allowed = np.stack([RNG.choice(VOCAB, 200, replace=False) for _ in range(SEQUENCES)])
    histories = [RNG.integers(0, VOCAB, size=n).tolist() for n in (0, 2, 5, 1, 3)]
    sample = {"temperature": 0.9, "top_k": 40, "seed": 5}
    native = _native(
        url,
        {
            "hidden_states": HIDDEN.tolist(),
            "draft_token_ids": ids.tolist(),
            "allowed_token_ids": allowed.tolist(),
            "output_token_ids": histories,
            "presence_penalty": 1.0,
            "logprobs_mode": "processed",
            "sample": sample,
        },
    )

    def tensor(name: str, array: npt.NDArray[Any], kind: str = "INT64") -> dict[str, Any]:
        return {"name": name, "shape": list(array.shape), "datatype": kind, "data": array.tolist()}

    flat = np.array([token for tokens in histories for token in tokens], np.int64)
    body = {
        "id": "verify-1",
        "inputs": [
            tensor("hidden_states", HIDDEN, "FP32"),
            tensor("draft_token_ids", ids),
            tensor("allowed_token_ids", allowed),
            tensor("output_token_ids", flat),
            tensor("output_token_ids_lengths", np.array([len(h) for h in histories])),
        ],
        "parameters": {"presence_penalty": 1.0, "logprobs_mode": "processed", "sample": sample},
    }
    answer = httpx.post(f"{url}/v2/models/head/infer", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    payload = answer.json()
    assert payload["id"] == "verify-1"
    assert payload["parameters"] == {"logprobs_mode": "processed"}
    outputs = {
        entry["name"]: np.array(
            entry["data"], np.float64 if entry["datatype"] == "FP32" else None
        ).reshape(entry["shape"])
        for entry in payload["outputs"]
    }
    assert list(outputs) == ["accepted", "token_ids", "logprobs", "nodes", "seed"]  # default
    _same(_trimmed(outputs), native)
    assert answer.headers["x-lmhead-model"] == "head"
    with Client(url) as client:  # the native wire's .npz body: the same answer
        sent = client.verify(
            "head",
            HIDDEN,
            ids,
            allowed_token_ids=allowed,
            output_token_ids=histories,
            presence_penalty=1.0,
            logprobs_mode="processed",
            sample=sample,
        )
    _same(sent["results"], native)


def _grpc_inputs(arrays: Arrays) -> list[triton_grpc.InferInput]:
    tensors = []
    for name, array in arrays.items():
        kind = "FP32" if array.dtype == np.float32 else "INT64"
        tensor = triton_grpc.InferInput(name, list(array.shape), kind)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def test_a_tree_and_a_draft_model_over_grpc_answer_as_native(served: tuple[str, str]) -> None:
    url, address = served
    ids, _ = _drafts()
    parents = np.array([-1, -1, 1], np.int64)
    states = RNG.standard_normal((SEQUENCES, K, DRAFT_D)).astype(np.float32)
    states[:, 1] = states[:, 0]  # siblings: one drafter state
    calls: list[tuple[Arrays, dict[str, Any]]] = [
        ({"draft_parents": parents}, {"temperature": 0.8}),
        ({"draft_hidden_states": states}, {"temperature": 0.7, "draft_model": "drafter"}),
        (
            {"draft_parents": parents, "draft_hidden_states": states},
            {"draft_model": "drafter", "sample": '{"top_k": 100}'},
        ),
    ]
    client = triton_grpc.InferenceServerClient(address)
    try:
        for extra, parameters in calls:
            if "draft_hidden_states" in extra:  # drafts the drafter gives mass under top-100
                logits = states.astype(np.float64) @ DRAFTER.astype(np.float64).T
                ids = np.argmax(logits, axis=2).astype(np.int64)
            arrays: Arrays = {"hidden_states": HIDDEN, "draft_token_ids": ids, "seeds": SEEDS}
            arrays |= extra
            native_parameters = {
                key: value if key != "sample" else {"top_k": 100}
                for key, value in parameters.items()
            }
            native = _native(
                url, {**{k: v.tolist() for k, v in arrays.items()}, **native_parameters}
            )
            result = client.infer("head", _grpc_inputs(arrays), parameters=parameters)
            names = ("accepted", "token_ids", "logprobs", "nodes", "seed")
            _same(_trimmed({name: result.as_numpy(name) for name in names}), native)
            mode = result.get_response().parameters["logprobs_mode"].string_param
            assert mode == "raw"
    finally:
        client.close()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"draft_probs": np.full((SEQUENCES, K, VOCAB), 2.0 / VOCAB, np.float32)}, "sum to 1"),
        ({"draft_token_ids": np.full((SEQUENCES, K), VOCAB, np.int64)}, "draft_token_ids"),
        ({"draft_token_ids": np.zeros((SEQUENCES, K + 1), np.int64)}, "draft_token_ids must"),
        ({"draft_parents": np.array([-1, 2, 0], np.int64)}, "draft_parents[1]"),
    ],
)
def test_bad_input_over_v2_is_refused_with_the_native_message(
    served: tuple[str, str], change: Arrays, message: str
) -> None:
    url, address = served
    ids, _ = _drafts()
    arrays: Arrays = {"hidden_states": HIDDEN, "draft_token_ids": ids, **change}
    body = {k: v.tolist() for k, v in arrays.items()}
    native = httpx.post(f"{url}/v1/models/head/verify", json=body, timeout=30)
    assert native.status_code == 422
    expected = native.json()["error"]["message"]
    assert message in expected
    client = triton_http.InferenceServerClient(url.removeprefix("http://"))
    with pytest.raises(InferenceServerException) as refused:
        client.infer("head", _http_inputs(arrays))
    assert refused.value.status() == "400"
    assert refused.value.message() == expected
    grpc_client = triton_grpc.InferenceServerClient(address)
    try:
        with pytest.raises(InferenceServerException) as failed:
            grpc_client.infer("head", _grpc_inputs(arrays))
    finally:
        grpc_client.close()
    assert failed.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
    assert failed.value.message() == expected


def test_split_mode_answers_as_one_process(served: tuple[str, str], repository: Path) -> None:
    """LMHEAD_WORKERS=2 (fronts forward to the engine): V2 over REST and gRPC with a
    draft_model, allowed ids and a penalty with histories give the one process's answer."""
    url, _ = served
    states = RNG.standard_normal((SEQUENCES, K, DRAFT_D)).astype(np.float32)
    ids = np.argmax(states @ DRAFTER.T, axis=2).astype(np.int64)
    allowed = np.unique(np.concatenate([ids.reshape(-1), RNG.choice(VOCAB, 150)]))
    arrays: Arrays = {
        "hidden_states": HIDDEN,
        "draft_token_ids": ids,
        "draft_hidden_states": states,
        "allowed_token_ids": allowed.astype(np.int64),
        "output_token_ids": np.array([1, 2, 3], np.int64),
        "output_token_ids_lengths": np.array([0, 1, 2, 0, 0], np.int64),
        "seeds": SEEDS,
    }
    parameters = {"draft_model": "drafter", "frequency_penalty": 0.5, "temperature": 0.9}
    names = ("accepted", "token_ids", "logprobs", "nodes", "seed")

    def answers(http: str, address: str) -> list[list[dict[str, Any]]]:
        client = triton_http.InferenceServerClient(http.removeprefix("http://"))
        rest = client.infer("head", _http_inputs(arrays), parameters=parameters)
        remote = triton_grpc.InferenceServerClient(address)
        try:
            called = remote.infer("head", _grpc_inputs(arrays), parameters=parameters)
        finally:
            remote.close()
        return [_trimmed({name: done.as_numpy(name) for name in names}) for done in (rest, called)]

    one = answers(url, served[1])
    _same(one[1], one[0])
    port = free_port()
    with running_server(repository, workers="2", grpc_port=str(port)) as split:
        for answer in answers(split, f"127.0.0.1:{port}"):
            _same(answer, one[0])
