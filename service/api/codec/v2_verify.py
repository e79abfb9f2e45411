"""Speculative verification over the Open Inference Protocol (V2): ``/verify`` as named tensors.

An infer request (REST or gRPC) with the input ``draft_token_ids`` is a verification, the
native ``/v1/models/{name}/verify`` (docs/verify.md) as a Triton or KServe client sends it:
the arrays are input tensors (``hidden_states`` [S, K + 1, d_model], ``draft_token_ids``
[S, K], and optionally ``draft_probs`` [S, K, vocab], ``draft_parents`` [K],
``draft_hidden_states`` [S, K, d], ``seeds`` [S], and the distribution's array options as
``/infer`` takes them), the options are the request's parameters (``temperature``,
``states``, ``sample``, ``logit_bias``, the decoding step's scalars, ``draft_model``). The
outputs are named as the native answer's fields, one row per sequence and padded where a
sequence stopped early (-1 ids, NaN log-probs: null in JSON): ``accepted`` [S],
``token_ids`` [S, depth + 1], ``logprobs`` [S, depth + 1], ``nodes`` [S, depth], ``seed``
[S]; the answer's parameter ``logprobs_mode`` says raw or processed. JSON and the binary
extension both ways, as any infer (``v2.encode_arrays``).

Every other request goes to ``v2.decode_header`` unchanged; the data plane checks both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy.typing as npt
from starlette.requests import Request
from starlette.responses import Response

from service.api.codec import v2
from service.api.codec.pieces import reply
from service.api.codec.v2outputs import OutputPlan, OutputRequest
from service.api.codec.v2params import flag, mapping, number, states, vocabulary
from service.api.codec.wire import json_type, off_loop
from service.errors import InvalidInput
from service.messages import InferRequest, Target
from service.verify_messages import VerifyRequest, VerifyResult

#: The input whose presence makes an infer request a verification.
DRAFTS = "draft_token_ids"
#: A verification's inputs and their datatypes: its arrays, then ``/infer``'s option inputs.
VERIFY_TYPES: dict[str, tuple[str, ...]] = {
    "hidden_states": ("FP32", "FP16"),
    DRAFTS: ("INT64", "INT32"),
    "draft_probs": ("FP32", "FP16"),
    "draft_hidden_states": ("FP32", "FP16"),
    "draft_parents": ("INT64", "INT32"),
    "seeds": ("INT64", "INT32"),
    **{name: v2.INPUT_TYPES[name] for name in v2.OPTION_INPUTS},
}
#: The outputs, named as the native answer's fields (the default: all of them).
VERIFY_OUTPUTS = ("accepted", "token_ids", "logprobs", "nodes", "seed")
#: ``/infer``'s parameters that mean nothing to a verification.
INFER_ONLY = ("k", "logprobs", "logprobs_over")


@dataclass(frozen=True)
class VerifyCall:
    """A decoded verification: the plane's request and the outputs to answer."""

    request: VerifyRequest
    plan: OutputPlan


Decoded = VerifyCall | tuple[InferRequest, OutputPlan]


async def decode_http(request: Request, body_limit: int) -> Decoded:
    """An HTTP infer request, a verification or not (``v2.decode_http`` otherwise)."""
    body, length, to = await v2.read_http(request, body_limit)
    return await off_loop(len(body), decode, body, length, to)


def decode(body: bytes, header_length: str | None, to: Target) -> Decoded:
    header, binary, booleans = v2.parse(body, header_length)
    return dispatch(header, binary, booleans, to)


def dispatch(header: dict[str, Any], binary: bytes, booleans: bool, to: Target) -> Decoded:
    """A parsed header (REST's, or the one gRPC builds): a verification when an input is
    named ``draft_token_ids``, else an infer."""
    if verifies(header):
        return decode_header(header, binary, booleans, to)
    return v2.decode_header(header, binary, booleans, to)


def verifies(header: dict[str, Any]) -> bool:
    entries = header.get("inputs")
    if not isinstance(entries, list):
        return False
    return any(isinstance(entry, dict) and entry.get("name") == DRAFTS for entry in entries)


def decode_header(header: dict[str, Any], binary: bytes, booleans: bool, to: Target) -> VerifyCall:
    """The verification's request: its input tensors, its parameters, its outputs."""
    parameters = mapping(header.get("parameters"), "parameters")
    for name in INFER_ONLY:
        if name in parameters:
            raise InvalidInput(
                f"parameter {name} does not apply to a verification (a request with the input "
                f"{DRAFTS}); its outputs are {', '.join(VERIFY_OUTPUTS)}"
            )
    inputs = v2.read_inputs(header.get("inputs"), binary, booleans, VERIFY_TYPES)
    if "hidden_states" not in inputs:
        raise InvalidInput(
            f"a verification (the input {DRAFTS}) needs the input hidden_states "
            "(sequences, K + 1, d_model)"
        )
    draft_model = parameters.get("draft_model")
    if draft_model is not None and not isinstance(draft_model, str):
        raise InvalidInput("parameter draft_model must be a string: a model of the repository")
    options = {name: inputs[name] for name in v2.OPTION_INPUTS if name in inputs}
    request = VerifyRequest(
        to,
        inputs["hidden_states"],
        inputs[DRAFTS],
        inputs.get("draft_probs"),
        inputs.get("draft_parents"),
        number(parameters, "temperature", 1.0),
        vocabulary(parameters, options),
        inputs.get("seeds"),
        states(parameters, header.get("inputs")),
        draft_model,
        inputs.get("draft_hidden_states"),
    )
    binary_output = flag(parameters, "binary_data_output")
    plan = OutputPlan(v2.request_id(header), _outputs(header.get("outputs"), binary_output))
    return VerifyCall(request, plan)


def _outputs(entries: Any, binary: bool) -> list[OutputRequest]:
    """The outputs named (each once, ``binary_data`` of its own or the request's), or all."""
    if entries is None:
        return [OutputRequest(name, binary) for name in VERIFY_OUTPUTS]
    if not isinstance(entries, list):
        raise InvalidInput("outputs must be a list of {name, parameters}")
    requests: list[OutputRequest] = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise InvalidInput(
                f'outputs[{index}] must be an object naming the output, e.g. {{"name": '
                f'"accepted"}}; got a JSON {json_type(entry)}'
            )
        name = entry.get("name")
        if name not in VERIFY_OUTPUTS:
            raise InvalidInput(
                f"unknown output {str(name)[:64]!r} of a verification (the input {DRAFTS}); "
                f"outputs: {', '.join(VERIFY_OUTPUTS)}"
            )
        if any(request.name == name for request in requests):
            raise InvalidInput(f"output {name!r} is requested twice; name each output once")
        parameters = mapping(entry.get("parameters"), f"output {name} parameters")
        other = sorted(set(parameters) - {"binary_data"})
        if other:
            raise InvalidInput(
                f"output {name} takes only the parameter binary_data, got {other[0][:32]!r}"
            )
        own = parameters.get("binary_data", binary)
        if not isinstance(own, bool):
            raise InvalidInput(f"output {name}: binary_data must be true or false")
        requests.append(OutputRequest(name, own))
    return requests


def outputs(result: VerifyResult, plan: OutputPlan) -> list[npt.NDArray[Any]]:
    """The arrays the plan's outputs carry, in its order."""
    arrays: dict[str, npt.NDArray[Any]] = {
        "accepted": result.accepted,
        "token_ids": result.token_ids,
        "logprobs": result.logprobs,
        "nodes": result.nodes,
        "seed": result.seeds,
    }
    return [arrays[output.name] for output in plan.outputs]


async def encode_http(result: VerifyResult, plan: OutputPlan) -> Response:
    """The answer (JSON, or binary tensors after a JSON header), as any infer's."""
    parameters = {"logprobs_mode": result.logprobs_mode}
    pieces, headers = await off_loop(
        result.token_ids.size * 48,
        v2.encode_arrays,
        result.head,
        plan,
        outputs(result, plan),
        parameters,
    )
    return reply(pieces, None, headers | v2.head_headers(result.head))
