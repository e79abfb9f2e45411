"""The native API's wire format (``/v1``): one decode and one encode per request.

Bodies are JSON (``hidden_states`` or ``input_ids`` beside the options) or ``.npy`` (options as
query parameters); ``/topk`` and ``/logits`` also take ``.npz`` (``hidden_states`` and every
array option an entry, ragged lists as values and ``<name>_lengths``; the scalars in the
query string). Answers are JSON by default; top-k also answers ``application/x-npy`` (one
structured array with fields ``token_ids``, ``logits`` and, when asked, ``logprobs``) and
``application/x-npz`` (one array per field plus ``logsumexp``); ``/logits`` answers ``.npy`` by
default. Every inference answer carries ``x-lmhead-model``, ``-version`` and ``-tied`` headers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from service.api.codec import memo, pieces
from service.api.codec.answer_bodies import identity, score_json, topk_json, topk_records
from service.api.codec.decoding_wire import BINARY_NAMES, binary_arrays, decoding, json_arrays
from service.api.codec.pieces import Piece, json_pieces, npy_pieces
from service.api.codec.wire import (
    JSON,
    NPY,
    NPZ,
    booleans_hidden,
    content_type,
    float_array,
    int_array,
    json_bytes,
    no_query_options,
    npz_bytes,
    off_loop,
    options,
    parse_json_object,
    parse_npy,
    parse_npz,
    read_body,
    response_type,
    target,
)
from service.api.decoding_fields import ARRAYS, LISTS
from service.api.schemas import (
    CompareOptions,
    EmbedOptions,
    LogitsOptions,
    ScoreOptions,
    TopKOptions,
)
from service.errors import InvalidInput, few
from service.messages import (
    CompareRequest,
    CompareResult,
    EmbedRequest,
    EmbedResult,
    HeadInfo,
    LogitsRequest,
    LogitsResult,
    SampleOptions,
    ScoreRequest,
    ScoreResult,
    Target,
    TopKRequest,
    TopKResult,
    VocabularyOptions,
)

HIDDEN = "hidden_states"
NO_EMBED_OPTIONS = "is not read: /embed takes no options (only ?version=)"


async def decode_topk(request: Request, body_limit: int) -> tuple[TopKRequest, str]:
    """A top-k request and the media type the answer should have."""
    answer = response_type(request, (JSON, NPY, NPZ), JSON)
    hidden, opts, arrays = await hidden_and_options(
        request, body_limit, TopKOptions, TOPK_LISTS, step=True
    )
    decoded = TopKRequest(
        target(request),
        hidden,
        opts.k,
        opts.temperature,
        opts.logprobs,
        tokens=answer == JSON,
        vocabulary=_vocabulary(opts, arrays),
        states=opts.states,
    )
    return decoded, answer


def _vocabulary(opts: TopKOptions, arrays: dict[str, Any]) -> VocabularyOptions | None:
    """The distribution options, or None when the request has none (the plain fast path)."""
    sample = opts.sample
    step = decoding(opts, arrays)
    if not (arrays or opts.logit_bias or opts.logprobs_over or sample or step):
        return None
    return VocabularyOptions(
        arrays.get("allowed_token_ids"),
        opts.logit_bias,
        arrays.get("banned_token_ids"),
        opts.logprobs_over,
        None if sample is None else SampleOptions(**sample.model_dump()),
        step,
    )


async def decode_logits(request: Request, body_limit: int) -> tuple[LogitsRequest, str]:
    answer = response_type(request, (NPY, JSON), NPY)
    hidden, opts, arrays = await hidden_and_options(
        request, body_limit, LogitsOptions, LOGITS_LISTS, step=True
    )
    allowed = arrays.get("allowed_token_ids")
    decoded = LogitsRequest(
        target(request),
        hidden,
        opts.temperature,
        allowed,
        opts.states,
        text=answer == JSON,
        decoding=decoding(opts, arrays),
    )
    return decoded, answer


async def decode_embed(request: Request, body_limit: int) -> tuple[EmbedRequest, str]:
    answer = response_type(request, (JSON, NPY), JSON)
    body = await read_body(request, body_limit)
    if content_type(request, (JSON, NPY)) == NPY:
        no_query_options(request, NO_EMBED_OPTIONS)
        ids = parse_npy(body, "input_ids")
    else:
        no_query_options(request)
        ids = await off_loop(len(body), _json_ids, body)
    return EmbedRequest(target(request), ids), answer


def _json_ids(body: bytes) -> npt.NDArray[np.int64]:
    payload = parse_json_object(body)
    booleans = booleans_hidden(body, payload)
    ids = int_array(
        _required(payload, "input_ids", "a nested list of token ids"), "input_ids", booleans
    )
    options(EmbedOptions, payload, taken=("input_ids",))
    return ids


async def decode_score(request: Request, body_limit: int) -> ScoreRequest:
    content_type(request, (JSON,))
    no_query_options(request)
    body = await read_body(request, body_limit)
    return await off_loop(len(body), _score_request, body, target(request))


def _score_request(body: bytes, to: Target) -> ScoreRequest:
    payload = parse_json_object(body)
    booleans = booleans_hidden(body, payload)
    hidden = float_array(_required(payload, HIDDEN, "(rows, d_model)"), HIDDEN, booleans)
    targets = _required(payload, "target_ids", "one token id per row")
    candidates = payload.pop("candidate_ids", None)
    opts: ScoreOptions = options(ScoreOptions, payload)
    return ScoreRequest(
        to,
        hidden,
        int_array(targets, "target_ids", booleans),
        None if candidates is None else int_array(candidates, "candidate_ids", booleans),
        opts.k or 0,  # null, as absent: no alternatives
        opts.logprobs_over,
        opts.states,
    )


async def decode_compare(request: Request, body_limit: int) -> CompareRequest:
    content_type(request, (JSON,))
    no_query_options(request, read=())  # the models (and no version) are in the body
    body = await read_body(request, body_limit)
    return await off_loop(len(body), _compare_request, body)


def _compare_request(body: bytes) -> CompareRequest:
    payload = parse_json_object(body)
    booleans = booleans_hidden(body, payload)
    hidden = float_array(_required(payload, HIDDEN, "(rows, d_model)"), HIDDEN, booleans)
    targets = payload.pop("target_ids", None)
    opts: CompareOptions = options(CompareOptions, payload)
    return CompareRequest(
        (opts.models[0], opts.models[1]),
        hidden,
        None if targets is None else int_array(targets, "target_ids", booleans),
        opts.k,
        opts.measure_speed,
        opts.states,
    )


async def encode_topk(result: TopKResult, answer: str) -> Response:
    return await off_loop(result.token_ids.size * 32, _topk_response, result, answer)


async def encode_logits(result: LogitsResult, answer: str) -> Response:
    return await off_loop(result.logits.nbytes * 3, _logits_response, result, answer)


async def encode_embed(result: EmbedResult, answer: str) -> Response:
    return await off_loop(result.embeddings.nbytes * 3, _embed_response, result, answer)


async def encode_score(result: ScoreResult) -> Response:
    size = result.rank.size * 64 + sum(
        found.ids.size * 40 for found in (result.candidates, result.alternatives) if found
    )
    return await off_loop(size, _score_response, result)


async def encode_compare(result: CompareResult) -> Response:
    return _compare_response(result)  # a few summaries: small whatever the rows


def _topk_response(result: TopKResult, answer: str) -> Response:
    if answer == JSON:
        return reply(result.head, topk_json(result), JSON)
    if answer == NPZ:
        arrays: dict[str, npt.NDArray[Any]] = {
            "token_ids": result.token_ids,
            "logits": result.logits,
        }
        if result.logprobs is not None:
            arrays["logprobs"] = result.logprobs
        if result.sampled is not None:
            arrays["sampled_token_ids"] = result.sampled.token_ids
            arrays["sampled_logprobs"] = result.sampled.logprobs
            arrays["seed"] = np.array(result.sampled.seed, np.uint64)  # to draw them again
        if result.logprobs_mode is not None:
            arrays["logprobs_mode"] = np.array(result.logprobs_mode)
        return reply(result.head, npz_bytes({**arrays, "logsumexp": result.logsumexp}), NPZ)
    return reply(result.head, npy_pieces(topk_records(result)), NPY)


def _logits_response(result: LogitsResult, answer: str) -> Response:
    if answer == JSON:
        payload = {**identity(result.head), "logits": result.logits}
        if result.token_ids is not None:  # restricted: the columns' ids (npy: as requested)
            payload["token_ids"] = result.token_ids
        return reply(result.head, json_pieces(payload), JSON)
    return reply(result.head, npy_pieces(result.logits), NPY)


def _embed_response(result: EmbedResult, answer: str) -> Response:
    if answer == NPY:
        return reply(result.head, npy_pieces(result.embeddings), NPY)
    payload = {**identity(result.head), "embeddings": result.embeddings}
    return reply(result.head, json_pieces(payload), JSON)


def _score_response(result: ScoreResult) -> Response:
    return reply(result.head, score_json(result), JSON)


def _compare_response(result: CompareResult) -> Response:
    payload: dict[str, Any] = {**result.agreement, "models": list(result.models)}
    if result.ties is not None:
        payload["ties"] = result.ties
    return Response(json_bytes(payload), media_type=JSON)


#: Id lists beside the options: decoded to numpy like the hidden states, not by pydantic.
ID_LISTS = ("allowed_token_ids", "banned_token_ids")
#: The routes that take the decoding step's: stop ids may come as the others do.
TOPK_LISTS = (*ID_LISTS, "stop_token_ids")
LOGITS_LISTS = ("allowed_token_ids", "stop_token_ids")
#: Query parameters (``.npy`` bodies) whose value is JSON text.
JSON_QUERY = (*TOPK_LISTS, "target_ids", "logit_bias", "sample")
QUERY_EXAMPLES = {"logit_bias": '{"3":-100}', "sample": '{"seed":1}'}
BOOLEANS = ("true", "false")


async def hidden_and_options(
    request: Request,
    body_limit: int,
    schema: type[BaseModel],
    lists: Sequence[str] = ID_LISTS,
    step: bool = False,
) -> tuple[npt.NDArray[Any], Any, dict[str, Any]]:
    """The rows, the options of ``schema`` and the id ``lists`` the route takes; with
    ``step``, the decoding step's arrays too (``decoding_wire``), and ``.npz`` bodies: every
    array an entry of the archive, the scalar options in the query string."""
    body = await read_body(request, body_limit)
    kind = content_type(request, (JSON, NPY, NPZ) if step else (JSON, NPY))
    if kind == JSON:
        no_query_options(request)
        return await off_loop(len(body), _json_hidden_and_options, body, schema, lists, step)
    if kind == NPZ:
        entries = await off_loop(len(body), parse_npz, body)
        array = _required(entries, HIDDEN, "an .npz entry of (rows, d_model) floats")
        arrays = binary_arrays(entries)
        arrays |= {name: entries.pop(name) for name in lists if name in entries}
        if entries:
            held = ", ".join((HIDDEN, *lists, *BINARY_NAMES))
            raise InvalidInput(f"unknown .npz entries {few(list(entries))}; it may hold {held}")
    else:
        array, arrays = parse_npy(body, HIDDEN), {}
    opts, listed = _query_options(request, schema, lists)
    for name in set(listed) & set(arrays):
        raise InvalidInput(f"{name} is given twice (the body and the query); give it once")
    return array, opts, arrays | listed


def _query_options(
    request: Request, schema: type[BaseModel], lists: Sequence[str]
) -> tuple[Any, dict[str, npt.NDArray[Any]]]:
    """The options of a binary body's query string, and the id lists given there (options of
    a short query string without lists are read once, ``memo``)."""
    raw = request.scope["query_string"]
    key = (schema, tuple(lists), raw) if len(raw) <= memo.QUERY_CACHE_CHARS else None
    known = memo.QUERY_OPTIONS.get(key) if key is not None else None
    if known is not None:
        return known, {}
    query = request.query_params
    values = {k: _query_value(k, v) for k, v in query.items() if k != "version"}
    literals = sum(query.get(name, "").count(word) for name in lists for word in BOOLEANS)
    arrays = _id_lists(values, lists, booleans=literals > 0)  # scan lists only then
    taken = (*lists, "version")
    typed = {k: v for k, v in values.items() if k in JSON_QUERY}
    untyped = {k: v for k, v in values.items() if k not in typed}
    opts = options(schema, untyped, strict=False, taken=taken)
    if typed:  # JSON text holds JSON types: checked as strictly as in a JSON body
        checked = options(schema, typed, taken=taken)
        opts = opts.model_copy(update={name: getattr(checked, name) for name in typed})
    if key is not None and not arrays:
        memo.remember(key, opts, memo.QUERY_OPTIONS)
    return opts, arrays


def _query_value(name: str, text: str) -> Any:
    if name not in JSON_QUERY:
        return text
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        example = QUERY_EXAMPLES.get(name, "[3,7]")
        raise InvalidInput(f"query parameter {name} must be JSON, e.g. {name}={example}") from None


def _id_lists(
    values: dict[str, Any], lists: Sequence[str], booleans: bool
) -> dict[str, npt.NDArray[Any]]:
    """The id ``lists`` taken out of ``values``; one sent as null is not given, as the
    document says (it was left among the options and refused as an unknown field)."""
    taken = {name: values.pop(name) for name in lists if name in values}
    return {
        name: int_array(value, name, booleans) for name, value in taken.items() if value is not None
    }


def _json_hidden_and_options(
    body: bytes, schema: type[BaseModel], lists: Sequence[str], step: bool = False
) -> tuple[npt.NDArray[Any], Any, dict[str, Any]]:
    values = parse_json_object(body)
    booleans = booleans_hidden(body, values)
    expected = "(rows, d_model) or (batch, tokens, d_model)"
    array = float_array(_required(values, HIDDEN, expected), HIDDEN, booleans)
    arrays: dict[str, Any] = _id_lists(values, lists, booleans)
    taken = (HIDDEN, *lists)
    if step:
        arrays |= json_arrays(values, booleans)
        taken = (*taken, *(name for name in (*LISTS, *ARRAYS) if name not in lists))
    return array, options(schema, values, taken=taken), arrays


def _required(payload: dict[str, Any], field: str, expected: str) -> Any:
    """``field``, taken out of the payload; missing, the error names what came instead (a
    misspelled ``hiden_states`` was reported as only "hidden_states is required")."""
    if field not in payload:
        came = f"; the body has {few(list(payload))}" if payload else ""
        raise InvalidInput(f"{field} is required: {expected}{came}")
    return payload.pop(field)


def reply(head: HeadInfo, body: bytes | list[Piece], media_type: str) -> Response:
    """An inference answer with the headers that name its head; a body made in pieces (a
    large one) is sent as they are (``service.api.codec.pieces``)."""
    headers = {
        "x-lmhead-model": head.name,
        "x-lmhead-version": str(head.version),
        "x-lmhead-tied": "true" if head.tied else "false",
    }
    return pieces.reply([body] if isinstance(body, bytes) else body, media_type, headers)
