"""The V2 codec on its own: requests decoded into the data plane's messages, answers encoded
as the Open Inference Protocol and its binary extension define them."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from service.api.codec.v2 import HEADER_LENGTH, decode, encode
from service.api.codec.v2outputs import OutputPlan, OutputRequest
from service.errors import InvalidInput, MalformedBody
from service.messages import HeadInfo, InferRequest, InferResult, Target, TopKResult

HEAD = HeadInfo("m", 3, True, 100, 4, "float32")


def _result(rows: int = 2, k: int = 3) -> InferResult:
    rng = np.random.default_rng(0)
    logits = -np.sort(rng.random((rows, k), dtype=np.float32), axis=1)
    ids = rng.integers(0, 100, (rows, k))
    lse = np.full(rows, 1.5, np.float32)
    return InferResult(HEAD, TopKResult(HEAD, ids, logits, lse, logits - lse[:, None]))


def test_the_header_length_counts_the_json_header_alone() -> None:
    """``Inference-Header-Content-Length`` is the JSON part's bytes: the binary tensors follow
    it, each ``binary_data_size`` long, in the order of the outputs."""
    result = _result()
    assert result.topk is not None
    plan = OutputPlan(
        "r1",
        [OutputRequest("topk_token_ids", binary=True), OutputRequest("topk_logits", binary=True)],
    )
    pieces, headers = encode(result, plan)
    body = b"".join(pieces)
    length = int(headers[HEADER_LENGTH])
    header = json.loads(body[:length])
    sizes = [output["parameters"]["binary_data_size"] for output in header["outputs"]]
    assert length + sum(sizes) == len(body)
    ids_bytes, logits_bytes = body[length : length + sizes[0]], body[length + sizes[0] :]
    np.testing.assert_array_equal(
        np.frombuffer(ids_bytes, np.int64).reshape(2, 3), result.topk.token_ids
    )
    np.testing.assert_array_equal(
        np.frombuffer(logits_bytes, np.float32).reshape(2, 3), result.topk.logits
    )
    assert header["id"] == "r1"
    assert header["model_version"] == "3"


def test_an_answer_without_binary_outputs_is_plain_json() -> None:
    pieces, headers = encode(_result(), OutputPlan(None, [OutputRequest("logsumexp", False)]))
    body = b"".join(pieces)
    assert HEADER_LENGTH not in headers
    assert headers["content-type"] == "application/json"
    assert json.loads(body)["outputs"][0]["data"] == [1.5, 1.5]


def test_a_binary_request_is_split_at_its_header_length() -> None:
    """The request side of the same rule: the header's bytes, then the tensors' bytes."""
    hidden = np.arange(8, dtype=np.float32).reshape(2, 4)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "hidden_states",
                    "datatype": "FP32",
                    "shape": [2, 4],
                    "parameters": {"binary_data_size": hidden.nbytes},
                }
            ]
        }
    ).encode()
    request, _ = decode(header + hidden.tobytes(), str(len(header)), Target("m"))
    assert request.hidden_states is not None
    np.testing.assert_array_equal(request.hidden_states, hidden)


def _header(**fields: object) -> bytes:
    hidden = {"name": "hidden_states", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}
    return json.dumps({"inputs": [hidden], **fields}).encode()


def test_a_parameter_sent_as_null_is_not_given() -> None:
    """Over REST a null, over gRPC a parameter with no value set: both as if left out (a
    null temperature was "must be a number")."""
    nulls = dict.fromkeys(
        ("k", "temperature", "logprobs", "binary_data_output", "states", "allowed_token_ids")
    )
    nulls |= dict.fromkeys(("banned_token_ids", "logit_bias", "logprobs_over", "sample"))
    own = json.loads(_header())
    own["inputs"][0]["parameters"] = {"states": None}
    left_out = _decoded(_header())
    assert _decoded(_header(parameters=nulls)) == left_out
    assert _decoded(json.dumps(own).encode()) == left_out


def _decoded(header: bytes) -> tuple[InferRequest, OutputPlan]:
    """The decoded request (its rows checked and left out: arrays do not compare) and plan."""
    request, plan = decode(header, None, Target("m"))
    assert request.hidden_states is not None
    np.testing.assert_array_equal(request.hidden_states, [[1, 2, 3, 4]])
    return replace(request, hidden_states=None), plan


def test_an_output_named_by_a_bare_string_says_what_an_output_is() -> None:
    with pytest.raises(InvalidInput, match=r"outputs\[1\] must be an object naming the output"):
        decode(_header(outputs=[{"name": "topk_logits"}, "topk_token_ids"]), None, Target("m"))


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"nan"])
def test_a_non_standard_number_in_the_header_is_named(literal: bytes) -> None:
    header = b'{"inputs": [{"name": "hidden_states", "data": [1.0, ' + literal + b"]}]}"
    with pytest.raises(
        MalformedBody, match=r"NaN or Infinity at byte 5[23]: JSON has no such numbers"
    ):
        decode(header, None, Target("m"))
