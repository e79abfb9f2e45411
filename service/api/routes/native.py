"""Native API (``/v1``): model metadata, top-k, full logits, embeddings, score and compare.

Each inference route is decode -> data plane -> encode (``service.api.codec.native`` is the
codec). The handlers take the bare ``Request``: the app serves them ahead of FastAPI's
middleware and dependency machinery (see ``service.hosting.app``), and ``routes.openapi``
declares what FastAPI cannot see.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from service.api.codec import native
from service.api.codec.lens_wire import decode_lens, encode_lens
from service.api.codec.verify_wire import decode_verify, encode_verify
from service.api.routes.deps import PlaneDep, body_limit, plane_of
from service.api.routes.openapi import (
    BINARY,
    INFERENCE_ERRORS,
    NPY,
    NPZ,
    VERSION_QUERY,
    errors,
    npy_query,
    operation,
)
from service.api.schemas import (
    CompareAnswer,
    CompareBody,
    EmbedAnswer,
    EmbedBody,
    LensAnswer,
    LensBody,
    LogitsAnswer,
    LogitsBody,
    ModelDescription,
    ModelList,
    ScoreAnswer,
    ScoreBody,
    TopKAnswer,
    TopKBody,
)
from service.api.verify_schemas import VerifyAnswer, VerifyBody, VerifyOptions

router = APIRouter(prefix="/v1", tags=["native"])
Handler = Callable[[Request], Awaitable[Response]]
TOPK_QUERY = (VERSION_QUERY, *npy_query(TopKBody))


def _inference(
    name: str, body: type[Any], answer: type[Any], *, answers: tuple[str, ...], **extra: Any
) -> Callable[[Handler], Handler]:
    """Register a raw-request handler at ``/models/{name}[/versions/{version}]/<name>``."""

    def register(handler: Handler) -> Handler:
        for path in (f"/models/{{name}}/{name}", f"/models/{{name}}/versions/{{version}}/{name}"):
            router.post(
                path,
                response_model=answer,
                responses=errors(*INFERENCE_ERRORS),
                openapi_extra=operation(router.prefix + path, body=body, answers=answers, **extra),
            )(handler)
        return handler

    return register


@router.get("/models", response_model=ModelList)
async def list_models(plane: PlaneDep) -> dict[str, Any]:
    """Every model: state (READY/FAILED with a reason), versions, tie, sizes, provider."""
    return {"models": [status.to_json() for status in await plane.models()]}


@router.get(
    "/models/{name}",
    response_model=ModelDescription,
    responses=errors(404),
    openapi_extra=operation("/v1/models/{name}"),
)
async def get_model(request: Request) -> dict[str, Any]:
    """One model, as in the list."""
    status = await plane_of(request).model(request.path_params["name"])
    return status.to_json()


@_inference(
    "topk",
    TopKBody,
    TopKAnswer,
    answers=(NPY, NPZ),
    alternatives={NPY: BINARY, NPZ: BINARY},
    parameters=TOPK_QUERY,
)
async def topk(request: Request) -> Response:
    """Top-k token ids and logits (and log-probs, token strings) for each row."""
    decoded, answer = await native.decode_topk(request, body_limit(request))
    return await native.encode_topk(await plane_of(request).topk(decoded), answer)


@_inference(
    "logits",
    LogitsBody,
    LogitsAnswer,
    answers=(NPY,),
    alternatives={NPY: BINARY, NPZ: BINARY},
    parameters=(VERSION_QUERY, *npy_query(LogitsBody)),
)
async def logits(request: Request) -> Response:
    """All (rows, vocab) logits: ``.npy`` by default, JSON when asked; bounded in bytes."""
    decoded, answer = await native.decode_logits(request, body_limit(request))
    return await native.encode_logits(await plane_of(request).logits(decoded), answer)


@_inference(
    "embed",
    EmbedBody,
    EmbedAnswer,
    answers=(NPY,),
    alternatives={NPY: BINARY},
    parameters=(VERSION_QUERY,),
)
async def embed(request: Request) -> Response:
    """Input embeddings for token ids: the Gather side of the same head."""
    decoded, answer = await native.decode_embed(request, body_limit(request))
    return await native.encode_embed(await plane_of(request).embed(decoded), answer)


@_inference("score", ScoreBody, ScoreAnswer, answers=(), parameters=(VERSION_QUERY,))
async def score(request: Request) -> Response:
    """Per row: the target's logit, log-prob and rank; the batch's NLL and perplexity."""
    decoded = await native.decode_score(request, body_limit(request))
    return await native.encode_score(await plane_of(request).score(decoded))


LENS_QUERY = (VERSION_QUERY, *npy_query(LensBody))


@_inference(
    "lens", LensBody, LensAnswer, answers=(NPZ,), alternatives={NPY: BINARY}, parameters=LENS_QUERY
)
async def lens(request: Request) -> Response:
    """The logit lens: every layer's hidden states (layers, tokens, d_model) through the head's
    final norm and projection: per layer and token the top-k, entropy, KL to the last layer
    and, with target_ids, each target's log-prob and rank. Runs in bounded memory."""
    decoded, answer = await decode_lens(request, body_limit(request))
    return await encode_lens(await plane_of(request).lens(decoded), answer)


@_inference(
    "verify",
    VerifyBody,
    VerifyAnswer,
    answers=(),
    alternatives={NPZ: BINARY},
    parameters=(VERSION_QUERY, *npy_query(VerifyOptions)),
)
async def verify(request: Request) -> Response:
    """Speculative verification: which drafted tokens the target accepts (exact rejection
    sampling; greedy at temperature 0; trees with draft_parents) and the token after them."""
    decoded = await decode_verify(request, body_limit(request))
    return await encode_verify(await plane_of(request).verify(decoded))


@router.post(
    "/compare",
    response_model=CompareAnswer,
    responses=errors(*INFERENCE_ERRORS),
    openapi_extra=operation("/v1/compare", body=CompareBody),
)
async def compare(request: Request) -> Response:
    """The same hidden states through two heads: agreement, KL both ways, and per head
    NLL/perplexity (with ``target_ids``), tie flag, sizes and, if asked, rows/s."""
    decoded = await native.decode_compare(request, body_limit(request))
    return await native.encode_compare(await plane_of(request).compare(decoded))
