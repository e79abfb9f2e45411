"""``/verify`` of a chain, or of a tree whose drafts are taken as certain, reading only what
the rule reads: each draft's target probability (in its parent's distribution; the draft's
too, from ``draft_probs`` or a ``draft_model``, on a chain), and each sequence's
distribution whole where it stops alone: one row per sequence, not K + 1 (a tree's: the node
its walk ended at, its rejected children's tokens removed).

Every position runs through the head once, with its full logits (``verify_rows.read``: the
graph's own log-sum-exp where the distribution is the head's own at a temperature, the
decoding step's run where any option shapes it), so nothing is projected twice and no
(rows x vocab) probabilities are made. A greedy verification of the head's own distribution
reads the top-1 graph alone. The rule is ``service.runtime.verification``'s: ``chain_accepted``
and ``chain_emitted`` (``chain_verdict``'s draw, what ``verify_chain`` calls, a few sequences
at a time: their stopping rows made below the mmap threshold in a reused buffer),
``tree_walk`` and ``tree_verdict`` (the walk of ``verify_tree`` without a draft distribution,
from p at the drafts), ``greedy_of_top``.
A tree with a draft distribution stays on the dense path (``plane.verify``): each rejection
there makes a residual of a whole row, at every node the walk passes.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import numpy.typing as npt

from service.errors import InvalidInput
from service.plane.verify_checks import CheckedVerify, draft_shape
from service.plane.verify_rows import Rows, raw_width, read
from service.repository.loaded_version import LoadedVersion
from service.runtime.processors import LogprobsMode
from service.runtime.verification import (
    Verdict,
    chain_accepted,
    chain_assembled,
    chain_emitted,
    chain_parents,
    greedy_of_top,
    tree_verdict,
    tree_walk,
    uniforms,
)
from service.runtime.vocabulary import CHUNK_BYTES, Floats, Ids, Shape
from service.verify_messages import VerifyResult


async def verify_by_reads(
    model: LoadedVersion,
    hidden: Floats,
    checked: CheckedVerify,
    draft: LoadedVersion | None = None,
    draft_states: Floats | None = None,
) -> VerifyResult:
    """``hidden``: final states (S, K + 1, d_model); ``draft_states`` the draft head's final
    states (S, K, its d_model) when ``draft`` is named (a chain); the rest as
    ``CheckedVerify`` (``parents``: a tree of drafts taken as certain)."""
    sequences, positions = hidden.shape[:2]
    shape = checked.shape or Shape()
    mode: LogprobsMode = "raw" if shape.processors is None else shape.processors.logprobs_mode
    plain = raw_width(shape, model.vocab_size)[1] == 1
    if checked.greedy and plain and draft is None:
        return await _greedy_top1(model, hidden, checked)
    temperature = checked.temperature
    drafted = None
    if draft is not None and draft_states is not None:
        rows = draft_states.reshape(-1, draft.d_model)
        shaped = draft_shape(checked)
        drafted = Rows(*await read(draft, rows, positions - 1, temperature, shaped))
    states = hidden.reshape(-1, model.d_model)
    target = Rows(*await read(model, states, positions, temperature, shape))
    loop = asyncio.get_running_loop()
    args = (target, drafted, checked, mode == "processed", draft)
    verdict, logprobs = await loop.run_in_executor(model.runner.executor, _decide, *args)
    return _result(model, verdict, logprobs, checked.seeds, mode)


def _decide(
    target: Rows,
    drafted: Rows | None,
    checked: CheckedVerify,
    processed: bool,
    draft: LoadedVersion | None,
) -> tuple[Verdict, npt.NDArray[np.float32]]:
    """The rule over what it reads (in the inference executor), and the tokens' log-probs."""
    draft_ids, parents = checked.draft_ids, checked.parents
    sequences, k = draft_ids.shape
    every = np.arange(sequences)
    tree = chain_parents(k) if parents is None else parents
    rows = (every[:, None] * (k + 1) + tree[None, :] + 1).reshape(-1)  # each draft's parent's
    tokens = draft_ids.reshape(-1)
    q_x = _draft_at(drafted, checked, draft, tokens)  # refused first when a draft has no mass
    if checked.greedy:
        verdict = greedy_of_top(target.top.reshape(sequences, k + 1), draft_ids, parents)
    else:
        p_x = target.probs(rows, tokens).reshape(sequences, k)
        u = uniforms(checked.seeds.tolist(), k + 1)
        if parents is not None:  # drafts taken as certain (a draft distribution: dense)
            walk = tree_walk(p_x, draft_ids, parents, u)
            p_rows = target.whole(every * (k + 1) + walk.current + 1)
            verdict = tree_verdict(p_rows, draft_ids, parents, walk, u)
        else:
            verdict = _chain(target, drafted, checked, p_x, q_x, u)
    base = target.kept_lse if processed else target.lse
    listed = verdict.token_ids >= 0
    at = (every[:, None] * (k + 1) + verdict.positions)[listed]
    logprobs = np.full(verdict.token_ids.shape, np.nan, np.float32)
    if checked.greedy:  # the top's own value where the top was chosen
        logprobs[listed] = target.top_value[at] - base[at]
    else:
        logprobs[listed] = target.values(at, verdict.token_ids[listed]) - base[at]
    return verdict, logprobs


def _chain(
    target: Rows,
    drafted: Rows | None,
    checked: CheckedVerify,
    p_x: npt.NDArray[np.float64],
    q_x: npt.NDArray[np.float64] | None,
    u: npt.NDArray[np.float64],
) -> Verdict:
    """A chain's verdict: the drafts accepted, then the stopping rows (the target's, and the
    draft's where a sequence rejects and a draft distribution is given) for the emitted
    token, a few sequences at a time: each chunk's rows below the mmap threshold the service
    fixes (``allocator.settle_allocator``), in buffers reused chunk by chunk, where whole
    (sequences x vocab) rows were fresh mappings faulted in on every request."""
    draft_ids = checked.draft_ids
    sequences, k = draft_ids.shape
    accepted = chain_accepted(p_x, q_x, u)
    emitted = np.zeros(sequences, np.int64)
    step = max(1, CHUNK_BYTES // (4 * max(1, target.vocab)))
    p_buffer = np.empty((min(step, sequences), target.vocab), np.float32)
    given = checked.draft_probs is not None or drafted is not None
    q_buffer = np.empty_like(p_buffer) if given else None
    for start in range(0, sequences, step):
        every = np.arange(start, min(start + step, sequences))
        p_rows = target.whole(every * (k + 1) + accepted[every], p_buffer)
        rejected = every[accepted[every] < k]
        stop = np.minimum(accepted[rejected], k - 1)
        q_rows = None
        if checked.draft_probs is not None and q_buffer is not None:
            q_rows = q_buffer[: len(rejected)]
            for at, (row, position) in enumerate(
                zip(rejected.tolist(), stop.tolist(), strict=True)
            ):
                q_rows[at] = checked.draft_probs[row, position]
        elif drafted is not None:
            q_rows = drafted.whole(rejected * k + stop, q_buffer)
        ids, got, chunk_u = draft_ids[every], accepted[every], u[every]
        emitted[every] = chain_emitted(p_rows, q_rows, ids, got, chunk_u)
    return chain_assembled(draft_ids, accepted, emitted)


def _draft_at(
    drafted: Rows | None, checked: CheckedVerify, draft: LoadedVersion | None, tokens: Ids
) -> npt.NDArray[np.float64] | None:
    """The draft's probability of each draft (None: taken as certain); a draft_model that
    gives a draft no mass under the options is refused, naming the draft."""
    draft_ids = checked.draft_ids
    if checked.draft_probs is not None:
        own = np.take_along_axis(checked.draft_probs, draft_ids[:, :, None], axis=2)[:, :, 0]
        return own.astype(np.float64)
    if drafted is None or draft is None:
        return None
    q_x = drafted.probs(np.arange(draft_ids.size), tokens).reshape(draft_ids.shape)
    if (q_x <= 0).any():
        s, k = (int(i) for i in np.argwhere(q_x <= 0)[0])
        raise InvalidInput(
            f"draft_token_ids[{s}][{k}]: draft_model {draft.name} gives token "
            f"{int(draft_ids[s, k])} probability 0 under these options"
        )
    return q_x


async def _greedy_top1(
    model: LoadedVersion, hidden: Floats, checked: CheckedVerify
) -> VerifyResult:
    """Greedy over the head's own distribution: every position's top token and its raw
    log-prob from the top-1 graph; no full logits leave the session."""
    sequences, positions = hidden.shape[:2]
    rows = hidden.reshape(-1, model.d_model)
    projection = await model.project(rows, 1, temperature=checked.temperature)
    top = projection.topk_token_ids.reshape(sequences, positions)
    verdict = greedy_of_top(top, checked.draft_ids, checked.parents)
    raw = projection.topk_logprobs.reshape(sequences, positions)
    at = np.maximum(verdict.positions, 0)
    picked = np.take_along_axis(raw, at, axis=1)
    logprobs = np.where(verdict.token_ids >= 0, picked, np.nan)
    return _result(model, verdict, logprobs, checked.seeds, "raw")


def _result(
    model: LoadedVersion,
    verdict: Verdict,
    logprobs: npt.NDArray[np.floating[Any]],
    seeds: Ids,
    mode: LogprobsMode,
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
        mode,
    )
