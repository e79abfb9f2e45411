"""Top-k calls served as one: the calls a front sends the engine together, grouped.

A front sends every call of one event-loop turn in one frame. Top-k calls in a frame that
differ only in their rows (same target, k, temperature and answer options, no vocabulary
options), and V2 ``infer`` calls that ask only that, go through ``DataPlane.topk_group``
together: one lookup and lease, one batcher entry, one result split back. Per call,
``topk``'s own bookkeeping (lookup, lease, limits, metrics, a batcher future, a task) costs
more than a one-row run of a small head: measured on 2 cores, 64 one-row JSON clients
through two fronts, the engine's event loop spent 100 us per call alone and 60 us grouped.
Each call still gets its own checks, answer or error, and metrics; when the group's rows
pass half a batch (``Batcher.room``), or the queue cannot take them at once, the calls are
queued one by one, so each is batched, let in or refused as it would be alone.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Hashable, Iterator
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from service.errors import ServiceError
from service.messages import InferRequest, TopKRequest
from service.runtime.session import Projection

logger = logging.getLogger("lmhead")
T = TypeVar("T")
#: A call kept for the group: its index among the calls, and its checked hidden states.
Kept = tuple[int, npt.NDArray[np.float32]]


def group_key(method: str, arguments: tuple[Any, ...]) -> tuple[Hashable, ...] | None:
    """What calls must share to be served as one: all but their rows (None: alone). Top-k
    calls without vocabulary options group; so do V2 ``infer`` calls that ask only that."""
    if len(arguments) != 1:
        return None
    request = arguments[0]
    if method == "topk" and type(request) is TopKRequest and request.vocabulary is None:
        return (
            method,
            request.target,
            request.k,
            request.temperature,
            request.logprobs,
            request.tokens,
            request.states,
        )
    if method == "infer" and type(request) is InferRequest and _top_k_only(request):
        key = (request.target, request.k, request.temperature, request.tokens, request.states)
        return (method, *key)
    return None


def _top_k_only(request: InferRequest) -> bool:
    return (
        request.hidden_states is not None
        and request.input_ids is None
        and not request.full_logits
        and request.vocabulary is None
    )


def as_topk(request: InferRequest) -> TopKRequest:
    """A top-k-only ``infer`` call as the ``topk`` call it amounts to (log-probs included)."""
    assert request.hidden_states is not None
    return TopKRequest(
        request.target,
        request.hidden_states,
        request.k,
        request.temperature,
        True,
        request.tokens,
        states=request.states,
    )


def rows(kept: list[Kept]) -> int:
    """The rows of the kept calls together."""
    return sum(math.prod(hidden.shape[:-1]) for _, hidden in kept)


def split(projection: Projection, shapes: list[tuple[int, ...]]) -> Iterator[Projection]:
    """The (rows, k) projection of concatenated calls (and their full logits, if fetched),
    back in one part per call, each with its call's leading dims."""
    offset = 0
    for leading in shapes:
        end = offset + math.prod(leading)
        logits = projection.logits
        yield Projection(
            projection.topk_logits[offset:end].reshape(*leading, -1),
            projection.topk_token_ids[offset:end].reshape(*leading, -1),
            projection.logsumexp[offset:end].reshape(leading),
            None if logits is None else logits[offset:end].reshape(*leading, -1),
        )
        offset = end


async def one_by_one(calls: list[Awaitable[T]]) -> list[T | ServiceError]:
    """Calls served alone, concurrently: each gets its own answer or error (a call that
    fails on a bug gets ``internal``'s error, the others their answers)."""
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    answers: list[T | ServiceError] = []
    for outcome in outcomes:
        if isinstance(outcome, BaseException) and not isinstance(outcome, ServiceError):
            answers.append(internal(outcome))
        else:
            answers.append(outcome)
    return answers


def internal(error: BaseException) -> ServiceError:
    """The answer to a call that failed on a bug (logged with its traceback)."""
    logger.error("a top-k call failed", exc_info=error)
    return ServiceError("the service failed on this call; see its log")
