"""The decoding step over every front end, against the float64 reference
(``service.heads.reference.decoding_step``): native JSON, native ``.npz`` (the Python client's
binary mode: array options in the body, never in the URL), V2 over HTTP (array options as
named input tensors), V2 over gRPC (``tritonclient``), the split mode's fronts; processed
log-probs over the whole vocabulary (k past what any row has left: every token with mass is
listed), n draws per row, /logits after the processors, and the 4xx that name the field."""

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
import tritonclient.grpc as triton

from service.client import Client
from service.errors import InvalidInput
from service.heads.reference import bitmask_of, decoding_step, draw
from service.runtime.filters import streams
from service.runtime.vocabulary import SampleSpec
from tests.conftest import D_MODEL, VOCAB, reference_logits
from tests.server import free_port, running_server

ROWS, N, SEED, TEMPERATURE = 4, 3, 11, 0.9
RTOL = ATOL = 1e-4
FILTERS = {"top_k": 400, "top_p": 0.92, "min_p": 0.005}
HIDDEN = (np.random.default_rng(45).standard_normal((ROWS, D_MODEL)) * 0.5).astype(np.float32)
PROMPTS = [[1, 2, 3, 2], [], [40, 41], [7] * 6]
OUTPUTS = [[5, 11, 12], [], [9, 9, 9], [100]]
WORDS = [[11, 12, 13], [14]]
STOP = [2, 3]
SCALARS = {
    "repetition_penalty": 1.3,
    "presence_penalty": 0.4,
    "frequency_penalty": 0.6,
    "min_tokens": 2,
}
Floats = npt.NDArray[np.float64]


def _mask() -> npt.NDArray[np.int32]:
    allows = np.random.default_rng(46).random((ROWS, VOCAB)) < 0.5
    allows[:, 20:40] = True
    return bitmask_of(allows)


MASK = _mask()


@pytest.fixture(scope="module")
def served(repository: Path) -> Iterator[tuple[str, str]]:
    """The server's HTTP URL and gRPC address (max_k past the vocabulary: k=VOCAB)."""
    port = free_port()
    with running_server(repository, grpc_port=str(port), max_k=str(VOCAB)) as url:
        yield url, f"127.0.0.1:{port}"


def _reference(repository: Path, order: str = "transformers") -> tuple[Floats, Floats]:
    logits = reference_logits(repository / "tied" / "1", HIDDEN)
    return decoding_step(
        logits,
        temperature=TEMPERATURE,
        prompts=PROMPTS,
        outputs=OUTPUTS,
        repetition=SCALARS["repetition_penalty"],
        presence=SCALARS["presence_penalty"],
        frequency=SCALARS["frequency_penalty"],
        min_tokens=int(SCALARS["min_tokens"]),
        stop_ids=STOP,
        bad_words=WORDS,
        bitmask=MASK,
        order=order,
        **FILTERS,  # type: ignore[arg-type]
    )


def _options(order: str = "transformers") -> dict[str, Any]:
    """Every option, as the client (and a JSON body) names them."""
    return {
        **SCALARS,
        "prompt_token_ids": PROMPTS,
        "output_token_ids": OUTPUTS,
        "stop_token_ids": STOP,
        "bad_words_ids": WORDS,
        "token_bitmask": MASK,
        "logprobs_mode": "processed",
        "processor_order": order,
        "sample": {"seed": SEED, "n": N, **FILTERS},
    }


def _check(
    token_ids: npt.NDArray[Any],
    logprobs: npt.NDArray[Any],
    sampled: npt.NDArray[Any],
    sampled_logprobs: npt.NDArray[Any],
    raw: Floats,
    processed: Floats,
) -> None:
    """Every token with raw mass listed in order, with its processed log-prob (-inf where the
    filters dropped it); each draw the reference's at its stream's u, with its log-prob."""
    listed = token_ids.shape[1]
    assert listed == np.isfinite(raw).sum(axis=1).min()
    for row in range(ROWS):
        order = np.lexsort((np.arange(VOCAB), -raw[row]))[:listed]
        np.testing.assert_array_equal(token_ids[row], order)
        want = processed[row, order]
        kept = np.isfinite(want)
        np.testing.assert_array_equal(np.isfinite(logprobs[row]), kept)
        np.testing.assert_allclose(logprobs[row, kept], want[kept], rtol=RTOL, atol=ATOL)
    u = streams(SampleSpec(seed=SEED, n=N), ROWS)
    assert sampled.shape == (ROWS, N)
    for row in range(ROWS):
        for j in range(N):
            assert sampled[row, j] == draw(processed[row], u[row, j])
    picked = np.take_along_axis(processed, sampled.astype(np.int64), axis=1)
    np.testing.assert_allclose(sampled_logprobs, picked, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("binary", [True, False], ids=["npz", "json"])
@pytest.mark.parametrize("order", ["transformers", "vllm"])
def test_native_topk_is_the_references_processed_distribution(
    served: tuple[str, str], repository: Path, binary: bool, order: str
) -> None:
    with Client(served[0], binary=binary) as client:
        top = client.topk(
            "tied", HIDDEN, k=VOCAB, logprobs=True, temperature=TEMPERATURE, **_options(order)
        )
    assert top.logprobs is not None
    assert top.sampled_token_ids is not None
    assert top.sampled_logprobs is not None
    assert top.logprobs_mode == "processed"
    raw, processed = _reference(repository, order)
    _check(top.token_ids, top.logprobs, top.sampled_token_ids, top.sampled_logprobs, raw, processed)


def test_the_client_sends_array_options_in_the_body(served: tuple[str, str]) -> None:
    """No id reaches the URL: 1,000 allowed ids and the step's arrays go in the .npz."""
    sent: list[httpx.Request] = []
    with Client(served[0]) as client:
        client._http.event_hooks["request"] = [sent.append]  # noqa: SLF001 - what is sent
        allowed = np.arange(0, VOCAB, 1)[:1000]
        client.topk("tied", HIDDEN, k=3, allowed_token_ids=allowed, **_options())
    (request,) = sent
    assert request.headers["content-type"] == "application/x-npz"
    assert len(str(request.url)) < 400
    assert "prompt_token_ids" not in str(request.url)


def test_logits_after_the_processors_are_the_references(
    served: tuple[str, str], repository: Path
) -> None:
    options = {key: value for key, value in _options().items() if key != "sample"}
    del options["logprobs_mode"], options["processor_order"]
    with Client(served[0]) as client:
        logits = client.logits("tied", HIDDEN, temperature=TEMPERATURE, **options).array
    raw, _ = _reference(repository)
    masked = np.isneginf(raw)
    np.testing.assert_array_equal(np.isneginf(logits), masked)
    # logits, where the reference gives log-probs: each row a constant apart (its top's)
    got = logits - logits.max(axis=1, keepdims=True)
    want = raw - raw.max(axis=1, keepdims=True)
    np.testing.assert_allclose(got[~masked], want[~masked], rtol=RTOL, atol=ATOL)


def _v2_inputs() -> list[tuple[str, npt.NDArray[Any], str]]:
    """(name, array, datatype) of every input: the rows and the array options."""

    def lists(name: str, values: list[list[int]]) -> list[tuple[str, npt.NDArray[Any], str]]:
        flat = np.array([token for row in values for token in row], np.int64)
        lengths = np.array([len(row) for row in values], np.int64)
        return [(name, flat, "INT64"), (f"{name}_lengths", lengths, "INT64")]

    return [
        ("hidden_states", HIDDEN, "FP32"),
        ("token_bitmask", MASK, "INT32"),
        ("stop_token_ids", np.array(STOP, np.int64), "INT64"),
        *lists("prompt_token_ids", PROMPTS),
        *lists("output_token_ids", OUTPUTS),
        *lists("bad_words_ids", WORDS),
    ]


V2_OUTPUTS = ["topk_token_ids", "topk_logprobs", "sampled_token_ids", "sampled_logprobs"]


def _v2_parameters() -> dict[str, Any]:
    return {
        "k": VOCAB,
        "temperature": TEMPERATURE,
        **SCALARS,
        "logprobs_mode": "processed",
        "sample": json.dumps({"seed": SEED, "n": N, **FILTERS}),
    }


def test_v2_over_http_takes_the_arrays_as_input_tensors(
    served: tuple[str, str], repository: Path
) -> None:
    inputs = [
        {"name": name, "shape": list(array.shape), "datatype": kind, "data": array.tolist()}
        for name, array, kind in _v2_inputs()
    ]
    body = {
        "inputs": inputs,
        "outputs": [{"name": name} for name in V2_OUTPUTS],
        "parameters": _v2_parameters(),
    }
    answer = httpx.post(f"{served[0]}/v2/models/tied/infer", json=body, timeout=30)
    assert answer.status_code == 200, answer.text[:300]
    outputs = {
        out["name"]: np.array(
            [-np.inf if value is None else value for value in out["data"]]
        ).reshape(out["shape"])
        for out in answer.json()["outputs"]
    }
    raw, processed = _reference(repository)
    _check(
        outputs["topk_token_ids"].astype(np.int64),
        outputs["topk_logprobs"],
        outputs["sampled_token_ids"].astype(np.int64),
        outputs["sampled_logprobs"],
        raw,
        processed,
    )


def test_v2_over_grpc_takes_the_arrays_as_input_tensors(
    served: tuple[str, str], repository: Path
) -> None:
    tensors = []
    for name, array, kind in _v2_inputs():
        tensor = triton.InferInput(name, list(array.shape), kind)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    outputs = [triton.InferRequestedOutput(name) for name in V2_OUTPUTS]
    client = triton.InferenceServerClient(served[1])
    try:
        result = client.infer("tied", tensors, outputs=outputs, parameters=_v2_parameters())
    finally:
        client.close()
    raw, processed = _reference(repository)
    _check(
        result.as_numpy("topk_token_ids"),
        result.as_numpy("topk_logprobs"),
        result.as_numpy("sampled_token_ids"),
        result.as_numpy("sampled_logprobs"),
        raw,
        processed,
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"repetition_penalty": 0}, "repetition_penalty must be a number > 0"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be a number in \[-2, 2\]"),
        ({"token_bitmask": MASK[:, :-1]}, r"ceil\(vocab / 32\) = 32 words per row \(vocab 997\)"),
        ({"token_bitmask": np.zeros_like(MASK)}, "token_bitmask row 0 allows no token"),
        ({"output_token_ids": OUTPUTS[:3]}, "one list per row: got 3 lists for 4 rows"),
        (
            {"prompt_token_ids": [[VOCAB]] * ROWS},
            r"prompt_token_ids must be token ids in \[0, 997\)",
        ),
        ({"sample": {"n": 65}}, r"sample.n must be an integer in \[1, 64\]"),
        ({"logprobs_mode": "logits"}, "logprobs_mode"),
    ],
)
@pytest.mark.parametrize("binary", [True, False], ids=["npz", "json"])
def test_bad_options_are_refused_naming_the_field(
    served: tuple[str, str], change: dict[str, Any], message: str, binary: bool
) -> None:
    options = {**_options(), **change}
    with Client(served[0], binary=binary) as client, pytest.raises(InvalidInput, match=message):
        client.topk("tied", HIDDEN, k=3, **options)


def test_lengths_that_do_not_add_up_are_refused_in_a_binary_body(served: tuple[str, str]) -> None:
    buffer = io.BytesIO()
    lengths = np.array([1, 1, 1, 5])
    np.savez(
        buffer,
        hidden_states=HIDDEN,
        output_token_ids=np.arange(4),
        output_token_ids_lengths=lengths,
    )
    answer = httpx.post(
        f"{served[0]}/v1/models/tied/topk",
        content=buffer.getvalue(),
        headers={"content-type": "application/x-npz"},
        timeout=30,
    )
    assert answer.status_code == 422
    assert "output_token_ids: the lists' lengths add up to 8, but 4 ids came" in answer.text
    buffer = io.BytesIO()
    np.savez(buffer, hidden_states=HIDDEN, output_token_ids=np.arange(4))
    answer = httpx.post(
        f"{served[0]}/v1/models/tied/topk",
        content=buffer.getvalue(),
        headers={"content-type": "application/x-npz"},
        timeout=30,
    )
    assert answer.status_code == 422
    assert "output_token_ids_lengths is missing" in answer.text


def test_split_mode_fronts_forward_the_step(repository: Path) -> None:
    with running_server(repository, workers="2", max_k=str(VOCAB)) as url, Client(url) as client:
        top = client.topk(
            "tied", HIDDEN, k=VOCAB, logprobs=True, temperature=TEMPERATURE, **_options()
        )
    assert top.logprobs is not None
    assert top.sampled_token_ids is not None
    assert top.sampled_logprobs is not None
    raw, processed = _reference(repository)
    _check(top.token_ids, top.logprobs, top.sampled_token_ids, top.sampled_logprobs, raw, processed)
