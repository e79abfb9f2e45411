"""Wire models of the Open Inference Protocol (V2) front end, as the OpenAPI document shows
them: tensors, outputs asked, parameters (the native options, by the same names), the infer
body and answer, model and server metadata. Kept beside ``schemas.py`` (the native API's):
one protocol's models each.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from service.api.decoding_fields import PenaltyFields, StepFields
from service.api.schemas import _EXAMPLE_ROW, IdLists, SampleBody, States, _Document, _example


class V2ErrorAnswer(_Document):
    """Errors on ``/v2`` paths, as the Open Inference Protocol defines them."""

    error: str


class V2Tensor(_Document):
    name: str
    """hidden_states (FP32/FP16) or input_ids (INT64/INT32) in, or an array option
    (``V2Parameters`` names them); an output name out."""
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    """binary_data_size (binary extension) or binary_data."""
    data: list[Any] | None = None
    """Row-major values, flat or nested; absent when the tensor is binary."""


class V2OutputRequest(_Document):
    name: str
    """topk_token_ids, topk_logits, topk_logprobs, logsumexp, logits or embeddings."""
    parameters: dict[str, Any] | None = None
    """k (top-k outputs), classification (logits), binary_data."""


class V2Parameters(PenaltyFields, StepFields, _Document):
    """The request's parameters: a parameter sent as null is not given; others (the
    protocol's extensions) are left alone. The structured ones may also come as their JSON
    text (gRPC parameters are scalars). The decoding step's arrays are input tensors:
    token_bitmask (INT32), prompt_token_ids, output_token_ids, bad_words_ids (each as its
    values and ``<name>_lengths``, INT64 or INT32), stop_token_ids, allowed_token_ids and
    banned_token_ids."""

    model_config = ConfigDict(extra="allow")

    k: int | None = Field(default=None, examples=[3])
    """Top tokens per row (an output's own ``k`` wins); the model's default when absent."""
    temperature: float | None = Field(default=None, examples=[1.0])
    logprobs: bool | None = Field(default=None, examples=[True])
    """Also answer topk_logprobs (when no outputs are named)."""
    binary_data_output: bool | None = Field(default=None, examples=[False])
    """Answer every output as binary data (the binary extension)."""
    states: States | None = Field(default=None, examples=["final"])
    """As the native API's ``states``; also taken from the hidden_states input's parameters."""
    allowed_token_ids: IdLists | str | None = Field(default=None, examples=[[3, 7, 11]])
    banned_token_ids: list[int] | str | None = Field(default=None, examples=[[7]])
    logit_bias: dict[str, float] | str | None = Field(default=None, examples=[{"3": 2.5}])
    logprobs_over: Literal["candidates", "vocabulary"] | None = Field(
        default=None, examples=["candidates"]
    )
    sample: SampleBody | str | None = None
    """Draws come back as the outputs sampled_token_ids and sampled_logprobs ((rows, n)
    with ``n``)."""
    stop_token_ids: list[int] | str | None = Field(default=None, examples=[[2]])
    """Banned while a row's output is shorter than min_tokens (or the input tensor)."""


class V2InferBody(_Document):
    model_config = _example(
        inputs=[
            {"name": "hidden_states", "shape": [1, 4], "datatype": "FP32", "data": _EXAMPLE_ROW}
        ],
        parameters={"k": 3},
    )

    id: str | None = Field(default=None, examples=["request-1"])
    """Echoed in the answer."""
    parameters: V2Parameters | None = None
    inputs: list[V2Tensor]
    outputs: list[V2OutputRequest] | None = Field(
        default=None, examples=[[{"name": "topk_token_ids"}, {"name": "topk_logits"}]]
    )
    """The outputs to answer; the top-k ids and logits (and log-probs, draws when asked) of
    hidden_states, or the embeddings of input_ids, when absent."""


class V2InferAnswer(_Document):
    model_name: str
    model_version: str
    id: str | None = None
    outputs: list[V2Tensor]


class V2TensorMetadata(_Document):
    name: str
    datatype: str
    shape: list[int]


class V2ModelMetadata(_Document):
    name: str
    versions: list[str]
    platform: str
    inputs: list[V2TensorMetadata]
    outputs: list[V2TensorMetadata]
    parameters: dict[str, Any]


class V2ServerMetadata(_Document):
    name: str
    version: str
    extensions: list[str]
