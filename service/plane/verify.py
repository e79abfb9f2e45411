"""Speculative verification in the data plane: one projection of every position of every
sequence (the inputs checked first by ``service.plane.verify_checks``), the target's processed
distribution, and the exact rule (``service.runtime.verification``).

The target distribution is the decoding step's, not a second copy of it: each run's full
logits go through ``service.runtime.step.step_run`` (bias and bans, every processor, the
temperature, the filters of ``sample``), so verification accepts against exactly what a
plain step would sample from (vllm #9834 was sampling options left out of verification).
``draft_probs`` are taken as the distribution the drafter sampled from, as sent: the rule is
exact only for that distribution, so the options are not applied to it a second time.

Sequences' uniforms come from their seeds (``verification.uniforms``), so a sequence's
answer depends on its seed and its own rows alone. ``temperature`` 0 (or ``sample``'s) is
greedy: the top token of the processed logits, ties to the lower id, as ``/topk``.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np

from service.errors import InvalidInput
from service.plane.lens import final_states
from service.plane.verify_checks import CheckedVerify, draft_shape
from service.plane.verify_plain import verify_by_reads
from service.repository.loaded_version import LoadedVersion
from service.runtime.filters import filtered_prefix
from service.runtime.processors import Processors
from service.runtime.step import columns, step_run
from service.runtime.verification import (
    Verdict,
    uniforms,
    verify_chain,
    verify_greedy,
    verify_tree,
)
from service.runtime.vocabulary import Floats, Shape, top_sorted
from service.verify_messages import VerifyResult

#: The prefix each row's processed distribution is ranked to before a row is sorted whole.
WIDTH = 64


async def with_draft(draft: LoadedVersion, checked: CheckedVerify, states: Floats) -> CheckedVerify:
    """The draft's distribution from its head (``states``: its final states), shaped by the
    same options as the target's; each draft must have had a chance to be sampled there."""
    rows = states.reshape(-1, draft.d_model)
    _, probs = await _runs(draft, rows, checked, draft_shape(checked))
    probs = probs.reshape(*checked.draft_ids.shape, -1)
    own = np.take_along_axis(probs, checked.draft_ids[:, :, None], axis=2)[:, :, 0]
    if (own <= 0).any():
        s, k = (int(i) for i in np.argwhere(own <= 0)[0])
        raise InvalidInput(
            f"draft_token_ids[{s}][{k}]: draft_model {draft.name} gives token "
            f"{int(checked.draft_ids[s, k])} probability 0 under these options"
        )
    return replace(checked, draft_probs=probs)


async def run(
    model: LoadedVersion, drafts: list[LoadedVersion], checked: CheckedVerify, residual: bool
) -> VerifyResult:
    """The request's rows as final states (through the norm when ``residual``); a chain,
    or a tree of drafts taken as certain, read where the rule reads (``verify_plain``); a
    tree with a draft distribution through every position's whole row (``dense``), the
    draft head's distribution when one is named, then ``verify``."""
    hidden = await final_states(model, checked.hidden, residual)
    if not checked.dense:  # what the rule reads alone (``verify_plain``)
        draft = drafts[0] if drafts else None
        states = None
        if draft is not None and checked.draft_hidden is not None:
            states = await final_states(draft, checked.draft_hidden, residual)
        return await verify_by_reads(model, hidden, checked, draft, states)
    for draft in drafts:
        if checked.draft_hidden is not None:
            states = await final_states(draft, checked.draft_hidden, residual)
            checked = await with_draft(draft, checked, states)
    return await verify(model, checked, hidden.reshape(-1, model.d_model))


async def verify(model: LoadedVersion, checked: CheckedVerify, hidden: Floats) -> VerifyResult:
    """One projection of every position (``hidden``: final states, (S * (K + 1), d_model)),
    run by run, each run's processed distribution in the inference executor; then the rule."""
    sequences, positions = checked.hidden.shape[:2]
    shape = checked.shape or Shape()
    processors = shape.processors or Processors()
    raw, probs = await _runs(model, hidden, checked, shape)
    loop = asyncio.get_running_loop()
    raw3 = raw.reshape(sequences, positions, -1)
    probs3 = probs.reshape(sequences, positions, -1)
    verdict = await loop.run_in_executor(model.runner.executor, _verdict, raw3, probs3, checked)
    mode = processors.logprobs_mode
    with np.errstate(divide="ignore"):
        chosen = raw3 if mode == "raw" else np.log(probs3)
    rows = np.arange(sequences)[:, None]
    safe_positions = np.maximum(verdict.positions, 0)
    safe_tokens = np.maximum(verdict.token_ids, 0)
    logprobs = np.where(
        verdict.token_ids >= 0, chosen[rows, safe_positions, safe_tokens], np.float32(np.nan)
    ).astype(np.float32)
    tokens = np.where(verdict.token_ids >= 0, model.space.original(safe_tokens), -1)
    return VerifyResult(
        model.info,
        verdict.accepted,
        tokens.astype(np.int64),
        logprobs,
        verdict.nodes,
        checked.seeds,
        mode,
    )


async def _runs(
    model: LoadedVersion, hidden: Floats, checked: CheckedVerify, shape: Shape
) -> tuple[Floats, Floats]:
    """Every row's raw log-probs and processed probabilities (rows, vocab), run by run."""
    processors = shape.processors or Processors()
    raw = np.empty((len(hidden), model.vocab_size), np.float32)
    probs = np.empty_like(raw)
    loop = asyncio.get_running_loop()
    step = model.rows_per_run
    for start in range(0, len(hidden), step):
        stop = min(start + step, len(hidden))
        projection = await model.project(
            hidden[start:stop], 1, temperature=checked.temperature, full_logits=True
        )
        assert projection.logits is not None
        args = (projection.logits, checked, processors.part(start, stop), shape)
        part = await loop.run_in_executor(model.runner.executor, _distribution, *args)
        raw[start:stop], probs[start:stop] = part
    return raw, probs


def _distribution(
    logits: Floats, checked: CheckedVerify, processors: Processors, shape: Shape
) -> tuple[Floats, Floats]:
    """A run's raw log-probs (every processor and the temperature) and processed
    probabilities (the filters too), from the decoding step's own run."""
    vocab = logits.shape[1]
    spec = shape.sample
    width = min(vocab, max(WIDTH, spec.top_k or 0) if spec is not None else WIDTH)
    run = step_run(logits, checked.temperature, processors, shape.bias, spec, width, None)
    logits -= run.lse[:, None]  # the raw log-probs, in place
    if not checked.filtered:
        return logits, np.exp(logits)
    assert spec is not None
    kept = np.zeros(logits.shape, np.bool_)
    inside = ~run.keep[:, -1] | (width >= vocab)
    rows = np.flatnonzero(inside)
    picked = np.where(run.keep[rows], run.ids[rows], run.ids[rows, :1])
    kept[rows[:, None], picked] = True
    for row in np.flatnonzero(~inside).tolist():  # the kept set may reach past the prefix
        ranked, order = top_sorted(logits[row : row + 1], columns(vocab), vocab)
        whole = filtered_prefix(ranked, np.zeros(1, np.float32), spec, processors.order, vocab)
        kept[row, order[0, whole.keep[0]]] = True
    shift = (run.kept_lse - run.lse)[:, None]  # log of the kept mass
    with np.errstate(over="ignore"):
        probs = np.where(kept, np.exp(logits - shift), np.float32(0.0))
    return logits, probs.astype(np.float32)


def _verdict(raw: Floats, probs: Floats, checked: CheckedVerify) -> Verdict:
    """The rule the inputs ask for (``service.runtime.verification``)."""
    nodes = checked.draft_ids.shape[1]
    if checked.greedy:
        return verify_greedy(raw, checked.draft_ids, checked.parents)
    u = uniforms(checked.seeds.tolist(), nodes + 1)
    if checked.parents is not None:
        return verify_tree(probs, checked.draft_ids, checked.parents, u, checked.draft_probs)
    return verify_chain(probs, checked.draft_ids, u, checked.draft_probs)
