"""The wire format of ``/v1/models/{name}/verify``: one decode, one encode.

The body is JSON (every array a nested list beside the options) or ``application/x-npz``
(``hidden_states``, ``draft_token_ids`` and optionally ``draft_probs``, ``draft_parents``,
``allowed_token_ids``, ``banned_token_ids``, ``seeds`` as entries; the options in the query
string): a ``draft_probs`` of 64 x 4 x 128256 float32 is 131 MB as an entry, several times
that as JSON text. The answer is JSON: per sequence its accepted drafts and emitted token,
trimmed to what was chosen (no padding).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
from starlette.requests import Request
from starlette.responses import Response

from service.api.codec.answer_bodies import identity
from service.api.codec.decoding_wire import binary_arrays, decoding, json_arrays, taken_from
from service.api.codec.native import reply
from service.api.codec.wire import (
    JSON,
    NPZ,
    booleans_hidden,
    content_type,
    float_array,
    int_array,
    json_bytes,
    off_loop,
    options,
    parse_json_object,
    read_body,
    target,
)
from service.api.decoding_fields import ARRAYS, LENGTHS, LISTS
from service.api.verify_schemas import VerifyOptions
from service.errors import InvalidInput, MalformedBody
from service.messages import SampleOptions, VocabularyOptions
from service.npyio import read_npz
from service.verify_messages import VerifyRequest, VerifyResult

FLOATS = ("hidden_states", "draft_probs", "draft_hidden_states")
INTEGERS = ("draft_token_ids", "draft_parents", "allowed_token_ids", "banned_token_ids", "seeds")
#: Query parameters of an ``.npz`` body holding JSON text.
JSON_QUERY = ("sample", "logit_bias")


async def decode_verify(request: Request, body_limit: int) -> VerifyRequest:
    body = await read_body(request, body_limit)
    kind = content_type(request, (JSON, NPZ))
    if kind == JSON:
        arrays, opts = await off_loop(len(body), _json_body, body)
    else:
        arrays = await off_loop(len(body), _npz_body, body)
        opts = _query_options(request)
    for name in ("hidden_states", "draft_token_ids"):
        if name not in arrays:
            raise InvalidInput(f"{name} is required")
    sample = opts.sample
    allowed, banned = arrays.get("allowed_token_ids"), arrays.get("banned_token_ids")
    step = decoding(opts, arrays)
    vocabulary = None
    shaped = (sample, allowed, banned, step)
    if opts.logit_bias or any(value is not None for value in shaped):
        vocabulary = VocabularyOptions(
            allowed,
            opts.logit_bias,
            banned,
            None,
            None if sample is None else SampleOptions(**sample.model_dump()),
            step,
        )
    return VerifyRequest(
        target(request),
        arrays["hidden_states"],
        arrays["draft_token_ids"],
        arrays.get("draft_probs"),
        arrays.get("draft_parents"),
        opts.temperature,
        vocabulary,
        arrays.get("seeds"),
        opts.states,
        opts.draft_model,
        arrays.get("draft_hidden_states"),
    )


def _json_body(body: bytes) -> tuple[dict[str, Any], VerifyOptions]:
    payload = parse_json_object(body)
    booleans = booleans_hidden(body, payload)
    arrays: dict[str, Any] = json_arrays(payload, booleans)
    arrays |= taken_from(payload, FLOATS, float_array, booleans)
    arrays |= taken_from(payload, INTEGERS, int_array, booleans)
    taken = (*FLOATS, *INTEGERS, *LISTS, *ARRAYS)
    checked: VerifyOptions = options(VerifyOptions, payload, taken=taken)
    return arrays, checked


def _npz_body(body: bytes) -> dict[str, Any]:
    try:
        entries = read_npz(body)
    except Exception:  # numpy raises ValueError/OSError/EOFError/BadZipFile for broken files
        raise MalformedBody("body is not a valid .npz archive") from None
    step: dict[str, Any] = binary_arrays(entries)
    unknown = sorted(set(entries) - {*FLOATS, *INTEGERS})
    if unknown:
        lists = (name + LENGTHS for name in LISTS)
        held = ", ".join((*FLOATS, *INTEGERS, *LISTS, *lists, *ARRAYS))
        raise InvalidInput(f"unknown .npz entries {unknown[:4]}; it may hold {held}")
    for name in INTEGERS:
        if name in entries and entries[name].dtype.kind not in "iu":
            raise InvalidInput(f"{name} must be integers, got {entries[name].dtype.name}")
    return {**entries, **step}


def _query_options(request: Request) -> VerifyOptions:
    values: dict[str, Any] = {}
    for name, text in request.query_params.items():
        if name == "version":
            continue
        if name in JSON_QUERY:
            try:
                values[name] = orjson.loads(text)
            except orjson.JSONDecodeError:
                raise InvalidInput(f"query parameter {name} must be JSON text") from None
        else:
            values[name] = text
    checked: VerifyOptions = options(
        VerifyOptions, values, strict=False, taken=(*FLOATS, *INTEGERS)
    )
    return checked


async def encode_verify(result: VerifyResult) -> Response:
    return await off_loop(result.token_ids.size * 48, _verify_response, result)


def _verify_response(result: VerifyResult) -> Response:
    results = []
    for row, accepted in enumerate(result.accepted.tolist()):
        logprobs = result.logprobs[row, : accepted + 1].astype(np.float64)
        results.append(
            {
                "accepted": accepted,
                "token_ids": result.token_ids[row, : accepted + 1].tolist(),
                "logprobs": [None if not np.isfinite(v) else v for v in logprobs.tolist()],
                "nodes": result.nodes[row, :accepted].tolist(),
                "seed": int(result.seeds[row]),
            }
        )
    payload = {
        **identity(result.head),
        "logprobs_mode": result.logprobs_mode,
        "results": results,
    }
    return reply(result.head, json_bytes(payload), JSON)
