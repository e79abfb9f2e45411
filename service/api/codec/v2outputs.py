"""What a V2 infer request asks back: the outputs it names (or the default ones), each cut to
its own k (an output without one takes the request's ``parameters.k``), and Triton's
classification strings, taken from the in-graph top-k."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from service.api.codec.pieces import PIECE_VALUES
from service.api.codec.v2params import SAMPLED_OUTPUTS, flag, mapping, optional_int, sampled_arrays
from service.api.codec.wire import json_type
from service.errors import InvalidInput
from service.messages import InferResult, Tokens

PROJECTION_OUTPUTS = (
    "topk_token_ids",
    "topk_logits",
    "topk_logprobs",
    "logsumexp",
    "logits",
    *SAMPLED_OUTPUTS,
)
OUTPUTS = (*PROJECTION_OUTPUTS, "embeddings")


@dataclass(frozen=True)
class OutputRequest:
    name: str
    binary: bool
    classification: int | None = None
    k: int | None = None


@dataclass(frozen=True)
class OutputPlan:
    """What the answer holds: the request id and the outputs, in order."""

    request_id: str | None
    outputs: list[OutputRequest] = field(default_factory=list)


def requested_outputs(
    entries: Any, parameters: dict[str, Any], inputs: dict[str, npt.NDArray[Any]], binary: bool
) -> list[OutputRequest]:
    """The outputs the request names, or the default ones for its inputs; each output
    without a k of its own takes the request's (a wider output elsewhere sets the run's k)."""
    asked = _outputs(entries, binary) or _default_outputs(inputs, parameters, binary)
    k = optional_int(parameters, "k")
    if k is not None and k < 1:  # an output's own k may hide it from the run's limits
        raise InvalidInput(f"parameter k must be an integer >= 1, got {k}")
    return [replace(output, k=k) if output.k is None else output for output in asked]


def takes_default_k(outputs: list[OutputRequest]) -> bool:
    """Whether a top-k output has no k of its own (nor the request's): the model's default."""
    widths = {"topk_token_ids", "topk_logits", "topk_logprobs"}
    return any(o.name in widths and o.k is None and o.classification is None for o in outputs)


def select(output: OutputRequest, result: InferResult) -> npt.NDArray[Any]:
    """The array one requested output carries."""
    topk = result.topk
    if output.name == "embeddings":
        assert result.embeddings is not None
        return result.embeddings
    assert topk is not None
    if output.classification is not None:
        count = output.classification
        return _classification(topk.logits[..., :count], topk.token_ids[..., :count], topk.tokens)
    if output.name == "logits":
        assert result.logits is not None
        return result.logits
    arrays: dict[str, npt.NDArray[Any] | None] = {
        "topk_token_ids": topk.token_ids,
        "topk_logits": topk.logits,
        "topk_logprobs": topk.logprobs,
        "logsumexp": topk.logsumexp,
    }
    arrays.update(sampled_arrays(topk))
    array = arrays[output.name]
    if array is None:
        raise InvalidInput(f"output {output.name} needs the parameter sample")
    per_position = output.name == "logsumexp" or output.name in SAMPLED_OUTPUTS  # no k axis
    return array if output.k is None or per_position else array[..., : output.k]


def _classification(
    values: npt.NDArray[np.float32], ids: npt.NDArray[np.int64], tokens: Tokens | None
) -> npt.NDArray[np.object_]:
    """Triton's classification format: ``"value:index"`` or ``"value:index:label"``; made a
    few rows at a time (``tolist`` of 4 million values, or one ``np.array`` of as many strings,
    held the GIL, and the event loop with it, ~0.3 s), the labels read by slices of rows."""
    flat_ids = ids.reshape(-1, ids.shape[-1])
    flat_values = values.reshape(-1, values.shape[-1])
    strings = np.empty(flat_ids.shape, dtype=object)
    step = max(1, PIECE_VALUES // max(1, flat_ids.shape[-1]))
    for start in range(0, len(flat_ids), step):
        labels = None if tokens is None else tokens[start : start + step]
        for offset, id_row in enumerate(flat_ids[start : start + step].tolist()):
            row_labels = [None] * len(id_row) if labels is None else labels[offset]
            strings[start + offset] = [
                f"{value:f}:{index}" + (f":{label}" if label is not None else "")
                for value, index, label in zip(
                    flat_values[start + offset].tolist(), id_row, row_labels, strict=False
                )
            ]
    return strings.reshape(*ids.shape)


def _default_outputs(
    inputs: dict[str, npt.NDArray[Any]], parameters: dict[str, Any], binary: bool
) -> list[OutputRequest]:
    if "hidden_states" not in inputs:
        return [OutputRequest("embeddings", binary)]
    names = ["topk_token_ids", "topk_logits"]
    if flag(parameters, "logprobs"):
        names.append("topk_logprobs")
    if parameters.get("sample") is not None:
        names += SAMPLED_OUTPUTS
    return [OutputRequest(name, binary) for name in names]


def _outputs(entries: Any, default_binary: bool) -> list[OutputRequest]:
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise InvalidInput("outputs must be a list of {name, parameters}")
    requests: list[OutputRequest] = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):  # ["topk_token_ids"] was "unknown output 'None'"
            raise InvalidInput(
                f"outputs[{index}] must be an object naming the output, e.g. "
                f'{{"name": "topk_token_ids"}}; got a JSON {json_type(entry)}'
            )
        name = entry.get("name")
        if name not in OUTPUTS:
            raise InvalidInput(f"unknown output {str(name)[:64]!r}; outputs: {', '.join(OUTPUTS)}")
        if any(request.name == name for request in requests):  # as Triton: each answer once
            raise InvalidInput(f"output {name!r} is requested twice; name each output once")
        parameters = mapping(entry.get("parameters"), f"output {name} parameters")
        classification = _count(parameters, "classification", name)
        if classification is not None and name != "logits":
            raise InvalidInput("classification applies to the logits output only")
        k = _count(parameters, "k", name)
        binary = parameters.get("binary_data", default_binary)
        if not isinstance(binary, bool):
            raise InvalidInput(f"output {name}: binary_data must be true or false")
        requests.append(OutputRequest(name, binary, classification, k))
    return requests


def _count(parameters: dict[str, Any], key: str, output: str) -> int | None:
    value = parameters.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise InvalidInput(f"output {output}: {key} must be an integer >= 1")
    return value
