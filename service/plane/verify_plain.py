"""``/verify``'s fast path: a chain whose target is the head's own distribution at a
temperature (no bias, bans, filters or processors), where the rule reads far less than every
position's whole row.

The rule needs each draft's target probability, ``exp(logit(x) / T - lse)``, and a whole row
only where a sequence stops: one row per sequence, not K + 1. So the positions run through
the head's top-1 graph (its log-sum-exp and top token, as ``/topk``: no (rows x vocab) array
leaves the session), the drafts' logits come from their rows of W (``candidate_logits``),
and the full logits are fetched for the S stopping rows alone. Greedy needs the top tokens
only. The rule is ``service.runtime.verification``'s, the same functions the dense path
calls (``chain_accepted``, ``chain_verdict``, ``greedy_of_top``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import numpy.typing as npt

from service.plane.distribution import candidate_logits
from service.repository.loaded_version import LoadedVersion
from service.runtime.verification import (
    Verdict,
    chain_accepted,
    chain_verdict,
    greedy_of_top,
    uniforms,
)
from service.runtime.vocabulary import Floats, Ids
from service.verify_messages import VerifyResult


async def plain_chain(
    model: LoadedVersion,
    hidden: Floats,
    draft_ids: Ids,
    draft_probs: npt.NDArray[np.float32] | None,
    seeds: Ids,
    temperature: float,
    greedy: bool,
) -> VerifyResult:
    """``hidden``: final states (S, K + 1, d_model); the rest as ``verify.CheckedVerify``."""
    sequences, positions = hidden.shape[:2]
    k = positions - 1
    every = np.arange(sequences)
    rows = hidden.reshape(-1, model.d_model)
    projection = await model.project(rows, 1, temperature=temperature)
    lse = projection.logsumexp.reshape(sequences, positions)
    top = projection.topk_token_ids.reshape(sequences, positions)
    if greedy:  # every token is its position's top: its log-prob is the top's
        verdict = greedy_of_top(top, draft_ids)
        raw = projection.topk_logprobs.reshape(sequences, positions)
        listed = verdict.token_ids >= 0
        logprobs = np.where(listed, raw[every[:, None], np.maximum(verdict.positions, 0)], np.nan)
        return _result(model, verdict, logprobs, seeds)
    drafted = hidden[:, :k].reshape(-1, model.d_model)
    found = await candidate_logits(model, drafted, draft_ids.reshape(-1, 1), temperature)
    raw_x = found.reshape(sequences, k) - lse[:, :k]
    u = uniforms(seeds.tolist(), k + 1)
    q_x = None
    if draft_probs is not None:
        q_x = np.take_along_axis(draft_probs, draft_ids[:, :, None], axis=2)[:, :, 0]
    accepted = chain_accepted(np.exp(raw_x.astype(np.float64)), q_x, u)
    stopping = np.ascontiguousarray(hidden[every, accepted])
    whole = await model.project(stopping, 1, temperature=temperature, full_logits=True)
    assert whole.logits is not None
    raw_rows = whole.logits - whole.logsumexp[:, None]
    stop = np.minimum(accepted, k - 1)
    q_rows = None if draft_probs is None else draft_probs[every, stop]
    loop = asyncio.get_running_loop()
    verdict = await loop.run_in_executor(
        model.runner.executor, _verdict, raw_rows, q_rows, draft_ids, accepted, u
    )
    columns = np.arange(k + 1)[None, :]
    drafts = np.take_along_axis(raw_x, np.minimum(columns, k - 1), axis=1)
    emitted = raw_rows[every, np.maximum(verdict.token_ids[every, accepted], 0)]
    logprobs = np.where(columns < accepted[:, None], drafts, np.nan)
    logprobs[every, accepted] = emitted
    return _result(model, verdict, logprobs, seeds)


def _verdict(
    raw_rows: Floats,
    q_rows: Floats | None,
    draft_ids: Ids,
    accepted: Ids,
    u: npt.NDArray[np.float64],
) -> Verdict:
    """The stopping rows' probabilities (float64) and the rule's draw from them."""
    return chain_verdict(np.exp(raw_rows.astype(np.float64)), q_rows, draft_ids, accepted, u)


def _result(
    model: LoadedVersion, verdict: Verdict, logprobs: npt.NDArray[np.floating[Any]], seeds: Ids
) -> VerifyResult:
    listed = verdict.token_ids >= 0
    tokens = np.where(listed, model.space.original(np.maximum(verdict.token_ids, 0)), -1)
    return VerifyResult(
        model.info,
        verdict.accepted,
        tokens.astype(np.int64),
        logprobs.astype(np.float32),
        verdict.nodes,
        seeds,
        "raw",
    )
