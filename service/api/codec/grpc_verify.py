"""Speculative verification over V2's gRPC ModelInfer: the REST codec's header built from
the protobuf request (``grpc.header_of``), a verification when it has the input
``draft_token_ids`` (``v2_verify``), answered as any ModelInfer (raw or typed contents),
with the answer's parameter ``logprobs_mode``."""

from __future__ import annotations

from typing import Any

from service.api.codec import grpc, v2_verify
from service.api.codec.v2outputs import OutputPlan
from service.verify_messages import VerifyResult


def decode(request: Any) -> v2_verify.Decoded:
    """A ModelInfer request, a verification or not (``grpc.decode`` otherwise)."""
    header, binary, to = grpc.header_of(request)
    return v2_verify.dispatch(header, binary, False, to)


def encode(result: VerifyResult, plan: OutputPlan) -> Any:
    answer = grpc.response(result.head, plan, v2_verify.outputs(result, plan))
    answer.parameters["logprobs_mode"].string_param = result.logprobs_mode
    return answer
