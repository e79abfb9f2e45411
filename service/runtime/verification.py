"""Speculative decoding's verification, exactly: which drafted tokens a target distribution
accepts, and the one token it emits after them (Leviathan et al. 2023; Chen et al. 2023).

The caller hands in the target's processed distribution at every drafted position and one
more (``target``: sequences x positions x vocab probabilities, from the decoding step's
processed log-probs: the same temperature, filters and processors a plain step applies, so
verification never samples from a distribution the step would not), the drafted ids, the
draft's distribution or none, and uniforms. Nothing here projects, filters or reads a seed's
meaning: the rule alone, so a test can run it over hundreds of thousands of verifications.

The rules:

* **Chain with a draft distribution** ``q``: draft i is accepted when ``u_i * q(x_i) <
  p(x_i)`` (probability ``min(1, p/q)``, u uniform in [0, 1) in float64: float32 can round to
  exactly 0); at the first rejection the emitted token is drawn from ``max(0, p - q)``
  renormalized; when all K are accepted, from ``p`` at position K + 1 (the bonus token).
* **Chain without one** (n-gram, prompt lookup, greedy drafters): ``q`` is one-hot, so draft i
  is accepted with probability ``p(x_i)`` and the residual ``max(0, p - onehot)`` is ``p``
  with ``x_i`` removed. Nothing of the size of the vocabulary is built for ``q``.
* **Trees** (Medusa, EAGLE; drafts taken as certain): ``parents[j]`` is node j's parent (-1:
  a child of the root, else an earlier node). From the root, a node's children are tried in
  index order against the residual: child x is accepted with probability ``r(x) / sum(r)``;
  a rejected child's mass is removed from ``r``. The walk moves to an accepted child (its own
  distribution, ``target[:, j + 1]``) and ends at a node whose children were all rejected;
  the emitted token is drawn from what is left of that node's residual. Each step draws the
  next token from exactly ``p`` (a draw without replacement, stopped at the first hit), so the
  walk is exact whatever the tree. A chain is the tree whose node i has parent i - 1.
  Drafts taken as certain need p at each draft in its parent's distribution and one whole
  row, where the walk ends (``tree_walk``, ``tree_verdict``: what ``plane.verify_plain``
  reads); with a draft distribution each rejection's residual is a whole row.
* **Greedy** (temperature 0): a draft is accepted while it equals the target's top token
  (ties: the lower id, as ``/topk``), and the top token at the stopping position is emitted:
  exactly what greedy decoding of the same states emits, one token per position.

Draws invert the CDF in id order (no sort of the vocabulary). Uniforms: column j < K (or
< nodes) is draft j's test, the last column the emitted token's draw; ``uniforms`` makes
them per sequence from its seed (Philox keyed by the seed, as ``SampleSpec.uniforms``), so a
sequence's answer depends on its seed and its own rows alone, never on the batch.

Positions loop in Python only over drafted nodes (K, or a tree's nodes: a few dozen at
most); every step is vectorized over the sequences, and nothing loops over the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

Probs = npt.NDArray[np.floating[Any]]
Doubles = npt.NDArray[np.float64]
Ids = npt.NDArray[np.int64]
Flags = npt.NDArray[np.bool_]


@dataclass(frozen=True)
class Verdict:
    """Per sequence: ``accepted`` drafts (S,); ``token_ids`` (S, depth + 1): the accepted
    drafts then the emitted token, -1 after it; ``positions`` (S, depth + 1): the target
    position each token was chosen at (its log-prob is ``target[s, position, token]``), -1
    after; ``nodes`` (S, depth): the accepted drafted nodes' indices (a chain's are 0..a-1),
    -1 after. ``depth`` is K for a chain, the tree's deepest path for a tree."""

    accepted: Ids
    token_ids: Ids
    positions: Ids
    nodes: Ids


def uniforms(seeds: Sequence[int], count: int) -> Doubles:
    """(sequences, count) float64 uniforms in [0, 1): row s is the first ``count`` values
    of Philox keyed by ``seeds[s]``, so a sequence draws the same whatever else is sent."""
    rows = [np.random.Generator(np.random.Philox(key=seed)).random(count) for seed in seeds]
    return np.stack(rows) if rows else np.zeros((0, count))


def chain_parents(k: int) -> Ids:
    """The parents of a chain of ``k`` drafts: node i follows node i - 1."""
    return np.arange(-1, k - 1, dtype=np.int64)


def depths(parents: Ids) -> Ids:
    """Each node's depth (1 for a child of the root); ``parents`` checked by the caller
    (every parent -1 or an earlier node)."""
    depth = np.zeros(len(parents), np.int64)
    for node, parent in enumerate(parents.tolist()):
        depth[node] = 1 if parent < 0 else depth[parent] + 1
    return depth


#: Tokens a draw's first look sums together: the block holding the draw is found from the
#: blocks' totals, then searched alone (a cumulative sum of every column cost ~30 ms for 64
#: rows of 128256 in float64; the blocks' sums ~8).
BLOCK = 256


def _draw(weights: Probs, u: Doubles) -> Ids:
    """One index per row of non-negative ``weights`` (S, V), by inverting the row's CDF in id
    order at ``u`` times its total (sums in float64 whatever the weights' dtype); an index
    always has weight > 0 (a row of zeros, which the rules never reach but rounding might,
    draws its last index). The CDF is walked in blocks of ``BLOCK`` columns: the blocks'
    totals find the block, one cumulative sum inside it the index."""
    rows, vocab = weights.shape
    full = vocab // BLOCK
    sums = np.zeros((rows, full + 1), np.float64)
    if full:
        body = weights[:, : full * BLOCK].reshape(rows, full, BLOCK)
        sums[:, :full] = body.sum(axis=2, dtype=np.float64)
    sums[:, full] = weights[:, full * BLOCK :].sum(axis=1, dtype=np.float64)
    cumulative = np.cumsum(sums, axis=1)
    target = u * cumulative[:, -1]
    block = np.minimum((cumulative <= target[:, None]).sum(axis=1), full)
    every = np.arange(rows)
    before = np.where(block > 0, cumulative[every, np.maximum(block - 1, 0)], 0.0)
    columns = block[:, None] * BLOCK + np.arange(BLOCK)[None, :]
    inside = columns < vocab
    segment = np.where(inside, weights[every[:, None], np.minimum(columns, vocab - 1)], 0.0)
    walked = np.cumsum(segment.astype(np.float64), axis=1)
    step = (walked <= (target - before)[:, None]).sum(axis=1)
    index: Ids = (block * BLOCK + step).astype(np.int64)
    for row in np.flatnonzero((step >= BLOCK) | (index >= vocab)).tolist():  # rounding
        positive = np.flatnonzero(weights[row, : min(vocab, (int(block[row]) + 1) * BLOCK)] > 0)
        if not len(positive):
            positive = np.flatnonzero(weights[row] > 0)
        index[row] = positive[-1] if len(positive) else vocab - 1
    return index


def _assemble(path: Ids, path_tokens: Ids, accepted: Ids, emitted: Ids, at: Ids) -> Verdict:
    """The verdict from each sequence's accepted nodes (S, depth; -1 after), their tokens,
    the emitted token and the position it was chosen at."""
    rows, depth = path.shape
    columns = np.arange(depth + 1)
    token_ids = np.full((rows, depth + 1), -1, np.int64)
    positions = np.full((rows, depth + 1), -1, np.int64)
    token_ids[:, :depth] = np.where(path >= 0, path_tokens, -1)
    positions[:, 1 : depth + 1] = np.where(path >= 0, path + 1, -1)
    positions[:, 0] = 0
    emit = columns[None, :] == accepted[:, None]
    token_ids = np.where(emit, emitted[:, None], token_ids)
    positions = np.where(emit, at[:, None], positions)
    return Verdict(accepted, token_ids, positions, path)


def verify_chain(target: Probs, draft_ids: Ids, u: Doubles, draft: Probs | None = None) -> Verdict:
    """A chain of K drafts per sequence: ``target`` (S, K + 1, V) probabilities, ``draft_ids``
    (S, K), ``u`` (S, K + 1), ``draft`` (S, K, V) or None (one-hot). The caller has checked
    that every draft gives its own token a probability above 0."""
    rows, k = draft_ids.shape
    every = np.arange(rows)
    p_x = np.take_along_axis(target[:, :k], draft_ids[:, :, None], axis=2)[:, :, 0]
    q_x = None
    if draft is not None:
        q_x = np.take_along_axis(draft, draft_ids[:, :, None], axis=2)[:, :, 0]
    accepted = chain_accepted(p_x, q_x, u)
    stop = np.minimum(accepted, k - 1) if k else accepted
    q_rows = None if draft is None or not k else draft[every, stop]
    return chain_verdict(target[every, accepted], q_rows, draft_ids, accepted, u)


def chain_accepted(p_x: Probs, q_x: Probs | None, u: Doubles) -> Ids:
    """How many drafts each sequence accepts: ``p_x`` (S, K) the target's probability of
    each draft, ``q_x`` the draft's (None: one-hot, 1), ``u`` (S, K + 1)."""
    k = p_x.shape[1]
    q = 1.0 if q_x is None else q_x.astype(np.float64)
    passed = u[:, :k] * q < p_x.astype(np.float64)
    accepted: Ids = np.cumprod(passed, axis=1).sum(axis=1).astype(np.int64)
    return accepted


def chain_verdict(
    p_rows: Probs, q_rows: Probs | None, draft_ids: Ids, accepted: Ids, u: Doubles
) -> Verdict:
    """The emitted token and the verdict, from each sequence's target row at its stopping
    position (``p_rows`` (S, V)) and the draft's there (``q_rows``; None: one-hot): the
    residual ``max(0, p - q)`` where a draft was rejected, ``p`` itself after all K."""
    rows, k = draft_ids.shape
    every = np.arange(rows)
    stop = np.minimum(accepted, k - 1) if k else accepted
    weights = p_rows
    rejected = accepted < k
    if k and rejected.any():
        if q_rows is None:  # one-hot q: max(0, p - onehot) is p with the draft removed
            residual = weights.copy()
            residual[every, draft_ids[every, stop]] = 0.0
        else:
            residual = np.maximum(weights - q_rows, 0)
        weights = np.where(rejected[:, None], residual, weights)
    return chain_assembled(draft_ids, accepted, _draw(weights, u[:, k]))


def chain_emitted(
    p_rows: Probs, q_rejected: Probs | None, draft_ids: Ids, accepted: Ids, u: Doubles
) -> Ids:
    """``chain_verdict``'s emitted tokens, the residuals made in ``p_rows`` itself (float32,
    overwritten): ``q_rejected`` holds the draft's rows of the rejecting sequences alone, in
    their order, of ``p_rows``' dtype (None: one-hot). Each sequence's token depends on its
    own rows alone, so a caller may hand its sequences in a few at a time (each chunk's rows
    below the mmap threshold) and gets the tokens ``chain_verdict`` draws, from the same
    float32 residuals."""
    k = draft_ids.shape[1]
    rejected = np.flatnonzero(accepted < k) if k else np.zeros(0, np.int64)
    if len(rejected):
        stop = np.minimum(accepted[rejected], k - 1)
        if q_rejected is None:  # one-hot q: the draft's token removed
            p_rows[rejected, draft_ids[rejected, stop]] = 0.0
        else:  # row by row in place: no temporary of the rows' size
            for at, row in enumerate(rejected.tolist()):
                np.subtract(p_rows[row], q_rejected[at], out=p_rows[row])
                np.maximum(p_rows[row], 0, out=p_rows[row])
    return _draw(p_rows, u[:, k])


def chain_assembled(draft_ids: Ids, accepted: Ids, emitted: Ids) -> Verdict:
    """A chain's verdict from its accepted counts and emitted tokens."""
    k = draft_ids.shape[1]
    path = np.where(np.arange(k)[None, :] < accepted[:, None], np.arange(k)[None, :], -1)
    return _assemble(path.astype(np.int64), draft_ids, accepted, emitted, accepted)


def verify_tree(
    target: Probs, draft_ids: Ids, parents: Ids, u: Doubles, draft: Probs | None = None
) -> Verdict:
    """A tree of N drafted nodes per sequence: ``target`` (S, N + 1, V) (position 0: the
    root's next token, j + 1: node j's), ``draft_ids`` (S, N), ``parents`` (N,) shared by the
    sequences (checked by the caller: -1 or earlier), ``u`` (S, N + 1). ``draft`` None:
    drafts taken as certain. ``draft`` (S, N, V): row j is the distribution node j was drawn
    from, the same for siblings, which are independent draws from it (SpecInfer's multi-draft
    rule): a child x is accepted when ``u * q(x) < r(x)``, r the normalized residual, and a
    rejection makes the residual ``max(0, r - q)``."""
    rows, nodes = draft_ids.shape
    every = np.arange(rows)
    depth = int(depths(parents).max()) if nodes else 0
    current = np.full(rows, -1, np.int64)
    accepted = np.zeros(rows, np.int64)
    path = np.full((rows, depth), -1, np.int64)
    residual = target[:, 0].astype(np.float64)  # copied: rejected children are removed
    total = residual.sum(axis=1)
    for node, parent in enumerate(parents.tolist()):
        trying = current == parent
        if not trying.any():
            continue
        token = draft_ids[:, node]
        mass = residual[every, token]
        q_x = 1.0 if draft is None else draft[every, node, token].astype(np.float64)
        passed = trying & (u[:, node] * q_x * total < mass)
        failed = trying & ~passed
        if draft is None:
            residual[failed, token[failed]] = 0.0
            total = np.where(failed, total - mass, total)
        elif failed.any():
            rejected = np.flatnonzero(failed)
            scale = np.maximum(total[rejected, None], np.finfo(np.float64).tiny)
            shifted = residual[rejected] / scale - draft[rejected, node]
            residual[rejected] = np.maximum(shifted, 0.0)
            total[rejected] = residual[rejected].sum(axis=1)
        if passed.any():
            moved = np.flatnonzero(passed)
            path[moved, accepted[moved]] = node
            accepted[moved] += 1
            current[moved] = node
            residual[moved] = target[moved, node + 1]
            total[moved] = residual[moved].sum(axis=1)
    emitted = _draw(residual, u[:, nodes])
    tokens = np.take_along_axis(draft_ids, np.maximum(path, 0), axis=1)
    return _assemble(path, tokens, accepted, emitted, current + 1)


@dataclass(frozen=True)
class Walk:
    """Where a tree walk of drafts taken as certain went, per sequence: ``accepted`` nodes,
    their ``path`` (S, depth; -1 after) and the node it ended at (``current``; -1: the
    root)."""

    accepted: Ids
    path: Ids
    current: Ids


def tree_walk(p_x: Probs, draft_ids: Ids, parents: Ids, u: Doubles) -> Walk:
    """``verify_tree``'s walk for drafts taken as certain, from p at each draft alone:
    ``p_x`` (S, N) is node j's token's probability in its parent's distribution (position
    ``parents[j] + 1``). A node's siblings before it were all tried and rejected wherever it
    is tried (the walk only moves down), so its residual mass is ``p_x`` unless an earlier
    sibling drew the same token (then 0), and the residual's total is 1 less the rejected
    siblings' masses."""
    rows, nodes = draft_ids.shape
    depth = int(depths(parents).max()) if nodes else 0
    current = np.full(rows, -1, np.int64)
    accepted = np.zeros(rows, np.int64)
    path = np.full((rows, depth), -1, np.int64)
    mass = np.where(_repeated(draft_ids, parents), 0.0, p_x.astype(np.float64))
    total = np.ones(rows)
    for node, parent in enumerate(parents.tolist()):
        trying = current == parent
        if not trying.any():
            continue
        passed = trying & (u[:, node] * total < mass[:, node])
        total = np.where(trying & ~passed, total - mass[:, node], total)
        moved = np.flatnonzero(passed)
        path[moved, accepted[moved]] = node
        accepted[moved] += 1
        current[moved] = node
        total[moved] = 1.0
    return Walk(accepted, path, current)


def _repeated(draft_ids: Ids, parents: Ids) -> Flags:
    """(S, N): whether an earlier sibling of node j (same parent) drew node j's token."""
    repeated = np.zeros(draft_ids.shape, np.bool_)
    listed = parents.tolist()
    for node, parent in enumerate(listed):
        for sibling in range(node):
            if listed[sibling] == parent:
                repeated[:, node] |= draft_ids[:, sibling] == draft_ids[:, node]
    return repeated


def tree_verdict(p_rows: Probs, draft_ids: Ids, parents: Ids, walk: Walk, u: Doubles) -> Verdict:
    """The emitted token and the verdict of a ``tree_walk``, from each sequence's
    distribution where its walk ended (``p_rows`` (S, V): position ``current + 1``): that
    node's children were all tried and rejected, so the residual is the row with their
    tokens removed, drawn from renormalized (``_draw`` normalizes)."""
    rows, nodes = draft_ids.shape
    residual = p_rows.copy()
    for node, parent in enumerate(parents.tolist()):
        child = np.flatnonzero(walk.current == parent)
        residual[child, draft_ids[child, node]] = 0.0
    emitted = _draw(residual, u[:, nodes])
    tokens = np.take_along_axis(draft_ids, np.maximum(walk.path, 0), axis=1)
    return _assemble(walk.path, tokens, walk.accepted, emitted, walk.current + 1)


def verify_greedy(target: Probs, draft_ids: Ids, parents: Ids | None = None) -> Verdict:
    """Temperature 0: accept while the draft is the target's top token (ties: the lower
    id), then emit the top token there; a tree's first child (in order) that matches is
    the one followed. ``parents`` None: a chain."""
    top = np.argmax(target, axis=2).astype(np.int64)  # (S, positions): the first maximum
    return greedy_of_top(top, draft_ids, parents)


def greedy_of_top(top: Ids, draft_ids: Ids, parents: Ids | None = None) -> Verdict:
    """``verify_greedy`` from each position's top token (S, positions), however found."""
    rows, nodes = draft_ids.shape
    tree = chain_parents(nodes) if parents is None else parents
    depth = int(depths(tree).max()) if nodes else 0
    current = np.full(rows, -1, np.int64)
    accepted = np.zeros(rows, np.int64)
    path = np.full((rows, depth), -1, np.int64)
    every = np.arange(rows)
    for node, parent in enumerate(tree.tolist()):
        passed = (current == parent) & (draft_ids[:, node] == top[every, parent + 1])
        moved = np.flatnonzero(passed)
        path[moved, accepted[moved]] = node
        accepted[moved] += 1
        current[moved] = node
    tokens = np.take_along_axis(draft_ids, np.maximum(path, 0), axis=1)
    return _assemble(path, tokens, accepted, top[every, current + 1], current + 1)
