"""The bodies of the native API's large answers: top-k and score as JSON, encoded a piece at a
time, and top-k as ``.npy`` records.

A piece is a few rows (``PIECE_VALUES`` values), so one encoder call holds the GIL for a few
milliseconds, not the ~0.6 s of a 113 MB answer, and the event loop gets it back between
pieces; the pieces are sent as they are (``service.api.codec.pieces``), never joined into one
buffer. Arrays go to the encoder as numpy rows, not as Python lists: a 4096-row, k=1000 score
answer made 12 million Python objects (~400 MB, beyond the memory budget's account, and left
in the allocator's arenas after).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from service.api.codec.pieces import PIECE_VALUES, Piece, joined
from service.api.codec.wire import json_bytes
from service.messages import CandidateScores, HeadInfo, ScoreResult, TopKResult


def identity(head: HeadInfo) -> dict[str, Any]:
    return {"model": head.name, "version": head.version, "tied": head.tied}


def topk_json(result: TopKResult) -> list[Piece]:
    """The JSON answer, its rows encoded a few at a time (``PIECE_VALUES`` values, ~1-2 ms of
    GIL each): one encoder call for a 4096-row, k=1000 answer (113 MB) held the GIL for
    ~0.6 s, and with it the event loop of the process (other requests, health checks)."""
    k = result.token_ids.shape[-1]
    rows = result.token_ids.size // max(1, k)
    leading = list(result.token_ids.shape[:-1])
    head = json_bytes({**identity(result.head), "k": k, "shape": leading} | shaping(result))
    step = max(1, PIECE_VALUES // max(1, k))
    fragments: list[Piece] = [head[:-1] + b',"results":[']
    for start in range(0, rows, step):
        items = json_bytes(_topk_items(result, start, min(rows, start + step)))
        fragments += [b"," if start else b"", memoryview(items)[1:-1]]  # no brackets
    return joined([*fragments, b"]}"])


def _topk_items(result: TopKResult, start: int, stop: int) -> list[dict[str, Any]]:
    """The answer's rows ``start`` to ``stop`` (flattened), one object each."""
    k = result.token_ids.shape[-1]
    ids = result.token_ids.reshape(-1, k)[start:stop]
    values = result.logits.reshape(-1, k)[start:stop]
    logprobs = None if result.logprobs is None else result.logprobs.reshape(-1, k)[start:stop]
    sampled = result.sampled
    draws = None if sampled is None else sampled.n
    width = 1 if draws is None else draws
    drawn = None
    if sampled is not None:  # one per row, or a list of n (``sample.n``)
        drawn = sampled.token_ids.reshape(-1, width)[start:stop]
        drawn_logprobs = sampled.logprobs.reshape(-1, width)[start:stop]
    tokens = None if result.tokens is None else result.tokens[start:stop]  # the piece's rows
    items = []
    for offset, row_ids in enumerate(ids.tolist()):  # one tolist for the piece: 3x cheaper
        row = start + offset
        item: dict[str, Any] = {"token_ids": row_ids, "logits": values[offset]}
        if logprobs is not None:
            item["logprobs"] = logprobs[offset]
        if tokens is not None:
            item["tokens"] = tokens[offset]
        if sampled is not None and drawn is not None and draws is None:
            item["sampled_token_id"] = int(drawn[offset, 0])
            item["sampled_logprob"] = float(drawn_logprobs[offset, 0])
            if sampled.tokens is not None:
                item["sampled_token"] = sampled.tokens[row]
        elif sampled is not None and drawn is not None:
            item["sampled_token_ids"] = drawn[offset]
            item["sampled_logprobs"] = drawn_logprobs[offset]
            if sampled.tokens is not None:
                item["sampled_tokens"] = sampled.tokens[row]
        items.append(item)
    return items


def shaping(result: TopKResult) -> dict[str, Any]:
    """What a shaped answer says about itself (nothing for a plain top-k)."""
    extra: dict[str, Any] = {}
    if result.logprobs_over != "vocabulary":
        extra["logprobs_over"] = result.logprobs_over
    if result.sampled is not None:
        extra["seed"] = result.sampled.seed
    if result.logprobs_mode is not None:
        extra["logprobs_mode"] = result.logprobs_mode
    return extra


def topk_records(result: TopKResult) -> npt.NDArray[Any]:
    k = result.token_ids.shape[-1]
    fields: list[tuple[str, Any, tuple[int]]] = [
        ("token_ids", np.int64, (k,)),
        ("logits", np.float32, (k,)),
    ]
    if result.logprobs is not None:
        fields.append(("logprobs", np.float32, (k,)))
    sampled = result.sampled
    if sampled is not None and sampled.n is None:
        fields += [("sampled_token_id", np.int64, ()), ("sampled_logprob", np.float32, ())]  # type: ignore[list-item]
    elif sampled is not None and sampled.n is not None:
        n = (sampled.n,)
        fields += [("sampled_token_ids", np.int64, n), ("sampled_logprobs", np.float32, n)]
    records = np.empty(result.token_ids.shape[:-1], dtype=np.dtype(fields))
    records["token_ids"] = result.token_ids
    records["logits"] = result.logits
    if result.logprobs is not None:
        records["logprobs"] = result.logprobs
    if sampled is not None:
        plural = "s" if sampled.n is not None else ""
        records[f"sampled_token_id{plural}"] = sampled.token_ids
        records[f"sampled_logprob{plural}"] = sampled.logprobs
    return records


def score_json(result: ScoreResult) -> list[Piece]:
    """``/score``'s JSON answer: per row its target's logit, log-prob and rank, then the
    candidates and alternatives asked for, each written a piece of rows at a time."""
    rows = len(result.logit)
    head = json_bytes(
        {
            **identity(result.head),
            "nll": result.nll,
            "perplexity": result.perplexity,
            "logprobs_over": result.logprobs_over,
        }
    )
    fragments: list[Piece] = [head[:-1], b',"results":[']
    fragments += _pieces(
        rows,
        1,
        lambda start, stop: [
            {"logit": logit, "logprob": logprob, "rank": rank}
            for logit, logprob, rank in zip(
                result.logit[start:stop].tolist(),
                result.logprob[start:stop].tolist(),
                result.rank[start:stop].tolist(),
                strict=True,
            )
        ],
    )
    fragments.append(b"]")
    for name, found in (("candidates", result.candidates), ("alternatives", result.alternatives)):
        if found is not None:
            fragments += [b',"' + name.encode() + b'":[', *_scores(found), b"]"]
    return joined([*fragments, b"}"])


def _scores(found: CandidateScores) -> list[Piece]:
    width = found.ids.shape[-1] if found.ids.ndim > 1 else 1
    return _pieces(
        len(found.ids),
        width,
        lambda start, stop: [
            {"ids": ids, "logits": logits, "logprobs": logprobs}
            for ids, logits, logprobs in zip(
                found.ids[start:stop],
                found.logits[start:stop],
                found.logprobs[start:stop],
                strict=True,
            )
        ],
    )


def _pieces(rows: int, width: int, items: Callable[[int, int], list[Any]]) -> list[Piece]:
    """The JSON of ``items(start, stop)`` for every piece of rows, comma-separated, without
    brackets."""
    step = max(1, PIECE_VALUES // max(1, width))
    fragments: list[Piece] = []
    for start in range(0, rows, step):
        encoded = json_bytes(items(start, min(rows, start + step)))
        fragments += [b"," if start else b"", memoryview(encoded)[1:-1]]
    return fragments
