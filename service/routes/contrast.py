"""Tied against untied: score real next tokens, and compare two served heads side by side.

Both run through the registry, leases and batcher like every other request; the numpy
statistics run in the inference thread pool, not on the event loop.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import numpy as np
import numpy.typing as npt
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from service import contrast
from service.codec import (
    check_hidden_states,
    check_ids,
    float_array,
    int_array,
    options,
    parse_json_object,
    read_body,
)
from service.errors import InvalidInput, PayloadTooLarge
from service.model import LoadedVersion
from service.routes.deps import leased_version
from service.settings import Settings

router = APIRouter(prefix="/v1", tags=["contrast"])
SPEED_ROWS = 64
SPEED_RUNS = 5


class CompareOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    models: list[str] = Field(min_length=2, max_length=2)
    k: int = Field(default=10, ge=1)
    measure_speed: bool = False


@router.post("/models/{name}/score")
@router.post("/models/{name}/versions/{version}/score")
async def score(request: Request) -> dict[str, Any]:
    """Per row: the target's logit, log-prob and rank; the batch's NLL and perplexity."""
    with leased_version(request) as (model, settings):
        payload = parse_json_object(await read_body(request, settings.max_body_bytes))
        hidden = _hidden(payload, model, settings)
        targets = _targets(payload, hidden, model)
        candidates = payload.pop("candidate_ids", None)
        if payload:
            raise InvalidInput(f"unknown fields: {', '.join(sorted(payload))[:200]}")
        logits, lse = await _full(model, hidden, settings)
        scores = await _offload(model, contrast.score, logits, lse, targets)
        answer: dict[str, Any] = {
            "model": model.name,
            "version": model.version,
            "tied": model.tied,
            "results": [
                {"logit": float(lg), "logprob": float(lp), "rank": int(rk)}
                for lg, lp, rk in zip(scores.logit, scores.logprob, scores.rank, strict=True)
            ],
            "nll": scores.nll,
            "perplexity": scores.perplexity,
        }
        if candidates is not None:
            answer["candidates"] = _candidates(candidates, logits, lse, model)
        return answer


@router.post("/compare")
async def compare(request: Request) -> dict[str, Any]:
    """Run the same hidden states through two heads: agreement, KL both ways, and per head
    NLL/perplexity (with ``target_ids``), tie flag, sizes and, if asked, rows/s."""
    settings: Settings = request.app.state.settings
    payload = parse_json_object(await read_body(request, settings.max_body_bytes))
    raw_hidden = payload.pop("hidden_states", None)
    raw_targets = payload.pop("target_ids", None)
    opts: CompareOptions = options(CompareOptions, payload)
    registry = request.app.state.registry
    heads = [registry.get(name) for name in opts.models]
    a, b = heads
    if a.d_model != b.d_model:
        raise InvalidInput(f"d_model differs: {a.name} has {a.d_model}, {b.name} has {b.d_model}")
    if a.vocab_size != b.vocab_size:
        raise InvalidInput(
            f"vocab sizes differ ({a.vocab_size} vs {b.vocab_size}): comparing them needs a "
            "token mapping, which is not supported"
        )
    with a.lease(), b.lease():
        hidden = check_hidden_states(
            float_array(raw_hidden, "hidden_states"), a.d_model, settings.max_rows
        )
        targets = None
        if raw_targets is not None:
            targets = _target_array(raw_targets, hidden, a)
        full = await asyncio.gather(*(_full(head, hidden, settings) for head in heads))
        (logits_a, lse_a), (logits_b, lse_b) = full
        answer: dict[str, Any] = await _offload(a, contrast.agreement, logits_a, logits_b, opts.k)
        blocks = [_block(head) for head in heads]
        if targets is not None:
            answer |= await _targets_block(a, targets, full, blocks)
        if opts.measure_speed:
            for head, block in zip(heads, blocks, strict=True):
                block["rows_per_s"] = await _offload(head, _speed, head, hidden)
                block["speed_rows"] = SPEED_ROWS
        answer["models"] = blocks
        return answer


def _hidden(
    payload: dict[str, Any], model: LoadedVersion, settings: Settings
) -> npt.NDArray[np.float32]:
    if "hidden_states" not in payload:
        raise InvalidInput(f"hidden_states is required: (rows, {model.d_model})")
    array = float_array(payload.pop("hidden_states"), "hidden_states")
    return check_hidden_states(array, model.d_model, settings.max_rows)


def _targets(
    payload: dict[str, Any], hidden: npt.NDArray[np.float32], model: LoadedVersion
) -> npt.NDArray[np.int64]:
    if "target_ids" not in payload:
        raise InvalidInput("target_ids is required: one token id per row of hidden_states")
    return _target_array(payload.pop("target_ids"), hidden, model)


def _target_array(
    raw: Any, hidden: npt.NDArray[np.float32], model: LoadedVersion
) -> npt.NDArray[np.int64]:
    ids = int_array(raw, "target_ids")
    if ids.shape != hidden.shape[:-1]:
        raise InvalidInput(
            f"target_ids must have shape {list(hidden.shape[:-1])} (one per row), "
            f"got {list(ids.shape)}"
        )
    return check_ids(ids, model.vocab_size, ids.size, "target_ids").reshape(-1)


async def _full(
    model: LoadedVersion, hidden: npt.NDArray[np.float32], settings: Settings
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    rows = math.prod(hidden.shape[:-1])
    if rows * model.vocab_size * 4 > settings.max_logits_bytes:
        raise PayloadTooLarge(
            f"{rows} rows x {model.vocab_size} logits exceed LMHEAD_MAX_LOGITS_BYTES "
            f"({settings.max_logits_bytes}); send fewer rows"
        )
    result = await model.project(hidden.reshape(-1, model.d_model), 1, full_logits=True)
    assert result.logits is not None
    return result.logits, result.logsumexp


async def _offload(model: LoadedVersion, function: Any, *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(model.executor, function, *args)


def _candidates(
    raw: Any, logits: npt.NDArray[np.float32], lse: npt.NDArray[np.float32], model: LoadedVersion
) -> list[dict[str, Any]]:
    ids = check_ids(int_array(raw, "candidate_ids"), model.vocab_size, 4096, "candidate_ids")
    per_row = np.broadcast_to(ids, (len(logits), ids.shape[-1])) if ids.ndim == 1 else ids
    if per_row.shape[0] != len(logits):
        raise InvalidInput(
            f"candidate_ids must be one list for all rows or one per row ({len(logits)}), "
            f"got {ids.shape[0]} lists"
        )
    values = np.take_along_axis(logits, per_row, axis=1)
    return [
        {"ids": row_ids.tolist(), "logits": row.tolist(), "logprobs": (row - row_lse).tolist()}
        for row_ids, row, row_lse in zip(per_row, values, lse, strict=True)
    ]


async def _targets_block(
    a: LoadedVersion,
    targets: npt.NDArray[np.int64],
    full: list[tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]],
    blocks: list[dict[str, Any]],
) -> dict[str, Any]:
    scores = [await _offload(a, contrast.score, lg, lse, targets) for lg, lse in full]
    for block, result in zip(blocks, scores, strict=True):
        block["nll"], block["perplexity"] = result.nll, result.perplexity
    first, second = scores[0].logprob, scores[1].logprob
    # Equal within float32 rounding is a tie: two kernels on one matrix differ in the last bits.
    tie = np.isclose(first, second, rtol=1e-5, atol=1e-5)
    return {
        "wins": {
            blocks[0]["name"]: float(np.mean((first > second) & ~tie)),
            blocks[1]["name"]: float(np.mean((second > first) & ~tie)),
            "tie": float(np.mean(tie)),
        }
    }


def _block(head: LoadedVersion) -> dict[str, Any]:
    """The head's metadata (tie, sizes, memory mode, provider), as ``/v1/models`` gives it."""
    return {"name": head.name, **head.describe()}


def _speed(head: LoadedVersion, hidden: npt.NDArray[np.float32]) -> float:
    """Rows/s of the bare session on a fixed 64-row batch (tiled from the request's rows)."""
    rows = np.resize(hidden.reshape(-1, head.d_model), (SPEED_ROWS, head.d_model))
    head.session.project(rows, 10)
    start = time.perf_counter()
    for _ in range(SPEED_RUNS):
        head.session.project(rows, 10)
    return SPEED_ROWS * SPEED_RUNS / (time.perf_counter() - start)
