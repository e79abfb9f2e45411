"""V2 parameters: the scalar readers, and the options that shape the distribution.

gRPC parameters are scalars, so the structured ones (``allowed_token_ids``,
``banned_token_ids``, ``logit_bias``, ``sample``) may also come as a string holding their JSON;
over REST they may be plain JSON values. Array options may come as named input tensors
instead (binary, never parsed as JSON): ``allowed_token_ids``, ``banned_token_ids``,
``stop_token_ids`` and the decoding step's (``token_bitmask`` INT32, histories and bad words
as values and ``<name>_lengths``); its scalars (``repetition_penalty``, ...,
``logprobs_mode``, ``processor_order``) are parameters. Draws come back as the outputs
``sampled_token_ids`` and ``sampled_logprobs`` (one per row; with ``sample.n``, (rows, n)).
"""

from __future__ import annotations

from typing import Any

import numpy.typing as npt
import orjson

from service.api.codec.decoding_wire import binary_arrays, decoding
from service.api.codec.wire import int_array
from service.errors import InvalidInput, few
from service.messages import SampleOptions, TopKResult, VocabularyOptions

SAMPLED_OUTPUTS = ("sampled_token_ids", "sampled_logprobs")
SAMPLE_KEYS = ("temperature", "top_k", "top_p", "min_p", "seed", "n")
#: The decoding step's scalar parameters: numbers, and words.
STEP_NUMBERS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens")
STEP_WORDS = ("logprobs_mode", "processor_order")
#: Every parameter ``vocabulary`` reads.
VOCABULARY_PARAMETERS = frozenset(
    (
        "allowed_token_ids",
        "banned_token_ids",
        "stop_token_ids",
        "logit_bias",
        "sample",
        "logprobs_over",
        *STEP_NUMBERS,
        *STEP_WORDS,
    )
)


def vocabulary(
    parameters: dict[str, Any], inputs: dict[str, npt.NDArray[Any]] | None = None
) -> VocabularyOptions | None:
    """The distribution options among the parameters and the option ``inputs`` (named input
    tensors: allowed and banned ids, the decoding step's arrays); None when there are none."""
    if not inputs and parameters.keys().isdisjoint(VOCABULARY_PARAMETERS):
        return None  # the plain request's case, without a reader per option
    tensors = dict(inputs or {})
    allowed = _once(parameters, tensors, "allowed_token_ids")
    banned = _once(parameters, tensors, "banned_token_ids")
    bias = _structured(parameters, "logit_bias", dict)
    sample = _structured(parameters, "sample", dict)
    over = parameters.get("logprobs_over")
    if over is not None and not isinstance(over, str):
        raise InvalidInput("parameter logprobs_over must be 'candidates' or 'vocabulary'")
    stop = _once(parameters, tensors, "stop_token_ids")
    arrays = binary_arrays(tensors) | ({} if stop is None else {"stop_token_ids": stop})
    step = decoding(_step_scalars(parameters), arrays)
    shaped = (allowed, banned, bias, sample, over, step)
    if all(value is None for value in shaped):
        return None
    return VocabularyOptions(
        allowed,
        bias,
        banned,
        over,
        None if sample is None else _sample(sample),
        step,
    )


def _once(
    parameters: dict[str, Any], tensors: dict[str, npt.NDArray[Any]], name: str
) -> npt.NDArray[Any] | None:
    """Ids given as a parameter (a list, or its JSON) or as an input tensor, not both."""
    listed = _structured(parameters, name, list)
    tensor = tensors.pop(name, None)
    if listed is not None and tensor is not None:
        raise InvalidInput(f"{name} is given as a parameter and as an input; give it once")
    return int_array(listed, name) if listed is not None else tensor


def _step_scalars(parameters: dict[str, Any]) -> dict[str, Any]:
    """The decoding step's scalars: numbers (``min_tokens`` an integer) and words."""
    values = {}
    for name in (*STEP_NUMBERS, *STEP_WORDS):
        value = parameters.get(name)
        if value is None:
            continue
        if name in STEP_WORDS and not isinstance(value, str):
            raise InvalidInput(f"parameter {name} must be a string")
        if name in STEP_NUMBERS:
            integral = name == "min_tokens"
            valid = isinstance(value, int) if integral else isinstance(value, int | float)
            if isinstance(value, bool) or not valid:
                raise InvalidInput(
                    f"parameter {name} must be {'an integer' if integral else 'a number'}"
                )
        values[name] = value
    return values


def sampled_arrays(topk: TopKResult) -> dict[str, npt.NDArray[Any] | None]:
    sampled = topk.sampled
    return {
        "sampled_token_ids": None if sampled is None else sampled.token_ids,
        "sampled_logprobs": None if sampled is None else sampled.logprobs,
    }


def _structured(parameters: dict[str, Any], name: str, kind: type) -> Any:
    value = parameters.get(name)
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError as error:  # not JSON, nested too deep, or 1e400
            why = str(error).split(":", 1)[0][:80]
            raise InvalidInput(
                f"parameter {name} is a string that orjson cannot read as JSON ({why})"
            ) from None
    if value is not None and not isinstance(value, kind):
        shape = "a list (or its JSON text)" if kind is list else "an object (or its JSON text)"
        raise InvalidInput(f"parameter {name} must be {shape}")
    return value


def _sample(values: dict[str, Any]) -> SampleOptions:
    unknown = [key for key in values if key not in SAMPLE_KEYS]
    if unknown:
        raise InvalidInput(f"parameter sample takes {list(SAMPLE_KEYS)}, not {few(unknown)}")
    for key, value in values.items():
        integral = key in ("top_k", "seed", "n")
        valid = isinstance(value, int) if integral else isinstance(value, int | float)
        if value is not None and (isinstance(value, bool) or not valid):
            raise InvalidInput(f"sample.{key} must be {'an integer' if integral else 'a number'}")
    return SampleOptions(**values)


def flag(parameters: dict[str, Any], name: str) -> bool:
    value = parameters.get(name, False)
    if not isinstance(value, bool):
        raise InvalidInput(f"parameter {name} must be true or false")
    return value


def optional_int(parameters: dict[str, Any], name: str) -> int | None:
    value = parameters.get(name)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise InvalidInput(f"parameter {name} must be an integer")
    return value


def number(parameters: dict[str, Any], name: str, default: float) -> float:
    value = parameters.get(name, default)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise InvalidInput(f"parameter {name} must be a number")
    return float(value)


def mapping(value: Any, where: str) -> dict[str, Any]:
    """An optional JSON object (``parameters`` of a request, an input or an output); a
    parameter sent as null (over gRPC: one with no value set) is not given."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInput(f"{where} must be a JSON object")
    return {name: given for name, given in value.items() if given is not None}


STATES = ("final", "residual")


def states(parameters: dict[str, Any], inputs: Any) -> str:
    """``states`` (``final`` or ``residual``) from the request's parameters or its
    hidden_states input's (where Triton clients put per-tensor options); given in both, the
    two must agree. ``final`` when neither says."""
    given: dict[str, Any] = {}
    if "states" in parameters:
        given["the request's parameters"] = parameters["states"]
    for entry in inputs if isinstance(inputs, list) else []:
        own = entry.get("parameters") if isinstance(entry, dict) else None
        mine = own if isinstance(own, dict) and entry.get("name") == "hidden_states" else {}
        if mine.get("states") is not None:  # null: not given
            given["input hidden_states's parameters"] = mine["states"]
    for where, value in given.items():
        if value not in STATES:
            shown = str(value)[:24] if isinstance(value, str) else type(value).__name__
            raise InvalidInput(
                f"parameter states in {where} must be 'final' or 'residual', got {shown!r}"
            )
    if len(set(given.values())) > 1:
        (first, one), (second, other) = given.items()
        raise InvalidInput(
            f"parameter states is {one!r} in {first} and {other!r} in {second}: give it once"
        )
    return next(iter(given.values()), "final")
